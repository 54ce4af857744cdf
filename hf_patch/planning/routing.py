"""Prefix-affine routing: which rank serves which request, decided identically on every rank.

Requests that share leading whole blocks go to the same rank, so that rank's store computes
their prefix once and every other request over it hits. Steps (all deterministic: no hashing
with a per-process seed, no clocks):

1. Sort the prompts by their token bytes; adjacent prompts then share the longest prefixes,
   and ``lcp[k]`` (floored to whole blocks) is what prompt k shares with prompt k-1.
2. Groups: maximal runs whose adjacent prompts share at least ``min_shared`` tokens.
3. A group's estimated uncached tokens: its first prompt in full plus, for every other
   prompt, what it does not share with its predecessor (the tokens its rank must compute).
4. A group estimated above one rank's fair share (total / ranks) is split where its prompts
   share least (its smallest ``lcp``), repeatedly: only that shortest shared prefix is then
   computed twice.
5. Groups go, largest first, to the rank with the least estimated work so far (LPT).

Guarantee: a prefix of ``min_shared`` tokens or more shared by a set of requests is computed
on one rank only, unless that set alone is estimated at more than a rank's fair share of the
job; then it is divided where its members share least.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from hf_patch.batch_share import common_prefix_tokens
from radixkv import PackedTokens


def sorted_lcp(prompts: Sequence[PackedTokens], block_size: int) -> tuple[list[int], list[int]]:
    """``(order, lcp)``: prompt indices by token bytes; ``lcp[k]`` whole-block tokens shared by
    ``order[k-1]`` and ``order[k]`` (``lcp[0] = 0``). O(n log n) comparisons + O(tokens)."""
    order = sorted(range(len(prompts)), key=prompts.__getitem__)
    lcp = [0] + [
        common_prefix_tokens(prompts[a], prompts[b]) // block_size * block_size
        for a, b in zip(order, order[1:])
    ]
    return order, lcp


def prefix_groups(
    prompts: Sequence[PackedTokens], num_ranks: int, block_size: int = 16, min_shared: int = 16
) -> list[tuple[int, list[int]]]:
    """``[(estimated uncached tokens, prompt indices)]``, split so no group exceeds a fair share
    unless it is one prompt."""
    if not prompts:
        return []
    order, lcp = sorted_lcp(prompts, block_size)
    cost = [prompts[i].num_tokens - lcp[k] for k, i in enumerate(order)]
    fair = sum(cost) / max(num_ranks, 1)
    runs, start = [], 0
    for k in range(1, len(order) + 1):
        if k == len(order) or lcp[k] < min_shared:
            runs.append((start, k))
            start = k
    groups: list[tuple[int, list[int]]] = []
    while runs:
        a, b = runs.pop()
        # The head of a run recomputes what it shared with the previous run.
        total = prompts[order[a]].num_tokens + sum(cost[a + 1 : b])
        if total <= fair or b - a == 1:
            groups.append((total, [order[k] for k in range(a, b)]))
            continue
        # Where the members share least; among equal cuts the most even one.
        cut = min(range(a + 1, b), key=lambda k: (lcp[k], abs(2 * k - a - b), k))
        runs += [(a, cut), (cut, b)]
    return groups


def assign_ranks(
    prompts: Sequence[PackedTokens], num_ranks: int, block_size: int = 16, min_shared: int = 16
) -> list[int]:
    """Rank of every prompt under prefix-affine routing (see the module docstring)."""
    ranks = [0] * len(prompts)
    groups = sorted(prefix_groups(prompts, num_ranks, block_size, min_shared), key=lambda g: (-g[0], g[1][0]))
    load = [(0, r) for r in range(num_ranks)]
    for total, members in groups:
        work, rank = heapq.heappop(load)
        for i in members:
            ranks[i] = rank
        heapq.heappush(load, (work + total, rank))
    return ranks


def round_robin(num_prompts: int, num_ranks: int) -> list[int]:
    """The baseline: request i to rank i mod ranks, blind to prefixes."""
    return [i % num_ranks for i in range(num_prompts)]
