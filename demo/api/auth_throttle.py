"""Slowing down key guessing: a token bucket of failed authentications per client address.

Each address may fail `burst` times at once; the bucket refills at `per_second` (one more
try every 1/per_second seconds). An address whose bucket is empty gets 429 with
Retry-After on every authenticated route, even with a right key (else a guess that hits
would still be told so). Only failures create entries, and at most `max_clients` addresses
are remembered (least recently failed dropped first), so a flood of addresses costs
bounded memory; a dropped address starts again with a full bucket.

    throttle = Throttle()
    wait = throttle.retry_after(addr)   # 0: go ahead; else seconds to answer in Retry-After
    throttle.failed(addr)               # after a 401
    throttle = Throttle.shared_by(n)    # one of n front ends' (--api-server-count n)

With n front ends on one port (demo.core) the kernel spreads a client's connections over
them, and each keeps its own buckets, as does the engine process's app (the routes it is
forwarded authenticate there): ``shared_by(n + 1)`` gives each 1/(n + 1) of the burst (at
least one try: past 10 processes, one each) and of the refill, so all of them together allow
a client no more guesses than the one-process server does.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable


class Throttle:
    def __init__(
        self,
        burst: int = 10,
        per_second: float = 0.2,
        max_clients: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        if burst < 1 or per_second <= 0 or max_clients < 1:
            raise ValueError("burst and max_clients must be >= 1 and per_second > 0")
        self.burst, self.per_second, self.max_clients, self._clock = burst, per_second, max_clients, clock
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # addr -> (tokens, at)

    @classmethod
    def shared_by(cls, front_ends: int, burst: int = 10, per_second: float = 0.2) -> Throttle:
        """One of ``front_ends`` throttles that together allow what ``Throttle(burst,
        per_second)`` allows alone."""
        if front_ends < 1:
            raise ValueError(f"front_ends must be >= 1, got {front_ends}")
        return cls(max(1, burst // front_ends), per_second / front_ends)

    def __len__(self) -> int:
        return len(self._buckets)

    def _tokens(self, addr: str, now: float) -> float:
        tokens, at = self._buckets.get(addr, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.per_second)

    def retry_after(self, addr: str) -> int:
        """0 if `addr` may try now, else whole seconds until its next try. O(1)."""
        with self._lock:
            if addr not in self._buckets:
                return 0
            tokens = self._tokens(addr, self._clock())
            return 0 if tokens >= 1 else max(1, math.ceil((1 - tokens) / self.per_second))

    def failed(self, addr: str) -> None:
        """Spend one try of `addr`. O(1) amortised."""
        with self._lock:
            now = self._clock()
            self._buckets[addr] = (max(0.0, self._tokens(addr, now) - 1), now)
            self._buckets.move_to_end(addr)
            while len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)
