"""What a ``RadixTree`` tells an observer of its contents (``RadixTree.listener``).

The tree calls these under whatever lock guards it (the store's), synchronously, once per
node, so a listener sees every change in order and must be quick and must not call back
into the tree. A split tells nothing: it changes no block, only where an edge is cut.

- ``stored(node)``: a new leaf, its blocks now cached in ``node.tier`` (insert, restore).
- ``removed(node)``: a node about to leave the tree (evict, evict_host, drop, clear); it is
  still attached, so its path from the root names its blocks.
- ``moved(node, from_tier)``: the node's blocks changed tier (demote: DEVICE -> HOST,
  promote: HOST -> DEVICE); the node and its path are unchanged.

``radixkv.events.TreeRecorder`` turns these into vLLM-compatible KV events.
"""

from __future__ import annotations

from typing import Protocol

from radixkv.tree.node import Node


class TreeListener(Protocol):
    def stored(self, node: Node) -> None: ...

    def removed(self, node: Node) -> None: ...

    def moved(self, node: Node, from_tier: int) -> None: ...
