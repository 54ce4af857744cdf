"""Counters a KVStore keeps, published as a flat dict (e.g. by a Prometheus endpoint)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StoreCounters:
    """Monotone counters since the store was built. Mutated only under the store's lock."""

    requests: int = 0  # acquire() calls
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # prompt tokens actually served from the pool
    inserted_tokens: int = 0  # tokens newly cached by commit()
    evicted_blocks: int = 0
    uncached_tokens: int = 0  # tokens a commit could not cache: every block pinned / pool too small
    flushes: int = 0

    def as_dict(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dataclasses.asdict(self)
        out["hit_rate"] = self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
        return out
