"""The engine process: the scheduler, step loop, model and store, served to front ends over ZMQ.

    engine_process.main(config, run_dir, ready)   # a child of demo.core.supervisor

It builds what ``python -m demo`` builds in-process (demo.startup: the engine, task prompts
pinned, the cache file restored, KV events) and, instead of an HTTP server, answers the
messages of demo.core.wire:

- ``Submit``: the request goes to ``Engine.submit`` with an event sink (``_Sink``) in place of
  the Generation's queue, so the worker thread's token ids go straight onto the ``out`` socket
  (one msgpack frame per step and request). ``Cancel``/``StopChoice`` are what the in-process
  HTTP thread would have set on the Generation.
- ``Call``: small synchronous questions (``CALLS``: the engine's metrics lines, its load, the Responses store's put / get / delete).
- ``HttpRequest``: a request the front end does not answer itself (admin, cache files,
  adapters, images...) runs through this process's own Flask app, in a thread of a bounded
  pool, streamed back as HttpStart / HttpChunk... / HttpEnd.

Threads: the receiving loop (this process's main thread), the engine's worker, the HTTP pool.
Sends on the ``out`` socket are serialised by one lock (a ZMQ socket is not thread safe).
SIGTERM ends it as it ends ``python -m demo``: requests are cut (503), the cache file saved.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from demo.core import wire

log = logging.getLogger(__name__)


class _Out:
    """The ROUTER socket, send-only, shared by the threads that answer (under one lock)."""

    def __init__(self, sock):
        self._sock, self._lock, self._codec = sock, threading.Lock(), wire.Codec()

    def send(self, identity: bytes, message: wire.Message) -> bool:
        import zmq

        with self._lock:
            data = self._codec.encode(message)
            try:
                self._sock.send_multipart((identity, data), flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.ZMQError:  # the front end is gone (ROUTER_MANDATORY) or not reading
                return False


class _Sink:
    """Stands in for a Generation's event queue: the worker's ``put`` goes onto the wire."""

    def __init__(self, server: EngineServer, rid: str, identity: bytes):
        self._server, self.rid, self.identity = server, rid, identity
        self.gen = None  # set once submitted
        self.ended = False  # a terminal event went out: later ones are nobody's
        self.lock = threading.Lock()

    def put(self, event: tuple) -> None:
        kind, rid = event[0], self.rid
        if kind == "ids":
            message = wire.Tokens(rid, event[1], event[2])
        elif kind in ("done", "error"):
            with self.lock:
                if self.ended:
                    return
                self.ended = True
                self._server.live.pop(rid, None)
            if kind == "done":
                started = self.gen.started if self.gen is not None else None
                message = wire.Done(rid, event[1], started)
            else:
                message = failed(rid, event[1])
        else:  # "gone": only the in-process alive() check makes it; none is set here
            return
        self._server.out.send(self.identity, message)


def failed(rid: str, error: BaseException) -> wire.Failed:
    from demo.errors import ApiError

    if isinstance(error, ApiError):
        return wire.Failed(
            rid, error.status, error.message, error.type, error.code, error.param, error.retry_after
        )
    log.error("request %s failed: %s: %s", rid, type(error).__name__, error)
    return wire.Failed(rid, 500, f"generation failed: {type(error).__name__}")


class EngineServer:
    """Answers front ends' messages for one engine (``app``: this process's own Flask app)."""

    def __init__(self, app, sock_in, sock_out):
        self.app = app
        self.engine = app.extensions["radixkv"]["engine"]
        self.config = app.extensions["radixkv"]["config"]
        self._in, self.out = sock_in, _Out(sock_out)
        self.live: dict[str, tuple] = {}  # rid -> (Generation, identity)
        self._incarnations: dict[int, str] = {}  # front end index -> its current incarnation
        # Forwarded requests answered at once (admin, adapters, images): as many as waitress's
        # threads in one process (demo.api.server.Limits.for_engine)
        threads = self.config.max_queue + self.config.max_batch_size + 8
        self._http = ThreadPoolExecutor(threads, thread_name_prefix="radixkv-forwarded")
        self._http_limit = 2 * threads  # answered or waiting for a thread; more: 503 busy
        self._http_cancelled: dict[str, threading.Event] = {}
        self._codec = wire.Codec()
        self._stopping = False

    # -- the receiving loop ----------------------------------------------------------------
    def serve(self) -> None:
        """Until KeyboardInterrupt (SIGTERM, Ctrl-C) or stop()."""
        import zmq

        while not self._stopping:
            try:
                data = self._in.recv(copy=False)
            except zmq.ZMQError:
                if self._stopping:
                    return
                raise
            try:
                message = self._codec.to_engine(data.bytes)
            except Exception as e:  # a bad frame is nobody's request: never crash the engine
                log.warning("a message from a front end could not be decoded: %s", e)
                continue
            try:
                self.handle(message)
            except Exception:  # one front end's message never ends the engine's loop
                log.exception("a %s from a front end failed", type(message).__name__)

    def handle(self, m) -> None:
        if isinstance(m, (wire.Submit, wire.HttpRequest, wire.Call)) and not self._welcomed(m.rid):
            return  # sent to an engine before this one (queued in the socket): answered 503 there
        if isinstance(m, wire.Submit):
            self._submit(m)
        elif isinstance(m, wire.Cancel):
            entry = self.live.get(m.rid)
            if entry is not None:
                entry[0].cancel()
            cancelled = self._http_cancelled.get(m.rid)
            if cancelled is not None:
                cancelled.set()
        elif isinstance(m, wire.StopChoice):
            entry = self.live.get(m.rid)
            if entry is not None and 0 <= m.index < len(entry[0].stopped):
                entry[0].stopped[m.index] = True
        elif isinstance(m, wire.Call):
            self._call(m)
        elif isinstance(m, wire.Observed):  # a front end's request counters: into this one registry
            observe(self.app.extensions["radixkv"]["metrics"], m)
        elif isinstance(m, wire.HttpRequest):
            if len(self._http_cancelled) >= self._http_limit:  # (each holds its body) bounded
                busy = wire.Failed(m.rid, 503, "server busy: too many forwarded requests; retry later",
                                   code="busy", retry_after=1)  # fmt: skip
                self.out.send(self._identity(m.rid), busy)
                return
            cancelled = self._http_cancelled[m.rid] = threading.Event()
            self._http.submit(self._forwarded, m, cancelled)
        elif isinstance(m, wire.Hello):
            self._hello(m)

    def _welcomed(self, rid: str) -> bool:
        frontend, incarnation, _ = rid.split(".", 2)
        return self._incarnations.get(int(frontend)) == incarnation

    def _identity(self, rid: str) -> bytes:
        return b"fe" + rid.split(".", 1)[0].encode()

    def _hello(self, m: wire.Hello) -> None:
        old = self._incarnations.get(m.frontend)
        if old != m.incarnation:
            self._incarnations[m.frontend] = m.incarnation
            if old is not None:  # that front end restarted: its requests have nobody to go to
                prefix = f"{m.frontend}.{old}."
                gone = [entry[0] for rid, entry in list(self.live.items()) if rid.startswith(prefix)]
                for gen in gone:
                    gen.cancel()
                for rid, event in list(self._http_cancelled.items()):
                    if rid.startswith(prefix):
                        event.set()
                if gone:
                    log.info("front end %d restarted: %d of its requests cancelled", m.frontend, len(gone))
        self.out.send(f"fe{m.frontend}".encode(), self.welcome(m.incarnation))

    def welcome(self, incarnation: str) -> wire.Welcome:
        e = self.engine
        adapters = e.adapters.names() if e.adapters is not None else []
        return wire.Welcome(
            incarnation=incarnation,
            engine_pid=os.getpid(),
            context=e.context,
            vocab_size=e.vocab_size,
            logits_size=e.logits_size,
            eos=sorted(e.runner.eos),
            snapshots=e.store is not None and e.store.states is not None,
            reuse=e.store is not None,
            max_queue=e.scheduler.max_queue,
            # A vision-language model's requests carry pixels, made by its processor: they stay here
            remote_only=e.processor is not None,
            adapters=list(adapters),
        )

    def _submit(self, m: wire.Submit) -> None:
        from demo.engine.engine import Busy
        from demo.errors import ApiError

        identity = self._identity(m.rid)
        sink = _Sink(self, m.rid, identity)
        try:
            slot = self.engine.reserve()
        except Busy as e:
            error = ApiError(503, f"server busy: {e}; retry later", type="server_error", code="busy")
            error.retry_after = 1
            self.out.send(identity, failed(m.rid, error))
            return
        try:
            with slot:
                gen = self.engine.submit(
                    m.prompt_ids,
                    m.params,
                    wire.hashable(m.namespace),
                    slot=slot,
                    snapshot_at=m.snapshot_at,
                    events=sink,
                )
        except ApiError as e:
            self.out.send(identity, failed(m.rid, e))
            return
        except ValueError as e:  # a grammar that does not compile for this tokenizer
            self.out.send(identity, wire.Failed(m.rid, 400, str(e), "invalid_request_error"))
            return
        with sink.lock:
            sink.gen = gen
            if not sink.ended:
                self.live[m.rid] = (gen, identity)
        self.out.send(identity, wire.Accepted(m.rid))

    def _call(self, m: wire.Call) -> None:
        try:
            value = CALLS[m.method](self, **m.args)
            reply = wire.Reply(m.rid, value)
        except Exception as e:  # an RPC that fails answers with its error, never kills the loop
            log.exception("call %s failed", m.method)
            reply = wire.Reply(m.rid, None, f"{type(e).__name__}: {e}")
        self.out.send(self._identity(m.rid), reply)

    def _forwarded(self, m: wire.HttpRequest, cancelled: threading.Event) -> None:
        identity = self._identity(m.rid)
        environ = dict(m.environ)
        environ.update(
            {
                "wsgi.input": io.BytesIO(m.body),
                "wsgi.errors": io.StringIO(),
                "wsgi.version": (1, 0),
                "wsgi.multithread": True,
                "wsgi.multiprocess": True,
                "wsgi.run_once": False,
                "wsgi.url_scheme": environ.get("wsgi.url_scheme", "http"),
                "CONTENT_LENGTH": str(len(m.body)),
                # demo.api.server.client_alive: a stream whose client hung up is stopped
                "waitress.client_disconnected": cancelled.is_set,
            }
        )
        if cancelled.is_set():  # its client hung up while it waited for a thread
            self._http_cancelled.pop(m.rid, None)
            return
        started: list = []

        def start_response(status, headers, exc_info=None):
            started[:] = [int(status.split(" ", 1)[0]), [(k, v) for k, v in headers]]
            return lambda data: None  # write() is not used by Flask

        body = None
        try:
            body = self.app(environ, start_response)
            chunks = iter(body)
            first = next(chunks, b"")  # a streamed response calls start_response lazily
            self.out.send(identity, wire.HttpStart(m.rid, started[0], started[1]))
            for data in [first] if first else []:
                self.out.send(identity, wire.HttpChunk(m.rid, bytes(data)))
            for data in chunks:
                if cancelled.is_set():
                    break
                if data:
                    self.out.send(identity, wire.HttpChunk(m.rid, bytes(data)))
            self.out.send(identity, wire.HttpEnd(m.rid))
        except Exception as e:
            log.exception("forwarded %s %s failed", environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"))
            self.out.send(identity, wire.Failed(m.rid, 500, f"internal error: {type(e).__name__}"))
        finally:
            if body is not None and hasattr(body, "close"):
                body.close()
            self._http_cancelled.pop(m.rid, None)

    def stop(self) -> None:
        self._stopping = True
        self._http.shutdown(wait=False, cancel_futures=True)


def _metrics(server: EngineServer) -> str:
    """Every line of /metrics: the engine's, then the requests' of every front end (and of
    this process's app: forwarded requests), one registry (wire.Observed)."""
    from demo.api.app import engine_metrics

    return engine_metrics(server.engine) + server.app.extensions["radixkv"]["metrics"].render_requests()


def observe(metrics, m: wire.Observed) -> None:
    """Count a front end's Observed into ``metrics`` (demo.metrics.Metrics), as it was counted."""
    endpoint = m.endpoint[:64]  # a front end's route name; bounded all the same
    if m.status:
        metrics.request(endpoint, m.status, m.seconds)
    else:
        metrics.record(endpoint, m.ttft, m.prompt, m.completion, m.cached)


def _load(server: EngineServer) -> dict:
    e = server.engine
    return {"running": e.running, "queued": e.queued, "load_tokens": e.load_tokens}


def _responses(server: EngineServer):
    """The engine app's Responses store: the front ends' too (engine_client.RemoteResponseStore)."""
    return server.app.extensions["radixkv"]["responses"]


def _responses_put(server: EngineServer, tenant, item: dict) -> None:
    from demo.api.conversations import StoredResponse

    item = StoredResponse(**{**item, "messages": tuple(item["messages"])})
    _responses(server).put(wire.hashable(tenant), item)


def _responses_get(server: EngineServer, tenant, response_id: str) -> dict | None:
    found = _responses(server).get(wire.hashable(tenant), response_id)
    return None if found is None else dataclasses.asdict(found)


def _responses_delete(server: EngineServer, tenant, response_id: str) -> bool:
    return _responses(server).delete(wire.hashable(tenant), response_id)


CALLS = {
    "metrics": _metrics,
    "load": _load,
    "responses_put": _responses_put,
    "responses_get": _responses_get,
    "responses_delete": _responses_delete,
}


def bind(run_dir: str):
    """The engine's two sockets in ``run_dir``: (context, PULL in, ROUTER out)."""
    import zmq

    ctx = zmq.Context()
    sock_in = ctx.socket(zmq.PULL)
    sock_in.setsockopt(zmq.LINGER, 0)
    sock_in.setsockopt(zmq.RCVHWM, 0)
    sock_in.bind(wire.endpoint(run_dir, "in"))
    sock_out = ctx.socket(zmq.ROUTER)
    sock_out.setsockopt(zmq.LINGER, 0)
    sock_out.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown front end raises, never blocks
    sock_out.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted front end takes its id back at once
    sock_out.setsockopt(zmq.SNDHWM, 0)
    sock_out.bind(wire.endpoint(run_dir, "out"))
    return ctx, sock_in, sock_out


def main(config, run_dir: str, ready) -> None:
    """The engine process (multiprocessing spawn target). ``ready``: a Connection that gets
    ("ready", pid) once the sockets are bound, or ("failed", message)."""
    from demo import log_format, startup

    log_format.configure()
    startup.exit_with_parent()
    try:
        started = startup.build(config)
    except SystemExit as e:  # startup printed the error
        ready.send(("failed", str(e.code)))
        raise
    app, engine = started.app, started.engine
    engine.tokenizer.save_pretrained(os.path.join(run_dir, "tokenizer"))  # the front ends' copy
    ctx, sock_in, sock_out = bind(run_dir)
    server = EngineServer(app, sock_in, sock_out)
    signal.signal(signal.SIGTERM, startup.interrupt)
    log.info("engine process %d on %s (requests) and %s (events)", os.getpid(), *wire.endpoints(run_dir))
    ready.send(("ready", os.getpid()))
    try:
        server.serve()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        stopped = startup.signalled_at()
        server.stop()
        engine.shutdown(wait=min(2.0, config.cache_save_timeout / 4))
        time.sleep(0.05)  # the cut requests' errors leave before the sockets close
        startup.save_at_exit(started, config, stopped)
        ctx.destroy(linger=0)
    logging.shutdown()
    os._exit(0)
