"""Task prompts pinned for good (rtp-llm's MultiTaskPrompt): a KVStore's prefixes held by task id.

``store.tasks.pin(task_id, tokens, k, v)`` caches the prompt's whole blocks through
``commit`` and keeps a pin on them, so they are never evicted nor demoted, whatever the
traffic, until ``unpin(task_id)`` or ``store.flush()`` (which drops them: KV of older
weights; the owner pins again). The model side (computing the KV) is ``hf_patch.task_prompts``.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from radixkv.store.lease import Lease
from radixkv.tree.node import Tokens, head_of, num_tokens_of, pack_tokens

if TYPE_CHECKING:
    from radixkv.store import KVStore


class TaskPins:
    """The pinned task prompts of one store; every method takes the store's lock itself."""

    def __init__(self, store: KVStore) -> None:
        # Weak, as is every pin lease's store: the store owns its task pins, and a strong
        # reference back would keep a dropped store (its whole pool) alive until the next GC.
        self._store = weakref.proxy(store)
        self._leases: dict[Hashable, Lease] = {}  # by task id, in pinning order

    def pin(
        self,
        task_id: Hashable,
        tokens: Tokens,
        k_src: Sequence[torch.Tensor],
        v_src: Sequence[torch.Tensor],
        namespace: Hashable = None,
        epoch: int | None = None,
        *,
        snapshots=None,
    ) -> int:
        """Cache the whole blocks of ``tokens`` (KV as for ``commit``) and pin them under ``task_id``.

        ``epoch``: ``store.epoch`` read before the KV was computed, as for ``commit``; if the
        store was flushed since (weights changed), the KV is stale and nothing is pinned.

        Pinned until ``unpin(task_id)`` or the store's ``flush()``: never evicted nor demoted. Pinning
        an id again replaces its prompt (the old one is unpinned once the new one holds).
        ``snapshots``: a stateful store's snapshots of the prompt, as for ``commit`` (the one at
        the prompt's whole-block end is what makes it usable).
        Returns the pinned tokens (whole blocks). Raises ValueError, pinning nothing, when the
        prompt is shorter than one block or the device pool cannot hold it beside the other
        task prompts (naming blocks needed and blocks that exist); RuntimeError when running
        requests pin so much of the pool that it could not be cached whole, or when the store
        was flushed after ``epoch`` (compute the KV again and pin again).
        """
        store = self._store
        hash(task_id)
        bs = store.block_size
        need = num_tokens_of(tokens) // bs
        if need == 0:
            raise ValueError(
                f"task prompt {task_id!r} has {num_tokens_of(tokens)} tokens, less than one block of {bs}: nothing to pin"
            )
        packed = pack_tokens(head_of(tokens, need * bs))
        with store._lock:
            others = self._task_device_blocks_locked(exclude=(task_id,))
            match = store.tree.match(packed, namespace, kv=True)
            shared = len(
                others.intersection(match.block_ids[: len(match.block_ids) - store._host_blocks(match)])
            )
        if need + len(others) - shared > store.pool.num_blocks:
            raise ValueError(
                f"task prompt {task_id!r} needs {need} blocks of {bs} tokens and other task prompts pin "
                f"{len(others)} ({shared} shared): the device pool has only {store.pool.num_blocks} blocks"
            )
        for _attempt in range(3):  # traffic may evict what commit cached before we pin it: retry
            with store._lock:  # a prefix demoted earlier comes back: task prompts live on the device
                prefix = store.tree.match(packed, namespace, kv=True)
                if prefix.node.tier:
                    store._promote_locked(prefix.node)
            store.commit(packed, k_src, v_src, namespace, epoch, snapshots=snapshots)
            with store._lock:
                if epoch is not None and epoch != store.epoch:  # checked with the pin, under one lock
                    raise RuntimeError(
                        f"task prompt {task_id!r}: the store was flushed (weights changed?) after its KV "
                        "was computed; nothing was pinned: compute it again and pin again"
                    )
                match = store.tree.match(packed, namespace)
                if match.num_tokens == need * bs:
                    store.tree.pin(match.node)
                    lease = Lease(store, store.tree, match, store.epoch, namespace, store._host_blocks(match))
                    old = self._leases.pop(task_id, None)
                    self._leases[task_id] = lease
                    break
        else:
            raise RuntimeError(
                f"task prompt {task_id!r}: only {match.num_tokens} of {need * bs} tokens could be cached; "
                "running requests pin the rest of the pool"
            )
        if old is not None:
            old.release()
        return need * bs

    def unpin(self, task_id: Hashable) -> None:
        """Unpin task ``task_id``'s prompt (it stays cached, evictable). Raises KeyError if not pinned."""
        with self._store._lock:
            lease = self._leases.pop(task_id, None)
        if lease is None:
            raise KeyError(f"no task prompt is pinned under id {task_id!r}")
        lease.release()

    def ids(self) -> list[Hashable]:
        """Ids of the pinned task prompts, in pinning order."""
        with self._store._lock:
            return list(self._leases)

    def drop_all(self) -> list[Lease]:
        """Forget every task pin (the store's flush unpins them); call under the store's lock."""
        leases, self._leases = list(self._leases.values()), {}
        return leases

    def check_locked(self) -> None:
        """Every task lease pins a node of the store's live tree; call under the store's lock."""
        for task_id, lease in self._leases.items():
            if lease._tree is not self._store.tree or not lease._match.node.attached:
                raise AssertionError(f"task prompt {task_id!r} is not pinned in the live tree")

    def device_blocks_locked(self) -> int:
        """Distinct device blocks the task prompts pin; call under the store's lock."""
        return len(self._task_device_blocks_locked(exclude=()))

    def host_blocks_locked(self) -> int:
        """Distinct host blocks the task prompts pin; call under the store's lock."""
        ids: set[int] = set()
        for lease in self._leases.values():
            ids.update(lease.block_ids[len(lease.block_ids) - lease.num_host_blocks :])
        return len(ids)

    def __len__(self) -> int:
        return len(self._leases)

    def device_blocks(self, exclude: Collection[Hashable] = ()) -> int:
        """Distinct device blocks pinned by the task prompts not in ``exclude``."""
        with self._store._lock:
            return len(self._task_device_blocks_locked(exclude))

    def _task_device_blocks_locked(self, exclude: Collection[Hashable]) -> set[int]:
        ids: set[int] = set()
        for task_id, lease in self._leases.items():
            if task_id not in exclude:
                ids.update(lease.block_ids[: len(lease.block_ids) - lease.num_host_blocks])
        return ids
