"""The messages between HTTP front ends and the engine process, as msgspec structs (msgpack).

Sockets (pyzmq, ``ipc://`` endpoints in a private run folder, made by the supervisor):

- ``in``: the engine binds a PULL socket; each front end PUSHes its requests to it.
- ``out``: the engine binds a ROUTER socket, used only to send; a front end's DEALER connects
  with the routing id ``fe<index>`` and receives the events of its own requests.

A front end says ``Hello`` until the engine answers ``Welcome`` (the engine's facts: context,
vocabulary, eos ids...). A request ``rid`` is ``<frontend>.<incarnation>.<n>``: a front end
that restarts says Hello with a new incarnation, and the engine cancels the old one's requests.
Every message is one frame; the tag is the class name. Not thread safe: one ``Codec`` a thread.
"""

from __future__ import annotations

import msgspec

from demo.engine.generation import Params
from demo.engine.processors import TokenLogprobs


class Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of every message; the tag is the class name."""


# -- front end -> engine ------------------------------------------------------------------------
class Hello(Message):
    frontend: int  # its index (0 .. api_server_count - 1)
    incarnation: str  # new at every start of that front end


class Submit(Message):
    rid: str
    prompt_ids: list[int]
    params: Params
    namespace: object = None  # the cache namespace (a tuple comes back a list: `hashable`)
    snapshot_at: list[int] | None = None


class Cancel(Message):
    rid: str


class StopChoice(Message):
    """The front end's text stream ended choice ``index`` (a stop string)."""

    rid: str
    index: int


class Call(Message):
    """An RPC: ``method`` is one of engine_process.CALLS; answered by ``Reply``."""

    rid: str
    method: str
    args: dict = {}


class Observed(Message):
    """A front end's request metrics (demo.metrics.Metrics.request / .generation), counted in
    the engine process's Metrics: one registry, whichever front end a scrape reaches."""

    endpoint: str
    status: int = 0  # a request's HTTP status (0: a generation's record)
    seconds: float | None = None  # the request's latency
    ttft: float = 0.0  # a generation's
    prompt: int = 0
    completion: int = 0
    cached: int = 0


class HttpRequest(Message):
    """A request the front end does not answer itself (admin, cache files, adapters, images...):
    the engine process answers it with its own Flask app, as in-process mode would.
    ``environ``: the WSGI environ's text entries (method, path, query, headers, client address)."""

    rid: str
    environ: dict[str, str]
    body: bytes


# -- engine -> front end ------------------------------------------------------------------------
class Welcome(Message):
    incarnation: str  # the Hello's, so a late Welcome for an earlier start is ignored
    engine_pid: int
    context: int
    vocab_size: int
    logits_size: int
    eos: list[int]
    snapshots: bool  # the store keeps recurrent-state snapshots (chat prompts send hints)
    reuse: bool
    max_queue: int
    remote_only: bool  # every generation request goes to the engine's own app (VLM, adapters)
    adapters: list[str] = []


class Accepted(Message):
    """The Submit is queued (else a Failed answers it: busy, shutting down, a bad grammar)."""

    rid: str


class Tokens(Message):
    """One step's ids for a request: per choice a list (empty: that row was not in the step),
    and per choice its TokenLogprobs (or None) when logprobs were asked for."""

    rid: str
    ids: list[list[int]]
    logprobs: list[TokenLogprobs | None] | None = None


class Done(Message):
    rid: str
    cached: int
    started: float | None = None  # time.perf_counter() when first batched (one clock per host)


class Gone(Message):
    """The engine cancelled the request (its client's front end restarted, or it was cancelled)."""

    rid: str


class Failed(Message):
    rid: str
    status: int
    message: str
    error_type: str = "server_error"
    code: str | None = None
    param: str | None = None
    retry_after: int | None = None


class Reply(Message):
    rid: str
    value: object = None
    error: str | None = None


class HttpStart(Message):
    rid: str
    status: int
    headers: list[tuple[str, str]]


class HttpChunk(Message):
    rid: str
    data: bytes


class HttpEnd(Message):
    rid: str


ToEngine = Hello | Submit | Cancel | StopChoice | Call | Observed | HttpRequest
ToFrontEnd = Welcome | Accepted | Tokens | Done | Gone | Failed | Reply | HttpStart | HttpChunk | HttpEnd


def endpoint(run_dir: str, name: str) -> str:
    """The ipc:// endpoint ``name`` ("in" or "out") in the supervisor's private run folder."""
    return f"ipc://{run_dir}/engine-{name}"


def endpoints(run_dir: str) -> tuple[str, str]:
    return endpoint(run_dir, "in"), endpoint(run_dir, "out")


def hashable(value):
    """A decoded namespace as the engine keys it: msgpack arrays back to (nested) tuples."""
    if isinstance(value, list):
        return tuple(hashable(v) for v in value)
    return value


class Codec:
    """``encode(message) -> bytes`` and ``decode(bytes, to_engine) -> message``; one a thread."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._to_engine = msgspec.msgpack.Decoder(ToEngine)
        self._to_front = msgspec.msgpack.Decoder(ToFrontEnd)

    def encode(self, message: Message) -> bytes:
        return self._encoder.encode(message)

    def to_engine(self, data: bytes) -> ToEngine:
        return self._to_engine.decode(data)

    def to_front_end(self, data: bytes) -> ToFrontEnd:
        return self._to_front.decode(data)
