"""Stored responses of /v1/responses: the conversation a ``previous_response_id`` continues.

    store = ResponseStore(max_items=1000, max_age_s=3600)
    store.put(tenant, StoredResponse(id, created, messages, body))
    store.get(tenant, id)       # None: unknown, expired, deleted, or another tenant's
    store.delete(tenant, id)    # True if it was there

A stored response keeps its whole conversation as chat messages (the history it continued,
its own input, and its output as an assistant turn), so a continuation renders the same
prompt the client would have sent by hand, and that prompt's prefix is in the prefix cache.

Per tenant: an entry is keyed by (tenant namespace, id), so one API key never reads, continues
or deletes another's responses (an id guessed or leaked answers 404, as an unknown one).
Bounded: at most ``max_items`` entries (the oldest dropped first) and ``max_age_s`` seconds
each. In memory only: lost when the server restarts (the prefix cache's KV can be kept with
--cache-file, the conversations cannot).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    id: str
    created: float  # time.time() of creation
    messages: tuple[dict, ...]  # the conversation, this response's output included (chat messages)
    body: dict  # the response object, as retrieve answers it


class ResponseStore:
    """A bounded, thread-safe map (tenant, id) -> StoredResponse. O(1) per operation,
    amortised (expiry drops from the oldest end)."""

    def __init__(self, max_items: int, max_age_s: float, clock: Callable[[], float] = time.time):
        if max_items < 0 or not max_age_s > 0:
            raise ValueError(f"max_items must be >= 0 and max_age_s > 0, got {max_items} and {max_age_s}")
        self.max_items, self.max_age_s, self._clock = max_items, max_age_s, clock
        self._items: OrderedDict[tuple[Hashable, str], StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._items)

    def put(self, tenant: Hashable, item: StoredResponse) -> None:
        """Store ``item`` for ``tenant`` (max_items 0: nothing is stored)."""
        with self._lock:
            self._expire()
            if self.max_items == 0:
                return
            self._items[(tenant, item.id)] = item
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)

    def get(self, tenant: Hashable, response_id: str) -> StoredResponse | None:
        with self._lock:
            self._expire()
            return self._items.get((tenant, response_id))

    def delete(self, tenant: Hashable, response_id: str) -> bool:
        with self._lock:
            self._expire()
            return self._items.pop((tenant, response_id), None) is not None

    def _expire(self) -> None:
        oldest = self._clock() - self.max_age_s
        while self._items:
            key, item = next(iter(self._items.items()))
            if item.created >= oldest:
                break
            del self._items[key]
