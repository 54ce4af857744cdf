"""A fuzzer of the sidecar's protocol, against a real sidecar process.

Hostile connections send random frames: requests of every op with random fields (missing,
unknown, of any JSON type, numbers past every range, ``NaN``, ``Infinity``, 5,000-digit ints,
lone surrogates, nesting past the limit), random bodies, lies in the length prefix, random bytes,
byte flips of valid frames, and every cut of valid frames (the rest never sent, or another frame
sent after it). They read what comes back and reuse the lease and transaction ids they are given
(commit twice, abort then commit, release another's). Layouts with recurrent-state snapshots
(and without KV layers) are in the mix, with random snapshot positions on allocs (``snaps``) and
random ``states`` in layouts. Meanwhile a correct client writes KV (and snapshots, in a layout
with states) and reads them back on another connection (``kv_round_trip``): the bytes must be
the ones written.

    python -m tests.sidecar_fuzz --frames 200000 --seed 1       # by hand: counts as JSON

``tests/test_sidecar_fuzz.py`` runs a bounded, seeded version.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

from radixkv.sidecar.protocol import HEADER, MAX_DEPTH, FrameBuffer, ProtocolError, encode
from tests.sidecar_process import (
    WIRE_KEY,
    WIRE_LAYOUT,
    WIRE_STATE_LAYOUT,
    WIRE_STATE_ONLY_LAYOUT,
    SidecarLog,
    connect,
    kv_round_trip,
    start_sidecar,
)

OPS = ["hello", "match", "release", "alloc", "commit", "abort", "stats"]
FIELDS = ["op", "layout", "ident", "ns", "have", "claim", "lease", "txn", "block_size", "layers", "states",
          "snaps", "shape"]  # fmt: skip
LAYOUTS = [WIRE_LAYOUT, WIRE_STATE_LAYOUT, WIRE_STATE_ONLY_LAYOUT]
GOOD_SNAPS = [[2], [2, 4], [4, 8], [2, 6], [6]]  # within a body of 8+ tokens of a layout with states
BAD_SNAPS = [[], [3], [2, 2], [4, 2], [0], [-2], [2.0], [True], [1 << 63], [2] * 5000, "x", {"a": 1}]
NUMBERS = [
    "0", "1", "-1", "2", "16", "9223372036854775807", "9223372036854775808", "-9223372036854775808",
    "1e400", "-1e400", "1E-400", "NaN", "Infinity", "-Infinity", "-0.0", "0.5", "3600", "3600.0001",
    "1" * 5000, "-" + "9" * 60, "1.0", "4294967296", "18446744073709551616",
]  # fmt: skip
STRINGS = [
    '""',
    '"ab"',
    '"' + "ab" * 32 + '"',
    '"zz"',
    '"\\ud800"',
    '"\\u0000"',
    '"null"',
    '"[[[["',
    '"\\\\"',
]


MARKER = encode({"op": "stats"})


class Hostile:
    """One hostile connection: reads what comes back and keeps the ids it is granted;
    reconnects when the sidecar drops it. ``careful``: sends requests only (bad fields, not bad
    framing) each followed by a stats request, and reads the replies up to that one (so its
    requests reach the state, with ids it was granted); else sends any frame without waiting."""

    def __init__(self, path: str, rng: random.Random, careful: bool = False) -> None:
        self.path, self.rng, self.careful = path, rng, careful
        self.sock: socket.socket | None = None
        self.ids: list[int] = []
        self.counts = dict.fromkeys(
            ("frames", "replies", "errors", "granted", "committed", "dropped", "connections", "snap_slots"), 0
        )

    def connect(self) -> None:
        self.close()
        self.sock = connect(self.path)
        self.sock.setblocking(False)
        self.buffer = FrameBuffer()
        self.counts["connections"] += 1
        self.sent = 0
        if self.careful and self.rng.random() < 0.9:  # mostly with a pool: its requests reach the state
            self._send_and_read(encode({"op": "hello", "layout": self.rng.choice(LAYOUTS)}))

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def send(self, data: bytes) -> None:
        if self.sock is None or self.sent > 400:  # a fresh connection now and then: frees its blocks
            self.connect()
            if self.sock is None:  # its hello dropped it
                return
        self.counts["frames"] += 1
        self.sent += 1
        if self.careful:
            return self._send_and_read(data)
        try:
            view = memoryview(data)
            while view:
                try:
                    view = view[self.sock.send(view) :]
                except BlockingIOError:
                    self.drain()  # its replies wait for it: read them, then send on
                    time.sleep(0.0005)
            self.drain()
        except (BrokenPipeError, ConnectionResetError, ConnectionError):
            self.counts["dropped"] += 1
            self.close()

    def _send_and_read(self, data: bytes) -> None:
        self.sock.setblocking(True)
        self.sock.settimeout(30)
        try:
            self.sock.sendall(data + MARKER)
            while True:
                header = self._next()
                if "stats" in header:
                    return
        except (BrokenPipeError, ConnectionResetError, ConnectionError):
            self.counts["dropped"] += 1
            self.close()

    def _next(self) -> dict:
        while True:
            try:
                frame = next(self.buffer.frames(), None)
            except ProtocolError as e:
                raise AssertionError(f"the sidecar sent a broken frame: {e}") from None
            if frame is not None:
                return self._note(frame[0])
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("dropped")
            self.buffer.feed(data)

    def _note(self, header: dict) -> dict:
        self.counts["replies"] += 1
        self.counts["errors"] += "error" in header
        for key in ("lease", "txn"):
            if isinstance(header.get(key), int) and header[key]:
                self.ids.append(header[key])
                self.counts["granted"] += 1
        self.counts["committed"] += isinstance(header.get("inserted"), int) and header["inserted"] > 0
        snaps = header.get("snaps")
        self.counts["snap_slots"] += sum(s >= 0 for s in snaps) if isinstance(snaps, list) else 0
        return header

    def drain(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                return
            if not data:
                raise ConnectionError("dropped")
            self.buffer.feed(data)
            try:
                for header, _ in self.buffer.frames():
                    self._note(header)
            except ProtocolError as e:
                raise AssertionError(f"the sidecar sent a broken frame: {e}") from None

    # -- what to send ---------------------------------------------------------------------
    def value(self, depth: int = 0) -> str:
        """A random JSON value as text (with the non-standard NaN and Infinity)."""
        rng = self.rng
        kind = rng.random()
        if kind < 0.3 or depth > MAX_DEPTH + 4:
            return rng.choice(NUMBERS) if rng.random() < 0.5 else str(rng.randrange(-(1 << 70), 1 << 70))
        if kind < 0.5:
            return rng.choice(STRINGS)
        if kind < 0.6:
            return rng.choice(["true", "false", "null"])
        if kind < 0.7 and self.ids:
            return str(rng.choice(self.ids))
        if kind < 0.85:
            return "[" + ",".join(self.value(depth + 1) for _ in range(rng.randrange(4))) + "]"
        return self.obj(depth + 1)

    def obj(self, depth: int = 0, op: str | None = None) -> str:
        rng = self.rng
        fields = {}
        if op is not None:
            fields["op"] = json.dumps(op)
        for _ in range(rng.randrange(4)):
            name = rng.choice(FIELDS) if rng.random() < 0.8 else rng.choice(["x", "", "lease ", "\\u006fp"])
            fields[name] = self.value(depth)
        return "{" + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}"

    def request(self) -> bytes:
        """A request, mostly well formed, with random field values (and random ids it holds)."""
        rng = self.rng
        op = rng.choice(OPS)
        layout = rng.choice(LAYOUTS)
        if rng.random() < 0.2:  # states of random shapes and dtypes: sizes past every bound, or not
            shape = [rng.choice([1, 2, 64, 256, 1 << 16, 0]) for _ in range(rng.randrange(1, 10))]
            layout = {
                **layout,
                "states": [{"shape": shape, "dtype": rng.choice(["float32", "bfloat16", "int8"])}],
            }
        valid = {
            "hello": {"op": "hello", "layout": layout},
            "match": {
                "op": "match",
                **WIRE_KEY,
                "have": rng.choice([0, 2, 3]),
                "claim": rng.choice([0, 0.5]),
            },
            "release": {"op": "release", "lease": rng.choice(self.ids or [0])},
            "alloc": {
                "op": "alloc",
                **WIRE_KEY,
                "snaps": rng.choice(GOOD_SNAPS if rng.random() < 0.6 else BAD_SNAPS),
            },
            "commit": {"op": "commit", "txn": rng.choice(self.ids or [0])},
            "abort": {"op": "abort", "txn": rng.choice(self.ids or [0])},
            "stats": {"op": "stats"},
        }[op]
        n = rng.randrange(12) if rng.random() < 0.6 else 0
        body = struct.pack(f"<{n}q", *(rng.randrange(-4, 4) for _ in range(n)))  # small ids: shared prefixes
        if rng.random() < 0.1:
            body += bytes(rng.randrange(1, 8))
        if rng.random() < (0.7 if self.careful else 0.4):
            return encode(valid, body)
        head = self.obj(0, op).encode()
        if rng.random() < 0.3:  # a valid request with fields replaced or added (or a trailing comma)
            head = (json.dumps(valid)[:-1] + "," + self.obj(0)[1:]).encode()
        return HEADER.pack(len(head), len(body)) + head + body

    def frame(self) -> bytes:
        rng = self.rng
        kind = rng.random()
        if kind < 0.6 or self.careful:
            return self.request()
        if kind < 0.7:  # a byte flipped, inserted or dropped in a valid request
            data = bytearray(self.request())
            at = rng.randrange(len(data))
            choice = rng.randrange(3)
            if choice == 0:
                data[at] ^= 1 << rng.randrange(8)
            elif choice == 1:
                data.insert(at, rng.randrange(256))
            else:
                del data[at]
            return bytes(data)
        if kind < 0.8:  # nesting, past the limit or not, in an unknown field or a known one
            depth = rng.choice([MAX_DEPTH - 2, MAX_DEPTH, MAX_DEPTH + 1, 1000, 100_000])
            field = rng.choice(["x", "layout", "lease", "ns"])
            head = f'{{"op":"{rng.choice(OPS)}","{field}":' + "[" * depth + "]" * depth + "}"
            return HEADER.pack(len(head), 0) + head.encode()
        if kind < 0.9:  # lengths that lie
            head_len = rng.choice([0, 1, 2, 7, 1 << 20, (1 << 20) + 1, 1 << 31, (1 << 32) - 1])
            body_len = rng.choice([0, 3, 8, 64 << 20, (64 << 20) + 1, (1 << 32) - 1])
            return HEADER.pack(head_len, body_len) + rng.randbytes(rng.randrange(32))
        return rng.randbytes(rng.randrange(1, 64))


def truncations(path: str, frames: list[bytes]) -> int:
    """Every cut of every frame, each on a fresh connection that says hello first: the cut frame
    then the connection closed, or the cut frame then a whole stats request. Returns the cuts."""
    cuts = 0
    hello = encode({"op": "hello", "layout": WIRE_STATE_LAYOUT})
    for frame in frames:
        for cut in range(len(frame)):
            with connect(path) as sock:
                tail = encode({"op": "stats"}) if cut % 2 else b""
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    sock.sendall(hello + frame[:cut] + tail)
            cuts += 1
    return cuts


def valid_frames(rng: random.Random) -> list[bytes]:
    tokens = struct.pack("<8q", *(rng.randrange(1 << 62) for _ in range(8)))
    return [
        encode({"op": "hello", "layout": WIRE_LAYOUT}),
        encode({"op": "hello", "layout": WIRE_STATE_ONLY_LAYOUT}),
        encode({"op": "match", **WIRE_KEY, "have": 0, "claim": 0.5}, tokens),
        encode({"op": "alloc", **WIRE_KEY}, tokens),
        encode({"op": "alloc", **WIRE_KEY, "snaps": [2, 8]}, tokens),
        encode({"op": "commit", "txn": 1}),
        encode({"op": "release", "lease": 3}),
        encode({"op": "abort", "txn": 2}),
        encode({"op": "stats"}),
    ]


def fuzz(path: str, seed: int, frames: int, *, hostiles: int = 4, check_every: int = 500) -> dict:
    """``frames`` random frames over ``hostiles`` connections, a correct client's KV round trip
    every ``check_every`` frames and at the end, and every cut of a few valid frames."""
    rng = random.Random(seed)
    pool = [Hostile(path, random.Random(rng.random()), careful=i % 2 == 0) for i in range(hostiles)]
    checks = 0
    for i in range(frames):
        client = rng.choice(pool)
        client.send(client.frame())
        if (i + 1) % check_every == 0:
            kv_round_trip(path, seed=rng.randrange(1 << 30), layout=LAYOUTS[checks % len(LAYOUTS)])
            checks += 1
    cuts = truncations(path, valid_frames(rng))
    for client in pool:
        client.close()
    for layout in LAYOUTS:
        kv_round_trip(path, seed=rng.randrange(1 << 30), layout=layout)
    counts = {k: sum(c.counts[k] for c in pool) for k in pool[0].counts}
    return {**counts, "cuts": cuts, "kv_checks": checks + len(LAYOUTS)}


def settled(path: str, attempts: int = 200) -> dict:
    """The sidecar's stats once every hostile connection's end has been handled (nothing held)."""
    from tests.sidecar_process import sidecar_stats

    for _ in range(attempts):
        stats = sidecar_stats(path)
        held = ("open_leases", "open_txns", "pinned_blocks", "claims", "private_snapshots")
        if not any(stats[k] for k in held):
            return stats
        time.sleep(0.05)
    return stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--host-bytes", default="256M")
    parser.add_argument("--log", default=None, help="write the sidecar's log here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.sock"
        proc = start_sidecar(path, args.host_bytes)
        log = SidecarLog(proc)
        try:
            start = time.monotonic()
            counts = fuzz(str(path), args.seed, args.frames)
            stats = settled(str(path))
            alive = proc.poll() is None
        finally:
            proc.terminate()
            log = log.finished(proc)
    if args.log:
        Path(args.log).write_text(log)
    raised = log.count("its request raised")
    print(json.dumps({**counts, "seconds": round(time.monotonic() - start, 1), "alive": alive,
                      "tracebacks": log.count("Traceback"), "requests_raised": raised,
                      "held_after": {k: stats[k] for k in ("open_leases", "open_txns", "pinned_blocks", "claims")}}))  # fmt: skip
    sys.exit(0 if alive and not raised and "Traceback" not in log else 1)


if __name__ == "__main__":
    main()
