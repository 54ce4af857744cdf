"""The radix tree over block-granular token prefixes (pure Python, no torch).

``node``: packed tokens, ``Node``, ``MatchResult`` and the walk/split primitives;
``radix_tree``: ``RadixTree`` (match, insert, pins, LRU eviction, tier moves);
``check``: the independent recount behind ``RadixTree.check_invariants``;
``listener``: the ``TreeListener`` protocol a tree tells of each node stored, removed or moved.
"""

from radixkv.tree.listener import TreeListener
from radixkv.tree.node import DEVICE, HOST, MatchResult, Node, PackedTokens, TreeInvariantError, pack_tokens
from radixkv.tree.radix_tree import RadixTree, TierOrderError

__all__ = [
    "DEVICE",
    "HOST",
    "MatchResult",
    "Node",
    "PackedTokens",
    "RadixTree",
    "TierOrderError",
    "TreeListener",
    "TreeInvariantError",
    "pack_tokens",
]
