"""A real `python -m demo` process for end-to-end tests: started, waited for, its URL."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_demo(args: list[str], log_path: str, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """Start ``python -m demo *args`` (stderr appended to ``log_path``) and wait for the line
    it prints once it listens; returns (process, base URL). Fails with the log's tail."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "demo", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT},
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
            if "serving on " in line:
                return proc, line.split("serving on ", 1)[1].strip()
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError("the server did not start:\n" + open(log_path).read()[-3000:])
