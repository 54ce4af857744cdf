"""Host tier and pinned task prompts, at the bench_hf model shape (random Llama 512x8, fp32).

Run by hand (never a timed test)::

    python -m benchmarks.bench_tiers                     # all parts
    python -m benchmarks.bench_tiers --parts cost        # a subset: cyclic, cost, task

1. ``cyclic``: 11 different prompts of ~1,000 tokens, each followed by a short question,
   asked in turn for several rounds, with a device pool that holds 10 of them: without a
   host tier (plain LRU: every prompt was evicted just before it comes back) and with a host
   tier holding all 11. Prompt tokens served from the cache and TTFT after the first round.
2. ``cost``: per-token cost of a hit read from the device pool, a hit read in place from the
   host pool, a hit promoted to device blocks first (copy host -> device, then read), a
   demotion (device -> host), and computing the KV (prefill), for a 1,024-token prefix.
3. ``task``: a pinned 1,000-token task prompt after a flood of unrelated traffic that
   evicted everything else: its TTFT and cached tokens, against the same flood without a pin.

Sides being compared run interleaved, so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import hf_patch
from benchmarks.bench_hf import build_model, document, ids, timed, ttft
from hf_patch import RadixCache
from radixkv.store.tier import copy_blocks

BS = 16


def part_cyclic(model, args) -> None:
    rng = random.Random(5)
    prompts = [document(rng, 1008) for _ in range(11)]  # 63 blocks
    per_prompt = 1008 + 16 * args.rounds  # the prompt and one question block per round
    device_tokens = 10 * per_prompt  # room for 10 of the 11
    sides = {
        "no host tier": hf_patch.build_store(model, block_size=BS, budget_tokens=device_tokens),
        "host tier": hf_patch.build_store(
            model, block_size=BS, budget_tokens=device_tokens, host_cache_tokens=11 * per_prompt
        ),
    }
    timed(model, ids(prompts[0][:32]))  # warm-up
    ttfts = {name: [] for name in sides}
    hits = {name: [0, 0] for name in sides}  # cached, prompt tokens after round one
    for r in range(args.rounds):
        for i, p in enumerate(prompts):
            prompt = ids(p + document(rng, 16))  # a new short question each round
            for name in sides if i % 2 == 0 else reversed(list(sides)):
                cache = RadixCache(store=sides[name])
                t = ttft(timed(model, prompt, past_key_values=cache))
                if r > 0:
                    ttfts[name].append(t)
                    hits[name][0] += cache.cached_tokens[0]
                    hits[name][1] += prompt.shape[1]
    print(
        f"\n1. cyclic: 11 prompts of 1,008 tokens + 16-token questions, {args.rounds} rounds, device pool "
        f"{device_tokens} tokens (10 prompts)"
    )
    base = statistics.median(ttfts["no host tier"])
    for name, store in sides.items():
        stats = store.stats()
        med = statistics.median(ttfts[name])
        print(
            f"   {name:<13} rounds 2-{args.rounds}: {hits[name][0] / hits[name][1]:6.1%} of prompt tokens cached, "
            f"TTFT median {med * 1e3:7.1f} ms ({base / med:4.1f}x), mean {statistics.mean(ttfts[name]) * 1e3:7.1f} ms, "
            f"demoted {stats['demoted_blocks']} blocks, host hits {stats['host_hit_tokens']} tokens"
        )


def _median_time(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def part_cost(model, args) -> None:
    rng = random.Random(6)
    n = 1024
    prefix = document(rng, n + 1)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4 * n, host_cache_tokens=4 * n)
    scope = (hf_patch.keys.weights.model_scope(model), None)
    model.generate(ids(prefix), past_key_values=RadixCache(store=store), max_new_tokens=1)
    specs = store.pool.layers
    k_out = [torch.empty(1, s.num_kv_heads, n, s.k_head_dim, dtype=s.dtype) for s in specs]
    v_out = [torch.empty(1, s.num_kv_heads, n, s.v_head_dim, dtype=s.dtype) for s in specs]
    lease = store.acquire(prefix, scope, max_tokens=n)
    assert lease.num_tokens == n and lease.num_host_blocks == 0
    device_ids = list(lease.block_ids)
    host_ids = store.host_pool.allocate(n // BS)  # a host copy of the same blocks, for the host sides
    spare = store.pool.allocate(n // BS)  # device blocks a promotion would copy into
    copy_blocks(store.pool, device_ids, store.host_pool, host_ids)
    host_ids_t = torch.tensor([host_ids])

    def device_hit() -> None:
        store.read([lease], n, k_out, v_out)

    def host_hit() -> None:  # what KVStore.read does for host blocks: straight into the buffers
        store.host_pool.gather(host_ids_t, n, k_out, v_out)

    def promoted_hit() -> None:
        copy_blocks(store.host_pool, host_ids, store.pool, spare)
        store.pool.gather(torch.tensor([spare]), n, k_out, v_out)

    def demotion() -> None:
        copy_blocks(store.pool, device_ids, store.host_pool, host_ids)

    def compute() -> None:
        model(ids(prefix[:n]), use_cache=True)

    sides = {
        "device hit (read)": device_hit,
        "host hit, read in place": host_hit,
        "host hit, promote then read": promoted_hit,
        "demotion (device -> host)": demotion,
        "compute (prefill)": compute,
    }
    for fn in sides.values():
        fn()  # warm-up
    results = {name: [] for name in sides}
    for _ in range(args.cost_runs):
        for name, fn in sides.items():
            results[name].append(_median_time(fn, 1 if name.startswith("compute") else 5))
    lease.release()
    store.pool.free(spare)
    store.host_pool.free(host_ids)
    base = statistics.median(results["device hit (read)"])
    print(f"\n2. per-token cost, {n}-token prefix, {store.pool.bytes_per_token} bytes of KV per token, CPU")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"   {name:<28} {med * 1e6 / n:8.2f} us/token  ({med / base:6.1f}x a device hit)")


def part_task(model, args) -> None:
    rng = random.Random(7)
    task = document(rng, 1008)
    flood = [document(rng, 1008) for _ in range(args.flood)]
    budget = 4 * 1024  # the task prompt plus ~3 others
    pinned = hf_patch.build_store(model, block_size=BS, budget_tokens=budget)
    plain = hf_patch.build_store(model, block_size=BS, budget_tokens=budget)
    hf_patch.pin_prompts(model, {"support": task}, store=pinned)
    timed(model, ids(task), past_key_values=RadixCache(store=plain))  # cached normally, unpinned
    for p in flood:
        for store in (pinned, plain):
            timed(model, ids(p), past_key_values=RadixCache(store=store))
    rows = {}
    for name, store in (("pinned", pinned), ("not pinned", plain)):
        cache = RadixCache(store=store)
        t = ttft(timed(model, ids(task + document(rng, 16)), past_key_values=cache))
        rows[name] = (t, cache.cached_tokens[0], store.stats())
    print(
        f"\n3. task prompt of 1,008 tokens after {args.flood} unrelated 1,008-token prompts, pool {budget} tokens"
    )
    for name, (t, cached, stats) in rows.items():
        print(
            f"   {name:<11} cached {cached:5d} of 1,024 prompt tokens, TTFT {t * 1e3:7.1f} ms, "
            f"evicted {stats['evicted_blocks']} blocks, task pinned blocks {stats['task_pinned_blocks']}"
        )
    print(f"   pinned vs not pinned: {rows['not pinned'][0] / rows['pinned'][0]:.1f}x faster")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="cyclic,cost,task")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cost-runs", type=int, default=7)
    parser.add_argument("--flood", type=int, default=8)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = build_model()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, model: Llama 512x8, 8 heads/4 KV, fp32"
    )
    parts = {"cyclic": part_cyclic, "cost": part_cost, "task": part_task}
    for name in args.parts.split(","):
        parts[name](model, args)


if __name__ == "__main__":
    main()
