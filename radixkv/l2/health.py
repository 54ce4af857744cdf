"""Counters and outage tracking shared by the L2 stores (thread safe).

``Health`` is a small circuit breaker: after a failed round trip the store is *down*; calls
made while it is down return at once (misses, nothing stored; counted as ``skipped``) until a
retry delay has passed, when exactly one caller probes the store again (the others keep
skipping, so N threads do not reconnect at once). A failed probe doubles the delay up to
``backoff_max_s``; a success ends the outage. One warning when an outage starts, one info
line when it ends: never a line per call.

``Refusals`` logs the first refused value of each kind (damaged, truncated, foreign...) once
per store, and counts every one.
"""

from __future__ import annotations

import logging
import threading
import time

from radixkv.l2.value_format import WHY

logger = logging.getLogger(__name__)

COUNTERS = (
    "reads",
    "hits",
    "writes",
    "errors",
    "refused",
    "skipped",
    "outages",
    "bytes_read",
    "bytes_written",
)


class Health:
    """Counters (``COUNTERS``) and the up/down state of one store; every method takes one lock."""

    def __init__(self, name: str, backoff_s: float, backoff_max_s: float):
        numbers = all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in (backoff_s, backoff_max_s)
        )
        if not (numbers and backoff_s > 0 and backoff_max_s >= backoff_s):
            raise ValueError(
                f"L2 backoff_s must be > 0 and backoff_max_s >= backoff_s, got {backoff_s}, {backoff_max_s}"
            )
        self.name = name
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._first_delay = backoff_s
        self._max_delay = backoff_max_s
        self._delay = backoff_s
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._refused_kinds: set[str] = set()
        self._full_logged = False

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += n

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counts)
            out["down"] = int(self._down_since is not None)
            return out

    def may_try(self) -> bool:
        """True when a round trip should be tried now: the store is up, or this caller is the
        one probe after the retry delay (the next probe is pushed a delay further meanwhile)."""
        with self._lock:
            if self._down_since is None:
                return True
            now = time.monotonic()
            if now < self._retry_at:
                return False
            self._retry_at = now + self._delay  # other callers keep skipping while this one probes
            return True

    def failed(self, what: str, exc: BaseException) -> None:
        """A round trip failed (down, refused connection, timeout, auth): start or extend an outage."""
        with self._lock:
            now = time.monotonic()
            starting = self._down_since is None
            if starting:
                self._down_since = now
                self._delay = self._first_delay
                self._counts["outages"] += 1
            else:
                self._delay = min(self._delay * 2, self._max_delay)
            self._retry_at = now + self._delay
            delay = self._delay
        if starting:
            logger.warning(
                "L2 %s unreachable during %s (%s: %s): going on without it, retrying every %.1f-%.0f s",
                self.name,
                what,
                type(exc).__name__,
                exc,
                delay,
                self._max_delay,
            )

    def succeeded(self) -> None:
        """A round trip worked: end an outage, if there was one."""
        with self._lock:
            if self._down_since is None:
                return
            lasted = time.monotonic() - self._down_since
            self._down_since = None
            self._delay = self._first_delay
        logger.warning("L2 %s is back after %.1f s", self.name, lasted)

    def refused(self, kind: str, key: bytes) -> None:
        """A value was refused (damaged, truncated, foreign): counted, logged once per kind."""
        with self._lock:
            self._counts["refused"] += 1
            first = kind not in self._refused_kinds
            self._refused_kinds.add(kind)
        if first:
            logger.warning(
                "L2 %s: refused the value under key %s... (kind=%s: %s); treated as a miss "
                "(logged once per kind; see stats()['refused'])",
                self.name,
                key[:8].hex(),
                kind,
                WHY.get(kind, kind),
            )

    def write_rejected(self, count: int, reason: str) -> None:
        """The store refused ``count`` writes (full, read-only, too large): counted; logged once
        per episode, which ends when a whole batch is accepted (``writes_accepted``)."""
        with self._lock:
            self._counts["errors"] += count
            first = not self._full_logged
            self._full_logged = True
        if first:
            logger.warning(
                "L2 %s rejects writes (%s): blocks stay local until it takes them again", self.name, reason
            )

    def writes_accepted(self) -> None:
        """A batch was stored whole: a later rejection is a new episode (logged again)."""
        with self._lock:
            self._full_logged = False
