"""KV events of a model's store: block hashes from the model's identity and its keys.

``record_events(model, store, log)`` attaches a ``radixkv.events.TreeRecorder`` to ``store``,
naming each namespace as the sidecar does (``hf_patch.stores.sidecar_namer``: the model's
identity digest and the encoded namespace), so a prefix has one hash in every replica of the
model, in the sidecar and after a restart; namespaces the sidecar would keep local (another
model object's, or ones without a file form) publish nothing. A namespace keyed by a PEFT
adapter (``KeyedNamespace(ns, ("adapter", name, ...))``) names it as ``lora_name``.
"""

from __future__ import annotations

from collections.abc import Hashable

from hf_patch.stores import sidecar_namer
from radixkv import KVStore
from radixkv.events import EventLog, TreeRecorder
from radixkv.persist.manifest import KeyedNamespace


def _lora_name(namespace: Hashable) -> str | None:
    inner = namespace[1] if type(namespace) is tuple and len(namespace) == 2 else None
    if type(inner) is KeyedNamespace and len(inner.parts) > 1 and inner.parts[0] == "adapter":
        return str(inner.parts[1])
    return None


def record_events(model, store: KVStore, log: EventLog) -> TreeRecorder:
    """Publish ``store``'s changes into ``log`` from now on (what it holds now first)."""
    recorder = TreeRecorder(log, store.block_size, sidecar_namer(model, store.pool), lora_name=_lora_name)
    store.set_listener(recorder)
    return recorder
