"""Counters a KVStore keeps, published as a flat dict (e.g. by a Prometheus endpoint)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.store import KVStore


@dataclasses.dataclass
class StoreCounters:
    """Monotone counters since the store was built. Mutated only under the store's lock."""

    requests: int = 0  # acquire() calls
    query_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # prompt tokens actually served from the pool
    inserted_tokens: int = 0  # tokens newly cached by commit()
    evicted_blocks: int = 0
    uncached_tokens: int = 0  # tokens a commit could not cache: every block pinned / pool too small
    flushes: int = 0
    # generate() calls run without the store: their KV depends on inputs the key cannot see
    uncacheable_requests: int = 0
    # Host tier (all zero without one). Host hits are read in place; only a task prompt pinned
    # over a demoted prefix brings that prefix back to the device (promoted_blocks).
    demoted_blocks: int = 0  # device blocks copied to the host instead of being dropped
    promoted_blocks: int = 0  # host blocks copied back to the device for a task pin
    host_hit_tokens: int = 0  # of hit_tokens, those read from host blocks
    remote_hit_tokens: int = 0  # of hit_tokens, those read from a remote tier (radixkv.sidecar)
    # read from the remote tier, hits or not (in-batch sharing reads a prefix it then extends)
    bytes_from_remote: int = 0
    bytes_to_host: int = 0  # demotions + commits written straight to the host tier
    bytes_from_host: int = 0  # host hits copied into request buffers, and promotions
    # Recurrent-state snapshots (stores with states=; all zero otherwise)
    snapshots_written: int = 0  # snapshots attached to nodes by commits
    snapshots_read: int = 0  # snapshots copied into a request's states (read_state)
    remote_snapshots_read: int = 0  # of snapshots_read, those read from a remote tier (radixkv.sidecar)
    evicted_snapshots: int = 0  # snapshots dropped for room (their KV stayed)
    uncached_snapshots: int = 0  # snapshots a commit could not keep: every slot pinned
    # matched KV past the deepest snapshot (not served: the caller computes on from there)
    junction_tokens: int = 0

    def as_dict(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dataclasses.asdict(self)
        out["hit_rate"] = self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
        return out


def store_stats(store: KVStore) -> dict[str, int | float]:
    """``store``'s counters and occupancy as one flat dict; call under the store's lock.

    Unprefixed block counts are the device pool's; ``host_*`` the host pool's (present only
    with a host tier). While no commit is copying, per tier
    ``free + cached + retired == num_blocks``. ``task_pinned_*``: distinct blocks pinned by
    task prompts, also counted in ``pinned_blocks`` / ``host_pinned_blocks``.
    """
    tree, pool = store.tree, store.pool
    out = store.counters.as_dict()
    retired_host = sum(t.num_host_blocks for t in store._retired)
    out.update(
        num_blocks=pool.num_blocks,
        free_blocks=pool.num_free,
        cached_blocks=tree.num_cached_blocks - tree.num_host_blocks,
        pinned_blocks=tree.num_pinned_blocks - tree.num_host_pinned_blocks,
        # Flushed blocks that live leases still read.
        retired_blocks=sum(t.num_cached_blocks for t in store._retired) - retired_host,
        block_size=store.block_size,
        bytes_per_token=pool.bytes_per_token,
        pool_bytes=pool.nbytes,
    )
    host = store.host_pool
    if host is not None:
        out.update(
            host_num_blocks=host.num_blocks,
            host_free_blocks=host.num_free,
            host_cached_blocks=tree.num_host_blocks,
            host_pinned_blocks=tree.num_host_pinned_blocks,
            host_retired_blocks=retired_host,
            host_pool_bytes=host.nbytes,
        )
    states = store.states
    if states is not None:
        out.update(
            snapshots=tree.num_snapshots,
            state_slots=states.num_slots,
            free_state_slots=states.num_free,
            snapshot_bytes=states.slot_bytes,
            state_pool_bytes=states.nbytes,
        )
        if store.host_states is not None:
            out.update(
                host_snapshots=tree.num_host_snapshots,
                host_state_slots=store.host_states.num_slots,
                host_free_state_slots=store.host_states.num_free,
            )
    out.update(
        task_prompts=len(store.tasks),
        task_pinned_blocks=store.tasks.device_blocks_locked(),
        task_pinned_host_blocks=store.tasks.host_blocks_locked(),
    )
    return out
