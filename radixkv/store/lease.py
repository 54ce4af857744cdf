"""Lease: a pinned match handed out by ``KVStore.acquire`` (and held by task pins)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from radixkv.tree import MatchResult, RadixTree

if TYPE_CHECKING:
    from radixkv.store import KVStore


class Lease:
    """A pinned match. Release exactly once (idempotent); use as a context manager."""

    __slots__ = ("_store", "_tree", "_match", "epoch", "namespace", "num_host_blocks", "remote")

    def __init__(
        self,
        store: KVStore,
        tree: RadixTree,
        match: MatchResult,
        epoch: int,
        namespace,
        num_host_blocks: int = 0,
    ) -> None:
        self._store = store
        self._tree: RadixTree | None = tree
        self._match = match
        self.epoch = epoch
        self.namespace = namespace
        # The last ``num_host_blocks`` of ``block_ids`` index the host pool (tiers never go back up
        # a path); fixed while pinned, since pinned nodes are never demoted.
        self.num_host_blocks = num_host_blocks
        # Blocks a remote tier (radixkv.sidecar) pinned past the local match: a RemoteHit or None.
        self.remote = None

    @property
    def num_tokens(self) -> int:
        """Tokens of the prompt whose KV the pinned blocks hold (a multiple of block_size): the
        local blocks, then the remote tier's."""
        remote = self.remote
        return remote.num_tokens if remote is not None else self._match.num_tokens

    @property
    def snap(self) -> int:
        """The local snapshot slot ending the local usable prefix (stateful stores), -1 for the
        initial state; a remote hit's is ``remote.snap`` (``KVStore.read_state`` picks)."""
        return self._match.snap

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV the matched path holds, past ``num_tokens`` when no snapshot is there:
        the junction, where a caller computing on should take a snapshot (the remote tier's
        junction too, when its hit reaches further)."""
        remote = self.remote
        return max(self._match.kv_tokens, self.num_tokens, remote.kv_tokens if remote is not None else 0)

    @property
    def block_ids(self) -> Sequence[int]:
        """The local pools' blocks (device, then the last ``num_host_blocks`` on the host)."""
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
