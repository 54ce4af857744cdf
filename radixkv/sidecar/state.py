"""The sidecar's state: shared pools, a radix tree per pool, and what each client holds.

No sockets here (``radixkv.sidecar.server`` feeds it): every method runs on the server's one
loop thread, or under ``Sidecar.lock`` (the metrics thread reads ``stats``).

- One ``SharedPool`` per KV layout: a memory file (memfd, sparse: pages are committed when first
  written) sized for the whole budget, its free list, and a ``RadixTree`` whose roots are
  ``(model identity digest, namespace)``: two models never share a node, nor do two namespaces.
- A layout with states (a model with recurrent layers) also has snapshot slots in its memory
  file (``radixkv.sidecar.layout``) and a stateful tree: a node may hold the snapshot taken
  after its last token, and a match is usable up to the deepest snapshot on its path.
- ``budget_bytes`` bounds the bytes of blocks and snapshots in use over all pools; of them,
  snapshots take at most ``state_bytes`` (a quarter by default). A pool short of room for blocks
  evicts its own least recently used unpinned blocks first, then other pools'; short of room for
  a snapshot, it drops least recently used unpinned snapshots (their KV stays), its own first,
  and evicts blocks only to take back room of the snapshots' share that blocks were using.
- A client's ``match`` pins what it will read (a lease); ``alloc`` pins the prefix it extends and
  takes free blocks and snapshot slots private to it (a transaction) that no tree holds until
  ``commit``: nobody can read a block or a snapshot before the client wrote it whole. When the client's socket closes
  (``drop_client``: it exited, crashed or was killed) its leases are unpinned and the blocks of
  its open transactions freed.
- Claims (prefixes in flight): a match may claim what it misses for a few seconds; another
  client that then misses a common prefix is told to wait for it (it polls). A client holding
  claims is never told to wait; claims go with their client, expire, or are fulfilled by its
  commit (``radixkv.sidecar.claims``).
- An optional L2 tier (``radixkv.l2``): a match shorter than the prompt asks it for the next
  blocks (chained keys over identity, namespace and tokens) and, in a pool with states, for the
  deepest snapshot past the usable match (the block key at its position plus a marker,
  ``radixkv.l2.block_keys.snapshot_key``), and inserts what it returns; committed blocks and
  snapshots are handed to ``l2_writer`` (bounded, in the background).
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import logging
import mmap
import os
import threading
from collections.abc import Callable

from radixkv.sidecar.claims import Claims
from radixkv.sidecar.layout import KVLayout, PoolGeometry
from radixkv.tree import RadixTree, TreeListener
from radixkv.tree.check import snapshot_slots
from radixkv.tree.node import TOKEN_BYTES, Node, PackedTokens

logger = logging.getLogger(__name__)

MAX_POOLS = 64  # KV layouts at once (each a memory file and its tree); pools are never dropped
L2_FIRST_RUN = 16  # blocks a match asks the L2 for first; each further run twice the last
L2_SNAPSHOT_PROBES = 64  # block positions a match asks the L2 for a snapshot at, deepest first
STATE_SHARE = 4  # snapshots take at most 1/STATE_SHARE of the budget unless state_bytes says
MIN_SNAPSHOTS = 4  # a layout with states whose snapshots fit fewer times is refused
MAX_SNAPSHOT_SLOTS = 1 << 16  # slots of one pool (a client's view keeps ~9 bytes a slot)


@dataclasses.dataclass
class Counters:
    """Monotone counters since the sidecar started."""

    matches: int = 0  # match requests
    query_tokens: int = 0  # tokens asked past what the client held itself
    hit_tokens: int = 0  # tokens served from sidecar memory (incl. those the L2 filled just before)
    l2_hit_tokens: int = 0  # of hit_tokens, read from the L2 tier into memory for this match
    inserted_tokens: int = 0  # tokens newly cached by commits
    evicted_blocks: int = 0
    uncached_tokens: int = 0  # tokens an alloc could not take: the pool full of pinned blocks
    aborted_blocks: int = 0  # blocks of transactions aborted or left open by a client that went
    released_pins: int = 0  # leases a client that went away still held
    clients_total: int = 0
    waits: int = 0  # matches told to wait for another client's prefix in flight
    # Pools with states (all zero otherwise)
    snapshot_hits: int = 0  # leases whose usable end is a snapshot in sidecar memory
    l2_snapshot_hits: int = 0  # snapshots read from the L2 tier into memory for a match
    inserted_snapshots: int = 0  # snapshots newly attached by commits
    evicted_snapshots: int = 0  # snapshots dropped for room (their KV stayed)
    uncached_snapshots: int = 0  # snapshots an alloc could not take (no room, or past its blocks)
    aborted_snapshots: int = 0  # snapshot slots of transactions aborted or left open


class FreeBlocks:
    """The free block ids of one pool, in memory that grows with the blocks used, never with the
    pool's size: ids never handed out are a counter (``fresh``, ascending runs for the copy
    kernels), ids freed again a stack of int64 (8 bytes each). A pool of 2**31 blocks costs
    nothing until its blocks are used (the free list used to be a Python list of every id:
    ~40 bytes a block, at hello)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.fresh = 0  # ids >= fresh were never handed out
        self.freed = array.array("q")  # a stack: the last freed is taken first

    def __len__(self) -> int:
        return self.num_blocks - self.fresh + len(self.freed)

    def __iter__(self):
        yield from self.freed
        yield from range(self.fresh, self.num_blocks)

    def take(self, n: int) -> list[int]:
        """``n`` ids (at most ``len(self)``): the freed ones last freed first, then fresh ones."""
        reused = min(n, len(self.freed))
        ids = self.freed[len(self.freed) - reused :].tolist()
        ids.reverse()
        del self.freed[len(self.freed) - reused :]
        fresh = min(n - reused, self.num_blocks - self.fresh)
        ids += range(self.fresh, self.fresh + fresh)
        self.fresh += fresh
        return ids

    def put(self, ids) -> None:
        self.freed.extend(ids)


class SharedPool:
    """One KV layout's blocks (and snapshot slots, with states) in one memory file, and the tree
    over them (stateful with states)."""

    def __init__(self, layout: KVLayout, num_blocks: int, num_slots: int = 0) -> None:
        self.geometry = PoolGeometry(layout, num_blocks, num_slots)
        self.layout = layout
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.block_bytes = layout.block_bytes  # 0: a layout without layers (Mamba)
        self.slot_bytes = layout.slot_stride if num_slots else 0  # what one snapshot takes of the budget
        self.fd = os.memfd_create("radixkv-sidecar-pool", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.geometry.total_bytes)
        self.buf = mmap.mmap(self.fd, self.geometry.total_bytes)
        self.stateful = bool(layout.states)
        self.tree = RadixTree(
            layout.block_size,
            check_block_ids=False,
            stateful=self.stateful,
            free_snapshot=self._free_snapshot if self.stateful else None,
        )
        self.free = FreeBlocks(num_blocks)
        self.free_slots = FreeBlocks(num_slots)

    def _free_snapshot(self, _tier: int, slot: int) -> None:
        """The tree's callback for the snapshot of every node it removes."""
        self.free_slots.put([slot])

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self.free_slots)

    @property
    def used_bytes(self) -> int:
        """Bytes of the budget this pool's blocks and snapshots in use take."""
        return self.num_used * self.block_bytes + self.num_used_slots * self.slot_bytes

    def allocate(self, n: int) -> list[int]:
        return self.free.take(n)

    def release(self, ids) -> None:
        self.free.put(ids)


@dataclasses.dataclass
class Lease:
    pool: SharedPool
    node: Node


@dataclasses.dataclass
class Txn:
    pool: SharedPool
    node: Node  # the pinned prefix the new blocks extend
    namespace: tuple
    tokens: PackedTokens  # the prefix plus the new blocks' tokens
    prefix_ids: list[int]
    slots: list[int]
    snaps: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (position, state slot)


@dataclasses.dataclass
class Client:
    pool: SharedPool | None = None
    leases: dict[int, Lease] = dataclasses.field(default_factory=dict)
    txns: dict[int, Txn] = dataclasses.field(default_factory=dict)


class Sidecar:
    """Pools, trees and clients of one sidecar process (see the module docstring)."""

    def __init__(
        self,
        budget_bytes: int,
        l2=None,
        l2_writer: Callable | None = None,
        state_bytes: int | None = None,
        tree_listener: Callable[[SharedPool], TreeListener] | None = None,
    ) -> None:
        """``state_bytes``: the most of ``budget_bytes`` snapshots take (default a quarter);
        blocks may use what snapshots leave unused. ``tree_listener(pool)``: the listener of
        each new pool's tree (KV events: ``--kv-events-config``)."""
        if type(budget_bytes) is not int or budget_bytes <= 0:
            raise ValueError(f"host bytes must be a positive int, got {budget_bytes!r}")
        if state_bytes is None:
            state_bytes = budget_bytes // STATE_SHARE
        if type(state_bytes) is not int or not 0 < state_bytes <= budget_bytes:
            raise ValueError(f"state bytes must be a positive int up to the host bytes, got {state_bytes!r}")
        self.budget_bytes = budget_bytes
        self.state_bytes = state_bytes
        self.pools: dict[str, SharedPool] = {}
        self.clients: dict[int, Client] = {}
        self.counters = Counters()
        self.lock = threading.Lock()
        self.l2 = l2
        self.l2_writer = l2_writer  # l2_writer(list of (key, payload)): queue blocks for the L2
        self.tree_listener = tree_listener
        self._ids = itertools.count(1)
        self.claims = Claims()

    # -- clients --------------------------------------------------------------------------
    def add_client(self, cid: int) -> None:
        self.clients[cid] = Client()
        self.counters.clients_total += 1

    def hello(self, cid: int, layout_json: object) -> SharedPool:
        """Bind client ``cid`` to the pool of its layout (made on first use, at most
        ``MAX_POOLS``); ValueError if the layout is bad or refused."""
        layout = KVLayout.from_json(layout_json)
        pool = self.pools.get(layout.key)
        if pool is None:
            if len(self.pools) >= MAX_POOLS:
                raise ValueError(
                    f"the sidecar holds pools of {MAX_POOLS} KV layouts already (one per model "
                    "architecture and block size): run another sidecar for more"
                )
            if layout.layers:
                num_blocks = self.budget_bytes // layout.block_bytes
            else:  # blocks of no bytes: bounded by count
                num_blocks = layout.state_only_blocks(self.budget_bytes)
            if num_blocks == 0:
                raise ValueError(
                    f"host bytes {self.budget_bytes} hold no block of this layout ({layout.block_bytes} bytes)"
                )
            num_slots = 0
            if layout.states:
                num_slots = min(MAX_SNAPSHOT_SLOTS, self.state_bytes // layout.slot_stride)
                if num_slots < MIN_SNAPSHOTS:
                    raise ValueError(
                        f"state bytes {self.state_bytes} hold {num_slots} snapshot(s) of this layout "
                        f"({layout.slot_stride} bytes each); the sidecar needs room for at least "
                        f"{MIN_SNAPSHOTS}: raise --state-bytes (or --host-bytes)"
                    )
            pool = self.pools[layout.key] = SharedPool(layout, num_blocks, num_slots)
            if self.tree_listener is not None:
                pool.tree.listener = self.tree_listener(pool)
            logger.info(
                "pool for a new layout: %d blocks of %d bytes%s",
                num_blocks,
                layout.block_bytes,
                f", {num_slots} snapshot slots of {layout.slot_stride} bytes" if num_slots else "",
            )
        self.clients[cid].pool = pool
        return pool

    def drop_client(self, cid: int) -> None:
        """Free what client ``cid`` held: unpin its leases, free its unwritten blocks."""
        client = self.clients.pop(cid, None)
        if client is None:
            return
        self.claims.drop(cid)
        for lease in client.leases.values():
            lease.pool.tree.unpin(lease.node)
            self.counters.released_pins += 1
        for txn in client.txns.values():
            self._close_txn(txn, commit=False)

    def _pool_of(self, cid: int) -> SharedPool:
        pool = self.clients[cid].pool
        if pool is None:
            raise ValueError("send hello with the model's KV layout first")
        return pool

    # -- reads ----------------------------------------------------------------------------
    def match(self, cid: int, namespace: tuple, tokens: bytes, have: int, claim_s: float = 0.0) -> dict:
        """Pin the longest cached prefix of ``tokens`` (whole blocks) when it is longer than
        ``have`` tokens (what the client holds itself); returns its lease and the slots past ``have``.

        ``claim_s`` > 0: the client is about to compute what is missing. If another client
        claimed a longer common prefix (it is computing it now), the reply's ``wait`` names how
        many tokens will come: the caller may poll for them rather than compute them again.
        Else this client's claim is recorded for ``claim_s`` seconds (or until it goes away).
        """
        pool = self._pool_of(cid)
        packed = tokens if type(tokens) is PackedTokens else PackedTokens(tokens)
        bs = pool.layout.block_size
        if type(have) is not int or have < 0 or have % bs:
            raise ValueError(f"have must be a multiple of the block size {bs}, got {have!r}")
        self.counters.matches += 1
        want = packed.num_tokens // bs * bs
        self.counters.query_tokens += max(0, want - have)
        match = pool.tree.match(packed, namespace)
        before = match.num_tokens
        if match.num_tokens < want and self.l2 is not None:
            if self._fill_from_l2(pool, namespace, packed, match, want):
                match = pool.tree.match(packed, namespace)
        wait = self._claim(cid, pool, namespace, packed, match.num_tokens, claim_s) if claim_s > 0 else 0
        # A pool with states: the usable match ends at a snapshot (``snap``: its slot); the KV
        # goes on to ``kv_tokens``, the junction where the client should take a snapshot.
        states = {"snap": match.snap, "kv_tokens": match.kv_tokens} if pool.stateful else {}
        if match.num_tokens <= have:
            miss = {"lease": 0, "num_tokens": 0, "slots": [], "wait": wait}
            return {**miss, **states, "snap": -1} if states else miss
        pool.tree.pin(match.node)
        lease = next(self._ids)
        self.clients[cid].leases[lease] = Lease(pool, match.node)
        served = match.num_tokens - have
        self.counters.hit_tokens += served
        self.counters.l2_hit_tokens += min(served, match.num_tokens - before)
        self.counters.snapshot_hits += pool.stateful
        return {
            "lease": lease,
            "num_tokens": match.num_tokens,
            "slots": list(match.block_ids[have // bs :]),
            "wait": wait,
            **states,
        }

    def _claim(self, cid, pool, namespace, tokens, cached: int, claim_s: float) -> int:
        wait = self.claims.check(cid, pool, namespace, tokens, cached, pool.layout.block_size, claim_s)
        if wait:
            self.counters.waits += 1
        return wait

    def release(self, cid: int, lease: int) -> None:
        held = self.clients[cid].leases.pop(lease, None)
        if held is not None:
            held.pool.tree.unpin(held.node)

    # -- writes ---------------------------------------------------------------------------
    def alloc(self, cid: int, namespace: tuple, tokens: bytes, snaps=()) -> dict:
        """Take blocks for the whole blocks of ``tokens`` past the cached prefix (fewer when the
        pool is pinned full); the client writes them, then commits. Returns txn, start, slots.

        ``snaps`` (a pool with states): the positions of the snapshots the client holds for
        ``tokens`` (block multiples, increasing). Each one this pool lacks, up to the blocks
        taken, gets a state slot to write (``snaps`` of the reply: a slot or -1 per position;
        the deepest first when room is short). O(tokens + path + slots taken)."""
        pool = self._pool_of(cid)
        bs = pool.layout.block_size
        packed = tokens if type(tokens) is PackedTokens else PackedTokens(tokens)
        num_blocks = packed.num_tokens // bs
        snaps = list(snaps)
        if snaps and not pool.stateful:
            raise ValueError("snaps: this layout holds no states (its hello named none)")
        for pos in snaps:
            if pos % bs or pos > num_blocks * bs:
                raise ValueError(
                    f"snaps: position {pos} is not a multiple of the block size {bs} within the "
                    f"{num_blocks * bs} whole-block tokens"
                )
        match = (
            pool.tree.match(packed, namespace, kv=True)
            if pool.stateful
            else pool.tree.match(packed, namespace)
        )
        start = match.num_tokens // bs
        need = num_blocks - start
        held = self._path_snapshots(match) if snaps else set()
        missing = [pos for pos in snaps if pos not in held]
        none = {"snaps": [-1] * len(snaps)} if pool.stateful else {}
        if need <= 0 and not missing:
            self._fulfil(cid, namespace, packed)
            return {"txn": 0, "start": start, "slots": [], **none}
        pool.tree.pin(match.node)
        take = 0
        if need > 0:
            if len(pool.free) < need or self._used_bytes() + need * pool.block_bytes > self.budget_bytes:
                self._make_room(pool, need)
            take = min(need, len(pool.free), self._room_blocks(pool))
            if take < need:
                self.counters.uncached_tokens += (need - take) * bs
        slots = pool.allocate(take)
        reach = (start + take) * bs  # a snapshot past the blocks taken has no node to go to
        chosen = [pos for pos in missing if pos <= reach]
        if chosen:
            room = self._make_state_room(pool, len(chosen))
            chosen = chosen[len(chosen) - room :] if room else []  # the deepest: the longest usable match
        self.counters.uncached_snapshots += len(missing) - len(chosen)
        if not slots and not chosen:
            pool.tree.unpin(match.node)
            return {"txn": 0, "start": start, "slots": [], **none}
        snap_slots = pool.free_slots.take(len(chosen))
        txn = next(self._ids)
        self.clients[cid].txns[txn] = Txn(
            pool, match.node, namespace, packed.head(reach), list(match.block_ids), slots,
            list(zip(chosen, snap_slots)),
        )  # fmt: skip
        reply = {"txn": txn, "start": start, "slots": slots}
        if pool.stateful:
            given = dict(zip(chosen, snap_slots))
            reply["snaps"] = [given.get(pos, -1) for pos in snaps]
        return reply

    @staticmethod
    def _path_snapshots(match) -> set[int]:
        """Positions (tokens from the root) of the snapshots on ``match``'s path. O(path)."""
        out, node, pos = set(), match.node, match.num_tokens
        while not node.is_root:
            if node.snap >= 0:
                out.add(pos)
            pos -= len(node.data) // TOKEN_BYTES
            node = node.parent
        return out

    def commit(self, cid: int, txn_id: int) -> int:
        """Make transaction ``txn_id``'s blocks (and snapshots) visible; the tokens newly cached."""
        return self.commit_reply(cid, txn_id)["inserted"]

    def commit_reply(self, cid: int, txn_id: int) -> dict:
        """``commit``'s reply: ``inserted`` tokens, and with states the ``snapshots`` attached."""
        txn = self.clients[cid].txns.pop(txn_id, None)
        if txn is None:
            raise ValueError(f"no open transaction {txn_id}")
        self._fulfil(cid, txn.namespace, txn.tokens)
        added, attached = self._close_txn(txn, commit=True)
        return {"inserted": added, "snapshots": attached} if txn.pool.stateful else {"inserted": added}

    def _fulfil(self, cid: int, namespace: tuple, tokens: PackedTokens) -> None:
        pool = self._pool_of(cid)
        self.claims.fulfil(cid, namespace, tokens, pool.layout.block_size)

    def abort(self, cid: int, txn_id: int) -> None:
        txn = self.clients[cid].txns.pop(txn_id, None)
        if txn is not None:
            self._close_txn(txn, commit=False)

    def _close_txn(self, txn: Txn, *, commit: bool) -> tuple[int, int]:
        """Unpin ``txn``'s prefix; insert its blocks and attach its snapshots (``commit``) or free
        them. Returns (tokens newly cached, snapshots attached)."""
        pool, tree = txn.pool, txn.pool.tree
        tree.unpin(txn.node)
        if not commit:
            pool.release(txn.slots)
            pool.free_slots.put([slot for _, slot in txn.snaps])
            self.counters.aborted_blocks += len(txn.slots)
            self.counters.aborted_snapshots += len(txn.snaps)
            return 0, 0
        already = tree.insert(txn.tokens, txn.prefix_ids + txn.slots, txn.namespace)
        bs = pool.layout.block_size
        start = len(txn.prefix_ids)
        duplicates = max(0, already // bs - start)  # another client committed them first
        if duplicates:
            pool.release(txn.slots[:duplicates])
        added = txn.tokens.num_tokens - max(already, start * bs)
        self.counters.inserted_tokens += added
        attached = []
        for pos, slot in txn.snaps:
            node = tree.node_at(txn.tokens.head(pos), txn.namespace)
            if node is not None and node.snap < 0:
                tree.set_snapshot(node, slot)
                attached.append((pos, slot))
            else:  # another client attached one first
                pool.free_slots.put([slot])
        self.counters.inserted_snapshots += len(attached)
        if self.l2_writer is not None and (added > 0 or attached):
            from radixkv.l2.block_keys import snapshot_key

            keys = self._l2_keys(pool, txn.namespace, txn.tokens)
            first = txn.tokens.num_tokens // bs - added // bs
            items = [
                (k, pool.geometry.read_block(pool.buf, s))
                for k, s in zip(keys[first:], (txn.prefix_ids + txn.slots)[first:])
            ]
            items += [
                (snapshot_key(keys[pos // bs - 1]), pool.geometry.read_snapshot(pool.buf, slot))
                for pos, slot in attached
            ]
            self.l2_writer(items)
        return added, len(attached)

    # -- room -----------------------------------------------------------------------------
    def _used_bytes(self) -> int:
        return sum(p.used_bytes for p in self.pools.values())

    def _used_state_bytes(self) -> int:
        return sum(p.num_used_slots * p.slot_bytes for p in self.pools.values())

    def _room_blocks(self, pool: SharedPool) -> int:
        if not pool.block_bytes:  # blocks of no bytes: only their count bounds them
            return pool.num_blocks
        return max(0, (self.budget_bytes - self._used_bytes()) // pool.block_bytes)

    def _make_room(self, pool: SharedPool, need: int) -> None:
        """Evict LRU unpinned blocks: ``pool``'s own first, then other layouts' pools (a pool of
        zero-byte blocks only its own: others' bytes give it no blocks, its blocks no bytes)."""
        short = need - min(len(pool.free), self._room_blocks(pool))
        others = (
            [p for p in self.pools.values() if p is not pool and p.block_bytes] if pool.block_bytes else []
        )
        for other in [pool, *others]:
            if short <= 0:
                return
            per = other.block_bytes
            want = short if other is pool else -(-short * pool.block_bytes // per)
            freed = other.tree.evict(want)
            other.release(freed)
            self.counters.evicted_blocks += len(freed)
            short = need - min(len(pool.free), self._room_blocks(pool))

    def _state_room(self, pool: SharedPool) -> int:
        """Snapshots of ``pool`` that can be taken now: free slots within both budgets."""
        per = pool.slot_bytes
        return max(
            0,
            min(
                len(pool.free_slots),
                (self.state_bytes - self._used_state_bytes()) // per,
                (self.budget_bytes - self._used_bytes()) // per,
            ),
        )

    def _make_state_room(self, pool: SharedPool, n: int) -> int:
        """Room for ``n`` snapshots of ``pool``; returns how many fit now (at most ``n``).

        First within the snapshots' share: the least recently used unpinned snapshots, this
        pool's first, then other pools' (their nodes and KV stay). Then, when blocks use the
        room that share leaves unused (the whole budget full), the least recently used blocks,
        this pool's first. Snapshot pressure never evicts KV beyond that share."""
        per = pool.slot_bytes
        others = [p for p in self.pools.values() if p is not pool and p.slot_bytes]
        for other in [pool, *others]:
            over = self._used_state_bytes() + n * per - self.state_bytes
            short = -(-over // other.slot_bytes) if over > 0 else 0
            if other is pool:
                short = max(short, n - len(pool.free_slots))
            if short <= 0:
                continue
            slots = other.tree.evict_snapshots(short)
            other.free_slots.put(slots)
            self.counters.evicted_snapshots += len(slots)
        for other in [p for p in (pool, *(q for q in self.pools.values() if q is not pool)) if p.block_bytes]:
            over = self._used_bytes() + n * per - self.budget_bytes
            if over <= 0:
                break
            freed = other.tree.evict(-(-over // other.block_bytes))  # their snapshots go too
            other.release(freed)
            self.counters.evicted_blocks += len(freed)
        return min(n, self._state_room(pool))

    # -- L2 -------------------------------------------------------------------------------
    def _l2_keys(self, pool: SharedPool, namespace: tuple, tokens: PackedTokens) -> list[bytes]:
        from radixkv.l2 import block_keys  # only with --l2: the sidecar runs without that package

        ident, ns = namespace
        ids = memoryview(tokens).cast("q").tolist()
        return block_keys(ident, ns, ids, pool.layout.block_size)

    def _l2_runs(self, pool: SharedPool, namespace: tuple, tokens: PackedTokens, first: int):
        """The L2 keys of the whole blocks of ``tokens`` from block ``first`` on, in runs of
        ``L2_FIRST_RUN`` blocks, then twice as many each time, at most the pool's blocks in all:
        the chain is hashed as far as each run reaches, never over a whole long prompt at once."""
        from radixkv.l2 import block_keys  # only with --l2: the sidecar runs without that package

        ident, ns = namespace
        bs = pool.layout.block_size
        ids = memoryview(tokens).cast("q")
        end = min(tokens.num_tokens // bs, first + pool.num_blocks)
        parent = block_keys(ident, ns, ids[: first * bs], bs)[-1] if first else None
        run = L2_FIRST_RUN
        while first < end:
            keys = block_keys(ident, ns, ids[first * bs : min(end, first + run) * bs], bs, parent=parent)
            yield keys
            first, parent, run = first + len(keys), keys[-1], run * 2

    def _fill_from_l2(
        self, pool: SharedPool, namespace: tuple, tokens: PackedTokens, match, want: int
    ) -> bool:
        """Extend ``match`` (shorter than ``want`` tokens) from the L2 tier: the blocks after the
        KV match, then (a pool with states) the deepest snapshot past the usable match. Whether
        anything was added (never raises for the L2's faults)."""
        kv = pool.tree.match(tokens, namespace, kv=True) if pool.stateful else match
        added = self._fill_blocks_from_l2(pool, namespace, tokens, kv) if kv.num_tokens < want else 0
        if pool.stateful:
            added += self._fill_snapshot_from_l2(pool, namespace, tokens, match.num_tokens, want)
        return added > 0

    def _fill_blocks_from_l2(self, pool: SharedPool, namespace: tuple, tokens: PackedTokens, match) -> int:
        """Read the blocks after ``match`` from the L2 tier into free blocks and insert them;
        returns blocks added (0 on a miss, a refusal or an L2 down: never raises for those).

        Only the leading run of hits is used, so the L2 is read in runs that double
        (``_l2_runs``) until one holds a miss: a long prompt the L2 does not hold costs one
        read of ``L2_FIRST_RUN`` keys (an 8 M-token look-up used to hash and ask for all of its
        blocks, holding the loop for seconds), and no read asks for more blocks than the pool has."""
        bs = pool.layout.block_size
        have = match.num_tokens // bs
        got = []
        for keys in self._l2_runs(pool, namespace, tokens, have):
            try:
                payloads = self.l2.get_many(keys)
            except Exception as e:  # the contract says it never raises; a bug there costs only speed
                logger.warning("L2 read failed: %s", e)
                break
            hits = 0
            for payload in payloads:
                if payload is None or len(payload) != pool.layout.block_bytes:
                    break
                hits += 1
            got += payloads[:hits]
            if hits < len(keys):
                break
        if not got:
            return 0
        pool.tree.pin(match.node)
        try:
            if len(pool.free) < len(got) or self._room_blocks(pool) < len(got):
                self._make_room(pool, len(got))
            n = min(len(got), len(pool.free), self._room_blocks(pool))
            if n == 0:
                return 0
            slots = pool.allocate(n)
            for slot, payload in zip(slots, got):
                pool.geometry.write_block(pool.buf, slot, payload)
        finally:
            pool.tree.unpin(match.node)
        already = pool.tree.insert(tokens.head((have + n) * bs), list(match.block_ids) + slots, namespace)
        duplicates = max(0, already // bs - have)
        if duplicates:
            pool.release(slots[:duplicates])
        return n - duplicates

    def _fill_snapshot_from_l2(
        self, pool: SharedPool, namespace: tuple, tokens: PackedTokens, usable: int, want: int
    ) -> int:
        """Read the deepest snapshot the L2 tier holds for ``tokens`` past the ``usable`` tokens
        and within the KV this pool holds for them (up to ``want``), and attach it; returns 1, or
        0 on a miss, a refusal, no room or an L2 down (never raises for those).

        Asks for snapshot keys deepest first, ``L2_FIRST_RUN`` a read, at most
        ``L2_SNAPSHOT_PROBES`` positions: a snapshot has its value only where one was taken (an
        interval, a junction, a prompt's end), so a run may hold a few, and only the deepest of
        the first run holding any is read into memory."""
        from radixkv.l2 import block_keys
        from radixkv.l2.block_keys import snapshot_key

        bs = pool.layout.block_size
        kv_end = min(pool.tree.cached_prefix(tokens.head(want), namespace)[0], want)
        positions = list(range(kv_end, usable, -bs))[:L2_SNAPSHOT_PROBES]
        if not positions:
            return 0
        ident, ns = namespace
        keys = block_keys(ident, ns, memoryview(tokens).cast("q")[:kv_end], bs)
        for at in range(0, len(positions), L2_FIRST_RUN):
            run = positions[at : at + L2_FIRST_RUN]
            try:
                payloads = self.l2.get_many([snapshot_key(keys[pos // bs - 1]) for pos in run])
            except Exception as e:  # the contract says it never raises; a bug there costs only speed
                logger.warning("L2 read failed: %s", e)
                return 0
            for pos, payload in zip(run, payloads):
                if payload is not None and len(payload) == pool.layout.snapshot_bytes:
                    return self._attach_l2_snapshot(pool, namespace, tokens.head(pos), payload)
        return 0

    def _attach_l2_snapshot(self, pool: SharedPool, namespace: tuple, head: PackedTokens, payload) -> int:
        """Write ``payload`` into a free state slot and attach it to the node ending after
        ``head`` (split there if need be); 1 if attached, 0 when the node holds one already or
        there is no room."""
        node = pool.tree.node_at(head, namespace)
        if node is None or node.snap >= 0:
            return 0
        pool.tree.pin(node)  # making room may evict blocks: never these
        try:
            if self._make_state_room(pool, 1) == 0:
                return 0
            (slot,) = pool.free_slots.take(1)
            pool.geometry.write_snapshot(pool.buf, slot, payload)
            pool.tree.set_snapshot(node, slot)
        finally:
            pool.tree.unpin(node)
        self.counters.l2_snapshot_hits += 1
        return 1

    # -- observation ----------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters and occupancy (call under ``lock``)."""
        out = dataclasses.asdict(self.counters)
        out.update(
            clients=len(self.clients),
            pools=len(self.pools),
            budget_bytes=self.budget_bytes,
            used_bytes=self._used_bytes(),
            state_budget_bytes=self.state_bytes,
            used_state_bytes=self._used_state_bytes(),
            cached_snapshots=sum(p.tree.num_snapshots for p in self.pools.values()),
            private_snapshots=sum(len(t.snaps) for c in self.clients.values() for t in c.txns.values()),
            cached_blocks=sum(p.tree.num_cached_blocks for p in self.pools.values()),
            pinned_blocks=sum(p.tree.num_pinned_blocks for p in self.pools.values()),
            open_leases=sum(len(c.leases) for c in self.clients.values()),
            open_txns=sum(len(c.txns) for c in self.clients.values()),
            claims=len(self.claims),
            private_blocks=sum(len(t.slots) for c in self.clients.values() for t in c.txns.values()),
        )
        if self.l2 is not None:
            out.update({f"l2_{k}": v for k, v in self.l2.stats().items()})
        return out

    def check_invariants(self) -> None:
        """Every pool's blocks (and snapshot slots) are free, in its tree or private to one
        transaction, once each; the budgets hold."""
        txns = [t for c in self.clients.values() for t in c.txns.values()]
        for pool in self.pools.values():
            pool.tree.check_invariants()
            owned = [i for n in pool.tree.iter_nodes() for i in n.block_ids]
            owned += [i for t in txns if t.pool is pool for i in t.slots]
            every = owned + list(pool.free)
            if sorted(every) != list(range(pool.num_blocks)):
                raise AssertionError("a sidecar block is lost or owned twice")
            slots = snapshot_slots(pool.tree._roots)[0] + [
                s for t in txns if t.pool is pool for _, s in t.snaps
            ]
            if sorted(slots + list(pool.free_slots)) != list(range(pool.num_slots)):
                raise AssertionError("a sidecar snapshot slot is lost or owned twice")
        if self._used_state_bytes() > self.state_bytes or self._used_bytes() > self.budget_bytes:
            raise AssertionError("the sidecar's blocks and snapshots in use exceed their budget")
