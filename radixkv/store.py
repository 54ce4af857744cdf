"""KVStore: a RadixTree and a BlockPool behind one lock, shared by many generate() calls.

Lifecycle of one request (see docs/design.md):

1. ``acquire(tokens)`` matches the longest cached prefix and pins it -> ``Lease``.
2. ``read(lease, ...)`` copies the pinned blocks into the caller's KV buffers (no lock
   held: pinned blocks are never evicted nor written).
3. ``commit(tokens, k, v)`` caches the finished sequence's whole blocks.
4. ``lease.release()`` (or leaving ``with lease:``) unpins, always (``radixkv.lease``).

Degrades instead of failing: when every block is pinned, or a sequence is longer than the
pool, ``commit`` caches what fits of the prefix (possibly nothing) and returns.

Host tier (``KVStore(pool, host_pool=...)``): making room on the device demotes the least
recently used candidates (their blocks are copied to host blocks, the nodes stay in the tree);
the host drops its own LRU leaves when full. Host-resident blocks of a match are served in
place: ``read`` copies them straight into the caller's buffers (docs/design.md says why no
promotion). A commit extending a host-resident prefix writes its new blocks to the host too,
so device nodes always form the top of the tree.

Task pins (``store.tasks``, ``radixkv.task_pins``): prefixes pinned by id until unpinned or flushed.
Persistence (``save``/``restore``): ``radixkv.store_persist``, the work in ``radixkv.persist``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Sequence

import torch

from radixkv.lease import Lease
from radixkv.node import DEVICE, HOST, Tokens, head_of, num_tokens_of, pack_tokens
from radixkv.pool import BlockPool
from radixkv.stats import StoreCounters, store_stats
from radixkv.store_persist import StorePersistence
from radixkv.store_tiers import StoreTierMoves
from radixkv.task_pins import TaskPins
from radixkv.tier import Tier, check_mirror, read_split_rows, scatter_into
from radixkv.tree import RadixTree, TierOrderError

logger = logging.getLogger(__name__)


class KVStore(StoreTierMoves, StorePersistence):
    """Thread-safe prefix store: tree + pool + one lock. All public methods may be called concurrently.

    Tier movement (``_make_room_locked``, ``_promote_locked``) lives in radixkv.store_tiers,
    ``save``/``restore`` in radixkv.store_persist.
    """

    def __init__(self, pool: BlockPool, host_pool: BlockPool | None = None) -> None:
        if host_pool is not None:
            check_mirror(pool, host_pool)
        self.pool = pool
        self.host_pool = host_pool
        self.tiers = (Tier(DEVICE, pool),) + ((Tier(HOST, host_pool),) if host_pool is not None else ())
        self.tree = self._new_tree()
        self.counters = StoreCounters()
        # Incremented by flush(): KV committed under an older epoch (older weights) is dropped.
        self.epoch = 0
        self._lock = threading.Lock()
        self._retired: list[RadixTree] = []  # flushed trees whose pinned blocks are still being read
        self._private: set[int] = set()  # blocks allocated by a commit in progress, not yet in a tree
        self._private_host: set[int] = set()  # the same, in the host pool
        self.tasks = TaskPins(self)  # prompts pinned for good, by task id

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

        Counts all of ``tokens`` as query tokens (``count=False``: not a request; nothing
        counted). O(len(tokens)) to pack them (outside the
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
            return Lease(self, tree, match, self.epoch, namespace, self._host_blocks(match))

    def read(
        self,
        leases: Sequence[Lease],
        num_tokens: int,
        k_out: Sequence[torch.Tensor],
        v_out: Sequence[torch.Tensor],
        *,
        count: bool = True,
        served: Sequence[int] | None = None,
    ) -> None:
        """Copy the first ``num_tokens`` cached tokens of each lease (one output row each).

        ``k_out[l]``/``v_out[l]``: ``[len(leases), H, num_tokens, D]`` views on layer l's device.
        Runs without the lock: pinned blocks are neither evicted nor rewritten.
        Hits counted: ``num_tokens`` per row, or ``served[i]`` for row i (tokens that row did
        not compute itself: hf_patch's in-batch sharing computed a prefix for it just before);
        nothing with ``count=False``.
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
        if any(len(lease.block_ids) - lease.num_host_blocks < nb for lease in leases):
            rows = [(lease.block_ids, lease.num_host_blocks) for lease in leases]
            host_tokens = read_split_rows(self.pool, self.host_pool, rows, num_tokens, k_out, v_out)
        else:
            host_tokens = 0
            ids = torch.tensor([list(lease.block_ids[:nb]) for lease in leases], dtype=torch.int64)
            self.pool.gather(ids, num_tokens, k_out, v_out)
        with self._lock:
            if count:  # False: hf_patch's in-batch sharing reading a prefix, no request's hit
                hits = num_tokens * len(leases) if served is None else sum(served)
                self.counters.hit_tokens += hits
                # Host blocks sit at the end of a prefix, where a batch's own computed blocks
                # are too only when they extend a host prefix: bounded so it stays "of hit_tokens".
                self.counters.host_hit_tokens += min(host_tokens, hits)
            self.counters.bytes_from_host += host_tokens * self.pool.bytes_per_token  # moved either way

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
            # Below a demoted prefix the new blocks go to the host too (tiers never go back up).
            tier = match.node.tier
            pool, private = (self.host_pool, self._private_host) if tier else (self.pool, self._private)
            if pool.num_free < need:
                self._make_room_locked(tier, need - pool.num_free)
            take = min(need, pool.num_free)
            ids = pool.allocate(take)
            private.update(ids)
            if take < need:
                self.counters.uncached_tokens += (need - take) * bs
        try:
            if take:
                start, stop = cached_blocks * bs, (cached_blocks + take) * bs
                scatter_into(
                    pool,
                    torch.tensor([ids], dtype=torch.int64),
                    [k[:, :, start:stop] for k in k_src],
                    [v[:, :, start:stop] for v in v_src],
                )
        except BaseException:
            with self._lock:
                private.difference_update(ids)
                pool.free(ids)
                self._unpin_locked(tree, match.node)
            raise
        with self._lock:
            private.difference_update(ids)
            self._unpin_locked(tree, match.node)
            if tree is not self.tree or not take:  # flushed meanwhile: the KV may be stale
                pool.free(ids)
                return 0
            if tier:
                self.counters.bytes_to_host += take * bs * pool.bytes_per_token
            new_tokens = tokens.head((cached_blocks + take) * bs)
            try:
                already = tree.insert(new_tokens, list(match.block_ids) + ids, namespace, tier)
            except TierOrderError:  # another thread cached this path deeper and it was demoted since
                pool.free(ids)
                return 0
            duplicates = max(0, already // bs - cached_blocks)  # another thread inserted them first
            if duplicates:
                pool.free(ids[:duplicates])
            added = new_tokens.num_tokens - max(already, cached_blocks * bs)
            self.counters.inserted_tokens += added
            return added

    def count_uncacheable(self) -> None:
        """Count one request served without the store (its KV depends on what no key holds)."""
        with self._lock:
            self.counters.uncacheable_requests += 1

    # -- maintenance ----------------------------------------------------------------------
    def flush(self) -> int:
        """Drop every cached prefix and task pin; returns blocks freed now (both tiers).

        Blocks pinned by running requests go when released."""
        with self._lock:
            old, self.tree = self.tree, self._new_tree()
            self.epoch += 1
            self.counters.flushes += 1
            for lease in self.tasks.drop_all():  # KV of older weights: the owner pins them again
                lease._tree = None
                old.unpin(lease._match.node)
            freed, host = old.clear_tiers()
            self.pool.free(freed)
            if host:
                self.host_pool.free(host)
            if old.num_cached_blocks:
                self._retired.append(old)
            return len(freed) + len(host)

    def _new_tree(self) -> RadixTree:
        # Ids come off the pool's free list (refcount 1), so the tree need not re-check that it
        # does not own them already; check_invariants still recounts them.
        return RadixTree(self.pool.block_size, check_block_ids=False)

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
            freed, host = tree.clear_tiers()
            self.pool.free(freed)
            if host:
                self.host_pool.free(host)
            if not tree.num_cached_blocks:
                self._retired.remove(tree)

    def stats(self) -> dict[str, int | float]:
        """Counters plus occupancy of each tier and of the task pins, as one flat dict."""
        with self._lock:
            return store_stats(self)

    def check_invariants(self) -> None:
        """Full recount: tree and pools consistent, every used block of each tier owned exactly once."""
        with self._lock:
            trees = [self.tree, *self._retired]
            owned: tuple[list[int], list[int]] = (list(self._private), list(self._private_host))
            for tree in trees:
                tree.check_invariants()
                for node in tree.iter_nodes():
                    owned[node.tier].extend(node.block_ids)
            for tier in self.tiers:
                tier.pool.check_invariants()
                ids = owned[tier.index]
                if len(ids) != len(set(ids)):
                    raise AssertionError(f"a {tier.name} block is owned twice")
                if set(ids) != tier.pool.used_blocks():
                    raise AssertionError(f"{tier.name} pool references differ from owners")
            if self.host_pool is None and owned[HOST]:
                raise AssertionError("host-resident nodes in a store without a host tier")
            self.tasks.check_locked()
