"""The stores hf_patch builds for a model: ``build_store`` (a new one) and ``default_store`` (the
one ``RadixCache()`` uses, one per model object).

A store may have a sidecar behind its own pools (``sidecar=PATH`` or ``RADIXKV_SIDECAR``): a
process beside this one, holding blocks for every process of the machine (``radixkv.sidecar``).
Its keys carry the model's identity (``hf_patch.identity``), so two models on one sidecar never
read each other's blocks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import weakref
from collections.abc import Hashable

from hf_patch.cache_files import restore_store_of
from hf_patch.identity import current_identity, identity_digest, kv_layout
from hf_patch.keys.weights import model_scope
from hf_patch.model_spec import ModelLayout, model_layout
from radixkv import BlockPool, KVStore, StatePool
from radixkv.persist.manifest import encode_namespace
from radixkv.sidecar.client import CONNECT_TIMEOUT_S, TIMEOUT_S, SidecarTier
from radixkv.store.state_pool import host_states_for, snapshot_bytes
from radixkv.store.tier import host_pool_for

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
DEFAULT_BUDGET_BYTES = 1 << 30  # 1 GiB of KV per model unless RADIXKV_CACHE_TOKENS/BYTES say otherwise
# Models with recurrent layers: the share of the byte budget their snapshots get (their own
# pool: snapshots never evict KV), and at least this many snapshots where that stays within half
# of the budget.
STATE_SHARE = 0.25
MIN_SNAPSHOTS = 16
# Tokens between the snapshots a prefill takes (hf_patch.recurrent): the most a second request
# over the same document recomputes. By default the tokens whose KV weighs one snapshot, as a
# power of two, at least 256 (benchmarks/bench_hybrid.py: 256 keeps a second question over a
# 2,000-token document >= 5x stock; Qwen3.5's real shapes give 1,024, where snapshots cost 1.5x
# the KV they cover instead of 6.2x); 2,048 for a model without KV (snapshots are all it keeps).
# Rounded up to a multiple of the block size.
MIN_SNAPSHOT_INTERVAL = 256
STATE_ONLY_SNAPSHOT_INTERVAL = 2048
# A model without attention KV: blocks hold no bytes, they only number the tree's token runs.
STATE_ONLY_TOKENS = 1 << 20

_default_stores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"environment variable {name} must be positive, got {value}")
    return value


def _env_seconds(name: str, default: float, most: float, *, zero: bool = False) -> float:
    """Seconds from environment variable ``name`` (unset or empty: ``default``), in (0, most]
    (``zero``: [0, most]); ValueError naming the variable otherwise."""
    raw = os.environ.get(name) or ""
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be seconds, got {raw!r}") from None
    if not (0 <= value <= most if zero else 0 < value <= most):
        bounds = f"[0, {most:g}]" if zero else f"(0, {most:g}]"
        raise ValueError(f"environment variable {name} must be seconds in {bounds}, got {raw!r}")
    return value


def build_store(
    model,
    block_size: int | None = None,
    budget_tokens: int | None = None,
    budget_bytes: int | None = None,
    restore: str | os.PathLike | None = None,
    *,
    host_cache_tokens: int | None = None,
    host_cache_bytes: int | None = None,
    sidecar: str | os.PathLike | None = None,
    state_bytes: int | None = None,
    snapshot_interval: int | None = None,
) -> KVStore:
    """A new KVStore shaped for ``model``.

    Budget: ``budget_tokens`` or ``budget_bytes`` (at most one), else the environment's
    ``RADIXKV_CACHE_TOKENS`` / ``RADIXKV_CACHE_BYTES``, else 1 GiB. Block size: argument,
    else ``RADIXKV_BLOCK_SIZE``, else 16. The pool is preallocated with ``torch.empty``.
    ``restore``: a file written by ``hf_patch.save_cache`` for this model, loaded into the new
    store (raises radixkv.CacheFileError, building nothing, when it is damaged or another model's).

    Host tier (none by default): ``host_cache_tokens`` or ``host_cache_bytes``, else
    ``RADIXKV_HOST_CACHE_TOKENS`` / ``RADIXKV_HOST_CACHE_BYTES``: a CPU pool of that size
    behind the device pool (page-locked when the model is on CUDA); blocks evicted from the
    device are demoted there instead of dropped.

    Sidecar (none by default): ``sidecar``, else ``RADIXKV_SIDECAR``: the Unix socket of a
    ``python -m radixkv.sidecar``. A prefix missing here is asked of it, and what this store
    commits is written through to it (in the background) for every other process. A sidecar
    that is not running (yet, or any more) costs nothing but a connect attempt now and then.
    ``RADIXKV_SIDECAR_WAIT_S`` (default 0: off): a prompt prefix another process is computing
    right now is waited for, up to that many seconds, instead of computed again (batch and
    eval ranks that meet one preamble at the same moment; docs/sidecar.md). A model with
    recurrent layers shares its snapshots through the sidecar with its blocks.
    ``RADIXKV_SIDECAR_TIMEOUT_S`` (10) bounds each call to it and
    ``RADIXKV_SIDECAR_CONNECT_TIMEOUT_S`` (5) attaching: past them a call is a miss (or a write
    not made), with a warning naming the socket and the timeout, and the connection stays.

    Models with recurrent layers (Mamba, linear attention, conv: ``hf_patch.model_spec``) also
    get a pool of state snapshots: ``state_bytes``, else ``RADIXKV_STATE_BYTES``, else a quarter
    of the byte budget (16 snapshots where that is at most half of it), the KV pool the rest; a
    model with no attention KV gives its whole budget to snapshots; neither pool ever exceeds the
    budget (one that holds no snapshot is refused). ``snapshot_interval`` (else
    ``RADIXKV_SNAPSHOT_INTERVAL``, else ``default_snapshot_interval``): tokens between the
    snapshots a prefill takes. The host tier gets the same split.

    DeepSeek-V4 (``ModelLayout.snapshot_grain``: the lcm of its compress rates, 128 for the
    released configs): the block size must be a multiple of the grain, so that no compression
    window straddles two blocks (a block's compressed entries are those of its own windows);
    the default is the smallest such multiple of 16.
    """
    if budget_tokens is not None and budget_bytes is not None:
        raise ValueError("give at most one of budget_tokens= and budget_bytes=")
    if host_cache_tokens is not None and host_cache_bytes is not None:
        raise ValueError("give at most one of host_cache_tokens= and host_cache_bytes=")
    if host_cache_tokens is None and host_cache_bytes is None:
        host_cache_tokens = _env_int("RADIXKV_HOST_CACHE_TOKENS")
        host_cache_bytes = None if host_cache_tokens else _env_int("RADIXKV_HOST_CACHE_BYTES")
    layout = model_layout(model)
    grain = layout.snapshot_grain
    block_size = block_size or _env_int("RADIXKV_BLOCK_SIZE") or math.lcm(DEFAULT_BLOCK_SIZE, grain)
    if block_size % grain:
        raise ValueError(
            f"{type(model).__name__} needs a block size that is a multiple of {grain} (its compression "
            f"windows must not straddle blocks), got {block_size}; see docs/models.md"
        )
    if budget_tokens is None and budget_bytes is None:
        budget_tokens = _env_int("RADIXKV_CACHE_TOKENS")
        budget_bytes = None if budget_tokens else (_env_int("RADIXKV_CACHE_BYTES") or DEFAULT_BUDGET_BYTES)
    if sidecar is None:
        sidecar = os.environ.get("RADIXKV_SIDECAR") or None
    specs = layout.specs
    if state_bytes is None:
        state_bytes = _env_int("RADIXKV_STATE_BYTES")
    states = host_states = None
    if layout.stateful:
        pool, states = _stateful_pools(layout, block_size, budget_tokens, budget_bytes, state_bytes)
    else:
        pool = BlockPool.from_budget(specs, block_size, tokens=budget_tokens, bytes=budget_bytes)
    host = None
    if host_cache_tokens is not None or host_cache_bytes is not None:
        if layout.stateful:
            host, host_states = _host_pools(pool, states, host_cache_tokens, host_cache_bytes)
        else:
            host = host_pool_for(pool, tokens=host_cache_tokens, bytes=host_cache_bytes)
    remote = None
    if sidecar is not None:
        remote = SidecarTier(
            os.fspath(sidecar),
            pool,
            sidecar_namer(model, pool),
            states=states,
            wait_s=_env_seconds("RADIXKV_SIDECAR_WAIT_S", 0.0, 60, zero=True),
            timeout_s=_env_seconds("RADIXKV_SIDECAR_TIMEOUT_S", TIMEOUT_S, 3600),
            connect_timeout_s=_env_seconds("RADIXKV_SIDECAR_CONNECT_TIMEOUT_S", CONNECT_TIMEOUT_S, 3600),
        )
    store = KVStore(pool, host, remote=remote, states=states, host_states=host_states)
    if layout.stateful:
        interval = (
            snapshot_interval or _env_int("RADIXKV_SNAPSHOT_INTERVAL") or default_snapshot_interval(layout)
        )
        store.snapshot_interval = -(-interval // block_size) * block_size
        if states.num_slots < MIN_SNAPSHOTS:
            logger.warning(
                "radixkv: %s's store holds only %d state snapshots of %.1f MiB: give it more (state_bytes=, "
                "RADIXKV_STATE_BYTES, or a larger budget) or take fewer (snapshot_interval=)",
                type(model).__name__, states.num_slots, states.slot_bytes / 2**20,
            )  # fmt: skip
    logger.info(
        "radixkv store for %s: %d blocks x %d tokens, %.1f MiB, %d layers%s%s%s",
        type(model).__name__,
        pool.num_blocks,
        block_size,
        pool.nbytes / 2**20,
        len(specs),
        f"; {states.num_slots} state snapshots of {states.slot_bytes / 2**20:.2f} MiB"
        if states is not None
        else "",
        f"; host tier {host.num_blocks} blocks, {host.nbytes / 2**20:.1f} MiB" if host is not None else "",
        f"; sidecar {sidecar}" if sidecar is not None else "",
    )
    if restore is not None:
        restore_store_of(model, restore, store)
    return store


def default_snapshot_interval(layout: ModelLayout) -> int:
    """Tokens between a prefill's snapshots when none is given (see MIN_SNAPSHOT_INTERVAL)."""
    per_token = sum(s.bytes_per_token for s in layout.specs)
    if not per_token:
        return STATE_ONLY_SNAPSHOT_INTERVAL
    tokens = snapshot_bytes(layout.state_specs) // per_token
    return max(MIN_SNAPSHOT_INTERVAL, 1 << max(0, tokens.bit_length() - 1))


def _stateful_pools(
    layout: ModelLayout, block_size: int, tokens: int | None, nbytes: int | None, state_bytes: int | None
) -> tuple[BlockPool, StatePool]:
    """The block pool and the snapshot pool of a model with recurrent layers (see build_store):
    neither ever takes more than the budget (a byte budget that holds no snapshot is refused)."""
    per_snapshot = snapshot_bytes(layout.state_specs)
    if not layout.specs:  # no attention KV: the whole budget holds snapshots
        pool = BlockPool([], STATE_ONLY_TOKENS // block_size, block_size)
        return pool, _state_pool(layout, state_bytes or nbytes or DEFAULT_BUDGET_BYTES)
    if tokens is not None:
        pool = BlockPool.from_budget(layout.specs, block_size, tokens=tokens)
        total = pool.nbytes / (1 - STATE_SHARE)
    else:
        total = nbytes
    if state_bytes is None:  # a quarter, or 16 snapshots if that is at most half of the budget
        state_bytes = int(max(total * STATE_SHARE, min(MIN_SNAPSHOTS * per_snapshot, total / 2)))
    if tokens is None:
        if nbytes - state_bytes <= 0:
            raise ValueError(
                f"a budget of {nbytes} bytes leaves nothing for KV beside {state_bytes} bytes of snapshots"
            )
        pool = BlockPool.from_budget(layout.specs, block_size, bytes=nbytes - state_bytes)
    return pool, _state_pool(layout, state_bytes)


def _state_pool(layout: ModelLayout, nbytes: int) -> StatePool:
    per_snapshot = snapshot_bytes(layout.state_specs)
    if nbytes < per_snapshot:
        raise ValueError(
            f"a state budget of {nbytes} bytes holds no snapshot of this model ({per_snapshot} bytes: "
            "every recurrent layer's state for one row); give a larger budget or state_bytes="
        )
    return StatePool.from_budget(layout.state_specs, nbytes)


def _host_pools(
    pool: BlockPool, states: StatePool, tokens: int | None, nbytes: int | None
) -> tuple[BlockPool, StatePool]:
    """The host tier's mirrors of a stateful store's pools, split as the device's are."""
    share = states.nbytes / (states.nbytes + pool.nbytes)
    if tokens is not None:
        host = (
            host_pool_for(pool, tokens=tokens)
            if pool.layers
            else BlockPool([], pool.num_blocks, pool.block_size)
        )
        state_bytes = int(host.nbytes * share / max(1e-9, 1 - share)) if pool.layers else states.nbytes
    else:
        state_bytes = int(nbytes * share)
        host = (
            host_pool_for(pool, bytes=max(nbytes - state_bytes, 1))
            if pool.layers
            else BlockPool([], pool.num_blocks, pool.block_size)
        )
    return host, host_states_for(states, max(state_bytes, states.slot_bytes))


def sidecar_namer(model, pool: BlockPool):
    """``namer(store namespace) -> (identity digest, namespace key) | None`` for ``model``'s keys.

    hf_patch keys a store by ``(model scope, namespace)``; the scope is a number private to this
    process, so the sidecar gets the model's identity digest (weights, config, KV layout: equal
    across processes for equal models) and the namespace encoded as cache files write it.
    Namespaces of other model objects, or that cannot be encoded, stay local (None).
    """
    ref = weakref.ref(model)
    scope = model_scope(model)
    layout = kv_layout(pool.layers, pool.block_size, model_layout(model).state_specs)
    memo: dict = {}

    def namer(namespace: Hashable) -> tuple[bytes, bytes] | None:
        owner = ref()
        if owner is None or type(namespace) is not tuple or len(namespace) != 2 or namespace[0] != scope:
            return None
        try:
            key = encode_namespace(namespace[1])
        except ValueError:
            return None
        identity = current_identity(owner)
        digest = memo.get(id(identity))
        if digest is None:
            memo.clear()
            digest = memo[id(identity)] = (identity_digest(identity, layout), identity)
        return digest[0], json.dumps(key, sort_keys=True, separators=(",", ":")).encode()

    return namer


def default_store(model) -> KVStore:
    """The store ``RadixCache()`` uses for ``model``: built on first use, one per model object.

    A model converted since (``.half()``, ``.to(device)``) gets a new store of its new shape;
    the old one is dropped with its KV, which the converted weights would not reproduce.
    """
    layout = model_layout(model)
    specs = layout.specs

    def fits(store: KVStore) -> bool:
        states = store.states.specs if store.states is not None else ()
        return tuple(store.pool.layers) == specs and tuple(states) == layout.state_specs

    with _lock:
        store = _default_stores.get(model)
    if store is not None and fits(store):
        return store
    if store is not None:
        logger.warning("radixkv: %s changed dtype/device; replacing its default store", type(model).__name__)
    fresh = build_store(model)
    with _lock:
        store = _default_stores.get(model)
        if store is None or not fits(store):
            _default_stores[model] = store = fresh
    return store
