"""The shared tier across machines: block values in Redis/Valkey or a shared directory.

``open_l2(url)`` gives an ``L2Store`` (get_many / put_many / stats / close); ``block_keys``
gives the content addresses of a token sequence's whole blocks, ``snapshot_key`` that of the
recurrent-state snapshot at a block's end. Layers: block_keys (the
chained hash) and value_format (header + checksum) are pure; redis_store and file_store are
the two backends; health holds their counters and outage backoff; url parses URLs. redis-py
is imported only when a Redis URL is opened. docs/l2.md is the user guide.
"""

from radixkv.l2.block_keys import KEY_BYTES, block_keys, snapshot_key
from radixkv.l2.l2_store import L2Store, open_l2
from radixkv.l2.value_format import HEADER_BYTES

__all__ = ["HEADER_BYTES", "KEY_BYTES", "L2Store", "block_keys", "open_l2", "snapshot_key"]
