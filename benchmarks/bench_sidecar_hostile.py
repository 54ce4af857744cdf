"""What one careless or hostile client costs a sidecar and the clients beside it. By hand::

    python -m benchmarks.bench_sidecar_hostile                       # all parts, this checkout
    python -m benchmarks.bench_sidecar_hostile --root /tmp/old      # the sidecar of another tree

1. ``memory``: the sidecar's resident memory grown by one hello: 4-byte blocks (1 token of one
   head of dim 1, float16) to ``--host-bytes 64M``, and 1 KiB blocks to ``--host-bytes 8G``.
2. ``flood``: a client sends 20,000 stats requests as fast as its socket takes them and reads
   nothing for 6 s; another client's stats calls meanwhile (and for 6 s before, with no flood:
   ``idle``): their longest, p99 and median round trip, and the replies the flooder reads at
   the end (a client that reads nothing for 5 s is dropped: what it read before that).
3. ``l2``: a sidecar with ``--l2`` on a loopback redis-server (empty); one client's match of
   8 M tokens (a 64 MiB body, the frame limit), another client's stats calls meanwhile.

``--root``: the code tree the sidecar runs from (``git archive COMMIT | tar -x -C DIR``): the
clients here send raw frames, so any tree with this wire format can be measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from radixkv.sidecar.protocol import FrameBuffer, encode, recv
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent
LAYOUT_1K = {
    "block_size": 2,
    "layers": [{"num_kv_heads": 1, "k_head_dim": 64, "v_head_dim": 64, "dtype": "float32"}],
}
LAYOUT_4B = {
    "block_size": 1,
    "layers": [{"num_kv_heads": 1, "k_head_dim": 1, "v_head_dim": 1, "dtype": "float16"}],
}
LAYOUT_16 = {
    "block_size": 16,
    "layers": [{"num_kv_heads": 1, "k_head_dim": 64, "v_head_dim": 64, "dtype": "float32"}],
}
KEY = {"ident": "cd" * 32, "ns": "null"}


def start_sidecar(root: Path, path: Path, host_bytes: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv.sidecar", "--socket", str(path), "--host-bytes", host_bytes,
         "--log-level", "WARNING", *extra], env=env, cwd=root,
    )  # fmt: skip
    while True:
        with socket.socket(socket.AF_UNIX) as probe:
            with contextlib.suppress(OSError):
                probe.connect(str(path))
                return proc
        if proc.poll() is not None:
            raise SystemExit("the sidecar did not start")
        time.sleep(0.05)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class Client:
    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(120)
        self.sock.connect(str(path))
        self.buffer = FrameBuffer()

    def call(self, header: dict, body: bytes = b"") -> dict:
        self.sock.sendall(encode(header, body))
        reply, _, fds = recv(self.sock, self.buffer, with_fds=True)
        for fd in fds:
            os.close(fd)
        return reply


class Beside(threading.Thread):
    """Stats calls in a loop until ``stop``; their round trips in seconds."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.client, self.times, self.stop = Client(path), [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.perf_counter()
            self.client.call({"op": "stats"})
            self.times.append(time.perf_counter() - start)
            time.sleep(0.002)

    def summary(self) -> dict:
        self.stop.set()
        self.join(60)
        times = sorted(self.times)
        return {"calls": len(times), "max_ms": round(times[-1] * 1e3, 1),
                "p99_ms": round(times[int(len(times) * 0.99)] * 1e3, 1),
                "median_ms": round(statistics.median(times) * 1e3, 2)}  # fmt: skip


def part_memory(args, tmp: Path) -> dict:
    out = {}
    for name, layout, host in (
        ("4-byte blocks, 64M", LAYOUT_4B, "64M"),
        ("1 KiB blocks, 8G", LAYOUT_1K, "8G"),
    ):
        path = tmp / f"m{len(out)}.sock"
        proc = start_sidecar(args.root, path, host)
        try:
            client = Client(path)
            client.call({"op": "stats"})
            before = rss(proc.pid)
            reply = client.call({"op": "hello", "layout": layout})
            grown = rss(proc.pid) - before
            out[name] = {"rss_grown_mib": round(grown / 2**20, 1), "reply": reply.get("error") or reply}
        finally:
            proc.kill()
            proc.wait()
    return out


def part_flood(args, tmp: Path) -> dict:
    path = tmp / "f.sock"
    proc = start_sidecar(args.root, path, "64M")
    try:
        flooder = Client(path)
        flooder.call({"op": "stats"})
        idle = Beside(path)  # the same calls without a flood first: what the machine's load costs
        idle.start()
        time.sleep(6.0)
        idle = idle.summary()
        beside = Beside(path)
        beside.start()
        time.sleep(0.2)
        frame = encode({"op": "stats"})
        flood = frame * 20_000
        flooder.sock.setblocking(False)
        sent = 0
        start = time.perf_counter()
        with contextlib.suppress(BlockingIOError, BrokenPipeError, ConnectionResetError):
            while sent < len(flood):
                sent += flooder.sock.send(flood[sent : sent + (1 << 16)])
        time.sleep(6.0)  # past the sidecar's 5 s send timeout
        result = beside.summary()
        flooder.sock.setblocking(True)
        got = 0
        with contextlib.suppress(ConnectionError, OSError):
            for _ in range(sent // len(frame)):
                recv(flooder.sock, flooder.buffer)
                got += 1
        return {"idle": idle, **result, "flood_s": round(time.perf_counter() - start, 1), "requests": sent // len(frame),
                "flooder_replies_read": got}  # fmt: skip
    finally:
        proc.kill()
        proc.wait()


def part_l2(args, tmp: Path) -> dict:
    redis = RedisServer(str(tmp / "redis")).start()
    path = tmp / "l.sock"
    proc = start_sidecar(args.root, path, "256M", "--l2", redis.url)
    try:
        client = Client(path)
        assert "error" not in client.call({"op": "hello", "layout": LAYOUT_16})
        tokens = struct.pack("<q", 7) * (8 << 20)  # 8 M tokens: the 64 MiB body limit
        beside = Beside(path)
        beside.start()
        time.sleep(0.2)
        start = time.perf_counter()
        reply = client.call({"op": "match", **KEY, "have": 0}, tokens)
        took = time.perf_counter() - start
        time.sleep(0.2)
        return {
            **beside.summary(),
            "lookup_s": round(took, 2),
            "reply": {k: reply.get(k) for k in ("lease", "num_tokens", "error")},
        }
    finally:
        proc.kill()
        proc.wait()
        redis.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="memory,flood,l2")
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree the sidecar runs from")
    args = parser.parse_args()
    parts = {"memory": part_memory, "flood": part_flood, "l2": part_l2}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.parts.split(","):
            print(
                json.dumps({"part": name, "root": str(args.root), **parts[name](args, Path(tmp))}), flush=True
            )


if __name__ == "__main__":
    main()
