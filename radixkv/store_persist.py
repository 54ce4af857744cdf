"""Persistence methods of ``KVStore`` (radixkv.store): ``save``, ``restore`` and their lock hook.

The work is in radixkv/persist.py; these methods are the store's public entry points to it.
``StorePersistence`` is a base of ``KVStore`` and uses the store's ``_lock``, ``tree``,
``pool`` and ``_unpin_locked``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Hashable, Iterator

from radixkv import persist
from radixkv.pool import BlockPool
from radixkv.tree import RadixTree


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
    ) -> persist.SaveResult:
        """Write the cached prefixes of ``namespaces`` (a list/set or a predicate; None: all) to ``path``.

        Atomic: ``path`` keeps its previous content unless the whole new file was written.
        ``identity`` (JSON-able) must be presented equal to ``restore``; ``rename`` maps a
        namespace to the one written. Pins the saved prefixes while it writes (the lock only
        for the snapshot of the tree), so commits meanwhile may cache less.
        Raises ValueError for a namespace other than None/str/bytes/int/tuples of them;
        RuntimeError, writing nothing, when the store was flushed after ``epoch`` (``self.epoch``
        read before ``identity`` was computed).
        """
        return persist.save_store(
            self, path, namespaces=namespaces, identity=identity, rename=rename, epoch=epoch
        )

    def restore(
        self,
        path,
        *,
        identity: object = None,
        rename: Callable[[Hashable], Hashable] | None = None,
        epoch: int | None = None,
    ) -> persist.RestoreResult:
        """Merge the prefixes saved in ``path`` into this store: cached ones stay, new ones go in.

        Checks all of the file first (checksums, format version, ``identity``, layout,
        structure) and raises ``radixkv.CacheFileError`` naming the fault, changing nothing.
        Restored blocks only take free blocks (nothing cached is evicted for them); what does
        not fit is dropped, least recently used first, and counted in the result. Prefixes the
        store holds already (pinned task prompts, say) are duplicates and need no free block.
        ``epoch``: ``self.epoch`` read when ``identity`` was computed; if the store was flushed
        since (weights changed), raises RuntimeError, changing nothing.
        """
        return persist.restore_store(self, path, identity=identity, rename=rename, epoch=epoch)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[tuple[RadixTree, BlockPool, Callable[[RadixTree, object], None]]]:
        """radixkv.persist's hook: the lock held; the live tree, the pool, and the unpin for
        nodes pinned under it (it frees the blocks of a tree flushed since)."""
        with self._lock:
            yield self.tree, self.pool, self._unpin_locked
