"""fork() and sidecar clients: a child never uses its parent's connection.

A process that holds a ``SidecarTier`` and forks (gunicorn ``--preload``, a DataLoader worker
started with fork, ``os.fork()``) gives the child copies of its socket, of locks a parent thread
may hold at that moment (the tier's, the writer's, the store's), of the writer's queue and of
the leases the parent holds; the parent's threads (the writer, the settler) do not exist in the
child. As redis-py and others do, the child drops that connection state and connects again,
with its own hello, on its next call. The hooks here (``os.register_at_fork``, once per process)
run for every live tier:

- before the fork, the store behind each tier is locked (its critical sections are short and do
  no I/O), so no child copies a tree mid-update or a store lock held by a thread it lacks; the
  lock is let go again in the parent and in the child;
- in the child, ``SidecarTier._after_fork`` closes the child's copies of the socket and the
  descriptors received (nothing is sent: the parent's connection, replies owed to it, its pins,
  claims and open writes stay the parent's) and takes fresh locks and an empty writer queue (the
  parent's writer writes the parent's commits).

A fork these hooks do not see (a C library calling fork()) is found by the tier's pid check on
its next call.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

logger = logging.getLogger(__name__)

STORE_LOCK_S = 10.0  # the longest a fork waits for a store's lock (held for microseconds)

_tiers: weakref.WeakSet = weakref.WeakSet()  # live SidecarTiers of this process
# Guards _tiers (a tier made in another thread while the hook walks it); held across the fork.
_registry = threading.Lock()
_locked: list = []  # stores the before-fork hook locked, let go after the fork
_held: list = []  # stores whose lock another thread held through the hook (the child warns)


def track(tier) -> None:
    """Run the fork hooks for ``tier`` (held weakly: a tier that is gone is forgotten)."""
    with _registry:
        _tiers.add(tier)


def _before() -> None:
    _registry.acquire()
    for tier in list(_tiers):
        store = tier.store
        if store is None or any(s is store for s in _locked):  # a store once, however many tiers
            continue
        if store.lock_for_fork(STORE_LOCK_S):
            _locked.append(store)
        else:  # never seen: the lock guards in-memory updates only
            _held.append(store)
            logger.warning(
                "radixkv: fork() while another thread held a store's lock for %g s; the child may wait on it",
                STORE_LOCK_S,
            )


def _unlock() -> None:
    while _locked:
        _locked.pop().unlock_after_fork()
    _registry.release()


def _after_in_child() -> None:
    tiers, held = list(_tiers), list(_held)
    _held.clear()
    _unlock()
    if held:  # the child has no thread that could let it go: say so where it will hang
        logger.error(
            "radixkv: this process was forked while another thread held %d store lock(s); "
            "calls on those stores here wait for ever: fork before the store is busy",
            len(held),
        )
    for tier in tiers:
        try:
            tier._after_fork()
        except Exception:  # one tier's reset never keeps the others' from running
            logger.exception("radixkv: resetting a sidecar client after fork() failed")


os.register_at_fork(before=_before, after_in_parent=_unlock, after_in_child=_after_in_child)
