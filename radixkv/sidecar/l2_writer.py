"""Write-through of committed blocks to the L2 tier, in the background and bounded.

A commit hands its blocks' (and snapshots') ``(key, payload)`` pairs to ``L2Writer.put``, which
queues them and returns at once; one thread writes them with ``put_many``. When more than
``max_bytes`` are waiting or being written (the L2 slow or down), new values are dropped and
counted: the sidecar's memory still holds them, only the other machines miss them. A value
larger than ``max_bytes`` is taken when nothing waits (a recurrent-state snapshot may outweigh
the bound: Mamba-2's default config, 261 MiB), so the bound is the larger of the two.
"""

from __future__ import annotations

import collections
import logging
import threading

logger = logging.getLogger(__name__)


class L2Writer:
    def __init__(self, l2, max_bytes: int = 256 << 20, batch: int = 64) -> None:
        self.l2 = l2
        self.max_bytes = max_bytes
        self.batch = batch
        self.queued_bytes = 0
        self.dropped_blocks = 0
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="sidecar-l2-writer", daemon=True)
        self._thread.start()

    def put(self, items: list[tuple[bytes, bytes]]) -> None:
        with self._cond:
            for key, payload in items:
                if self.queued_bytes and self.queued_bytes + len(payload) > self.max_bytes:
                    self.dropped_blocks += 1
                    continue
                self._queue.append((key, payload))
                self.queued_bytes += len(payload)
            self._cond.notify()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"l2_queued_bytes": self.queued_bytes, "l2_dropped_blocks": self.dropped_blocks}

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the queue is written (tests, shutdown); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    _busy = False

    def close(self, timeout: float = 5.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed and not self._queue:
                    return
                items = [self._queue.popleft() for _ in range(min(self.batch, len(self._queue)))]
                self._busy = True
            try:
                self.l2.put_many(items)
            except Exception as e:  # the contract says never; a bug there must not stop the writer
                logger.warning("L2 write failed: %s", e)
            with self._cond:
                self.queued_bytes -= sum(len(p) for _, p in items)
                self._busy = False
                self._cond.notify_all()
