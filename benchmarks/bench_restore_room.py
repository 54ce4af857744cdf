"""A restore into a full, warm store: with and without ``evict``, with and without a host tier.

Run by hand (CPU, fp32, bench_hf's random Llama):

    python -m benchmarks.bench_restore_room

The saved traffic: 4 system prompts of 128 tokens, 8 questions of 64 tokens after each (32
prompts of 192 tokens), one generated token each, saved from a large store. The restarted
server's own traffic: 32 other prompts of the same shape, filling its device pool (room for
half of the file) and its host tier when it has one (the other half). Then the file is
restored (``hf_patch.restore_cache(..., evict=...)``) and the saved traffic replayed: the
saved prompts whose whole prefix was restored, blocks restored and placed on the host tier,
store blocks evicted or demoted, and the replay's hit rate (cached_tokens over prompt tokens;
a fully cached prompt recomputes its last block: at most 176 of 192 tokens hit), replayed
most recent first (the sessions a restart interrupts last come back first) and in the order
saved (oldest first: under LRU the replay's own misses then evict what was restored before it
is reached). Without any restore the replay hits 0.58: the system prompts it computes itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import tempfile

import torch

import hf_patch
from benchmarks.bench_hf import build_model, ids
from hf_patch import RadixCache
from hf_patch.keys.weights import model_scope

BS = 16


def traffic(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 32000) for _ in range(128)] for _ in range(4)]
    return [s + [rng.randrange(100, 32000) for _ in range(64)] for s in systems for _ in range(8)]


def run(model, store, prompts) -> int:
    """Generate one token for each prompt in turn; the tokens they found cached."""
    hits = 0
    for p in prompts:
        cache = RadixCache(store=store)
        model.generate(ids(p), max_new_tokens=1, do_sample=False, past_key_values=cache)
        hits += cache.cached_tokens[0]
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model()
    saved, other = traffic(1), traffic(2)
    logging.basicConfig(level=logging.ERROR)  # the restore's "did not fit" warnings: in the table
    with torch.no_grad(), tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "kv.safetensors")
        source = hf_patch.build_store(model, block_size=BS, budget_tokens=1 << 15)
        run(model, source, saved)
        file = hf_patch.save_cache(model, path, source)
        half = file.num_blocks // 2 * BS
        print(f"torch threads {torch.get_num_threads()}; {os.cpu_count()} cores")
        print(f"file: {file.num_nodes} nodes, {file.num_blocks} blocks; device pool {half // BS} blocks")
        print(
            "host tier   restore   prompts restored  blocks restored  on host  evicted  demoted"
            "   hit rate: recent first  saved order"
        )
        total = sum(len(p) for p in saved)
        namespace = (model_scope(model), None)
        for host in (False, True):
            for evict in (False, True):
                rates = []
                for order in (saved[::-1], saved):
                    store = hf_patch.build_store(
                        model, block_size=BS, budget_tokens=half, host_cache_tokens=half if host else None
                    )
                    run(model, store, other)  # the restarted server's own traffic: the store is full
                    stats = store.stats()
                    assert stats["free_blocks"] < 12 and stats.get("host_free_blocks", 0) < 12, stats
                    result = hf_patch.restore_cache(model, path, store, evict=evict)
                    store.check_invariants()
                    kept = sum(store.tree.cached_prefix(p, namespace)[0] == len(p) for p in saved)
                    rates.append(run(model, store, order) / total)
                print(
                    f"{'yes' if host else 'no':9s}   {'evict' if evict else 'default':7s}   "
                    f"{kept:9d} of {len(saved)}  {result.restored_blocks:15d}  {result.host_blocks:7d}  "
                    f"{result.evicted_blocks:7d}  {result.demoted_blocks:7d}   {rates[0]:22.2f}  {rates[1]:11.2f}"
                )


if __name__ == "__main__":
    main()
