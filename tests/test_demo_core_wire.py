"""The engine process's messages (demo.core.wire) and the front end's routing (demo.api.forwarding)."""

from __future__ import annotations

import time

import pytest

from demo.api.forwarding import answered_here
from demo.core import wire
from demo.engine.generation import Params
from demo.engine.processors import TokenLogprobs

pytest.importorskip("msgspec")


def test_every_message_round_trips_and_a_namespace_comes_back_hashable():
    codec = wire.Codec()
    params = Params(7, 0.5, 0.9, ("stop",), 3, n=2, logit_bias=((5, -1.5),), top_logprobs=2, grammar="g")
    submit = wire.Submit("0.ab.1", [1, 2, 3], params, ("tenant:x", "salt", "s"), [2])
    back = codec.to_engine(codec.encode(submit))
    assert back.params == params and back.prompt_ids == [1, 2, 3] and back.snapshot_at == [2]
    assert wire.hashable(back.namespace) == ("tenant:x", "salt", "s")
    hash(wire.hashable(back.namespace))
    lps = [TokenLogprobs(4, -0.25, ((4, -0.25), (9, -2.0))), None]
    tokens = wire.Tokens("0.ab.1", [[4], []], lps)
    assert codec.to_front_end(codec.encode(tokens)) == tokens
    for m in (
        wire.Done("r", 3, 1.5),
        wire.Failed("r", 503, "busy", code="busy", retry_after=1),
        wire.Accepted("r"),
    ):
        assert codec.to_front_end(codec.encode(m)) == m
    for m in (
        wire.Cancel("r"),
        wire.StopChoice("r", 1),
        wire.Hello(0, "i"),
        wire.HttpRequest("r", {"PATH_INFO": "/"}, b"{}"),
    ):
        assert codec.to_engine(codec.encode(m)) == m


def test_a_bad_params_value_is_refused_by_name_on_decoding():
    codec = wire.Codec()
    data = codec.encode(wire.Submit("r", [1], Params(1)))
    bad = data.replace(b"\xaemax_new_tokens\x01", b"\xaemax_new_tokens\x00")
    with pytest.raises(ValueError, match="max_new_tokens"):
        codec.to_engine(bad)


@pytest.mark.parametrize(
    "path, method, body, remote_only, here",
    [
        ("/v1/chat/completions", "POST", b'{"model": "m"}', False, True),
        ("/v1/chat/completions", "POST", b'{"model": "an-adapter"}', False, False),
        ("/v1/chat/completions", "POST", b"not json", False, True),  # the route says what is wrong
        ("/v1/chat/completions", "POST", b"{}", True, False),  # a VLM: its processor is the engine's
        ("/v1/responses/resp_1", "GET", None, False, True),
        ("/metrics", "GET", None, False, True),
        ("/v1/cache/flush", "POST", None, False, False),
        ("/v1/models", "GET", None, False, False),
        ("/get_load", "GET", None, False, False),
    ],
)
def test_what_a_front_end_answers_and_what_it_forwards(path, method, body, remote_only, here):
    assert answered_here(path, method, body, {"m"}, remote_only) is here


def test_a_front_end_survives_early_events_bad_frames_and_unencodable_requests(tmp_path, monkeypatch):
    """Against a fake engine on the real sockets: a request whose Done comes before its Accepted
    (the worker was quicker than the receive loop) is answered at once (it waited 30 s for a
    503); a frame the front end cannot decode leaves its receiver running (it died: every later
    request waited 30 s, /health said ok); a request msgpack cannot encode leaves nothing pending
    (each one leaked a RemoteGeneration)."""
    zmq = pytest.importorskip("zmq")
    import threading

    from demo.api import engine_client

    monkeypatch.setattr(engine_client, "ACCEPT_TIMEOUT", 5.0)
    run = str(tmp_path)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(wire.endpoint(run, "in"))
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(wire.endpoint(run, "out"))
    codec, stop = wire.Codec(), threading.Event()

    def fake_engine():
        out = wire.Codec()
        while not stop.is_set():
            if not pull.poll(50):
                continue
            m = codec.to_engine(pull.recv())
            if isinstance(m, wire.Hello):
                welcome = wire.Welcome(m.incarnation, 1, 4096, 100, 100, [0], False, True, 32, False)
                router.send_multipart([b"fe0", out.encode(welcome)])
            elif isinstance(m, wire.Submit):
                router.send_multipart([b"fe0", b"\xc1 not msgpack"])  # a frame nobody can read
                for late in (wire.Tokens(m.rid, [[5]]), wire.Done(m.rid, 0, None), wire.Accepted(m.rid)):
                    router.send_multipart([b"fe0", out.encode(late)])

    thread = threading.Thread(target=fake_engine, daemon=True)
    thread.start()
    client = engine_client.EngineClient(run, 0)
    try:
        client.wait_up(10)
        engine = object.__new__(engine_client.RemoteEngine)
        engine.client, engine.eos, engine.decode = client, {0}, lambda ids: "x" * len(ids)
        for _ in range(2):  # the second after the first's bad frame: the receiver still runs
            t0 = time.monotonic()
            gen = engine.submit([1, 2, 3], Params(4))
            assert time.monotonic() - t0 < 4.0 and gen.refusal is None
            assert gen.finished.wait(5)
        with pytest.raises(UnicodeEncodeError):
            engine.submit([1, 2, 3], Params(4), ("tenant:abc", "salt", "\ud800"))
        assert not [r for r, p in client.pending.items() if isinstance(p, engine_client.RemoteGeneration)]
    finally:
        stop.set()
        thread.join(5)
        client.close()
        pull.close(0)
        router.close(0)


def test_a_front_end_that_fails_to_start_again_is_tried_again_later(monkeypatch):
    """A failed restart (the engine not answering the new front end's Hello) no longer ends the
    supervisor's watch: the front end is tried again after FRONT_END_RETRY_S."""
    from demo.core import supervisor

    sup = object.__new__(supervisor.Supervisor)
    sup.front_ends = ["old", "other"]
    tries = []

    def start(indices):
        tries.append(indices)
        raise RuntimeError("front end 0 did not start: no answer")

    monkeypatch.setattr(sup, "start_front_ends", start, raising=False)
    retry: dict[int, float] = {}
    sup._restart_front_end(0, retry)
    assert tries == [[0]] and sup.front_ends == [None, "other"]
    assert retry[0] > time.monotonic() + supervisor.FRONT_END_RETRY_S - 1


def test_forwarded_requests_are_bounded_and_skipped_once_their_client_hung_up():
    """The engine process answers forwarded requests from a pool of threads; past twice its
    size waiting, a new one is a 503 busy at once (each waiting one holds its body: unbounded
    before), and one whose client hung up while it waited is not run."""
    import threading

    from demo.config import Config
    from demo.core.engine_process import EngineServer

    class Sock:
        def __init__(self):
            self.sent = []

        def send_multipart(self, frames, **kwargs):
            self.sent.append(wire.Codec().to_front_end(bytes(frames[1])))

    release, ran = threading.Event(), []

    def app(environ, start_response):  # a slow forwarded route
        ran.append(environ["PATH_INFO"])
        release.wait(10)
        start_response("200 OK", [])
        return [b"ok"]

    app.extensions = {"radixkv": {"engine": None, "config": Config(max_queue=1, max_batch_size=1)}}
    sock = Sock()
    server = EngineServer(app, None, sock)
    server._incarnations[0] = "i"
    limit = server._http_limit  # 2 x (1 + 1 + 8) threads
    for n in range(limit + 1):
        server.handle(wire.HttpRequest(f"0.i.{n}", {"PATH_INFO": f"/{n}", "REQUEST_METHOD": "GET"}, b""))
    busy = [m for m in sock.sent if isinstance(m, wire.Failed)]
    assert [m.rid for m in busy] == [f"0.i.{limit}"] and busy[0].status == 503 and busy[0].code == "busy"
    server.handle(wire.Cancel(f"0.i.{limit - 1}"))  # waiting for a thread: its client hung up
    release.set()
    server._http.shutdown(wait=True)
    assert f"/{limit - 1}" not in ran and len(ran) == limit - 1
    assert not server._http_cancelled
