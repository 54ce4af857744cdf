"""Choosing the demo's WSGI server: waitress vs gunicorn (gthread) on what the demo needs.

A toy WSGI app (no model) streams server-sent events, one every 20 ms, and notes when it
learns that its client hung up. For each server (started as a subprocess on 127.0.0.1):

- time to the first event and the largest gap between events on the client (is SSE buffered?);
- hang-up detection: the client reads 3 events and closes; how long until the app knows;
- 200 half-open connections (request line + Host header, then close, all at once): how many
  reached the app, and the latency of a normal request sent right after.

    python benchmarks/bench_wsgi.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVENTS, GAP = 100, 0.02
_calls: list[str] = []
_detected: list[float] = []


def app(environ, start_response):
    path = environ["PATH_INFO"]
    _calls.append(path)
    if path == "/stats":
        body = json.dumps({"calls": len(_calls) - 1, "detected": _detected}).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]
    if path == "/wait":  # a non-streaming reply still being computed: poll for a hang-up
        return wait(environ, start_response)
    if path != "/sse":
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
        return [b"ok"]
    start_response("200 OK", [("Content-Type", "text/event-stream")])
    gone = environ.get("waitress.client_disconnected")

    def events():
        i = 0
        try:
            for i in range(EVENTS):
                if gone is not None and gone():
                    return
                yield f"data: {i} {time.time()}\n\n".encode()
                time.sleep(GAP)
        finally:
            # GeneratorExit (gunicorn: the write failed) or the waitress check: note the time
            if i < EVENTS - 1:
                _detected.append(time.time())

    return events()


def _peek_closed(sock) -> bool:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        if not sel.select(timeout=0):
            return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def wait(environ, start_response):
    gone = environ.get("waitress.client_disconnected")
    sock = environ.get("gunicorn.socket")
    check = gone if gone is not None else (lambda: _peek_closed(sock))
    for _ in range(250):
        if check():
            _detected.append(time.time())
            break
        time.sleep(0.02)
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
    return [b"ok"]


def serve(kind: str, port: int) -> None:
    if kind == "waitress":
        from waitress import serve as wserve

        wserve(
            app, host="127.0.0.1", port=port, threads=8, channel_request_lookahead=1, asyncore_use_poll=True
        )
    else:
        os.execvp(
            sys.executable,
            [
                sys.executable,
                "-m",
                "gunicorn",
                "-k",
                "gthread",
                "--threads",
                "8",
                "-w",
                "1",
                "-b",
                f"127.0.0.1:{port}",
                "--log-level",
                "warning",
                "benchmarks.bench_wsgi:app",
            ],
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def stats_of(port: int) -> dict:
    return json.loads(get(port, "/stats").split(b"\r\n\r\n", 1)[1])


def measure(kind: str) -> dict:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, str(port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                get(port, "/")
                break
            except OSError:
                time.sleep(0.1)
        # SSE: first event, largest gap
        s = socket.create_connection(("127.0.0.1", port))
        t0 = time.perf_counter()
        s.sendall(b"GET /sse HTTP/1.1\r\nHost: x\r\n\r\n")
        arrivals, buf = [], b""
        while len(arrivals) < 20:
            buf += s.recv(65536)
            while b"\n\n" in buf:
                _, buf = buf.split(b"\n\n", 1)
                arrivals.append(time.perf_counter() - t0)
        closed_at = time.time()
        s.close()  # hang up mid-stream
        time.sleep(2.5)
        stats = stats_of(port)
        detect = [d - closed_at for d in stats["detected"]]
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.5)
        closed_at = time.time()
        s.close()
        time.sleep(1.0)
        stats = stats_of(port)
        wait_detect = [d - closed_at for d in stats["detected"][len(detect) :]]
        calls_before = stats["calls"]
        socks = []
        for _ in range(200):
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            socks.append(c)
        for c in socks:
            c.close()
        t1 = time.perf_counter()
        get(port, "/")
        normal = time.perf_counter() - t1
        time.sleep(1)
        calls_after = stats_of(port)["calls"]
        return {
            "first_event_ms": arrivals[0] * 1e3,
            "max_gap_ms": max(b - a for a, b in zip(arrivals, arrivals[1:])) * 1e3,
            "hangup_detected_ms": detect[0] * 1e3 if detect else None,
            "hangup_while_computing_detected_ms": wait_detect[0] * 1e3 if wait_detect else None,
            "half_open_reaching_app": calls_after - calls_before - 2,  # minus our GET / and /stats
            "request_after_half_open_ms": normal * 1e3,
        }
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]))
        return
    for kind in ("waitress", "gunicorn"):
        r = measure(kind)
        print(
            f"{kind:>9}: "
            + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items())
        )


if __name__ == "__main__":
    main()
