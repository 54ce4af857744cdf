"""KV cache events for routers, vLLM-compatible (docs/kv-events.md).

``recorder``: ``TreeRecorder`` (a tree's listener: BlockStored / BlockRemoved per node, block
hashes from the L2 key chain) into an ``EventLog``; ``wire``: vLLM's msgspec schema;
``config``: ``KVEventsConfig.from_json`` (vLLM's ``--kv-events-config`` JSON);
``publisher``: the ZMQ PUB socket with vLLM's framing and replay ROUTER (pyzmq, imported only
when a publisher starts).
"""

from radixkv.events.config import KVEventsConfig
from radixkv.events.publisher import start_publisher
from radixkv.events.recorder import EventLog, TreeRecorder, external_hash

__all__ = ["EventLog", "KVEventsConfig", "TreeRecorder", "external_hash", "start_publisher"]
