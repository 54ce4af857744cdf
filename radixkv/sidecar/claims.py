"""Prefixes in flight: which client is computing which prompt prefix right now (pure Python).

A client whose match misses may *claim* the rest of its prompt for a few seconds. Another client
that misses a common prefix while the claim lives is told how many tokens will come, and polls
for the claimer's commit instead of computing them again. A client is never told to wait for a
client that waits, directly or through others, for it (two ranks each computing what the other
wants would otherwise wait for each other until their claims expire): the sidecar keeps who
waits for whom (refreshed by each poll, forgotten ``WAIT_MARK_S`` after the last one) and the
match that would close a cycle computes instead. Claims go with their client, on expiry, or
when the client's commit covers them. Bounded: ``MAX_CLAIMS`` live claims, each keeping
``MAX_CLAIM_TOKENS`` tokens.

Why not simply "a client holding claims never waits" (the first rule): a rank claims its whole
batch at once and its claims live until its background write reaches the sidecar, which is
after its next batch's lookups, so under that rule ranks meeting documents together almost
never waited and computed them twice (batchrun round-robin over 2 ranks: 1.14-1.21x one
process's prompt tokens; docs/sidecar.md).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable

from radixkv.tree.node import PackedTokens

MAX_CLAIMS = 256
MAX_CLAIM_TOKENS = 1 << 16
MAX_CLAIM_S = 60.0
WAIT_MARK_S = 1.0  # a waiter polls every 10 ms; one silent this long has stopped waiting


@dataclasses.dataclass
class Claim:
    cid: int
    pool: Hashable  # the pool (KV layout) the tokens' blocks would go to
    namespace: tuple
    tokens: PackedTokens
    expires: float


def common_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens two packed sequences share. O(len) in C, plus O(log len) slices."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n // 8
    lo, hi = 0, n  # bytes known equal up to lo; they differ somewhere before hi
    while hi - lo > 8:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo // 8


class Claims:
    """The live claims of one sidecar (its loop thread only)."""

    def __init__(self) -> None:
        self.live: list[Claim] = []
        # client -> (the client whose claim it waits for, until when the mark holds)
        self.waiting: dict[int, tuple[int, float]] = {}

    def __len__(self) -> int:
        return len(self.live)

    def check(
        self,
        cid: int,
        pool,
        namespace: tuple,
        tokens: PackedTokens,
        cached: int,
        block_size: int,
        claim_s: float,
    ) -> int:
        """Whole-block tokens of ``tokens`` another client's live claim covers, when more than
        ``cached`` and that client does not wait for ``cid`` (the caller should wait for them);
        else 0, and ``cid``'s claim is recorded."""
        now = time.monotonic()
        self.live = [c for c in self.live if c.expires > now]
        best, owner = 0, None
        for c in self.live:
            if c.cid != cid and c.pool is pool and c.namespace == namespace:
                common = common_tokens(c.tokens, tokens) // block_size * block_size
                if common > best:
                    best, owner = common, c.cid
        if best > cached and not self._waits_for(owner, cid, now):
            self.waiting[cid] = (owner, now + WAIT_MARK_S)
            return best
        self.waiting.pop(cid, None)
        if tokens.num_tokens // block_size * block_size > cached and len(self.live) < MAX_CLAIMS:
            head = tokens.head(MAX_CLAIM_TOKENS // block_size * block_size)
            self.live.append(Claim(cid, pool, namespace, head, now + min(claim_s, MAX_CLAIM_S)))
        return 0

    def fulfil(self, cid: int, namespace: tuple, tokens: PackedTokens, block_size: int) -> None:
        """Drop ``cid``'s claims in ``namespace`` whose whole blocks ``tokens`` (now cached) cover."""
        self.live = [
            c
            for c in self.live
            if not (
                c.cid == cid
                and c.namespace == namespace
                and common_tokens(c.tokens, tokens) // block_size >= c.tokens.num_tokens // block_size
            )
        ]

    def _waits_for(self, owner: int, cid: int, now: float) -> bool:
        """Whether ``owner`` waits now for ``cid``, directly or through other waiting clients."""
        seen = set()
        while owner not in seen:
            seen.add(owner)
            mark = self.waiting.get(owner)
            if mark is None or mark[1] <= now:
                return False
            owner = mark[0]
            if owner == cid:
                return True
        return False  # a cycle that does not pass through cid (its members resolve it)

    def drop(self, cid: int) -> None:
        self.live = [c for c in self.live if c.cid != cid]
        self.waiting.pop(cid, None)
