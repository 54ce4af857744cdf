"""Tree changes -> vLLM KV events, with block hashes stable across processes and restarts.

A block's hash is the low 64 bits of its L2 key (``radixkv.l2.block_keys``: BLAKE3 chained
over the model identity, the namespace key, the block size and every token up to the block's
end), so the same prefix under the same key gives the same hash on every replica, in every
process, and in the sidecar's shared tier; never Python's ``hash()``. ``namer(namespace) ->
(identity, namespace key) | None`` maps a tree's namespaces to those bytes (hf_patch's
``sidecar_namer`` for a store, the identity for the sidecar, whose roots are those pairs);
a namespace it names None stays private: none of its blocks is published.

``TreeRecorder`` is a ``radixkv.tree.TreeListener``; it appends events to an ``EventLog``,
which a publisher drains (``radixkv.events.publisher``). Cost under the tree's lock: one
BLAKE3 call per new or removed block plus one struct per node (measured with evictions
included: ~8 µs a block, ~0.55 ms on a commit of 64 new blocks, docs/kv-events.md); the chain
key at each node's end is memoised by node uid, so a commit hashes only its new blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence

from radixkv.events.wire import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from radixkv.l2.block_keys import block_keys
from radixkv.tree import RadixTree
from radixkv.tree.node import Node, root_of

Namer = Callable[[Hashable], "tuple[bytes, bytes] | None"]


def external_hash(key: bytes) -> int:
    """vLLM's int form of a block hash: the key's last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(key[-8:], "big")


class EventLog:
    """Events in the order the trees changed, until a publisher takes them. Thread safe.

    ``wake`` is set when the log goes from empty to not empty.
    """

    def __init__(self) -> None:
        self._events: list = []
        self._lock = threading.Lock()
        self.wake = threading.Event()
        self.num_appended = 0  # events ever appended

    def append(self, event) -> None:
        with self._lock:
            self._events.append(event)
            self.num_appended += 1
            if len(self._events) == 1:
                self.wake.set()

    def take(self) -> list:
        """Every event appended since the last take, oldest first."""
        with self._lock:
            events, self._events = self._events, []
            self.wake.clear()
            return events


class TreeRecorder:
    """The ``TreeListener`` of one tree: BlockStored / BlockRemoved for each node, by tier.

    ``media[tier]``: the medium named for blocks of that tier (default GPU for the device
    pool, CPU for the host tier). ``lora_name(namespace)``: the adapter name a namespace's
    blocks carry (None: none).
    """

    def __init__(
        self,
        log: EventLog,
        block_size: int,
        namer: Namer,
        *,
        media: Sequence[str] = (MEDIUM_GPU, MEDIUM_CPU),
        lora_name: Callable[[Hashable], str | None] | None = None,
    ) -> None:
        self.log = log
        self.block_size = block_size
        self.media = tuple(media)
        self._namer = namer
        self._lora_name = lora_name or (lambda _ns: None)
        self._names: dict[Hashable, tuple[tuple[bytes, bytes] | None, str | None]] = {}
        self._end_keys: dict[int, bytes] = {}  # node uid -> key of its last block

    # -- TreeListener ----------------------------------------------------------------------
    def stored(self, node: Node) -> None:
        keys = self._keys(node)
        if keys is not None:
            self._stored(node, *keys)

    def removed(self, node: Node) -> None:
        keys = self._keys(node)
        self._end_keys.pop(node.uid, None)
        if keys is not None:
            self.log.append(BlockRemoved([external_hash(k) for k in keys[1]], self.media[node.tier]))

    def moved(self, node: Node, from_tier: int) -> None:
        keys = self._keys(node)
        if keys is not None:
            self.log.append(BlockRemoved([external_hash(k) for k in keys[1]], self.media[from_tier]))
            self._stored(node, *keys)

    # -- the store's --------------------------------------------------------------------------
    def cleared(self) -> None:
        """The tree was replaced by an empty one (a flush): AllBlocksCleared."""
        self._end_keys.clear()
        self._names.clear()
        self.log.append(AllBlocksCleared())

    def announce(self, tree: RadixTree) -> None:
        """BlockStored for every node ``tree`` holds now, parents first (a listener attached
        to a store that holds KV already, e.g. restored from a file). O(N + blocks)."""
        for node in tree.iter_nodes():
            self.stored(node)

    # -- internals ------------------------------------------------------------------------
    def _stored(self, node: Node, parent: bytes | None, keys: list[bytes], lora: str | None) -> None:
        self.log.append(
            BlockStored(
                [external_hash(k) for k in keys],
                None if parent is None else external_hash(parent),
                node.tokens,
                self.block_size,
                None,
                self.media[node.tier],
                lora,
            )
        )

    def _keys(self, node: Node) -> tuple[bytes | None, list[bytes], str | None] | None:
        """(key before ``node``'s first block, keys of its blocks, lora name), or None for a
        private namespace. Hashes the path up from the nearest node whose end key is known."""
        path = [node]
        while not path[-1].parent.is_root and path[-1].parent.uid not in self._end_keys:
            path.append(path[-1].parent)
        top = path[-1].parent
        namespace = root_of(top).key
        names = self._names.get(namespace)
        if names is None:
            names = self._names[namespace] = (self._namer(namespace), self._lora_name(namespace))
        if names[0] is None:
            return None
        identity, ns_key = names[0]
        parent = None if top.is_root else self._end_keys[top.uid]
        keys: list[bytes] = []
        for part in reversed(path):
            before = parent
            keys = block_keys(
                identity, ns_key, memoryview(part.data).cast("q"), self.block_size, parent=parent
            )
            self._end_keys[part.uid] = parent = keys[-1]
        return before, keys, names[1]


def sidecar_listener(log: EventLog) -> Callable:
    """``tree_listener(pool)`` for ``radixkv.sidecar.state.Sidecar``: a recorder per pool's tree,
    whose roots are ``(identity digest, namespace key)`` already (the pairs ``namer`` gives a
    store), medium CPU (the sidecar's memory is host memory)."""

    def listener(pool) -> TreeRecorder:
        return TreeRecorder(log, pool.layout.block_size, lambda namespace: namespace, media=(MEDIUM_CPU,))

    return listener
