"""One copy for all layers against one per layer (cuda_ext.stacking), paired in one process.

The shapes of bench_contention's radix path (bench_hf's model: 8 layers, 4 KV heads, head dim
64, fp32): ``read``: the cold batch's 16 reads of one row x 2,000 cached tokens; ``commit``:
a decode batch's 8 commits of 32 new tokens each. Each round times both ways, alternately, on
the same pool (per layer: the same outputs, not slices of one buffer); medians of the rounds.
``--busy`` adds bench_contention's competitor. The OMP wait policy is the environment's:

    python benchmarks/bench_layer_copies.py [--busy] [--rounds 20]
    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_layer_copies.py --busy
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.bench_contention import COMPETITOR
from hf_patch.layer import AppendLayer, allocate_stacked
from radixkv import BlockPool, LayerSpec

LAYERS, HEADS, DIM, BS = 8, 4, 64, 16
SPECS = tuple(LayerSpec(HEADS, DIM, DIM, torch.float32, torch.device("cpu")) for _ in range(LAYERS))


def buffers(stacked: bool, batch: int, capacity: int):
    layers = [AppendLayer() for _ in SPECS]
    if stacked:
        allocate_stacked(layers, batch, SPECS, capacity)
    else:
        for layer in layers:
            layer.allocate(batch, HEADS, DIM, DIM, capacity, torch.float32, "cpu")
    return [layer.buffers()[0] for layer in layers], [layer.buffers()[1] for layer in layers]


def read(pool, k, v, rows: int = 16, tokens: int = 2000) -> None:
    ids = torch.arange(-(-tokens // BS)).unsqueeze(0)
    for r in range(rows):  # one read per row, as rows of different padding are read
        pool.gather(
            ids,
            tokens,
            [t[r : r + 1, :, 8 : 8 + tokens] for t in k],
            [t[r : r + 1, :, 8 : 8 + tokens] for t in v],
        )


def commit(pool, k, v, rows: int = 8, tokens: int = 32) -> None:
    for r in range(rows):
        ids = torch.arange(200 + r * 2, 202 + r * 2).unsqueeze(0)
        pool.scatter(
            ids,
            [t[r : r + 1, :, 480 : 480 + tokens] for t in k],
            [t[r : r + 1, :, 480 : 480 + tokens] for t in v],
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--busy", action="store_true")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    pool = BlockPool(SPECS, 1024, BS)
    for t in (*pool.k, *pool.v):
        t.normal_()
    ways = {"per layer": buffers(False, 16, 2100), "all layers": buffers(True, 16, 2100)}
    competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR]) if args.busy else None
    try:
        time.sleep(2 if competitor else 0)
        times = {(case, way): [] for case in ("read", "commit") for way in ways}
        for _ in range(args.rounds):
            for case, fn in (("read", read), ("commit", commit)):
                for way, (k, v) in ways.items():
                    t0 = time.perf_counter()
                    fn(pool, k, v)
                    times[case, way].append(time.perf_counter() - t0)
        load = os.getloadavg()[0]
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(f"OMP_WAIT_POLICY {policy}, threads {torch.get_num_threads()}, busy {args.busy}, load {load:.1f}")
    for case in ("read", "commit"):
        per, merged = (statistics.median(times[case, way]) * 1e3 for way in ways)
        print(f"  {case:6s} per layer {per:8.2f} ms  all layers {merged:8.2f} ms  {per / merged:5.2f}x")


if __name__ == "__main__":
    main()
