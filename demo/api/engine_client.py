"""A front end's side of the engine process: the engine create_app serves, over ZMQ.

    client = EngineClient(run_dir, frontend=0)       # connects, says Hello until Welcome
    engine = RemoteEngine(client, tokenizer)        # what create_app(config, engine) takes

``RemoteEngine`` has the in-process Engine's request side: the prompt methods (chat
templates, tokenising and decoding here, demo.engine.prompts), ``reserve``/``submit``, the
sizes the API checks against. ``submit`` sends a wire.Submit and returns a
``RemoteGeneration``: a demo.engine.generation.Generation whose events come from the receiver
thread and whose cancel / stop strings go back as messages, so streaming, stop strings,
detokenising, logprobs and n>1 run here exactly as in-process. A watcher thread polls every
waiting request's client (as the in-process worker does between steps) and cancels the
requests of clients that hung up.

Faults: the engine's death shows as the ``out`` connection's drop (a socket monitor): every
request in flight fails at once with 503 ``engine_unavailable``, and so does every new one
until the restarted engine answers a Hello (the supervisor restarts it; this side keeps saying
Hello while it is down). A request is never sent twice.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Hashable

from demo.api.conversations import StoredResponse
from demo.core import wire
from demo.engine.constrained import Grammars
from demo.engine.generation import ALIVE_EVERY, WORKER_ALIVE_EVERY, Generation, Params
from demo.engine.prompts import Prompts
from demo.errors import ApiError
from demo.metrics import Metrics

log = logging.getLogger(__name__)
HELLO_EVERY = 0.2  # seconds between Hellos while the engine does not answer
CALL_TIMEOUT = 10.0  # seconds an RPC (metrics, load) may take
ACCEPT_TIMEOUT = 30.0  # seconds the engine may take to queue a request (it only reserves a slot)
RETRY_AFTER_S = 1


def unavailable(why: str) -> ApiError:
    return ApiError(
        503,
        f"the engine process is not available ({why}); retry later",
        type="server_error",
        code="engine_unavailable",
        retry_after=RETRY_AFTER_S,
    )


class _Waiter:
    """One RPC or forwarded HTTP request's answers, as the receiver thread delivers them."""

    def __init__(self) -> None:
        self.items: list = []
        self.cond = threading.Condition()

    def put(self, item) -> None:
        with self.cond:
            self.items.append(item)
            self.cond.notify()

    def get(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not self.items:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError
                self.cond.wait(left)
            return self.items.pop(0)


class RemoteGeneration(Generation):
    """A Generation run by the engine process. Its events arrive from ``EngineClient``'s
    receiver; ``cancel`` and a stop string's end of a choice are sent back."""

    def __init__(self, client: EngineClient, rid: str, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._client, self.rid = client, rid
        self.accepted = threading.Event()
        self.refusal: ApiError | None = None
        self._sent_stops: set[int] = set()
        self._cancel_sent = False

    def cancel(self) -> None:
        super().cancel()
        if not self._cancel_sent and not self.finished.is_set():
            self._cancel_sent = True
            self._client.send(wire.Cancel(self.rid))

    def _push(self, index, ids, logprobs):
        delta = super()._push(index, ids, logprobs)
        if self.stopped[index] and index not in self._sent_stops:
            self._sent_stops.add(index)
            self._client.send(wire.StopChoice(self.rid, index))
        return delta

    def deliver(self, m) -> bool:
        """Put a message from the engine into this request's events; True once it has ended."""
        if isinstance(m, wire.Tokens):
            self.generated += 1
            self._events.put(("ids", m.ids, m.logprobs))
            self.accepted.set()  # (its Accepted may come after the worker's first events)
            return False
        if isinstance(m, wire.Accepted):
            self.accepted.set()
            return False
        if isinstance(m, wire.Done):
            self.started = m.started
            self._events.put(("done", m.cached))
            self.accepted.set()
        else:  # Failed, or the engine gone (an ApiError)
            error = m if isinstance(m, ApiError) else _api_error(m)
            if not self.accepted.is_set():
                self.refusal = error
                self.accepted.set()
            self._events.put(("error", error))
        self.finished.set()
        return True


def _api_error(m: wire.Failed | wire.Gone) -> ApiError:
    if isinstance(m, wire.Gone):
        return ApiError(503, "the engine cancelled the request", type="server_error", code="cancelled")
    return ApiError(m.status, m.message, m.param, m.code, m.error_type, m.retry_after)


class EngineClient:
    """The sockets to the engine process and the thread that receives its messages."""

    def __init__(self, run_dir: str, frontend: int = 0):
        import zmq

        self.frontend, self.incarnation = frontend, uuid.uuid4().hex[:12]
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.connect(wire.endpoint(run_dir, "in"))
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.setsockopt(zmq.RCVHWM, 0)
        self._dealer.setsockopt(zmq.ROUTING_ID, f"fe{frontend}".encode())
        self._monitor = self._dealer.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        self._dealer.connect(wire.endpoint(run_dir, "out"))
        self._lock = threading.Lock()  # the PUSH socket, shared by the HTTP threads
        self._codec = wire.Codec()
        self._ids = itertools.count()
        self.pending: dict[str, RemoteGeneration | _Waiter] = {}
        self.welcome: wire.Welcome | None = None  # the engine's facts; None while it is down
        self.up = threading.Event()
        self.down_reason = "starting"
        self._stop = False
        self._receiver = threading.Thread(target=self._receive, name="radixkv-engine-events", daemon=True)
        self._receiver.start()
        self._watcher = threading.Thread(target=self._watch, name="radixkv-hangups", daemon=True)
        self._watcher.start()

    # -- sending -----------------------------------------------------------------------------
    def new_rid(self) -> str:
        return f"{self.frontend}.{self.incarnation}.{next(self._ids)}"

    def send(self, message: wire.Message) -> None:
        with self._lock:
            self._push.send(self._codec.encode(message), copy=False)

    def wait_up(self, timeout: float) -> wire.Welcome:
        """The engine's Welcome, waiting up to ``timeout`` s; raises TimeoutError."""
        if not self.up.wait(timeout):
            raise TimeoutError(f"no answer from the engine process within {timeout:.0f}s")
        return self.welcome

    def call(self, method: str, **args):
        """An RPC (demo.core.engine_process.CALLS); raises ApiError 503 if the engine is down."""
        if not self.up.is_set():
            raise unavailable(self.down_reason)
        rid, waiter = self.new_rid(), _Waiter()
        self.pending[rid] = waiter
        try:
            self.send(wire.Call(rid, method, args))
            reply = waiter.get(CALL_TIMEOUT)
        except TimeoutError:
            raise unavailable(f"no answer to {method} within {CALL_TIMEOUT:.0f}s") from None
        finally:
            self.pending.pop(rid, None)
        if isinstance(reply, ApiError):
            raise reply
        if reply.error is not None:
            raise ApiError(500, f"the engine process failed: {reply.error}", type="server_error")
        return reply.value

    def forward(self, environ: dict[str, str], body: bytes, alive=None):
        """Send an HTTP request to the engine process's own app: (status, headers, chunks), the
        chunks an iterator of bytes; raises ApiError 503 if the engine is down. ``alive``: the
        client's check (demo.api.server.client_alive), polled until the answer starts."""
        if not self.up.is_set():
            raise unavailable(self.down_reason)
        rid, waiter = self.new_rid(), _Waiter()
        self.pending[rid] = waiter
        self.send(wire.HttpRequest(rid, environ, body))
        while True:
            try:
                first = waiter.get(ALIVE_EVERY if alive is not None else None)
                break
            except TimeoutError:
                if not alive():
                    self.pending.pop(rid, None)
                    self.send(wire.Cancel(rid))
                    raise ApiError(499, "the client closed the connection", code="client_closed") from None
        if isinstance(first, (ApiError, wire.Failed)):
            self.pending.pop(rid, None)
            raise first if isinstance(first, ApiError) else _api_error(first)

        def chunks():
            ended = False
            try:
                while True:
                    m = waiter.get()
                    if isinstance(m, wire.HttpChunk):
                        yield m.data
                        continue
                    ended = True
                    if not isinstance(m, wire.HttpEnd):  # the engine died mid-answer: cut it
                        log.warning("forwarded %s: the engine process stopped mid-answer", rid)
                    return
            finally:
                self.pending.pop(rid, None)
                if not ended and self.up.is_set():  # the client hung up: stop the engine's side
                    self.send(wire.Cancel(rid))

        return first.status, first.headers, chunks()

    # -- receiving ---------------------------------------------------------------------------
    def _receive(self) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        poller = zmq.Poller()
        poller.register(self._dealer, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        codec = wire.Codec()
        next_hello = 0.0
        while not self._stop:
            now = time.monotonic()
            if not self.up.is_set() and now >= next_hello:
                self.send(wire.Hello(self.frontend, self.incarnation))
                next_hello = now + HELLO_EVERY
            timeout = None if self.up.is_set() else HELLO_EVERY * 1000
            try:
                events = dict(poller.poll(timeout))
            except zmq.ZMQError:
                return
            if self._monitor in events:
                try:
                    event = recv_monitor_message(self._monitor)
                except zmq.ZMQError:  # (the same)
                    return
                if event["event"] == zmq.EVENT_DISCONNECTED and self.up.is_set():
                    self._engine_lost("it stopped")
                elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.up.is_set():
                    next_hello = 0.0  # a (re)started engine: greet it now
            if self._dealer in events:
                while True:
                    try:
                        data = self._dealer.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    except zmq.ZMQError:  # close() destroyed the sockets meanwhile
                        return
                    try:
                        self._dispatch(codec.to_front_end(data.bytes))
                    except Exception:  # one bad message must not end this thread (nobody
                        log.exception("a message from the engine could not be handled")  # would hear)

    def _dispatch(self, m) -> None:
        if isinstance(m, wire.Welcome):
            if m.incarnation == self.incarnation and not self.up.is_set():
                self.welcome = m
                self.up.set()
                log.info("front end %d: engine process %d is up", self.frontend, m.engine_pid)
            return
        target = self.pending.get(m.rid)
        if target is None:  # a request that ended here already (cancelled, failed)
            return
        if isinstance(target, _Waiter):
            target.put(m)
        elif target.deliver(m):
            self.pending.pop(m.rid, None)

    def _engine_lost(self, why: str) -> None:
        """Every request in flight fails at once (503), and new ones until the engine is back."""
        self.up.clear()
        self.down_reason = why
        error = unavailable(why)
        lost = list(self.pending.items())
        self.pending.clear()
        for _rid, target in lost:
            if isinstance(target, _Waiter):
                target.put(error)
            else:
                target.deliver(error)
        log.error(
            "front end %d: the engine process %s; %d requests in flight answered 503",
            self.frontend,
            why,
            sum(1 for _, t in lost if isinstance(t, RemoteGeneration)),
        )

    def _watch(self) -> None:
        """The in-process worker's hang-up check between steps, done here for every request."""
        while not self._stop:
            time.sleep(WORKER_ALIVE_EVERY)
            for target in list(self.pending.values()):
                if isinstance(target, RemoteGeneration) and target.client_gone():
                    pass  # client_gone cancelled it (sent) and told its thread

    def close(self) -> None:
        self._stop = True
        self._ctx.destroy(linger=0)


class _Slot:
    """reserve()'s place: the engine process takes the real one when the Submit arrives."""

    def __enter__(self) -> _Slot:
        return self

    def __exit__(self, *exc) -> None:
        pass


class _Runner:
    def __init__(self, grammars: Grammars, eos: set[int]):
        self.grammars, self.eos = grammars, eos


class RemoteEngine(Prompts):
    """The engine create_app serves in a front end's process (docs/design.md#processes)."""

    remote = True
    store = None  # the store is the engine process's; routes that need it are forwarded
    processor = None  # a vision-language model's requests are all forwarded
    adapters = None  # a request naming an adapter is forwarded

    def __init__(self, client: EngineClient, tokenizer, timeout: float = 120.0):
        w = client.wait_up(timeout)
        super().__init__(tokenizer, None, snapshots=w.snapshots)
        self.client, self.context = client, w.context
        self.vocab_size, self.logits_size = w.vocab_size, w.logits_size
        self.remote_only = w.remote_only
        self.eos = set(w.eos)
        self.runner = _Runner(Grammars(tokenizer, w.logits_size, self.eos), self.eos)

    def reserve(self) -> _Slot:
        if not self.client.up.is_set():
            raise unavailable(self.client.down_reason)
        return _Slot()

    def submit(
        self,
        prompt_ids: list[int],
        params: Params,
        namespace: Hashable = None,
        slot=None,
        inputs: dict | None = None,
        hooks=None,
        snapshot_at: list[int] | None = None,
    ) -> RemoteGeneration:
        """Engine.submit over the wire; waits for the engine to queue it (raises ApiError: busy
        503, shutting down 503, a grammar refused 400, the engine down 503)."""
        if inputs or hooks is not None:
            raise ApiError(500, "model inputs and hooks do not cross processes", type="server_error")
        client = self.client
        if not client.up.is_set():
            raise unavailable(client.down_reason)
        rid = client.new_rid()
        gen = RemoteGeneration(client, rid, prompt_ids, params, namespace, self.decode, self.eos)
        gen.snapshot_at = snapshot_at
        client.pending[rid] = gen
        if not client.up.is_set():  # lost between the check and the registration
            client.pending.pop(rid, None)
            raise unavailable(client.down_reason)
        try:
            client.send(wire.Submit(rid, prompt_ids, params, namespace, snapshot_at))
        except BaseException:  # (a value msgpack cannot encode) nothing left waiting for it
            client.pending.pop(rid, None)
            raise
        if not gen.accepted.wait(ACCEPT_TIMEOUT):  # an engine alive but not answering
            client.pending.pop(rid, None)
            gen.cancel()
            raise unavailable(f"it did not queue the request within {ACCEPT_TIMEOUT:.0f}s")
        if gen.refusal is not None:
            raise gen.refusal
        return gen

    def metrics_text(self) -> str:
        return self.client.call("metrics")

    def request_metrics(self) -> RemoteMetrics:
        """The request counters, kept by the engine process for every front end."""
        return RemoteMetrics(self.client)

    def response_store(self) -> RemoteResponseStore:
        """The Responses store, which the engine process holds for every front end."""
        return RemoteResponseStore(self.client)

    def load(self) -> dict:
        return self.client.call("load")

    def shutdown(self, wait: float) -> None:
        """Cut this front end's requests (503, as the in-process shutdown answers them)."""
        error = ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
        for target in list(self.client.pending.values()):
            if isinstance(target, RemoteGeneration):
                target.deliver(error)
                target.cancel()
        self.client.pending.clear()


class RemoteResponseStore:
    """demo.api.conversations.ResponseStore's put / get / delete, answered by the engine
    process's store (one for all front ends: with ``--api-server-count 2`` a
    ``previous_response_id`` or a GET reaches it whichever front end the connection lands on).
    The engine is down: put, get and delete answer 503 ``engine_unavailable``, as generation does;
    the store lives and dies with the engine process (in memory, as in one-process mode)."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    def put(self, tenant: Hashable, item: StoredResponse) -> None:
        self.client.call("responses_put", tenant=tenant, item=dataclasses.asdict(item))

    def get(self, tenant: Hashable, response_id: str) -> StoredResponse | None:
        found = self.client.call("responses_get", tenant=tenant, response_id=response_id)
        return None if found is None else StoredResponse(**{**found, "messages": tuple(found["messages"])})

    def delete(self, tenant: Hashable, response_id: str) -> bool:
        return bool(self.client.call("responses_delete", tenant=tenant, response_id=response_id))


class RemoteMetrics(Metrics):
    """demo.metrics.Metrics whose counts go to the engine process's registry (wire.Observed,
    sent and not answered), so /metrics on any front end shows every front end's requests and
    its counters only grow (a scrape through the shared port reaches any one of them). Nothing
    is counted here; an engine that is down loses the counts sent meanwhile, as its restart
    resets them."""

    def __init__(self, client: EngineClient) -> None:
        super().__init__()
        self.client = client

    def request(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        self._send(wire.Observed(endpoint, status, seconds))

    def record(self, endpoint: str, ttft_s: float, prompt: int, completion: int, cached: int) -> None:
        self._send(wire.Observed(endpoint, 0, None, ttft_s, prompt, completion, cached))

    def _send(self, message: wire.Observed) -> None:
        try:
            self.client.send(message)
        except Exception:  # a count never fails the request it counts
            log.debug("a metrics count was not sent", exc_info=True)
