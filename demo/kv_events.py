"""``--kv-events-config``: the server's KV events for routers (docs/kv-events.md).

``start(config_json, engine)`` starts the ZMQ publisher and attaches its recorder to the
engine's store; ``close()`` on what it returns sends what is left. Raises ValueError with a
message for the user (pyzmq missing, a socket that cannot bind, no store to publish).
"""

from __future__ import annotations

from hf_patch.kv_events import record_events
from radixkv.events import EventLog, KVEventsConfig, start_publisher


def start(config_json: str | None, engine):
    """The running publisher, or None when ``config_json`` turns events off (or is None)."""
    if not config_json:
        return None
    config = KVEventsConfig.from_json(config_json)
    if config.enabled and engine.store is None:
        raise ValueError("KV events need the prefix cache: drop --no-reuse")
    log = EventLog()
    publisher = start_publisher(config, log)
    if publisher is not None:
        record_events(engine.model, engine.store, log)
    return publisher
