"""SIGTERM while streams are running: time to exit, exit status, and what the shutdown save wrote.

Run by hand (CPU, a real `python -m demo` process, the built-in tiny model by default):

    python -m benchmarks.bench_shutdown_load                          # 8 streams, timeout 2 s
    python -m benchmarks.bench_shutdown_load --streams 16 --timeout 3 --model builtin

Starts the server with ``--cache-file`` and ``--cache-save-timeout``, opens ``--streams``
streaming completions that cannot end early (EOS suppressed with logit_bias), waits until each
has sent text, sends SIGTERM and prints: seconds from the signal to the exit, the exit status
and the cache file's size (none: the save never ran). Issue 28 item 5: the server used to wait
up to 5 s for the streams before saving, and lost the cache under any timeout up to ~5 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time

import requests

from demo.model.loading import build_builtin
from tests.demo_process import start_demo


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=2.0, help="--cache-save-timeout (default 2)")
    parser.add_argument("--model", default="builtin-tiny", choices=("builtin", "builtin-tiny"))
    args = parser.parse_args()
    _, tokenizer = build_builtin(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "cache.radixkv")
        server_args = ["--model", args.model, "--port", "0", "--max-batch-size", str(args.streams)]
        server_args += ["--cache-file", cache, "--cache-save-timeout", str(args.timeout)]
        proc, url = start_demo(server_args, os.path.join(tmp, "server.log"))
        first = [threading.Event() for _ in range(args.streams)]

        def stream(i: int) -> None:
            body = {"prompt": f"Stream {i}: " + "a staff list | Name | Age | " * 8, "max_tokens": 700,
                    "temperature": 0, "stream": True, "logit_bias": {str(tokenizer.eos_token_id): -100}}  # fmt: skip
            try:
                with requests.post(url + "/v1/completions", json=body, stream=True, timeout=300) as r:
                    for line in r.iter_lines():
                        if line.startswith(b"data: {"):
                            first[i].set()
            except requests.RequestException:
                pass

        for i in range(args.streams):
            threading.Thread(target=stream, args=(i,), daemon=True).start()
        ready = all(e.wait(120) for e in first)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        took = time.monotonic() - started
        size = os.path.getsize(cache) if os.path.exists(cache) else None
    print(f"streams running at SIGTERM: {args.streams if ready else 'not all'}")
    print(f"exit after {took:.2f}s (--cache-save-timeout {args.timeout:g}), status {rc}")
    print(f"cache file: {size / 2**20:.2f} MiB" if size is not None else "cache file: none (nothing saved)")


if __name__ == "__main__":
    main()
