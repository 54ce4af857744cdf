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
import os
import threading
import weakref
from collections.abc import Hashable

from hf_patch.cache_files import restore_store_of
from hf_patch.identity import current_identity, identity_digest, kv_layout
from hf_patch.keys.weights import model_scope
from hf_patch.model_spec import layer_specs
from radixkv import BlockPool, KVStore
from radixkv.persist.manifest import encode_namespace
from radixkv.sidecar.client import CONNECT_TIMEOUT_S, TIMEOUT_S, SidecarTier
from radixkv.store.tier import host_pool_for

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
DEFAULT_BUDGET_BYTES = 1 << 30  # 1 GiB of KV per model unless RADIXKV_CACHE_TOKENS/BYTES say otherwise

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
    eval ranks that meet one preamble at the same moment; docs/sidecar.md).
    ``RADIXKV_SIDECAR_TIMEOUT_S`` (10) bounds each call to it and
    ``RADIXKV_SIDECAR_CONNECT_TIMEOUT_S`` (5) attaching: past them a call is a miss (or a write
    not made), with a warning naming the socket and the timeout, and the connection stays.
    """
    if budget_tokens is not None and budget_bytes is not None:
        raise ValueError("give at most one of budget_tokens= and budget_bytes=")
    if host_cache_tokens is not None and host_cache_bytes is not None:
        raise ValueError("give at most one of host_cache_tokens= and host_cache_bytes=")
    if host_cache_tokens is None and host_cache_bytes is None:
        host_cache_tokens = _env_int("RADIXKV_HOST_CACHE_TOKENS")
        host_cache_bytes = None if host_cache_tokens else _env_int("RADIXKV_HOST_CACHE_BYTES")
    block_size = block_size or _env_int("RADIXKV_BLOCK_SIZE") or DEFAULT_BLOCK_SIZE
    if budget_tokens is None and budget_bytes is None:
        budget_tokens = _env_int("RADIXKV_CACHE_TOKENS")
        budget_bytes = None if budget_tokens else (_env_int("RADIXKV_CACHE_BYTES") or DEFAULT_BUDGET_BYTES)
    if sidecar is None:
        sidecar = os.environ.get("RADIXKV_SIDECAR") or None
    specs = layer_specs(model)
    pool = BlockPool.from_budget(specs, block_size, tokens=budget_tokens, bytes=budget_bytes)
    host = None
    if host_cache_tokens is not None or host_cache_bytes is not None:
        host = host_pool_for(pool, tokens=host_cache_tokens, bytes=host_cache_bytes)
    remote = None
    if sidecar is not None:
        remote = SidecarTier(
            os.fspath(sidecar),
            pool,
            sidecar_namer(model, pool),
            wait_s=_env_seconds("RADIXKV_SIDECAR_WAIT_S", 0.0, 60, zero=True),
            timeout_s=_env_seconds("RADIXKV_SIDECAR_TIMEOUT_S", TIMEOUT_S, 3600),
            connect_timeout_s=_env_seconds("RADIXKV_SIDECAR_CONNECT_TIMEOUT_S", CONNECT_TIMEOUT_S, 3600),
        )
    store = KVStore(pool, host, remote=remote)
    logger.info(
        "radixkv store for %s: %d blocks x %d tokens, %.1f MiB, %d layers%s%s",
        type(model).__name__,
        pool.num_blocks,
        block_size,
        pool.nbytes / 2**20,
        len(specs),
        f"; host tier {host.num_blocks} blocks, {host.nbytes / 2**20:.1f} MiB" if host is not None else "",
        f"; sidecar {sidecar}" if sidecar is not None else "",
    )
    if restore is not None:
        restore_store_of(model, restore, store)
    return store


def sidecar_namer(model, pool: BlockPool):
    """``namer(store namespace) -> (identity digest, namespace key) | None`` for ``model``'s keys.

    hf_patch keys a store by ``(model scope, namespace)``; the scope is a number private to this
    process, so the sidecar gets the model's identity digest (weights, config, KV layout: equal
    across processes for equal models) and the namespace encoded as cache files write it.
    Namespaces of other model objects, or that cannot be encoded, stay local (None).
    """
    ref = weakref.ref(model)
    scope = model_scope(model)
    layout = kv_layout(pool.layers, pool.block_size)
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
    specs = layer_specs(model)
    with _lock:
        store = _default_stores.get(model)
    if store is not None and tuple(store.pool.layers) == specs:
        return store
    if store is not None:
        logger.warning("radixkv: %s changed dtype/device; replacing its default store", type(model).__name__)
    fresh = build_store(model)
    with _lock:
        store = _default_stores.get(model)
        if store is None or tuple(store.pool.layers) != specs:
            _default_stores[model] = store = fresh
    return store
