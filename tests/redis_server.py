"""A real redis-server for tests: started on a free loopback port with its own temp dir, no
persistence; killed (SIGKILL) and restarted on the same port by the fault tests.

Tests that need it call ``need_redis()`` first: a clear skip where Debian's ``redis-server``
is not installed (``bash scripts/install.sh --dev`` as root installs it).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

REDIS_SERVER = shutil.which("redis-server")


def need_redis() -> None:
    if REDIS_SERVER is None:
        pytest.skip(
            "redis-server is not installed (apt-get install redis-server; scripts/install.sh --dev does)"
        )
    pytest.importorskip("redis", reason="redis-py is not installed (pip install 'radixkv[dev]')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; ``start()`` again after ``kill()`` reuses the port and args."""

    def __init__(self, workdir: str, *args: str, port: int | None = None, unix_socket: bool = False):
        self.workdir = str(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.port = port or free_port()
        self.args = list(args)
        self.unix_path = os.path.join(self.workdir, "redis.sock") if unix_socket else None
        self.proc: subprocess.Popen | None = None
        self.password: str | None = None
        if "--requirepass" in self.args:
            self.password = self.args[self.args.index("--requirepass") + 1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        cmd = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        cmd += ["--dir", self.workdir, "--logfile", os.path.join(self.workdir, "redis.log")]
        if self.unix_path:
            cmd += ["--unixsocket", self.unix_path, "--unixsocketperm", "700"]
        self.proc = subprocess.Popen(cmd + self.args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.client().ping():
                    return self
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = open(os.path.join(self.workdir, "redis.log")).read()[-2000:]
                    self.kill()
                    raise RuntimeError(f"redis-server did not start on port {self.port}: {log}") from None
                time.sleep(0.05)

    def client(self):
        """A plain redis-py client to poke the server (set garbage, CONFIG, CLIENT PAUSE)."""
        import redis

        return redis.Redis(port=self.port, password=self.password, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL, as a crash or a lost machine; waits for the process to go."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
