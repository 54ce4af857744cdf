"""Replay a multi-turn chat workload against ``RadixTree`` and report per-operation cost and hit rate.

Run by hand (never a timed test)::

    python -m benchmarks.bench_tree              # 256 open conversations, 400k-token pool
    python -m benchmarks.bench_tree --large      # 2,048 open conversations, 2M-token pool
    python -m benchmarks.bench_tree --requests 2000
    python -m benchmarks.bench_tree --evict-scaling  # + eviction on synthetic 1k-100k-leaf trees
    python -m benchmarks.bench_tree --check-block-ids  # the tree also validates inserted ids
    python -m benchmarks.bench_tree --host-tier    # device pool 1/8 of the pool, host tier the rest

Each request matches its prompt, pins the match, evicts until the simulated free list covers
the new blocks, inserts prompt + reply and unpins: what ``KVStore.commit`` does around a
generate() call. Token ids arrive as int64 memory, as hf_patch has them (rows of
``input_ids`` / ``sequences``), and are packed (``pack_tokens``, timed as "pack") once for the
match and once for the insert. The workload (token ids and schedule) is generated before
anything is timed; only packing and tree calls are timed.
"""

from __future__ import annotations

import argparse
import random
import time
from array import array
from dataclasses import dataclass, field, replace

from radixkv import RadixTree, pack_tokens
from radixkv.tree import HOST


@dataclass(frozen=True)
class Config:
    """Workload shape; lengths are inclusive ``(low, high)`` ranges in tokens."""

    num_system_prompts: int = 200
    system_len: tuple[int, int] = (1000, 2000)
    zipf_s: float = 1.0
    open_conversations: int = 256
    turns: tuple[int, int] = (1, 8)
    user_len: tuple[int, int] = (50, 500)
    reply_len: tuple[int, int] = (20, 300)
    requests: int = 20_000
    pool_tokens: int = 400_000
    block_size: int = 16
    vocab: int = 32_000
    seed: int = 0
    check_block_ids: bool = False  # KVStore's setting: its ids come off the pool's free list
    # Pools sized from the working set (every block the unbounded cache ends up holding): device
    # 1/8 of it, demoting into a host tier holding the rest (pool_tokens is then ignored).
    host_tier: bool = False
    working_set_blocks: int = 0


LARGE = {"open_conversations": 2048, "pool_tokens": 2_000_000}


@dataclass(frozen=True)
class Request:
    """One turn: conversation ``conv`` (new when ``system`` is set) appends ``user`` then ``reply``."""

    conv: int
    system: int | None
    user: array
    reply: array
    last: bool


@dataclass
class Timings:
    """Nanosecond totals and counts per operation."""

    ns: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("pack", "match", "pin", "evict", "insert", "unpin"), 0)
    )
    evict_calls: int = 0
    demoted_blocks: int = 0
    host_hit_tokens: int = 0
    evicted_nodes: int = 0
    evicted_blocks: int = 0
    nodes_at_evict: int = 0  # sum over evict calls of the tree's node count
    hit_tokens: int = 0
    query_tokens: int = 0


def make_workload(cfg: Config) -> tuple[list[array], list[Request]]:
    """System prompts and the request schedule, all token ids drawn from one seeded RNG."""
    rng = random.Random(cfg.seed)
    population = range(cfg.vocab)

    def segment(bounds: tuple[int, int]) -> array:
        return array("H", rng.choices(population, k=rng.randint(*bounds)))

    systems = [segment(cfg.system_len) for _ in range(cfg.num_system_prompts)]
    weights = [1.0 / (rank + 1) ** cfg.zipf_s for rank in range(cfg.num_system_prompts)]
    next_conv = 0

    def open_conversation() -> list[int]:  # [conv id, turns left]
        nonlocal next_conv
        next_conv += 1
        return [next_conv, rng.randint(*cfg.turns)]

    slots = [open_conversation() for _ in range(cfg.open_conversations)]
    started: set[int] = set()
    requests = []
    for _ in range(cfg.requests):
        slot = rng.randrange(cfg.open_conversations)
        conv, turns_left = slots[slot]
        system = None
        if conv not in started:
            started.add(conv)
            system = rng.choices(range(cfg.num_system_prompts), weights=weights)[0]
        last = turns_left == 1
        requests.append(Request(conv, system, segment(cfg.user_len), segment(cfg.reply_len), last))
        if last:
            slots[slot] = open_conversation()
        else:
            slots[slot][1] -= 1
    return systems, requests


def replay(cfg: Config, systems: list[array], requests: list[Request]) -> tuple[RadixTree, Timings]:
    """Serve every request against a tree over a pool of ``cfg.pool_tokens`` tokens."""
    bs = cfg.block_size
    tree = RadixTree(bs, check_block_ids=cfg.check_block_ids)
    num_blocks = cfg.pool_tokens // bs
    num_host = 0
    if cfg.host_tier:  # what KVStore does with a host tier, minus the block copies
        num_blocks = cfg.working_set_blocks // 8
        num_host = cfg.working_set_blocks - num_blocks
    free = list(range(num_blocks))
    host_free = list(range(num_host))
    convs: dict[int, array] = {}  # conversation so far, compact
    t = Timings()
    clock = time.perf_counter_ns
    for req in requests:
        history = array("H", systems[req.system]) if req.system is not None else convs.pop(req.conv)
        history += req.user
        # Fresh int64 memory per call, as a row of ``input_ids`` is (hf_patch packs it with
        # ``pack_tokens(row.numpy())``): nothing is shared with what the tree stored.
        prompt_row = array("q", history)
        t.query_tokens += len(prompt_row)

        t0 = clock()
        prompt = pack_tokens(prompt_row)
        t1 = clock()
        m = tree.match(prompt)
        t2 = clock()
        tree.pin(m.node)
        t3 = clock()
        t.ns["pack"] += t1 - t0
        t.ns["match"] += t2 - t1
        t.ns["pin"] += t3 - t2
        t.hit_tokens += m.num_tokens
        if num_host and m.node.tier == HOST:
            t.host_hit_tokens += tree.host_blocks_at(m.node) * bs

        history += req.reply
        sequence_row = array("q", history)
        have = len(m.block_ids)
        need = len(history) // bs - have
        # Below a demoted prefix new blocks go to the host, as KVStore.commit does.
        tier = m.node.tier
        pool_free = host_free if tier == HOST else free
        if need > len(pool_free):
            nodes_before = tree.num_nodes
            t0 = clock()
            if tier == HOST:
                freed = tree.evict_host(need - len(host_free))
            elif num_host:
                freed = _demote(tree, need - len(free), host_free, t)
            else:
                freed = tree.evict(need - len(free))
            t1 = clock()
            t.ns["evict"] += t1 - t0
            t.evict_calls += 1
            t.evicted_nodes += nodes_before - tree.num_nodes
            t.evicted_blocks += len(freed)
            t.nodes_at_evict += nodes_before
            pool_free += freed
        if need > len(pool_free):  # host tier only: every candidate pinned, cache what fits
            need = len(pool_free)
            sequence_row = sequence_row[: (have + need) * bs]
        new_ids = pool_free[len(pool_free) - need :]
        del pool_free[len(pool_free) - need :]
        block_ids = list(m.block_ids) + new_ids

        t0 = clock()
        sequence = pack_tokens(sequence_row)
        t1 = clock()
        cached = tree.insert(sequence, block_ids, None, tier)
        t2 = clock()
        tree.unpin(m.node)
        t3 = clock()
        t.ns["pack"] += t1 - t0
        t.ns["insert"] += t2 - t1
        t.ns["unpin"] += t3 - t2
        pool_free += new_ids[: cached // bs - have]  # duplicates stay ours

        if not req.last:
            convs[req.conv] = history
    if len(free) + len(host_free) + tree.num_cached_blocks != num_blocks + num_host:
        raise RuntimeError("block ids leaked: free + cached != pool size")
    return tree, t


def _demote(tree: RadixTree, num_blocks: int, host_free: list[int], t: Timings) -> list[int]:
    """Demote LRU device candidates until ``num_blocks`` device blocks are freed; returns them.

    The host drops its own LRU leaves for room. (KVStore also copies the blocks: not timed here.)
    """
    freed: list[int] = []
    while len(freed) < num_blocks:
        node = tree.demotion_candidate()
        if node is None:
            break
        n = len(node.block_ids)
        if len(host_free) < n:
            host_free += tree.evict_host(n - len(host_free))
        if len(host_free) < n:
            break
        host_ids = host_free[len(host_free) - n :]
        del host_free[len(host_free) - n :]
        freed += tree.demote(node, host_ids)
        t.demoted_blocks += n
        t.evicted_nodes += 1  # a demoted node leaves the device (the tree keeps it)
    return freed


def ideal_hit_rate(cfg: Config, systems: list[array], requests: list[Request]) -> tuple[float, int]:
    """Hit rate of an unbounded cache, from chained block hashes (an oracle independent of the tree),
    and the blocks that cache holds at the end (the working set)."""
    bs = cfg.block_size
    cached: set[int] = set()
    chains: dict[int, tuple[list[int], list[int]]] = {}  # conv -> (tokens, chain key per whole block)
    hit = query = 0
    for req in requests:
        tokens, keys = ([*systems[req.system]], []) if req.system is not None else chains.pop(req.conv)
        tokens += req.user
        query += len(tokens)
        _extend_chain(tokens, keys, bs)
        hit += bs * next((i for i, key in enumerate(keys) if key not in cached), len(keys))
        tokens += req.reply
        _extend_chain(tokens, keys, bs)
        cached.update(keys)
        if not req.last:
            chains[req.conv] = (tokens, keys)
    return hit / query, len(cached)


def _extend_chain(tokens: list[int], keys: list[int], bs: int) -> None:
    prev = keys[-1] if keys else 0
    for start in range(len(keys) * bs, len(tokens) - bs + 1, bs):
        prev = hash((prev, tuple(tokens[start : start + bs])))
        keys.append(prev)


def report(name: str, cfg: Config, tree: RadixTree, t: Timings, ideal: float) -> None:
    n = cfg.requests
    us = {op: ns / 1000 for op, ns in t.ns.items()}
    leaves = sum(1 for node in tree.iter_nodes() if not node.children)
    calls = max(t.evict_calls, 1)
    pool = cfg.working_set_blocks // 8 * cfg.block_size if cfg.host_tier else cfg.pool_tokens
    print(
        f"== {name}: {n} requests, {cfg.open_conversations} open conversations, device pool {pool} "
        f"tokens ({pool // cfg.block_size} blocks), block size {cfg.block_size}, "
        f"check_block_ids={cfg.check_block_ids}"
    )
    for op in ("pack", "match", "insert", "pin", "unpin"):
        print(f"{op:<7} {us[op] / n:8.1f} us/request")
    print(
        f"evict   {us['evict'] / n:8.1f} us/request  ({t.evict_calls} calls, {us['evict'] / calls:.1f} us/call; "
        f"{t.evicted_nodes} nodes / {t.evicted_blocks} blocks evicted: "
        f"{us['evict'] / max(t.evicted_nodes, 1):.2f} us/evicted node)"
    )
    print(f"total   {sum(us.values()) / n:8.1f} us/request (pack + match + pin + evict + insert + unpin)")
    print(f"hit rate {t.hit_tokens / t.query_tokens:.3f} (ideal, unbounded cache: {ideal:.3f})")
    if cfg.host_tier:
        print(
            f"host tier: working set {cfg.working_set_blocks} blocks, device pool {cfg.working_set_blocks // 8}, "
            f"host the other 7/8; "
            f"{t.demoted_blocks} blocks demoted (counted as evicted above), {t.host_hit_tokens / max(t.hit_tokens, 1):.1%} of hit tokens "
            f"end on the host; evict = demote + host drops (copies not included)"
        )
    print(
        f"tree: {t.nodes_at_evict / calls:.0f} nodes on average when evicting; at the end {tree.num_nodes} "
        f"nodes, {leaves} leaves, {tree.num_cached_blocks} cached blocks"
    )


def evict_scaling(sizes: tuple[int, ...] = (1_000, 10_000, 100_000), evictions: int = 2_000) -> None:
    """Evict one LRU leaf at a time from trees of growing leaf count: the cost per node stays flat."""
    print("== eviction cost vs tree size (synthetic: 2-block leaves under 100 shared 1-block prefixes)")
    for num_leaves in sizes:
        rng = random.Random(0)
        tree = RadixTree(16)
        for i in range(num_leaves):
            tokens = [i % 100] * 16 + [rng.randrange(32_000) for _ in range(32)]
            tree.insert(tokens, [3 * i, 3 * i + 1, 3 * i + 2])
        for i in range(0, num_leaves, 7):  # refresh some prefixes so LRU order is not insertion order
            tree.match([i % 100] * 16)
        before = tree.num_nodes
        t0 = time.perf_counter_ns()
        for _ in range(evictions):
            tree.evict(1)
        elapsed_us = (time.perf_counter_ns() - t0) / 1000
        print(
            f"{num_leaves:>8} leaves, {before:>8} nodes: {elapsed_us / (before - tree.num_nodes):.2f} us "
            f"per evicted node ({before - tree.num_nodes} nodes)"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--large", action="store_true", help="2,048 open conversations, 2M-token pool")
    parser.add_argument("--requests", type=int, default=Config.requests)
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument(
        "--evict-scaling", action="store_true", help="also time eviction on 1k-100k-leaf trees"
    )
    parser.add_argument(
        "--check-block-ids", action="store_true", help="the tree checks inserted ids (direct-use default)"
    )
    parser.add_argument("--host-tier", action="store_true", help="device pool 1/8, host tier the rest")
    args = parser.parse_args(argv)
    cfg = Config(
        requests=args.requests, seed=args.seed, check_block_ids=args.check_block_ids, host_tier=args.host_tier
    )
    cfg = replace(cfg, **(LARGE if args.large else {}))
    systems, requests = make_workload(cfg)
    ideal, working_set = ideal_hit_rate(cfg, systems, requests)
    cfg = replace(cfg, working_set_blocks=working_set)
    tree, timings = replay(cfg, systems, requests)
    report("large" if args.large else "standard", cfg, tree, timings, ideal)
    if args.evict_scaling:
        evict_scaling()


if __name__ == "__main__":
    main()
