"""The process ``python -m demo --api-server-count N`` runs: it starts one engine process and N
HTTP front ends, says where each listens, and restarts whichever dies.

    engine process (demo.core.engine_process): scheduler, step loop, model, store; ZMQ ipc://
    front end 0..N-1 (demo.core.front_end): HTTP on one shared port (SO_REUSEPORT)

- The port: bound here first (port 0 picks a free one) and held, without listening, for the
  supervisor's life, so a restarted front end gets the same port back.
- An engine that dies (crash, kill -9, out of memory) is started again at once with the same
  flags (a --cache-file is restored as at any start); meanwhile the front ends answer 503
  ``engine_unavailable`` (demo.api.engine_client). A front end that dies loses only its own
  connections and is started again.
- SIGTERM or Ctrl-C: the front ends stop first (their requests cut), then the engine, which
  saves the cache file within --cache-save-timeout, as the one-process server does.
The supervisor imports neither torch nor the app: it only starts, waits and signals.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import wait

from demo import startup

log = logging.getLogger("demo")
START_TIMEOUT = 600.0  # seconds for the engine to load its model (a Hub download included)
FRONT_END_TIMEOUT = 120.0
RESTART_PAUSE = 0.5  # seconds between an exit and the restart (a crash loop stays slow)
FRONT_END_RETRY_S = 5.0  # seconds between tries of a front end that failed to start again


class Supervisor:
    def __init__(self, config):
        self.config = config
        self.ctx = multiprocessing.get_context("spawn")
        self.run_dir = tempfile.mkdtemp(prefix="radixkv-")  # mode 0700: the ipc sockets' folder
        self.engine: multiprocessing.Process | None = None
        self.front_ends: list[multiprocessing.Process | None] = [None] * config.api_server_count
        self.port = 0
        self.stopping = False

    def reserve_port(self) -> socket.socket:
        from demo.core.front_end import listener

        sock = listener(self.config.host, self.config.port)
        self.port = sock.getsockname()[1]
        return sock

    def start_engine(self) -> int:
        from demo.core import engine_process

        parent, child = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(
            target=engine_process.main, args=(self.config, self.run_dir, child), name="radixkv-engine"
        )
        proc.start()
        child.close()
        status = _answer(parent, proc, START_TIMEOUT)
        if status[0] != "ready":
            proc.join(5)
            raise SystemExit(2)  # the engine printed why (a bad flag: exit status 2)
        self.engine = proc
        return status[1]

    def start_front_ends(self, indices: list[int]) -> None:
        """Start these front ends together and wait until each listens."""
        from demo.core import front_end

        started = []
        for index in indices:
            parent, child = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(
                target=front_end.main,
                args=(self.config, self.run_dir, index, self.port, child),
                name=f"radixkv-api-{index}",
            )
            proc.start()
            child.close()
            started.append((index, proc, parent))
        for index, proc, parent in started:
            status = _answer(parent, proc, FRONT_END_TIMEOUT)
            if status[0] != "ready":
                for i, other, _ in started:  # none of this start is left running unwatched
                    if self.front_ends[i] is not other and other.is_alive():
                        other.kill()
                        other.join(10)
                raise RuntimeError(f"front end {index} did not start: {status[1]}")
            self.front_ends[index] = proc
            log.info("front end %d: pid %d, HTTP on %s", index, proc.pid, status[2])

    def watch(self) -> None:
        """Until SIGTERM / Ctrl-C: restart whichever child exits (a front end whose restart
        fails, say while the engine does not answer, is tried again every few seconds)."""
        retry: dict[int, float] = {}  # front end index -> when to try starting it again
        while True:
            for index, when in list(retry.items()):
                if time.monotonic() >= when:
                    del retry[index]
                    self._restart_front_end(index, retry)
            procs = [p for p in [self.engine, *self.front_ends] if p is not None]
            ended = wait([p.sentinel for p in procs], timeout=1.0)
            for proc in procs:
                if proc.sentinel not in ended:
                    continue
                proc.join()
                time.sleep(RESTART_PAUSE)
                if proc is self.engine:
                    log.error("the engine process %d exited (%s); starting it again", proc.pid, proc.exitcode)
                    try:
                        pid = self.start_engine()
                    except SystemExit:
                        log.error("the engine process could not start again; stopping")
                        raise
                    log.info("engine process: pid %d (restarted)", pid)
                else:
                    index = self.front_ends.index(proc)
                    log.error(
                        "front end %d (pid %d) exited (%s); starting it again", index, proc.pid, proc.exitcode
                    )
                    self._restart_front_end(index, retry)

    def _restart_front_end(self, index: int, retry: dict[int, float]) -> None:
        self.front_ends[index] = None
        try:
            self.start_front_ends([index])
        except RuntimeError as e:
            log.error("%s; trying again in %.0f s", e, FRONT_END_RETRY_S)
            retry[index] = time.monotonic() + FRONT_END_RETRY_S

    def stop(self) -> None:
        """Front ends first (SIGTERM: their requests cut), then the engine (its cache save)."""
        for proc in self.front_ends:
            if proc is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        for proc in self.front_ends:
            if proc is not None:
                _end(proc, 5.0)
        if self.engine is not None and self.engine.is_alive():
            os.kill(self.engine.pid, signal.SIGTERM)
            _end(self.engine, self.config.cache_save_timeout + 5.0)
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _answer(conn, proc, timeout: float) -> tuple:
    """A child's first message on ``conn``, or ("failed", why) if it exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            try:
                return conn.recv()
            except EOFError:
                break
        if not proc.is_alive():
            break
    if proc.is_alive():
        proc.kill()
    return ("failed", f"exit status {proc.exitcode}")


def _end(proc, timeout: float) -> None:
    proc.join(timeout)
    if proc.is_alive():
        log.warning("%s (pid %d) did not stop within %.0fs: killed", proc.name, proc.pid, timeout)
        proc.kill()
        proc.join(5)


def run(config) -> int:
    """``python -m demo`` with --api-server-count >= 1; returns the exit status."""
    from radixkv.wait_policy import quiet_threads

    quiet_threads()  # the children load torch: passive OpenMP threads unless the user chose
    sup = Supervisor(config)
    signal.signal(signal.SIGTERM, startup.interrupt)
    held = None
    try:
        held = sup.reserve_port()
        pid = sup.start_engine()
        log.info("engine process: pid %d, ipc in %s", pid, sup.run_dir)
        sup.start_front_ends(list(range(config.api_server_count)))
        url = f"http://{config.host}:{sup.port}"
        log.info(
            "supervisor %d: engine process %d, %d front ends on %s",
            os.getpid(),
            pid,
            config.api_server_count,
            url,
        )
        # A fixed line on stdout that scripts (benchmarks/bench_http.py) wait for: the only one.
        print(f"radixkv demo: serving on {url}", flush=True)
        sup.watch()
    except KeyboardInterrupt:
        pass
    except SystemExit as e:
        sup.stopping = True
        sup.stop()
        return int(e.code or 2)
    except OSError as e:  # the port is taken, the run folder cannot be made
        print(f"python -m demo: error: {e}", file=sys.stderr, flush=True)
        sup.stop()
        return 2
    except RuntimeError as e:  # a front end did not start (at the first start)
        print(f"python -m demo: error: {e}", file=sys.stderr, flush=True)
        sup.stopping = True
        sup.stop()
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sup.stopping = True
    sup.stop()
    if held is not None:
        held.close()
    return 0
