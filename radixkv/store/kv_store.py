"""KVStore: a RadixTree and a BlockPool behind one lock, shared by many generate() calls.

Lifecycle of one request (see docs/design.md):

1. ``acquire(tokens)`` matches the longest cached prefix and pins it -> ``Lease``.
2. ``read(lease, ...)`` copies the pinned blocks into the caller's KV buffers (no lock
   held: pinned blocks are never evicted nor written).
3. ``commit(tokens, k, v)`` caches the finished sequence's whole blocks.
4. ``lease.release()`` (or leaving ``with lease:``) unpins, always (``radixkv.store.lease``).

Degrades instead of failing: when every block is pinned, or a sequence is longer than the
pool, ``commit`` caches what fits of the prefix (possibly nothing) and returns.

Host tier (``KVStore(pool, host_pool=...)``): making room on the device demotes the least
recently used candidates (their blocks are copied to host blocks, the nodes stay in the tree);
the host drops its own LRU leaves when full. Host-resident blocks of a match are served in
place: ``read`` copies them straight into the caller's buffers (docs/design.md says why no
promotion). A commit extending a host-resident prefix writes its new blocks to the host too,
so device nodes always form the top of the tree.

Recurrent state (``KVStore(pool, states=StatePool(...))``, models with linear-attention / Mamba /
conv layers): the tree is stateful. A node may hold a snapshot of every recurrent layer's
state after its last token, in a slot of the state pool of its tier; a match is usable up to
its deepest snapshot (``Lease.snap``, read by ``read_state``); ``commit(..., snapshots={pos:
states})`` caches the KV up to the deepest snapshot given and attaches each snapshot at its
position. The state pool has a byte budget of its own: snapshots evict snapshots (LRU), never
KV; a node evicted or dropped frees its snapshot; demotion moves it to the host's state pool.
With a remote tier (the sidecar) a stateful store asks it for more than its own usable match:
a remote hit ends at the sidecar's deepest snapshot, which ``read_state`` copies from the
shared memory; commits write their snapshots through with their blocks.

Task pins (``store.tasks``, ``radixkv.store.task_pins``): prefixes pinned by id until unpinned or flushed.
Persistence (``save``/``restore``): the work is in ``radixkv.persist``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence

import torch

from radixkv import persist
from radixkv.store.lease import Lease
from radixkv.store.pool import BlockPool
from radixkv.store.state_pool import StatePool, check_state_mirror
from radixkv.store.stats import StoreCounters, store_stats
from radixkv.store.task_pins import TaskPins
from radixkv.store.tier import Tier, check_mirror, copy_blocks, gather_into, read_split_rows, scatter_into
from radixkv.tree import DEVICE, HOST, MatchResult, RadixTree, TierOrderError
from radixkv.tree.check import snapshot_slots
from radixkv.tree.node import TOKEN_BYTES, Tokens, head_of, num_tokens_of, pack_tokens

logger = logging.getLogger(__name__)


class KVStore:
    """Thread-safe prefix store: tree + pool + one lock. All public methods may be called concurrently.

    Sections: lookup (acquire, read), insertion (commit), tier movement (make room on a tier,
    promote a host prefix back; under the lock), persistence (save, restore: the work is in
    radixkv.persist), maintenance (flush, stats, check_invariants).
    """

    def __init__(
        self,
        pool: BlockPool,
        host_pool: BlockPool | None = None,
        remote=None,
        *,
        states: StatePool | None = None,
        host_states: StatePool | None = None,
    ) -> None:
        """``remote``: a shared tier behind both pools (``radixkv.sidecar.client.SidecarTier``):
        asked for what a match misses, handed every commit to write through. ``states``: the
        snapshot pool of a model with recurrent layers (the tree becomes stateful; a ``remote``
        then carries snapshots too: ``SidecarTier(..., states=)``); ``host_states``: its
        host-tier mirror (needs ``host_pool``)."""
        if host_pool is not None:
            check_mirror(pool, host_pool)
        if host_states is not None:
            if states is None or host_pool is None:
                raise ValueError("host_states needs states= and host_pool= as well")
            check_state_mirror(states, host_states)
        self.pool = pool
        self.host_pool = host_pool
        self.states = states
        self.host_states = host_states
        # Tokens between the snapshots a caller computing a prefill takes (its policy; hf_patch
        # sets it from build_store's snapshot_interval). None: the caller's default.
        self.snapshot_interval: int | None = None
        self._private_snaps: tuple[set[int], set[int]] = (set(), set())  # slots being written
        self.tiers = (Tier(DEVICE, pool),) + ((Tier(HOST, host_pool),) if host_pool is not None else ())
        self.listener = None  # set_listener: told of every change of the tree's contents
        self.tree = self._new_tree()
        self.counters = StoreCounters()
        # Incremented by flush(): KV committed under an older epoch (older weights) is dropped.
        self.epoch = 0
        self._lock = threading.Lock()
        self._retired: list[RadixTree] = []  # flushed trees whose pinned blocks are still being read
        self._private: set[int] = set()  # blocks allocated by a commit in progress, not yet in a tree
        self._private_host: set[int] = set()  # the same, in the host pool
        self.tasks = TaskPins(self)  # prompts pinned for good, by task id
        self.remote = remote
        if remote is not None:
            remote.bind(self)

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
        remote: bool = True,
        claim: bool | None = None,
    ) -> Lease:
        """Match the longest cached whole-block prefix of ``tokens[:max_tokens]`` and pin it.

        Counts all of ``tokens`` as query tokens (``count=False``: not a request; nothing
        counted). O(len(tokens)) to pack them (outside the
        lock; nothing for PackedTokens) plus the tree's match. With a remote tier (and
        ``remote``), a match shorter than the whole blocks asked is extended by the remote's
        (one round trip, no lock held): ``Lease.remote`` pins those blocks there. ``claim``
        (default: ``count``): the caller will compute and commit what is missing, so the remote
        may have it wait for another process computing the same prefix (radixkv.sidecar).
        """
        query = pack_tokens(tokens if max_tokens is None else head_of(tokens, max_tokens))
        with self._lock:
            tree = self.tree
            match = tree.match(query, namespace)
            tree.pin(match.node)
            if count:  # False: a lookup that is no prompt (hf_patch's in-batch prefix sharing)
                self.counters.requests += 1
                self.counters.query_tokens += num_tokens_of(tokens)
            lease = Lease(self, tree, match, self.epoch, namespace, self._host_blocks(match))
            if self.states is not None:
                self.counters.junction_tokens += match.kv_tokens - match.num_tokens
        if (
            remote
            and self.remote is not None
            and query.num_tokens // self.block_size * self.block_size > match.num_tokens
        ):
            try:
                lease.remote = self.remote.lookup(
                    query, namespace, match.num_tokens, request=count if claim is None else claim
                )
            except BaseException:  # a fault there is no hit, never a pin left behind
                lease.release()
                raise
        return lease

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
        remote_tokens = 0
        if any(lease.remote is not None for lease in leases):
            host_tokens, remote_tokens = self._read_with_remote(leases, num_tokens, k_out, v_out)
        elif any(len(lease.block_ids) - lease.num_host_blocks < nb for lease in leases):
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
                self.counters.remote_hit_tokens += min(remote_tokens, hits)
            self.counters.bytes_from_host += host_tokens * self.pool.bytes_per_token  # moved either way
            self.counters.bytes_from_remote += remote_tokens * self.pool.bytes_per_token

    def read_in_place(
        self, leases: Sequence[Lease], num_tokens: Sequence[int], *, served: Sequence[int] | None = None
    ) -> list[list[int]] | None:
        """The device pool's block ids holding each lease's first ``num_tokens[i]`` tokens, for a
        caller that reads them where they lie (``pool.k`` / ``pool.v``) while it holds the leases
        (pinned blocks are neither evicted, demoted nor rewritten): hf_patch.paged_attention.
        Counted as ``read`` counts (``served``); None, counting nothing, when some of those tokens
        are not all in the device pool (host tier, remote tier): the caller copies them instead.
        Raises as ``read`` does for a lease of another store, a released one or too few tokens."""
        if len(num_tokens) != len(leases):
            raise ValueError(f"read_in_place: {len(num_tokens)} token counts for {len(leases)} leases")
        rows = []
        for lease, n in zip(leases, num_tokens):
            if lease._store is not self:
                raise ValueError("read_in_place() of a lease acquired from another KVStore")
            if not lease.active:
                raise RuntimeError("read_in_place() from a released lease")
            if not 0 <= n <= lease.num_tokens:
                raise ValueError(f"lease holds {lease.num_tokens} tokens, {n} requested")
            nb = -(-n // self.block_size)
            if lease.remote is not None or len(lease.block_ids) - lease.num_host_blocks < nb:
                return None
            rows.append(list(lease.block_ids[:nb]))
        with self._lock:
            self.counters.hit_tokens += sum(num_tokens) if served is None else sum(served)
        return rows

    def read_state(self, lease: Lease, out: Sequence[torch.Tensor]) -> bool:
        """Copy the snapshot ``lease`` pins (the recurrent states after its ``num_tokens``) into one
        row's ``out`` tensors (``out[j]``: ``states.specs[j].shape``, any device). Returns False,
        copying nothing, when the lease holds no snapshot (nothing matched: the initial state).
        A lease whose usable end is the remote tier's reads the remote's snapshot from shared
        memory (``remote_snapshots_read``). Runs without the lock: a pinned node's snapshot (local
        or remote) is neither evicted nor moved."""
        if lease._store is not self:
            raise ValueError("read_state() of a lease acquired from another KVStore")
        if not lease.active:
            raise RuntimeError("read_state() from a released lease")
        if self.states is None:
            return False
        hit = lease.remote
        remote = hit is not None and hit.snap >= 0
        if remote:
            hit.pool.states.read(hit.snap, out)
        elif lease.snap >= 0:
            pool = self.host_states if lease._match.node.tier else self.states
            pool.read(lease.snap, out)
        else:
            return False
        with self._lock:
            self.counters.snapshots_read += 1
            self.counters.remote_snapshots_read += remote
        return True

    def path_snapshots(self, lease: Lease) -> list[tuple[int, int, int]]:
        """The local snapshots on ``lease``'s pinned path, root first: ``(position, tier, slot)``,
        ``position`` the tokens before it, ``tier`` the state pool holding ``slot`` (0: ``states``,
        1: ``host_states``). They stay valid while the lease is held (pinned nodes keep their
        snapshots and tiers): what write-through copies to the remote tier. O(path)."""
        with self._lock:
            node, pos, out = lease._match.node, lease._match.num_tokens, []
            while not node.is_root:
                if node.snap >= 0:
                    out.append((pos, node.tier, node.snap))
                pos -= len(node.data) // TOKEN_BYTES
                node = node.parent
        out.reverse()
        return out

    def _read_with_remote(self, leases, num_tokens, k_out, v_out) -> tuple[int, int]:
        """``read`` for rows some of whose blocks the remote tier pinned (after the local ones);
        returns (host tokens, remote tokens) copied."""
        host_tokens = remote_tokens = 0
        bs = self.block_size
        for i, lease in enumerate(leases):
            local = min(num_tokens, lease._match.num_tokens)
            row_k, row_v = [k[i : i + 1] for k in k_out], [v[i : i + 1] for v in v_out]
            if local:
                host_tokens += read_split_rows(
                    self.pool, self.host_pool, [(lease.block_ids, lease.num_host_blocks)], local,
                    [k[:, :, :local] for k in row_k], [v[:, :, :local] for v in row_v],
                )  # fmt: skip
            rest = num_tokens - local
            if rest:
                hit = lease.remote
                ids = torch.tensor([hit.slots[: -(-rest // bs)]], dtype=torch.int64)
                gather_into(
                    hit.pool,
                    ids,
                    rest,
                    [k[:, :, local:num_tokens] for k in row_k],
                    [v[:, :, local:num_tokens] for v in row_v],
                )
                remote_tokens += rest
        return host_tokens, remote_tokens

    # -- insertion ------------------------------------------------------------------------
    def commit(
        self,
        tokens: Tokens,
        k_src: Sequence[torch.Tensor],
        v_src: Sequence[torch.Tensor],
        namespace: Hashable = None,
        epoch: int | None = None,
        *,
        snapshots: Mapping[int, Sequence[torch.Tensor]] | None = None,
        offset: int = 0,
    ) -> int:
        """Cache the whole blocks of ``tokens`` whose KV is ``k_src[l]``/``v_src[l]`` ``[1, H, >=len, D]``.

        ``offset``: the sources begin at token ``offset`` (``[1, H, >= len - offset, D]``), whose
        earlier tokens the store must hold already (a prefix the caller read in place under a
        lease: hf_patch.paged_attention); when it holds fewer (flushed meanwhile), nothing is cached.

        Only blocks not already cached are copied. Returns the number of tokens newly cached.
        With ``epoch`` older than the store's (a flush happened since the KV was computed)
        nothing is cached. With a remote tier the key is then queued for write-through (the
        remote copies from this store's blocks in the background).

        ``snapshots`` (a store with ``states``): position -> one row's recurrent states after
        the first ``position`` tokens (``states.specs`` shapes); positions are multiples of
        the block size. Only KV up to the deepest position is cached (KV past every snapshot
        could never be served); each snapshot is attached where its node has none. Without
        snapshots such a store caches nothing.

        Raises ValueError, caching nothing, when ``tokens`` is a tensor/array or a source does
        not hold one row of KV for every whole-block token: a shorter source would leave the
        end of a cached block unwritten (garbage served as a hit); or when a snapshot position
        is not a block multiple within the tokens, or snapshots come to a store without states.
        """
        whole = num_tokens_of(tokens) // self.block_size * self.block_size
        if self.states is not None or snapshots:
            whole = self._check_snapshots(snapshots, whole)
            if whole == 0:
                pack_tokens(tokens)  # still refuses a tensor / non-int ids
                return 0
        if whole:  # packed once: _commit_local and the remote push share it
            tokens = pack_tokens(head_of(tokens, whole))
        if offset and (snapshots or self.states is not None):
            raise ValueError("commit(offset=...) is for stores without recurrent state")
        added = self._commit_local(tokens, k_src, v_src, namespace, epoch, offset)
        if snapshots:
            self._attach_snapshots(tokens, snapshots, namespace, epoch)
        if self.remote is not None and whole and (epoch is None or epoch == self.epoch):
            self.remote.push(tokens, namespace)
        return added

    def _check_snapshots(self, snapshots: Mapping[int, Sequence[torch.Tensor]] | None, whole: int) -> int:
        """The tokens a stateful commit caches (its deepest snapshot), after checking positions."""
        if self.states is None:
            raise ValueError("commit(snapshots=...) to a store without a state pool (KVStore(states=))")
        deepest = 0
        for pos, states in (snapshots or {}).items():
            if type(pos) is not int or pos <= 0 or pos % self.block_size or pos > whole:
                raise ValueError(
                    f"snapshot position {pos!r} must be a positive multiple of the block size "
                    f"({self.block_size}) within the {whole} whole-block tokens"
                )
            self.states._check_states("commit", states)
            deepest = max(deepest, pos)
        return deepest

    def _attach_snapshots(
        self,
        tokens: Tokens,
        snapshots: Mapping[int, Sequence[torch.Tensor]],
        namespace: Hashable,
        epoch: int | None,
    ) -> None:
        """Attach each snapshot to the node ending at its position where that node has none:
        slots taken under the lock (private), written without it, attached under it."""
        todo = []  # (position, tier, slot, node)
        with self._lock:
            if epoch is not None and epoch != self.epoch:
                return
            tree = self.tree
            for pos in sorted(snapshots):
                node = tree.node_at(head_of(tokens, pos), namespace)
                if node is None or node.snap >= 0:  # not cached (room) / taken already
                    continue
                tier = node.tier
                pool = self.host_states if tier else self.states
                if pool is None:  # a host node without a host state pool: no snapshot there
                    continue
                if pool.num_free == 0:
                    self._evict_snapshots_locked(tier, 1)
                if pool.num_free == 0:
                    self.counters.uncached_snapshots += 1
                    continue
                slot = pool.allocate(1)[0]
                self._private_snaps[tier].add(slot)
                tree.pin(node)  # neither evicted nor demoted while its snapshot is written
                todo.append((pos, tier, slot, node))
        written = []
        try:
            for pos, tier, slot, node in todo:
                (self.host_states if tier else self.states).write(slot, snapshots[pos])
                written.append((tier, slot, node))
        finally:
            with self._lock:
                for _pos, tier, slot, node in todo:
                    self._private_snaps[tier].discard(slot)
                    pool = self.host_states if tier else self.states
                    ok = (tier, slot, node) in written and tree is self.tree
                    if ok and node.attached and node.snap < 0 and node.tier == tier:
                        tree.set_snapshot(node, slot)
                        self.counters.snapshots_written += 1
                    else:
                        pool.free([slot])
                    self._unpin_locked(tree, node)

    def _evict_snapshots_locked(self, tier: int, n: int) -> None:
        slots = self.tree.evict_snapshots(n, tier)
        if slots:
            (self.host_states if tier else self.states).free(slots)
            self.counters.evicted_snapshots += len(slots)

    def _free_snapshot(self, tier: int, slot: int) -> None:
        """The tree's callback for the snapshot of every node it removes (under the lock)."""
        (self.host_states if tier else self.states).free([slot])

    def _commit_local(
        self,
        tokens: Tokens,
        k_src: Sequence[torch.Tensor],
        v_src: Sequence[torch.Tensor],
        namespace: Hashable = None,
        epoch: int | None = None,
        offset: int = 0,
    ) -> int:
        """``commit`` without the remote tier."""
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
                if src.dim() != 4 or src.shape[0] != 1 or src.shape[2] < num_blocks * bs - offset:
                    raise ValueError(
                        f"commit: {name}[{i}] has shape {tuple(src.shape)}, expected "
                        f"[1, kv_heads, >= {num_blocks * bs - offset}, head_dim] (KV of every whole-block "
                        f"token from token {offset})"
                    )
        with self._lock:
            if epoch is not None and epoch != self.epoch:
                return 0
            tree = self.tree
            match = tree.match(tokens, namespace, kv=True)
            cached_blocks = match.num_tokens // bs
            need = num_blocks - cached_blocks
            if need == 0 or cached_blocks * bs < offset:  # (the sources lack tokens the store lost)
                return 0
            tree.pin(match.node)  # the prefix we extend must outlive the copy
            # Below a demoted prefix the new blocks go to the host too (tiers never go back up).
            tier = match.node.tier
            pool, private = (self.host_pool, self._private_host) if tier else (self.pool, self._private)
            try:
                if pool.num_free < need:
                    self._make_room_locked(tier, need - pool.num_free)
                take = min(need, pool.num_free)
                ids = pool.allocate(take)
            except BaseException:  # (an eviction's demotion failing, say) nothing pinned is left
                self._unpin_locked(tree, match.node)
                raise
            private.update(ids)
            if take < need:
                self.counters.uncached_tokens += (need - take) * bs
        try:
            if take:
                start, stop = cached_blocks * bs, (cached_blocks + take) * bs
                scatter_into(
                    pool,
                    torch.tensor([ids], dtype=torch.int64),
                    [k[:, :, start - offset : stop - offset] for k in k_src],
                    [v[:, :, start - offset : stop - offset] for v in v_src],
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

    # -- tier movement (under the lock) ------------------------------------------------
    # Making room on the device demotes the least recently used candidates when there is a host
    # tier (their blocks are copied to host blocks, the nodes stay in the tree) and evicts them
    # otherwise; the host drops its own LRU leaves. Promotion (task pins only) copies a
    # host-resident path end back to device blocks.

    def _host_blocks(self, match: MatchResult) -> int:
        return self.tree.host_blocks_at(match.node) if self.host_pool is not None else 0

    def _make_room_locked(self, tier: int, num_blocks: int) -> None:
        """Free ``num_blocks`` blocks of ``tier`` (fewer when too much is pinned): the host drops
        LRU leaves; the device drops them too, or demotes them when there is a host tier."""
        if tier == HOST:
            freed = self.tree.evict_host(num_blocks)
            self.host_pool.free(freed)
            self.counters.evicted_blocks += len(freed)
            return
        if self.host_pool is None:
            freed = self.tree.evict(num_blocks)
            self.pool.free(freed)
            self.counters.evicted_blocks += len(freed)
            return
        tree, host, done = self.tree, self.host_pool, 0
        while done < num_blocks:
            node = tree.demotion_candidate()
            if node is None:
                break
            n = len(node.block_ids)
            # Drop host leaves only when that makes room for the node: emptying the host for a
            # node larger than what it can free would lose its content and demote nothing.
            if host.num_free < n <= host.num_free + tree.num_host_blocks - tree.num_host_pinned_blocks:
                self._make_room_locked(HOST, n - host.num_free)
            if host.num_free < n:  # the host is pinned full: drop device leaves instead
                freed = tree.evict(num_blocks - done)
                self.pool.free(freed)
                self.counters.evicted_blocks += len(freed)
                return
            host_ids = host.allocate(n)
            host_snap = self._host_snapshot_slot_locked(node)
            # Under the lock: nobody can pin, read or overwrite the node's blocks meanwhile.
            try:
                self.counters.bytes_to_host += copy_blocks(self.pool, node.block_ids, host, host_ids)
                dev_snap = node.snap
                if host_snap >= 0:
                    self.counters.bytes_to_host += self.states.copy_to(dev_snap, self.host_states, host_snap)
                demoted = tree.demote(node, host_ids, host_snap)
            except BaseException:  # the node keeps its device blocks; the host ids go back
                host.free(host_ids)
                if host_snap >= 0:
                    self.host_states.free([host_snap])
                raise
            if host_snap >= 0:
                self.states.free([dev_snap])
            self.pool.free(demoted)
            self.counters.demoted_blocks += n
            done += n

    def _host_snapshot_slot_locked(self, node) -> int:
        """A host state slot for demoting ``node``'s snapshot, or -1 when it has none; a snapshot
        the host state pool cannot take (none, or full of pinned ones) is dropped first."""
        if node.snap < 0:
            return -1
        if self.host_states is not None and self.host_states.num_free == 0:
            self._evict_snapshots_locked(HOST, 1)
        if self.host_states is None or self.host_states.num_free == 0:
            self.states.free([self._drop_snapshot_locked(node)])
            return -1
        return self.host_states.allocate(1)[0]

    def _drop_snapshot_locked(self, node) -> int:
        """Take ``node``'s snapshot off it (its KV stays); returns the slot (the caller frees it)."""
        slot = node.snap
        self.tree.detach_snapshot(node)
        self.counters.evicted_snapshots += 1
        return slot

    def _promote_locked(self, node) -> bool:
        """Move the host-resident end of the path to ``node`` back to device blocks (task pins:
        never served from the host). Only when nothing else pins it (a reader's lease fixes
        which ids are host ids) and the device can make room; returns whether it moved."""
        tree, host = self.tree, self.host_pool
        chain = []
        while node.tier:
            chain.append(node)
            node = node.parent
        if not chain or chain[-1].pin_count:  # chain[-1]: the topmost host node; pins cover the path below
            return False
        chain.reverse()
        n = sum(len(c.block_ids) for c in chain)
        tree.pin(chain[-1])  # neither demotion nor host eviction may touch the path meanwhile
        try:
            if self.pool.num_free < n:
                self._make_room_locked(DEVICE, n - self.pool.num_free)
            if self.pool.num_free < n:
                return False
            for c in chain:  # top down: each one's parent is on the device by then
                ids = self.pool.allocate(len(c.block_ids))
                dev_snap = -1
                if c.snap >= 0:
                    if self.states.num_free == 0:
                        self._evict_snapshots_locked(DEVICE, 1)
                    if self.states.num_free == 0:  # every device snapshot pinned: promote without it
                        self.host_states.free([self._drop_snapshot_locked(c)])
                    else:
                        dev_snap = self.states.allocate(1)[0]
                try:
                    self.counters.bytes_from_host += copy_blocks(host, c.block_ids, self.pool, ids)
                    host_snap = c.snap
                    if dev_snap >= 0:
                        self.counters.bytes_from_host += self.host_states.copy_to(
                            host_snap, self.states, dev_snap
                        )
                except BaseException:  # the node keeps its host blocks; ours go back
                    self.pool.free(ids)
                    if dev_snap >= 0:
                        self.states.free([dev_snap])
                    raise
                host.free(tree.promote(c, ids, dev_snap))
                if dev_snap >= 0:
                    self.host_states.free([host_snap])
                self.counters.promoted_blocks += len(ids)
            return True
        finally:
            tree.unpin(chain[-1])

    # -- persistence ----------------------------------------------------------------------

    def save(
        self,
        path,
        namespaces: Collection[Hashable] | Callable[[Hashable], bool] | None = None,
        *,
        identity: object = None,
        rename: Callable[[Hashable], Hashable] | None = None,
        epoch: int | None = None,
        max_bytes: int | None = None,
        deadline: float | None = None,
        cancel: threading.Event | None = None,
        max_rate: float | None = None,
    ) -> persist.SaveResult:
        """Write the cached prefixes of ``namespaces`` (a list/set or a predicate; None: all) to ``path``.

        Atomic: ``path`` keeps its previous content unless the whole new file was written.
        ``identity`` (JSON-able) must be presented equal to ``restore``; ``rename`` maps a
        namespace to the one written. Pins the saved prefixes while it writes (the lock only
        for the snapshot of the tree), so commits meanwhile may cache less.
        Raises ValueError for a namespace other than None/str/bytes/int/tuples of them;
        RuntimeError, writing nothing, when the store was flushed after ``epoch`` (``self.epoch``
        read before ``identity`` was computed).

        ``max_bytes``: write at most this many KV (and snapshot) bytes, the most recently used
        prefixes first (``SaveResult.skipped_*`` counts the rest). A store with ``states``
        writes every saved node's snapshot with it (format 3: docs/cache-files.md). ``deadline`` (a ``time.monotonic()`` value)
        and ``cancel`` (an Event) stop the save between chunks: ``radixkv.SaveAborted``, the
        previous file unchanged, no temporary file left. ``max_rate``: at most this many KV
        bytes per second (a save in the background of requests).
        """
        return persist.save_store(
            self,
            path,
            namespaces=namespaces,
            identity=identity,
            rename=rename,
            epoch=epoch,
            max_bytes=max_bytes,
            deadline=deadline,
            cancel=cancel,
            max_rate=max_rate,
        )

    def restore(
        self,
        path,
        *,
        identity: object = None,
        rename: Callable[[Hashable], Hashable] | None = None,
        epoch: int | None = None,
        evict: bool = False,
        namespaces: Callable[[Hashable], bool] | None = None,
    ) -> persist.RestoreResult:
        """Merge the prefixes saved in ``path`` into this store: cached ones stay, new ones go in.

        Checks all of the file first (checksums, format version, ``identity``, layout,
        structure) and raises ``radixkv.CacheFileError`` naming the fault, changing nothing.
        Restored prefixes go in as the most recently used, in the file's order. Prefixes the
        store holds already (pinned task prompts, say) are duplicates and need no room.
        ``evict=False``: restored blocks take free blocks only, on the device and then on the
        host tier (device blocks never below host ones); nothing cached is evicted.
        ``evict=True``: the file wins over the store's unpinned blocks: the least recently used
        are demoted to the host tier or evicted to make room. Either way, what does not fit is
        dropped, least recently used first, and counted in the result.
        ``namespaces(ns)`` (``ns`` after ``rename``): restore only the prefixes it accepts; the
        others are left out before anything is placed (no room taken, nothing evicted) and
        counted as dropped.
        ``epoch``: ``self.epoch`` read when ``identity`` was computed; if the store was flushed
        since (weights changed), raises RuntimeError, changing nothing.
        A store with ``states`` takes only files with snapshots of the same state specs (and a
        store without, only files without: ``CacheFileMismatch`` otherwise). Each snapshot goes
        into the state pool of its node's tier, a free slot (``evict``: or one of the store's
        least recently used unpinned snapshots'); one that finds none is dropped, its node's KV
        kept (``RestoreResult.*_snapshots``).
        """
        return persist.restore_store(
            self, path, identity=identity, rename=rename, epoch=epoch, evict=evict, namespaces=namespaces
        )

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[persist.Locked]:
        """radixkv.persist's hook: the lock held while the ``Locked`` view is used."""
        with self._lock:
            pools = tuple(tier.pool for tier in self.tiers)
            private = (self._private, self._private_host)
            states = () if self.states is None else (self.states, self.host_states)
            yield persist.Locked(
                self.tree,
                pools,
                self.counters,
                self._unpin_locked,
                self._make_room_locked,
                private,
                states,
                self._private_snaps,
                self._evict_snapshots_locked,
            )

    # -- maintenance ----------------------------------------------------------------------
    def flush(self) -> int:
        """Drop every cached prefix and task pin; returns blocks freed now (both tiers).

        Blocks pinned by running requests go when released."""
        with self._lock:
            old, self.tree = self.tree, self._new_tree()
            old.listener = None  # the old tree's nodes leave as one AllBlocksCleared, not one by one
            if self.listener is not None:
                self.listener.cleared()
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

    def drop(self, namespaces: Callable[[Hashable], bool]) -> int:
        """Drop the cached prefixes under every namespace ``namespaces(ns)`` accepts, both tiers
        (the KV of an adapter that was unloaded). Prefixes pinned now (a running request, a task
        pin) stay and become ordinary LRU candidates once released. Returns blocks freed."""
        with self._lock:
            freed, host = self.tree.drop(namespaces)
            self.pool.free(freed)
            if host:
                self.host_pool.free(host)
            return len(freed) + len(host)

    def set_listener(self, listener) -> None:
        """Tell ``listener`` (a ``radixkv.tree.TreeListener`` with ``cleared()`` and
        ``announce(tree)``, e.g. ``radixkv.events.TreeRecorder``) of every change of the cached
        contents from now on: nodes stored, removed and moved between tiers, and each flush.
        What the store holds already is announced first. None detaches. O(N) under the lock."""
        with self._lock:
            self.listener = self.tree.listener = listener
            if listener is not None:
                listener.announce(self.tree)

    def _new_tree(self) -> RadixTree:
        # Ids come off the pool's free list (refcount 1), so the tree need not re-check that it
        # does not own them already; check_invariants still recounts them.
        if self.states is None:
            tree = RadixTree(self.pool.block_size, check_block_ids=False)
        else:
            tree = RadixTree(
                self.pool.block_size, check_block_ids=False, stateful=True, free_snapshot=self._free_snapshot
            )
        tree.listener = self.listener
        return tree

    def _check_layers(self, op: str, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> None:
        n = len(self.pool.layers)
        if len(ks) != n or len(vs) != n:
            raise ValueError(f"{op}: the pool has {n} layers, got {len(ks)} K and {len(vs)} V tensors")

    def _release(self, lease: Lease) -> None:
        # Check and clear under the lock: two threads releasing one lease must unpin once.
        with self._lock:
            tree, lease._tree = lease._tree, None
            hit, lease.remote = lease.remote, None
            if tree is not None:
                self._unpin_locked(tree, lease._match.node)
        if hit is not None:
            self.remote.release(hit)

    def _unpin_locked(self, tree: RadixTree, node) -> None:
        tree.unpin(node)
        if tree is not self.tree and tree in self._retired:
            freed, host = tree.clear_tiers()
            self.pool.free(freed)
            if host:
                self.host_pool.free(host)
            if not tree.num_cached_blocks:
                self._retired.remove(tree)

    def lock_for_fork(self, timeout: float) -> bool:
        """Take the store's lock before a fork() (``radixkv.sidecar.forks``), so the child never
        copies the tree mid-update or the lock held by a thread it lacks; False if another
        thread held it for ``timeout`` s. Let go with ``unlock_after_fork`` (parent and child)."""
        return self._lock.acquire(timeout=timeout)

    def unlock_after_fork(self) -> None:
        self._lock.release()

    def stats(self) -> dict[str, int | float]:
        """Counters plus occupancy of each tier and of the task pins, as one flat dict."""
        with self._lock:
            out = store_stats(self)
        if self.remote is not None:
            out.update(self.remote.stats())
        return out

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
            if self.states is not None:
                snaps: tuple[list[int], list[int]] = tuple(list(p) for p in self._private_snaps)
                for tree in trees:
                    for tier, slots in enumerate(snapshot_slots(tree._roots)):
                        snaps[tier].extend(slots)
                for tier, pool in enumerate((self.states, self.host_states)):
                    if pool is None:
                        if snaps[tier]:
                            raise AssertionError("host snapshots in a store without a host state pool")
                        continue
                    pool.check_invariants()
                    if len(snaps[tier]) != len(set(snaps[tier])) or set(snaps[tier]) != pool.used_slots():
                        raise AssertionError(
                            f"{('device', 'host')[tier]} state slots differ from their owners"
                        )
            self.tasks.check_locked()
