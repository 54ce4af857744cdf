"""The sidecar's state: shared pools, a radix tree per pool, and what each client holds.

No sockets here (``radixkv.sidecar.server`` feeds it): every method runs on the server's one
loop thread, or under ``Sidecar.lock`` (the metrics thread reads ``stats``).

- One ``SharedPool`` per KV layout: a memory file (memfd, sparse: pages are committed when first
  written) sized for the whole budget, its free list, and a ``RadixTree`` whose roots are
  ``(model identity digest, namespace)``: two models never share a node, nor do two namespaces.
- ``budget_bytes`` bounds the bytes of blocks in use over all pools; a pool short of room evicts
  its own least recently used unpinned blocks first, then other pools'.
- A client's ``match`` pins what it will read (a lease); ``alloc`` pins the prefix it extends and
  takes free blocks private to it (a transaction) that no tree holds until ``commit``: nobody
  can read a block before the client wrote it whole. When the client's socket closes
  (``drop_client``: it exited, crashed or was killed) its leases are unpinned and the blocks of
  its open transactions freed.
- Claims (prefixes in flight): a match may claim what it misses for a few seconds; another
  client that then misses a common prefix is told to wait for it (it polls). A client holding
  claims is never told to wait; claims go with their client, expire, or are fulfilled by its
  commit (``radixkv.sidecar.claims``).
- An optional L2 tier (``radixkv.l2``): a match shorter than the prompt asks it for the next
  blocks (chained keys over identity, namespace and tokens) and inserts what it returns;
  committed blocks are handed to ``l2_writer`` (bounded, in the background).
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
from radixkv.tree import RadixTree
from radixkv.tree.node import Node, PackedTokens

logger = logging.getLogger(__name__)

MAX_POOLS = 64  # KV layouts at once (each a memory file and its tree); pools are never dropped
L2_FIRST_RUN = 16  # blocks a match asks the L2 for first; each further run twice the last


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
    """One KV layout's blocks in one memory file, and the tree over them."""

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        self.geometry = PoolGeometry(layout, num_blocks)
        self.layout = layout
        self.num_blocks = num_blocks
        self.fd = os.memfd_create("radixkv-sidecar-pool", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.geometry.total_bytes)
        self.buf = mmap.mmap(self.fd, self.geometry.total_bytes)
        self.tree = RadixTree(layout.block_size, check_block_ids=False)
        self.free = FreeBlocks(num_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

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


@dataclasses.dataclass
class Client:
    pool: SharedPool | None = None
    leases: dict[int, Lease] = dataclasses.field(default_factory=dict)
    txns: dict[int, Txn] = dataclasses.field(default_factory=dict)


class Sidecar:
    """Pools, trees and clients of one sidecar process (see the module docstring)."""

    def __init__(self, budget_bytes: int, l2=None, l2_writer: Callable | None = None) -> None:
        if type(budget_bytes) is not int or budget_bytes <= 0:
            raise ValueError(f"host bytes must be a positive int, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.pools: dict[str, SharedPool] = {}
        self.clients: dict[int, Client] = {}
        self.counters = Counters()
        self.lock = threading.Lock()
        self.l2 = l2
        self.l2_writer = l2_writer  # l2_writer(list of (key, payload)): queue blocks for the L2
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
            num_blocks = self.budget_bytes // layout.block_bytes
            if num_blocks == 0:
                raise ValueError(
                    f"host bytes {self.budget_bytes} hold no block of this layout ({layout.block_bytes} bytes)"
                )
            pool = self.pools[layout.key] = SharedPool(layout, num_blocks)
            logger.info("pool for a new layout: %d blocks of %d bytes", num_blocks, layout.block_bytes)
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
        l2_blocks = 0
        if match.num_tokens < want and self.l2 is not None:
            l2_blocks = self._fill_from_l2(pool, namespace, packed, match)
            if l2_blocks:
                match = pool.tree.match(packed, namespace)
        wait = self._claim(cid, pool, namespace, packed, match.num_tokens, claim_s) if claim_s > 0 else 0
        if match.num_tokens <= have:
            return {"lease": 0, "num_tokens": 0, "slots": [], "wait": wait}
        pool.tree.pin(match.node)
        lease = next(self._ids)
        self.clients[cid].leases[lease] = Lease(pool, match.node)
        served = match.num_tokens - have
        self.counters.hit_tokens += served
        self.counters.l2_hit_tokens += min(served, l2_blocks * bs)
        return {
            "lease": lease,
            "num_tokens": match.num_tokens,
            "slots": list(match.block_ids[have // bs :]),
            "wait": wait,
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
    def alloc(self, cid: int, namespace: tuple, tokens: bytes) -> dict:
        """Take blocks for the whole blocks of ``tokens`` past the cached prefix (fewer when the
        pool is pinned full); the client writes them, then commits. Returns txn, start, slots."""
        pool = self._pool_of(cid)
        bs = pool.layout.block_size
        packed = tokens if type(tokens) is PackedTokens else PackedTokens(tokens)
        num_blocks = packed.num_tokens // bs
        match = pool.tree.match(packed, namespace)
        start = match.num_tokens // bs
        need = num_blocks - start
        if need <= 0:
            self._fulfil(cid, namespace, packed)
            return {"txn": 0, "start": start, "slots": []}
        pool.tree.pin(match.node)
        if len(pool.free) < need or self._used_bytes() + need * pool.layout.block_bytes > self.budget_bytes:
            self._make_room(pool, need)
        take = min(need, len(pool.free), self._room_blocks(pool))
        if take < need:
            self.counters.uncached_tokens += (need - take) * bs
        if take == 0:
            pool.tree.unpin(match.node)
            return {"txn": 0, "start": start, "slots": []}
        slots = pool.allocate(take)
        txn = next(self._ids)
        self.clients[cid].txns[txn] = Txn(
            pool, match.node, namespace, packed.head((start + take) * bs), list(match.block_ids), slots
        )
        return {"txn": txn, "start": start, "slots": slots}

    def commit(self, cid: int, txn_id: int) -> int:
        txn = self.clients[cid].txns.pop(txn_id, None)
        if txn is None:
            raise ValueError(f"no open transaction {txn_id}")
        self._fulfil(cid, txn.namespace, txn.tokens)
        return self._close_txn(txn, commit=True)

    def _fulfil(self, cid: int, namespace: tuple, tokens: PackedTokens) -> None:
        pool = self._pool_of(cid)
        self.claims.fulfil(cid, namespace, tokens, pool.layout.block_size)

    def abort(self, cid: int, txn_id: int) -> None:
        txn = self.clients[cid].txns.pop(txn_id, None)
        if txn is not None:
            self._close_txn(txn, commit=False)

    def _close_txn(self, txn: Txn, *, commit: bool) -> int:
        pool, tree = txn.pool, txn.pool.tree
        tree.unpin(txn.node)
        if not commit:
            pool.release(txn.slots)
            self.counters.aborted_blocks += len(txn.slots)
            return 0
        already = tree.insert(txn.tokens, txn.prefix_ids + txn.slots, txn.namespace)
        bs = pool.layout.block_size
        start = len(txn.prefix_ids)
        duplicates = max(0, already // bs - start)  # another client committed them first
        if duplicates:
            pool.release(txn.slots[:duplicates])
        added = txn.tokens.num_tokens - max(already, start * bs)
        self.counters.inserted_tokens += added
        if self.l2_writer is not None and added > 0:
            first = txn.tokens.num_tokens // bs - added // bs
            keys = self._l2_keys(pool, txn.namespace, txn.tokens)[first:]
            slots = (txn.prefix_ids + txn.slots)[first:]
            self.l2_writer([(k, pool.geometry.read_block(pool.buf, s)) for k, s in zip(keys, slots)])
        return added

    # -- room -----------------------------------------------------------------------------
    def _used_bytes(self) -> int:
        return sum(p.num_used * p.layout.block_bytes for p in self.pools.values())

    def _room_blocks(self, pool: SharedPool) -> int:
        return max(0, (self.budget_bytes - self._used_bytes()) // pool.layout.block_bytes)

    def _make_room(self, pool: SharedPool, need: int) -> None:
        """Evict LRU unpinned blocks: ``pool``'s own first, then other layouts' pools."""
        short = need - min(len(pool.free), self._room_blocks(pool))
        for other in [pool, *(p for p in self.pools.values() if p is not pool)]:
            if short <= 0:
                return
            per = other.layout.block_bytes
            want = short if other is pool else -(-short * pool.layout.block_bytes // per)
            freed = other.tree.evict(want)
            other.release(freed)
            self.counters.evicted_blocks += len(freed)
            short = need - min(len(pool.free), self._room_blocks(pool))

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

    def _fill_from_l2(self, pool: SharedPool, namespace: tuple, tokens: PackedTokens, match) -> int:
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

    # -- observation ----------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters and occupancy (call under ``lock``)."""
        out = dataclasses.asdict(self.counters)
        out.update(
            clients=len(self.clients),
            pools=len(self.pools),
            budget_bytes=self.budget_bytes,
            used_bytes=self._used_bytes(),
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
        """Every pool's blocks are free, in its tree or private to one transaction, once each."""
        for pool in self.pools.values():
            pool.tree.check_invariants()
            owned = [i for n in pool.tree.iter_nodes() for i in n.block_ids]
            owned += [
                i for c in self.clients.values() for t in c.txns.values() if t.pool is pool for i in t.slots
            ]
            every = owned + list(pool.free)
            if sorted(every) != list(range(pool.num_blocks)):
                raise AssertionError("a sidecar block is lost or owned twice")
