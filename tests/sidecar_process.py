"""Helpers for tests with a real sidecar process, and the client processes they start.

python -m tests.sidecar_process client --run DOC:QUESTION:NAMESPACE:MODEL_SEED ...
    a fresh process: tiny llamas with their default stores (RADIXKV_SIDECAR from the
    environment), one generate() of document + question per run, each checked against
    stock; prints JSON (cached tokens per run).
python -m tests.sidecar_process half-write --socket S --doc-seed 1 --pin-seed 2
    pins a committed document, takes blocks for another and writes half of them, then
    SIGKILLs itself before committing (a client killed while writing).
python -m tests.sidecar_process half-write-states --socket S
    the same for a store with recurrent-state snapshots (radixkv only, no model): commits a
    document with snapshots, pins it, takes blocks and snapshot slots for another, writes half.
python -m tests.sidecar_process hybrid --run FAMILY:QUESTION_SEED ...
    a fresh process: per run, the tiny hybrid model of that family (tests/hybrid_models.py) asks
    ``HYBRID_DOC`` + a question of that seed through ``build_store(model, sidecar=...)``
    (RADIXKV_SIDECAR), checked against stock (tokens equal, logits within 1e-4); prints JSON
    (cached tokens and remote hit tokens per run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BS = 4
DOC_LEN = 42  # 10 whole blocks of 4, and 2 tokens more
QUESTION_LEN = 6


def start_sidecar(path: Path, host_bytes: str = "16M", *extra: str) -> subprocess.Popen:
    """``python -m radixkv.sidecar`` on ``path``; returns once it accepts connections."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv.sidecar", "--socket", str(path), "--host-bytes", host_bytes, *extra],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not _listening(path):  # the file exists from bind(), before listen(): connect to know
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"sidecar did not start: {proc.stdout.read()}")
        time.sleep(0.05)
    return proc


class SidecarLog:
    """A sidecar's output (``start_sidecar``'s pipe), read by a thread as it comes: a sidecar that
    logs a line per dropped client would block on a full pipe that nobody reads."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self._lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self._lines.append(line)

    def text(self) -> str:
        """What it logged so far."""
        return "".join(self._lines)

    def wait_for(self, *words: str, timeout: float = 30) -> str:
        """What it logged, once every one of ``words`` is in it (the reader thread may lag the
        sidecar a little), or when ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not all(w in (text := self.text()) for w in words) and time.monotonic() < deadline:
            time.sleep(0.01)
        return text

    def finished(self, proc: subprocess.Popen) -> str:
        """All it logged, once ``proc`` ended."""
        proc.wait(60)
        self._thread.join(60)
        return self.text()


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def client_env(socket_path: Path) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "RADIXKV_SIDECAR": str(socket_path),
        "RADIXKV_BLOCK_SIZE": str(BS),
        "RADIXKV_CACHE_TOKENS": "2048",
    }


def run_client(socket_path: Path, *args: str) -> dict:
    res = subprocess.run(
        [sys.executable, "-m", "tests.sidecar_process", *args],
        env=client_env(socket_path), cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def sidecar_stats(path) -> dict:
    """The sidecar's counters, over the protocol (what ``python -m radixkv.sidecar stats`` prints)."""
    import socket

    from radixkv.sidecar.protocol import FrameBuffer, recv, send

    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        send(sock, {"op": "stats"})
        return recv(sock, FrameBuffer())[0]["stats"]


def connect(path, timeout: float = 30) -> socket.socket:
    """A socket connected to ``path``, waiting while the listen backlog is full (a connect with a
    timeout fails at once with EAGAIN then, as after a burst of connects)."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock.connect(str(path))
            return sock
        except BlockingIOError:
            if time.monotonic() > deadline:
                sock.close()
                raise
            time.sleep(0.001)


class Wire:
    """A raw client of a sidecar, for what no ``SidecarTier`` sends: any bytes (``send_raw``),
    requests as dicts (``call``), and the KV round trip of a correct client (``kv_round_trip``)."""

    def __init__(self, path, timeout: float = 30) -> None:
        self.sock = connect(path, timeout)
        from radixkv.sidecar.protocol import FrameBuffer

        self.buffer = FrameBuffer()

    def close(self) -> None:
        self.sock.close()

    @staticmethod
    def frame(head: bytes, body: bytes = b"") -> bytes:
        """One frame of any header bytes (JSON or not) and body."""
        from radixkv.sidecar.protocol import HEADER

        return HEADER.pack(len(head), len(body)) + head + body

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> tuple[dict, list[int]]:
        """The next reply and the fds it carried; ConnectionError when the sidecar hung up."""
        from radixkv.sidecar.protocol import recv

        header, _, fds = recv(self.sock, self.buffer, with_fds=True)
        return header, fds

    def call(self, header: dict, body: bytes = b"") -> dict:
        from radixkv.sidecar.protocol import encode

        self.send_raw(encode(header, body))
        reply, fds = self.reply()
        for fd in fds:
            os.close(fd)
        return reply

    def hung_up(self) -> bool:
        """Whether the sidecar closed this connection (reads what is left until EOF or timeout)."""
        try:
            while data := self.sock.recv(1 << 16):
                del data
        except TimeoutError:
            return False
        except ConnectionResetError:
            pass
        return True


# The smallest layout a sidecar pool takes: 2 tokens x (64 + 64) float32 = 1 KiB a block
WIRE_LAYOUT = {
    "block_size": 2,
    "layers": [{"num_kv_heads": 1, "k_head_dim": 64, "v_head_dim": 64, "dtype": "float32"}],
}
WIRE_KEY = {"ident": "ab" * 32, "ns": "null"}
# The same blocks with snapshots of 1 KiB (the smallest taken), and snapshots alone (Mamba-like)
WIRE_STATES = [{"shape": [2, 128], "dtype": "float32"}]
WIRE_STATE_LAYOUT = {**WIRE_LAYOUT, "states": WIRE_STATES}
WIRE_STATE_ONLY_LAYOUT = {"block_size": 2, "layers": [], "states": WIRE_STATES}


def kv_round_trip(path, seed: int, layout: dict = WIRE_LAYOUT) -> None:
    """A correct client's write, then another connection's read of it: the bytes read back from
    shared memory are the bytes written (what a hostile client beside them must not change).
    A ``layout`` with states writes and reads back the snapshots after 4 and 8 tokens too."""
    import mmap
    import random

    from radixkv.sidecar.layout import KVLayout, PoolGeometry
    from radixkv.sidecar.protocol import encode

    rng = random.Random(seed)
    tokens = [rng.randrange(1 << 62) for _ in range(8)]  # 4 whole blocks, a key of this seed alone
    body = struct.pack(f"<{len(tokens)}q", *tokens)
    stateful = "states" in layout
    writer, reader = Wire(path), Wire(path)
    try:
        writer.send_raw(encode({"op": "hello", "layout": layout}))
        hello, (fd,) = writer.reply()
        geometry = PoolGeometry(KVLayout.from_json(layout), hello["num_blocks"], hello.get("num_slots", 0))
        with mmap.mmap(fd, hello["pool_bytes"]) as buf:
            os.close(fd)
            txn = writer.call({"op": "alloc", **WIRE_KEY, **({"snaps": [4, 8]} if stateful else {})}, body)
            assert "error" not in txn and txn["start"] == 0 and len(txn["slots"]) == 4, txn
            payloads = [rng.randbytes(geometry.layout.block_bytes) for _ in txn["slots"]]
            for slot, payload in zip(txn["slots"], payloads):
                geometry.write_block(buf, slot, payload)
            snaps = [rng.randbytes(geometry.layout.snapshot_bytes) for _ in txn.get("snaps", [])]
            for slot, payload in zip(txn.get("snaps", []), snaps):
                assert slot >= 0, txn
                geometry.write_snapshot(buf, slot, payload)
            done = writer.call({"op": "commit", "txn": txn["txn"]})
            assert done == ({"inserted": 8, "snapshots": 2} if stateful else {"inserted": 8}), done
            assert "error" not in reader.call({"op": "hello", "layout": layout})
            hit = reader.call({"op": "match", **WIRE_KEY, "have": 0}, body)
            assert hit["num_tokens"] == 8 and len(hit["slots"]) == 4, hit
            assert [geometry.read_block(buf, s) for s in hit["slots"]] == payloads
            if stateful:
                assert geometry.read_snapshot(buf, hit["snap"]) == snaps[1]
            reader.send_raw(encode({"op": "release", "lease": hit["lease"]}))
    finally:
        writer.close()
        reader.close()


def after_copy(monkeypatch, then, once: bool = False) -> None:
    """Make the write-through writer call ``then()`` right after it copies a commit's blocks
    (between its alloc and its commit): after every copy, or after the first one only."""
    import radixkv.sidecar.write_through as wt

    copy_blocks, done = wt.copy_blocks, []

    def copied(*args):
        copy_blocks(*args)
        if not (once and done):
            done.append(True)
            then()

    monkeypatch.setattr(wt, "copy_blocks", copied)


def document(doc_seed: int) -> list[int]:
    from tests.hf_models import tokens

    return tokens(DOC_LEN, doc_seed)


# a prompt's tokens the store serves: whole blocks short of its last token (generate() computes it)
PROMPT_HIT = (DOC_LEN + QUESTION_LEN - 1) // BS * BS


def prompt_of(seed: int) -> list[int]:
    """Document ``seed`` and a question of its own."""
    from tests.hf_models import tokens

    return document(seed) + tokens(QUESTION_LEN, 1000 + seed)


def _client(args) -> None:
    import torch

    import hf_patch
    from tests.hf_models import assert_same_as_stock, build, ids, tokens

    torch.set_num_threads(1)
    models = {}
    out = []
    for run in args.run:  # "doc_seed:question_seed:namespace:model_seed", empty fields: defaults
        doc_seed, question_seed, namespace, model_seed = (run.split(":") + ["", "", "", ""])[:4]
        model_seed = int(model_seed or 0)
        model = models.get(model_seed) or models.setdefault(model_seed, build("llama-sdpa", seed=model_seed))
        prompt = document(int(doc_seed)) + tokens(QUESTION_LEN, int(question_seed or 1000))
        cache = hf_patch.RadixCache(namespace=namespace or None)
        assert_same_as_stock(model, ids(prompt), cache=cache, max_new_tokens=5, do_sample=False)
        out.append(cache.cached_tokens[0])
    remote = sum(hf_patch.default_store(m).stats()["remote_hit_tokens"] for m in models.values())
    print(json.dumps({"cached": out, "remote_hit_tokens": remote}), flush=True)
    if args.exit_doc is not None:
        # generate() once more and exit at once: the write-through queue is flushed at exit.
        model = models.get(0) or build("llama-sdpa")
        prompt = ids(document(args.exit_doc) + tokens(QUESTION_LEN, 1000))
        out = model.generate(prompt, past_key_values=hf_patch.RadixCache(), max_new_tokens=3, do_sample=False)
        assert torch.equal(out, model.generate(prompt, max_new_tokens=3, do_sample=False))


def _half_write(args) -> None:
    import torch

    import hf_patch
    from hf_patch.keys.weights import model_scope
    from hf_patch.stores import sidecar_namer
    from tests.hf_models import build, ids

    model = build("llama-sdpa")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=args.socket)
    tier = store.remote
    model.generate(ids(document(args.pin_seed)), past_key_values=hf_patch.RadixCache(store), max_new_tokens=1)
    assert tier.flush(30)
    ident, ns = sidecar_namer(model, store.pool)((model_scope(model), None))
    key = {"ident": ident.hex(), "ns": ns.decode()}
    pinned, _, _ = tier.call(
        {"op": "match", **key, "have": 0}, torch.tensor(document(args.pin_seed)).numpy().tobytes()
    )
    assert pinned["lease"] and pinned["slots"], pinned
    doc = torch.tensor(document(args.doc_seed)).numpy().tobytes()
    taken, view, _ = tier.call({"op": "alloc", **key}, doc)
    assert taken["start"] == 0 and len(taken["slots"]) == DOC_LEN // BS, taken
    for slot in taken["slots"][: len(taken["slots"]) // 2]:
        for t in (*view.k, *view.v):
            t[slot].fill_(7.0)  # written, never committed
    print("killing myself", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


# A stateful store of radixkv alone: 2 KiB blocks of 4 tokens, snapshots of 2,078 bytes.
STATE_SHAPES = ((8, 64), (3, 5))
STATE_KEY = (b"\x05" * 32, b"null")


def state_store(path, *, kv: bool = True, host: bool = False, namer=None):
    """A ``KVStore(states=...)`` on the sidecar at ``path`` (``kv``: two attention layers, else
    none, as Mamba; ``host``: with a host tier and its state pool). ``namer``: the tier's (default:
    every namespace to ``STATE_KEY``)."""
    import torch

    from radixkv import BlockPool, KVStore, LayerSpec, StatePool, StateSpec
    from radixkv.sidecar.client import SidecarTier
    from radixkv.store.state_pool import host_states_for
    from radixkv.store.tier import host_pool_for

    layers = [LayerSpec(2, 16, 16, torch.float32, "cpu")] * 2 if kv else []
    pool = BlockPool(layers, 64, BS)
    specs = [
        StateSpec(STATE_SHAPES[0], torch.float32, "cpu"),
        StateSpec(STATE_SHAPES[1], torch.bfloat16, "cpu"),
    ]
    states = StatePool(specs, 8)
    host_pool = host_states = None
    if host:
        host_pool = host_pool_for(pool, tokens=256) if kv else BlockPool([], 64, BS)
        host_states = host_states_for(states, 8 * states.slot_bytes)
    tier = SidecarTier(str(path), pool, namer or (lambda ns: STATE_KEY), states=states)
    return KVStore(pool, host_pool, remote=tier, states=states, host_states=host_states)


def state_entry(seed: int, num_tokens: int, positions, layers: int = 2):
    """Tokens, K, V and snapshots {position: states} of one document, drawn from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 1 << 40, (num_tokens,), generator=g).tolist()
    k = [torch.randn(1, 2, num_tokens, 16, generator=g) for _ in range(layers)]
    v = [torch.randn(1, 2, num_tokens, 16, generator=g) for _ in range(layers)]
    snaps = {
        p: [torch.randn(*STATE_SHAPES[0], generator=g), torch.randn(*STATE_SHAPES[1], generator=g).bfloat16()]
        for p in positions
    }
    return toks, k, v, snaps


def _half_write_states(args) -> None:
    import torch

    store = state_store(args.socket)
    tier = store.remote
    toks, k, v, snaps = state_entry(args.pin_seed, 24, (8, 16))
    store.commit(toks, k, v, snapshots=snaps)
    assert tier.flush(30) and tier.counters["written_snapshots"] == 2, tier.stats()
    key = {"ident": STATE_KEY[0].hex(), "ns": STATE_KEY[1].decode()}
    packed = torch.tensor(toks[:16]).numpy().tobytes()
    pinned, _, _ = tier.call({"op": "match", **key, "have": 0}, packed)
    assert pinned["lease"] and pinned["snap"] >= 0, pinned
    other, _, _, _ = state_entry(args.doc_seed, 24, ())
    body = torch.tensor(other).numpy().tobytes()
    taken, view, _ = tier.call({"op": "alloc", **key, "snaps": [8, 16, 24]}, body)
    assert taken["start"] == 0 and len(taken["slots"]) == 6 and -1 not in taken["snaps"], taken
    for slot in taken["slots"][:3]:
        for t in (*view.k, *view.v):
            t[slot].fill_(7.0)  # written, never committed
    for t in view.states.tensors:
        t[taken["snaps"][0]].fill_(7.0)
    print("killing myself", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def hybrid_same_as_stock(model, input_ids, store):
    """``tests.test_hf_recurrent.same_as_stock`` for a store with a sidecar: tokens equal to
    stock's, logits within 1e-4, and once the write-through is done (its writer pins the local
    blocks it copies) no pin left and the store's invariants hold. Returns the cache."""
    import torch

    import hf_patch
    from tests.hf_models import assert_outputs_equal, stock
    from tests.test_hf_recurrent import ATOL, GEN

    ref = stock(model, input_ids, **GEN)
    cache = hf_patch.RadixCache(store=store)
    with torch.no_grad():
        out = model.generate(
            input_ids, past_key_values=cache, output_logits=True, return_dict_in_generate=True, **GEN
        )
    assert_outputs_equal(ref, out, atol=ATOL)
    assert store.remote.flush(30)
    store.check_invariants()
    stats = store.stats()
    assert stats["pinned_blocks"] == stats["task_pinned_blocks"], "a finished call left blocks pinned"
    return cache


def _hybrid(args) -> None:
    import torch

    import hf_patch
    from tests.hybrid_models import build_hybrid, tokens
    from tests.test_hf_recurrent import DOC, INTERVAL

    torch.set_num_threads(1)
    out = []
    for run in args.run:  # "family:question_seed"
        name, seed = run.split(":")
        model = build_hybrid(name)
        store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL)
        cache = hybrid_same_as_stock(model, torch.tensor([DOC + tokens(11, seed=int(seed))]), store)
        stats = store.stats()
        out.append(
            {
                "cached": cache.cached_tokens[0],
                "remote_hit_tokens": stats["remote_hit_tokens"],
                "remote_snapshots_read": stats["remote_snapshots_read"],
            }
        )
    print(json.dumps(out), flush=True)  # then exit: the write-through queue is flushed at exit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["client", "half-write", "half-write-states", "hybrid"])
    parser.add_argument("--exit-doc", type=int, default=None)
    parser.add_argument("--socket")
    parser.add_argument("--doc-seed", type=int, default=0)
    parser.add_argument("--run", action="append", default=[])
    parser.add_argument("--pin-seed", type=int, default=0)
    args = parser.parse_args()
    what = {"client": _client, "half-write": _half_write, "half-write-states": _half_write_states}
    {**what, "hybrid": _hybrid}[args.what](args)


if __name__ == "__main__":
    main()
