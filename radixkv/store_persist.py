"""Persistence methods of ``KVStore`` (radixkv.store): ``save``, ``restore`` and their lock hook.

The work is in radixkv/persist.py; these methods are the store's public entry points to it.
``StorePersistence`` is a base of ``KVStore`` and uses the store's ``_lock``, ``tree``,
``tiers``, ``counters``, ``_unpin_locked`` and ``_make_room_locked``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Collection, Hashable, Iterator

from radixkv import persist, restore
from radixkv.pool import BlockPool
from radixkv.stats import StoreCounters
from radixkv.tree import RadixTree


@dataclasses.dataclass(frozen=True)
class Locked:
    """What radixkv.persist may use while it holds the store's lock."""

    tree: RadixTree  # the live tree
    pools: tuple[BlockPool, ...]  # indexed by tier: (device,) or (device, host)
    counters: StoreCounters
    unpin: Callable[[RadixTree, object], None]  # unpin a node pinned earlier (frees the blocks of a
    # tree flushed since)
    make_room: Callable[[int, int], None]  # (tier, blocks): evict / demote least recently used
    private: tuple[set[int], set[int]]  # per tier: blocks taken from the pool, in no tree yet


class StorePersistence:
    """``KVStore.save`` / ``KVStore.restore`` and the ``_exclusive`` hook radixkv.persist uses."""

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
    ) -> persist.SaveResult:
        """Write the cached prefixes of ``namespaces`` (a list/set or a predicate; None: all) to ``path``.

        Atomic: ``path`` keeps its previous content unless the whole new file was written.
        ``identity`` (JSON-able) must be presented equal to ``restore``; ``rename`` maps a
        namespace to the one written. Pins the saved prefixes while it writes (the lock only
        for the snapshot of the tree), so commits meanwhile may cache less.
        Raises ValueError for a namespace other than None/str/bytes/int/tuples of them;
        RuntimeError, writing nothing, when the store was flushed after ``epoch`` (``self.epoch``
        read before ``identity`` was computed).

        ``max_bytes``: write at most this many KV bytes, the most recently used prefixes first
        (``SaveResult.skipped_*`` counts the rest). ``deadline`` (a ``time.monotonic()`` value)
        and ``cancel`` (an Event) stop the save between chunks: ``radixkv.SaveAborted``, the
        previous file unchanged, no temporary file left.
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
        )

    def restore(
        self,
        path,
        *,
        identity: object = None,
        rename: Callable[[Hashable], Hashable] | None = None,
        epoch: int | None = None,
        evict: bool = False,
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
        ``epoch``: ``self.epoch`` read when ``identity`` was computed; if the store was flushed
        since (weights changed), raises RuntimeError, changing nothing.
        """
        return restore.restore_store(self, path, identity=identity, rename=rename, epoch=epoch, evict=evict)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[Locked]:
        """radixkv.persist's hook: the lock held while the ``Locked`` view is used."""
        with self._lock:
            pools = tuple(tier.pool for tier in self.tiers)
            private = (self._private, self._private_host)
            yield Locked(self.tree, pools, self.counters, self._unpin_locked, self._make_room_locked, private)
