"""Cheap detection of weights that changed since a store's blocks were computed.

A fingerprint is every parameter's storage address and autograd version counter. In-place
updates (optimizer steps, ``load_state_dict``, ``param.add_`` under ``no_grad``) bump the
version; replacing a parameter changes the address. Writes through ``param.data`` bypass the
version counter and are NOT seen: call ``store.flush()`` after such surgery.
Cost: one pass over the parameter list (microseconds for hundreds of tensors), no device sync.
"""

from __future__ import annotations

import logging

from radixkv import KVStore

logger = logging.getLogger(__name__)


def fingerprint(model) -> int:
    return hash(tuple((p.data_ptr(), p._version) for p in model.parameters()))


def flush_if_weights_changed(store: KVStore, model) -> bool:
    """Flush ``store`` when ``model``'s weights differ from those its blocks were computed with."""
    current = fingerprint(model)
    seen = getattr(store, "weights_fingerprint", None)
    if seen == current:
        return False
    store.weights_fingerprint = current
    if seen is None:
        return False
    flushed = store.flush()
    logger.warning(
        "radixkv: weights of %s changed since its KV was cached; flushed the store (%d blocks)",
        type(model).__name__,
        flushed,
    )
    return True
