"""Radix-tree node, match record, token packing and edge walk of :mod:`radixkv.tree` (pure Python).

Edges store their tokens packed as native-order int64 bytes, not as lists of ints: a slice
comparison is then one ``memcmp`` instead of a pointer chase per token through int objects
scattered over the heap (a fresh query shares no int objects with the tree), and a cached
token costs 8 bytes instead of ~40. Packing a list costs ~6-10 ns per token (one copy for
an int64 buffer, see ``pack_tokens``). Positions inside
this module are byte offsets (``TOKEN_BYTES`` per token); the tree converts.

A node's edge is a run of whole blocks: ``len(data) == len(block_ids) * block_size * 8``.
The tree owns every block id it references.
"""

from __future__ import annotations

import struct
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

TOKEN_BYTES = 8

# Where a node's blocks live (``Node.tier``). Along any root-to-leaf path tiers never go back
# up: device nodes form the top of the tree, host nodes hang below them.
DEVICE = 0
HOST = 1


def check_block_size(block_size: object) -> None:
    """Raise ValueError unless ``block_size`` is a power-of-two int (not a bool). Tree and pool share it."""
    if type(block_size) is not int or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two (1, 2, 4, 8, 16, ...), got {block_size!r}")


def check_not_array(seq: object, name: str) -> None:
    """Raise ValueError when ``seq`` is a torch tensor or numpy array rather than a sequence.

    A ``[1, n]`` tensor has ``len()`` 1 and would silently match nothing; a 1-D one would be
    unpacked element by element into 0-d tensors (slow, and float ones fail obscurely).
    """
    if hasattr(seq, "ndim"):
        raise ValueError(
            f"{name} must be a sequence of ints (ids.tolist()) or packed (radixkv.pack_tokens("
            f"ids.numpy()) for a 1-D int64 array), got {type(seq).__name__} "
            f"of shape {tuple(getattr(seq, 'shape', ()))}"
        )


class PackedTokens(bytes):
    """Token ids packed once (``pack_tokens``), accepted wherever a token sequence is.

    Converting Python ints is most of what a match or insert of a list costs (~10 ns per
    token); packing a 1-D int64 array (``tensor.numpy()``) is a memcpy. ``len()`` is in bytes:
    use ``num_tokens``.
    """

    __slots__ = ()

    @property
    def num_tokens(self) -> int:
        return len(self) // TOKEN_BYTES

    def head(self, num_tokens: int) -> PackedTokens:
        """The first ``num_tokens`` tokens (all of them when there are fewer)."""
        return (
            self if num_tokens >= self.num_tokens else PackedTokens(self[: max(0, num_tokens) * TOKEN_BYTES])
        )


Tokens = Sequence[int] | PackedTokens  # what match / insert / acquire / commit take


def pack_tokens(tokens: object) -> PackedTokens:
    """``tokens`` packed for repeated use: PackedTokens as they are, a 1-D int64 buffer (a numpy
    array, ``torch_tensor.numpy()``, ``array('q')``) by one copy, a sequence of ints converted.

    Raises ValueError for a buffer of another shape or dtype, or as ``pack`` does.
    """
    if type(tokens) is PackedTokens:
        return tokens
    if isinstance(tokens, (list, tuple)):
        return PackedTokens(pack(tokens, len(tokens)))
    try:
        view = memoryview(tokens)  # type: ignore[arg-type]
    except TypeError:  # a sequence without the buffer protocol (or a torch tensor: refused)
        return PackedTokens(pack(tokens, len(tokens)))  # type: ignore[arg-type]
    if view.ndim != 1 or view.itemsize != TOKEN_BYTES or view.format.lstrip("@=") not in ("q", "l"):
        raise ValueError(
            f"a token buffer must be 1-D native int64, got format {view.format!r}, shape {view.shape}"
        )
    return PackedTokens(view.tobytes())


def num_tokens_of(tokens: Tokens) -> int:
    return tokens.num_tokens if type(tokens) is PackedTokens else len(tokens)


def head_of(tokens: Tokens, num_tokens: int) -> Tokens:
    """The first ``num_tokens`` tokens of a sequence or of PackedTokens."""
    return tokens.head(num_tokens) if type(tokens) is PackedTokens else tokens[: max(0, num_tokens)]


def pack(tokens: Tokens, num_tokens: int) -> bytes:
    """The first ``num_tokens`` token ids as native-order int64 bytes. O(num_tokens), in C.

    PackedTokens are sliced, not converted. Raises ValueError when ``tokens`` is an array (a
    torch tensor or numpy array: pass ``.tolist()``) or an id is not an int in ``[-2**63, 2**63)``.
    """
    if type(tokens) is PackedTokens:
        return tokens.head(num_tokens)
    check_not_array(tokens, "tokens")
    try:
        if type(tokens) is list and len(tokens) - num_tokens < 64:
            # Packing the few trailing tokens too is cheaper than copying the list to slice it.
            return struct.pack(f"={len(tokens)}q", *tokens)[: num_tokens * TOKEN_BYTES]
        return struct.pack(f"={num_tokens}q", *tokens[:num_tokens])
    except (struct.error, TypeError) as exc:
        raise ValueError(
            f"token ids must be ints in [-2**63, 2**63), in a sliceable sequence: {exc}"
        ) from exc


def check_block_ids(block_ids: Sequence[int], owned: set[int]) -> list[int]:
    """``block_ids`` as a list of distinct plain ints >= 0 not in ``owned``. O(len), in C.

    Raises ValueError otherwise: a repeated, owned, negative or non-int id would put two
    blocks of KV in one slot or hand a caller an id the pool never had.
    """
    check_not_array(block_ids, "block_ids")
    try:
        ids = list(struct.unpack(f"<{len(block_ids)}Q", struct.pack(f"<{len(block_ids)}Q", *block_ids)))
    except (struct.error, TypeError) as exc:
        raise ValueError(f"block ids must be ints >= 0: {exc}") from exc
    if len(set(ids)) != len(ids):
        raise ValueError(f"block ids must be distinct, got {ids}")
    if not owned.isdisjoint(ids):
        raise ValueError(f"block ids {sorted(owned.intersection(ids))} are already in the tree")
    return ids


def unpack(data: bytes) -> list[int]:
    """Inverse of ``pack``. O(len(data))."""
    return list(struct.unpack(f"={len(data) // TOKEN_BYTES}q", data))


class TreeInvariantError(AssertionError):
    """Raised by ``RadixTree.check_invariants()`` when a recount disagrees with the tree."""


class Node:
    """One edge of the radix tree (or a namespace root, whose edge is empty).

    Attributes:
        data: the edge's ``len(block_ids) * block_size`` token ids, packed (see ``pack``);
            ``tokens`` decodes them.
        block_ids: the KV block ids storing the edge, one per block, in order.
        children: a child's first block, packed -> child.
        parent: the parent node; None for a namespace root and for a detached node.
        key: this node's key in ``parent.children``; for a root, its namespace.
        pin_count: pins held on this node or any descendant (SGLang's ``lock_ref``);
            a node with ``pin_count > 0`` is never evicted.
        own_pins: pins held on this node itself (what ``unpin`` may release).
        last_access: tree clock value of the last match/insert that used this node.
        uid: creation number; breaks ties between equal ``last_access`` values.
        evict_entry: this node's ``(last_access, uid, node)`` entry in the tree's evictable
            set, or None when it is not there (pinned, inner, root or detached).
        is_root: True for a namespace root (never evicted, never counted in ``num_nodes``).
        attached: False once the node has been evicted, cleared or dropped.
        tier: ``DEVICE`` or ``HOST``: the pool ``block_ids`` index. Never lower than the
            parent's tier.
        dev_children: children with ``tier == DEVICE``; a device node without any is a
            demotion candidate (its host children stay where they are).
        snap: the slot (in the state pool of the node's tier) of the recurrent-state snapshot
            taken after the edge's last token, or -1 (stateful trees only; see
            ``RadixTree(stateful=True)``). A split leaves it on the deeper part.
        snap_entry: this node's entry in the tree's snapshot LRU order (unpinned nodes with a
            snapshot), or None.
    """

    __slots__ = (
        "data",
        "block_ids",
        "children",
        "parent",
        "key",
        "pin_count",
        "own_pins",
        "last_access",
        "uid",
        "evict_entry",
        "is_root",
        "attached",
        "tier",
        "dev_children",
        "snap",
        "snap_entry",
    )

    def __init__(
        self,
        data: bytes,
        block_ids: list[int],
        parent: Node | None,
        key: Hashable,
        uid: int,
        last_access: int,
        pin_count: int = 0,
        is_root: bool = False,
        tier: int = DEVICE,
    ) -> None:
        self.data = data
        self.block_ids = block_ids
        self.children: dict[Hashable, Node] = {}
        self.parent = parent
        self.key = key
        self.pin_count = pin_count
        self.own_pins = 0
        self.last_access = last_access
        self.uid = uid
        self.evict_entry: tuple[int, int, Node] | None = None
        self.is_root = is_root
        self.attached = True
        self.tier = tier
        self.dev_children = 0
        self.snap = -1
        self.snap_entry: tuple[int, int, Node] | None = None

    @property
    def tokens(self) -> list[int]:
        """The edge's token ids (decoded on each access: O(edge length))."""
        return unpack(self.data)

    @property
    def num_tokens(self) -> int:
        """Tokens on this edge. O(1)."""
        return len(self.data) // TOKEN_BYTES

    def __repr__(self) -> str:
        kind = "root" if self.is_root else "node"
        return (
            f"<{kind} uid={self.uid} blocks={len(self.block_ids)} children={len(self.children)} "
            f"pins={self.own_pins}/{self.pin_count} last_access={self.last_access}"
            f"{' host' if self.tier else ''}{f' snap={self.snap}' if self.snap >= 0 else ''}>"
        )


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Longest cached whole-block prefix of a query.

    Attributes:
        num_tokens: matched tokens, a multiple of ``block_size`` (0 on a miss). In a stateful
            tree: the usable prefix, which ends at the deepest snapshot on the matched path.
        block_ids: the ``num_tokens // block_size`` block ids holding them, in order.
        node: the deepest matched node, ending exactly at ``num_tokens``; the namespace
            root when nothing matched. Pin it to keep the blocks alive.
        snap: stateful trees: ``node``'s snapshot slot (in the state pool of ``node.tier``), or
            -1 when the usable prefix is empty (the initial state).
        kv_tokens: tokens whose KV the path holds (>= ``num_tokens``): where the query and the
            cached path part. A stateful tree serves only ``num_tokens`` of them; a caller
            that computes on from there takes a snapshot at ``kv_tokens``, the junction.
    """

    num_tokens: int
    block_ids: tuple[int, ...]
    node: Node
    snap: int = -1
    kv_tokens: int = 0


def walk(
    node: Node, query: bytes, width: int, tick: int, ids: list[int] | None
) -> tuple[Node, int, Node | None, int]:
    """Follow fully matching edges from ``node`` over packed ``query``, stamping them with ``tick``.

    Offsets are in bytes; ``width`` is the bytes of one block and ``len(query)`` a multiple
    of it. Returns ``(node, pos, edge, matched)``: the deepest fully matched
    node and the bytes it covers; ``edge`` is the child matched only partially (its first
    ``matched`` bytes, at least one block) or None. Appends matched block ids to ``ids`` when
    given. One dict lookup and one ``memcmp`` per node; O(log(edge blocks)) more comparisons
    on the one partially matched edge.
    """
    pos, end = 0, len(query)
    while pos < end:
        child = node.children.get(query[pos : pos + width])
        if child is None:
            break
        edge = child.data
        # One memcmp, no copy; false when the edge runs past the end of the query.
        if query.startswith(edge, pos):
            child.last_access = tick
            if ids is not None:
                ids += child.block_ids
            node, pos = child, pos + len(edge)
            continue
        # Binary search for the longest matching run of whole blocks; the first block matched
        # (it is the key), and prefix equality is monotone in the length.
        lo, hi = 1, min(len(edge), end - pos) // width
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if query[pos : pos + mid * width] == edge[: mid * width]:
                lo = mid
            else:
                hi = mid - 1
        return node, pos, child, lo * width
    return node, pos, None, 0


def root_of(node: Node) -> Node:
    """The namespace root above ``node`` (``node`` itself for a root or a detached node). O(d)."""
    while node.parent is not None:
        node = node.parent
    return node


def split(node: Node, cut: int, width: int, uid: int) -> Node:
    """Split non-root ``node`` after ``cut`` bytes (whole blocks of ``width``); return the new parent.

    ``node`` itself stays the deeper part, so references held by pinners stay valid; the new
    parent (``uid``) takes the first part, ``node``'s old key, last access, pin count (the
    same pins pass through it) and tier, and no pins of its own. ``node``'s eviction entry stays valid
    (its ``last_access`` and ``uid`` are unchanged). O(len(node.data)) bytes copied.
    """
    parent = node.parent
    if parent is None:
        raise ValueError(f"cannot split {node!r}: it is a root or detached")
    nb = cut // width
    top = Node(
        node.data[:cut],
        node.block_ids[:nb],
        parent,
        node.key,
        uid,
        node.last_access,
        node.pin_count,
        tier=node.tier,
    )  # no snapshot: the state at the cut was never taken
    top.dev_children = 1 if node.tier == DEVICE else 0
    node.data = node.data[cut:]
    node.block_ids = node.block_ids[nb:]
    node.key = node.data[:width]
    node.parent = top
    top.children[node.key] = node
    parent.children[top.key] = top
    return top
