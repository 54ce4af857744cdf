"""KV memory and the store that serves it (torch).

``pool``: ``BlockPool`` (paged KV storage of one tier); ``tier``: the host tier behind the
device pool and every copy between them; ``kv_store``: ``KVStore`` = tree + pools + one lock;
``state_pool``: ``StatePool``, recurrent-state snapshots; ``lease``: a pinned match; ``task_pins``: prompts pinned by id; ``stats``: counters.
"""

from radixkv.store.kv_store import KVStore
from radixkv.store.lease import Lease
from radixkv.store.pool import BlockPool, LayerSpec, OutOfBlocks
from radixkv.store.state_pool import OutOfSlots, StatePool, StateSpec, host_states_for
from radixkv.store.tier import Tier, host_pool_for

__all__ = [
    "BlockPool",
    "KVStore",
    "LayerSpec",
    "Lease",
    "OutOfBlocks",
    "OutOfSlots",
    "StatePool",
    "StateSpec",
    "Tier",
    "host_pool_for",
    "host_states_for",
]
