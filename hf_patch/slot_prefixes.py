"""SlotPrefixes: the cached prefixes a RunningBatch's rows read from the store's pool in place.

Per slot of the batch (hf_patch.running_batch): ``tokens[i]``, the row's first tokens whose KV
lies in the device pool (0: none, its slot holds all its KV), the lease pinning them until the
row leaves, and their block ids. ``tables`` gives a step's block tables
(``ragged_attention.PoolTables``), built once per change of membership. A pinned block is
never evicted, demoted or rewritten (radixkv.store); a flush frees it only at ``release``.
Not thread-safe: the batch's worker owns it.

    prefixes = SlotPrefixes()
    prefixes.relayout(keep, free)                 # slots follow the batch's re-layout
    lease, blocks = prefixes.lease(store, key, most, served)
    prefixes.hold(slot, lease, blocks)            # (lease, blocks) or (None, None)
    pool = prefixes.tables(store.pool, layout)    # None: no row reads the pool
    prefixes.release(slot)                        # the row left: its lease released
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hf_patch.ragged_attention import PoolTables

__all__ = ["SlotPrefixes"]


class SlotPrefixes:
    """See the module. O(slots) per re-layout; ``tables`` O(slots x blocks) when rebuilt."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.leases: list = []
        self.blocks: list[list[int]] = []
        self._tables: PoolTables | None = None

    @staticmethod
    def lease(store, key, most: int, served: int | None):
        """The longest cached prefix of ``key``'s tokens (at most ``most``), pinned, and its blocks
        in the device pool: ``(lease, blocks)``. ``blocks`` None: nothing cached, or some of it on
        the host or remote tier (the caller copies it; the lease is still held then, to read).
        ``served``: the hit tokens counted (None: the lease's; 0: none, the prefill that read them
        counted its own, and the lookup is no request)."""
        request = served is None
        lease = store.acquire(key.tokens, key.namespace, max_tokens=most, count=request, remote=request)
        try:
            n = lease.num_tokens
            blocks = store.read_in_place([lease], [n], served=None if request else [served]) if n else None
        except BaseException:
            lease.release()
            raise
        return lease, (blocks[0] if blocks is not None else None)

    def hold(self, slot: int, lease, blocks: Sequence[int] | None) -> None:
        """Slot ``slot``'s row reads ``lease``'s tokens at ``blocks`` in place until it leaves
        (``lease`` None: it reads none)."""
        self.tokens[slot] = lease.num_tokens if lease is not None else 0
        self.leases[slot], self.blocks[slot] = lease, list(blocks or [])
        self._tables = None

    def release(self, slot: int) -> None:
        """Slot ``slot``'s row left: its lease released (after its commit, which extends the prefix it pins)."""
        if self.leases[slot] is not None:
            self.leases[slot].release()
        self.hold(slot, None, None)

    def clear(self) -> None:
        """Every lease released, no slots."""
        for lease in self.leases:
            if lease is not None:
                lease.release()
        self.tokens, self.leases, self.blocks, self._tables = [], [], [], None

    def relayout(self, keep: Sequence[int], free: int) -> None:
        """New slot j is old slot ``keep[j]``, then ``free`` free slots (the batch's re-layout)."""
        self.tokens = [self.tokens[i] for i in keep] + [0] * free
        self.leases = [self.leases[i] for i in keep] + [None] * free
        self.blocks = [self.blocks[i] for i in keep] + [[] for _ in range(free)]
        self._tables = None

    def tables(self, pool, layout) -> PoolTables | None:
        """The step's block tables over ``pool`` (the store's BlockPool; ``layout``: the model's,
        its KV layers the pool's), None when no row reads the pool."""
        if not any(self.tokens):
            return None
        if self._tables is None:
            tables = np.zeros((len(self.tokens), max(1, max(len(b) for b in self.blocks))), dtype=np.int64)
            for i, blocks in enumerate(self.blocks):
                tables[i, : len(blocks)] = blocks
            self._tables = PoolTables(
                pool.k,
                pool.v,
                {layer: j for j, layer in enumerate(layout.kv_layers)},
                tables,
                np.asarray(self.tokens, dtype=np.int64),
            )
        return self._tables
