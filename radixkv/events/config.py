"""``--kv-events-config``: vLLM's ``KVEventsConfig`` JSON, read into a frozen dataclass.

Keys (vLLM's names and defaults): ``enable_kv_cache_events`` (false), ``publisher``
(``"zmq"``, or ``"null"``: nothing published), ``endpoint`` (``"tcp://*:5557"``: a ``*``,
``::``, ``ipc://`` or ``inproc://`` endpoint is bound, any other connected to), ``topic``
(``""``), ``replay_endpoint`` (null: no replay; else a ROUTER socket bound there),
``buffer_steps`` (10000 batches kept for replay), ``hwm`` (100000, the PUB socket's high-water
mark); and radixkv's own ``event_layout`` (``"array"`` or ``"map"``: ``radixkv.events.wire``).
Other keys are refused by name, so a typo never silently turns events off.
"""

from __future__ import annotations

import dataclasses
import json

from radixkv.events.wire import LAYOUTS

PUBLISHERS = ("zmq", "null")


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    event_layout: str = "array"

    def __post_init__(self) -> None:
        if type(self.enable_kv_cache_events) is not bool:
            raise ValueError(
                f"enable_kv_cache_events must be true or false, got {self.enable_kv_cache_events!r}"
            )
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"publisher must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}")
        if self.event_layout not in LAYOUTS:
            raise ValueError(f"event_layout must be one of {', '.join(LAYOUTS)}, got {self.event_layout!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if not self.endpoint:
            raise ValueError("endpoint must not be empty")
        if self.replay_endpoint is not None and not (
            isinstance(self.replay_endpoint, str) and self.replay_endpoint
        ):
            raise ValueError(
                f"replay_endpoint must be a non-empty string or null, got {self.replay_endpoint!r}"
            )
        for name in ("buffer_steps", "hwm"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def enabled(self) -> bool:
        """Whether anything is published."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse ``text`` (a JSON object); raises ValueError naming what is wrong."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError("must be a JSON object")
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(obj) - set(allowed))
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
        return cls(**obj)
