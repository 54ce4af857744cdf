"""KVStore: a RadixTree and a BlockPool behind one lock, shared by many generate() calls.

Lifecycle of one request (see docs/design.md):

1. ``acquire(tokens)`` matches the longest cached prefix and pins it -> ``Lease``.
2. ``read(lease, ...)`` copies the pinned blocks into the caller's KV buffers (no lock
   held: pinned blocks are never evicted nor written).
3. ``commit(tokens, k, v)`` caches the finished sequence's whole blocks.
4. ``lease.release()`` (or leaving ``with lease:``) unpins, always.

Degrades instead of failing: when every block is pinned, or a sequence is longer than the
pool, ``commit`` caches what fits of the prefix (possibly nothing) and returns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Sequence

import torch

from radixkv.node import Tokens, head_of, num_tokens_of, pack_tokens
from radixkv.pool import BlockPool
from radixkv.stats import StoreCounters
from radixkv.tree import MatchResult, RadixTree

logger = logging.getLogger(__name__)


class Lease:
    """A pinned match. Release exactly once (idempotent); use as a context manager."""

    __slots__ = ("_store", "_tree", "_match", "epoch", "namespace")

    def __init__(self, store: KVStore, tree: RadixTree, match: MatchResult, epoch: int, namespace) -> None:
        self._store = store
        self._tree: RadixTree | None = tree
        self._match = match
        self.epoch = epoch
        self.namespace = namespace

    @property
    def num_tokens(self) -> int:
        """Tokens of the prompt whose KV the pinned blocks hold (a multiple of block_size)."""
        return self._match.num_tokens

    @property
    def block_ids(self) -> Sequence[int]:
        return self._match.block_ids

    @property
    def active(self) -> bool:
        return self._tree is not None

    def release(self) -> None:
        if self._tree is not None:  # else released already: no need for the lock
            self._store._release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class KVStore:
    """Thread-safe prefix store: tree + pool + one lock. All public methods may be called concurrently."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.tree = self._new_tree()
        self.counters = StoreCounters()
        # Incremented by flush(): KV committed under an older epoch (older weights) is dropped.
        self.epoch = 0
        self._lock = threading.Lock()
        self._retired: list[RadixTree] = []  # flushed trees whose pinned blocks are still being read
        self._private: set[int] = set()  # blocks allocated by a commit in progress, not yet in a tree

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    # -- lookup -------------------------------------------------------------------------
    def acquire(
        self,
        tokens: Tokens,
        namespace: Hashable = None,
        max_tokens: int | None = None,
        *,
        count: bool = True,
    ) -> Lease:
        """Match the longest cached whole-block prefix of ``tokens[:max_tokens]`` and pin it.

        Counts all of ``tokens`` as query tokens. O(len(tokens)) to pack them (outside the
        lock; nothing for PackedTokens) plus the tree's match.
        """
        query = pack_tokens(tokens if max_tokens is None else head_of(tokens, max_tokens))
        with self._lock:
            tree = self.tree
            match = tree.match(query, namespace)
            tree.pin(match.node)
            if count:  # False: a lookup that is no prompt (hf_patch's in-batch prefix sharing)
                self.counters.requests += 1
                self.counters.query_tokens += num_tokens_of(tokens)
            return Lease(self, tree, match, self.epoch, namespace)

    def read(
        self,
        leases: Sequence[Lease],
        num_tokens: int,
        k_out: Sequence[torch.Tensor],
        v_out: Sequence[torch.Tensor],
        *,
        count: bool = True,
    ) -> None:
        """Copy the first ``num_tokens`` cached tokens of each lease (one output row each).

        ``k_out[l]``/``v_out[l]``: ``[len(leases), H, num_tokens, D]`` views on layer l's device.
        Runs without the lock: pinned blocks are neither evicted nor rewritten.
        """
        if num_tokens == 0 or not leases:
            return
        self._check_layers("read", k_out, v_out)
        nb = -(-num_tokens // self.block_size)
        for lease in leases:
            if lease._store is not self:  # its block ids index another pool
                raise ValueError("read() of a lease acquired from another KVStore")
            if not lease.active:
                raise RuntimeError("read() from a released lease")
            if lease.num_tokens < num_tokens:
                raise ValueError(f"lease holds {lease.num_tokens} tokens, {num_tokens} requested")
        ids = torch.tensor([list(lease.block_ids[:nb]) for lease in leases], dtype=torch.int64)
        self.pool.gather(ids, num_tokens, k_out, v_out)
        if count:
            with self._lock:
                self.counters.hit_tokens += num_tokens * len(leases)

    # -- insertion ------------------------------------------------------------------------
    def commit(
        self,
        tokens: Tokens,
        k_src: Sequence[torch.Tensor],
        v_src: Sequence[torch.Tensor],
        namespace: Hashable = None,
        epoch: int | None = None,
    ) -> int:
        """Cache the whole blocks of ``tokens`` whose KV is ``k_src[l]``/``v_src[l]`` ``[1, H, >=len, D]``.

        Only blocks not already cached are copied. Returns the number of tokens newly cached.
        With ``epoch`` older than the store's (a flush happened since the KV was computed)
        nothing is cached.

        Raises ValueError, caching nothing, when ``tokens`` is a tensor/array or a source does
        not hold one row of KV for every whole-block token: a shorter source would leave the
        end of a cached block unwritten (garbage served as a hit).
        """
        bs = self.block_size
        num_blocks = num_tokens_of(tokens) // bs
        if num_blocks == 0:
            pack_tokens(tokens)  # still refuses a tensor / non-int ids
            return 0
        # Packed once, outside the lock: the match and the insert below both reuse it.
        tokens = pack_tokens(head_of(tokens, num_blocks * bs))
        self._check_layers("commit", k_src, v_src)
        for name, srcs in (("k_src", k_src), ("v_src", v_src)):
            for i, src in enumerate(srcs):
                if src.dim() != 4 or src.shape[0] != 1 or src.shape[2] < num_blocks * bs:
                    raise ValueError(
                        f"commit: {name}[{i}] has shape {tuple(src.shape)}, expected "
                        f"[1, kv_heads, >= {num_blocks * bs}, head_dim] (KV of every whole-block token)"
                    )
        with self._lock:
            if epoch is not None and epoch != self.epoch:
                return 0
            tree = self.tree
            match = tree.match(tokens, namespace)
            cached_blocks = match.num_tokens // bs
            need = num_blocks - cached_blocks
            if need == 0:
                return 0
            tree.pin(match.node)  # the prefix we extend must outlive the copy
            if self.pool.num_free < need:
                self._evict_locked(need - self.pool.num_free)
            take = min(need, self.pool.num_free)
            ids = self.pool.allocate(take)
            self._private.update(ids)
            if take < need:
                self.counters.uncached_tokens += (need - take) * bs
        try:
            if take:
                start, stop = cached_blocks * bs, (cached_blocks + take) * bs
                self.pool.scatter(
                    torch.tensor([ids], dtype=torch.int64),
                    [k[:, :, start:stop] for k in k_src],
                    [v[:, :, start:stop] for v in v_src],
                )
        except BaseException:
            with self._lock:
                self._private.difference_update(ids)
                self.pool.free(ids)
                self._unpin_locked(tree, match.node)
            raise
        with self._lock:
            self._private.difference_update(ids)
            self._unpin_locked(tree, match.node)
            if tree is not self.tree or not take:  # flushed meanwhile: the KV may be stale
                self.pool.free(ids)
                return 0
            new_tokens = tokens.head((cached_blocks + take) * bs)
            already = tree.insert(new_tokens, list(match.block_ids) + ids, namespace)
            duplicates = max(0, already // bs - cached_blocks)  # another thread inserted them first
            if duplicates:
                self.pool.free(ids[:duplicates])
            added = new_tokens.num_tokens - max(already, cached_blocks * bs)
            self.counters.inserted_tokens += added
            return added

    # -- maintenance ----------------------------------------------------------------------
    def flush(self) -> int:
        """Drop every cached prefix; returns blocks freed now. Pinned blocks go when released."""
        with self._lock:
            old, self.tree = self.tree, self._new_tree()
            self.epoch += 1
            self.counters.flushes += 1
            freed = old.clear()
            self.pool.free(freed)
            if old.num_cached_blocks:
                self._retired.append(old)
            return len(freed)

    def _new_tree(self) -> RadixTree:
        # Ids come off the pool's free list (refcount 1), so the tree need not re-check that it
        # does not own them already; check_invariants still recounts them.
        return RadixTree(self.pool.block_size, check_block_ids=False)

    def _evict_locked(self, num_blocks: int) -> None:
        freed = self.tree.evict(num_blocks)
        self.pool.free(freed)
        self.counters.evicted_blocks += len(freed)

    def _check_layers(self, op: str, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> None:
        n = len(self.pool.layers)
        if len(ks) != n or len(vs) != n:
            raise ValueError(f"{op}: the pool has {n} layers, got {len(ks)} K and {len(vs)} V tensors")

    def _release(self, lease: Lease) -> None:
        # Check and clear under the lock: two threads releasing one lease must unpin once.
        with self._lock:
            tree, lease._tree = lease._tree, None
            if tree is not None:
                self._unpin_locked(tree, lease._match.node)

    def _unpin_locked(self, tree: RadixTree, node) -> None:
        tree.unpin(node)
        if tree is not self.tree and tree in self._retired:
            self.pool.free(tree.clear())
            if not tree.num_cached_blocks:
                self._retired.remove(tree)

    def stats(self) -> dict[str, int | float]:
        """Counters plus pool occupancy, as one flat dict."""
        with self._lock:
            out = self.counters.as_dict()
            out.update(
                num_blocks=self.pool.num_blocks,
                free_blocks=self.pool.num_free,
                cached_blocks=self.tree.num_cached_blocks,
                pinned_blocks=self.tree.num_pinned_blocks,
                # Flushed blocks that live leases still read. While no commit is copying,
                # free + cached + retired == num_blocks.
                retired_blocks=sum(t.num_cached_blocks for t in self._retired),
                block_size=self.block_size,
                bytes_per_token=self.pool.bytes_per_token,
                pool_bytes=self.pool.nbytes,
            )
            return out

    def check_invariants(self) -> None:
        """Full recount: tree and pool consistent, every used block owned by exactly one holder."""
        with self._lock:
            self.tree.check_invariants()
            self.pool.check_invariants()
            owned = [b for node in self.tree.iter_nodes() for b in node.block_ids]
            for t in self._retired:
                t.check_invariants()
                owned.extend(b for node in t.iter_nodes() for b in node.block_ids)
            owned.extend(self._private)
            if len(owned) != len(set(owned)):
                raise AssertionError("a block is owned twice")
            if set(owned) != self.pool.used_blocks():
                raise AssertionError("pool references differ from owners")
