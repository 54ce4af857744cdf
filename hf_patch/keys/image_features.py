"""Encoded image features by image content: vLLM's encoder cache, for one model.

The prefix store holds an image's KV only in whole blocks, and an image rarely ends on a block
boundary: a second question about an image usually reuses its KV up to the block that also
holds the new question, and the model still needs the features of that image's last
placeholders. Keeping each image's features (one row per placeholder) by its content id
(hf_patch.keys.multimodal) lets that prefill, and any prompt that shows a known image in a new
context, skip the vision tower entirely.

One LRU per model, bounded in bytes (``RADIXKV_IMAGE_FEATURES_BYTES``, default 64 MiB; 0 turns
it off), dropped whole when the model's weights change (hf_patch.keys.weights.fingerprint), and not
used at all for a model with PEFT adapters (the features may depend on the adapter).
Features stay on the device they were computed on. Thread-safe.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict

from hf_patch.keys.adapters import tuner_layers
from hf_patch.keys.encoder_outputs import Features
from hf_patch.keys.weights import fingerprint

DEFAULT_BYTES = 64 << 20


class FeatureCache:
    """content id -> encoder_outputs.Features (one row per placeholder), least recently used
    dropped first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.entries: OrderedDict[int, Features] = OrderedDict()
        self.weights: int | None = None  # the fingerprint the entries were computed under
        # modality -> how the model's encoder hands its features over (encoder_outputs.Container);
        # features fed back without an encoder output of this call keep it.
        self.containers: dict = {}
        self.lock = threading.Lock()

    def get(self, content_id: int) -> Features | None:
        with self.lock:
            rows = self.entries.get(content_id)
            if rows is not None:
                self.entries.move_to_end(content_id)
            return rows

    def put(self, content_id: int, rows: Features) -> None:
        size = rows.nbytes
        if size > self.max_bytes:
            return
        rows = Features(rows.pooled.detach(), tuple(d.detach() for d in rows.deep))
        with self.lock:
            old = self.entries.pop(content_id, None)
            if old is not None:
                self.bytes -= old.nbytes
            self.entries[content_id] = rows
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, gone = self.entries.popitem(last=False)
                self.bytes -= gone.nbytes


_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def for_model(model) -> FeatureCache | None:
    """``model``'s feature cache, emptied if its weights changed since; None when turned off."""
    max_bytes = int(os.environ.get("RADIXKV_IMAGE_FEATURES_BYTES", DEFAULT_BYTES))
    if max_bytes <= 0 or tuner_layers(model):
        # With PEFT adapters the vision tower's output may depend on the adapter (a LoRA on
        # q_proj / v_proj reaches a CLIP tower's attention too): features are not shared then.
        return None
    current = fingerprint(model)
    with _lock:
        cache = _caches.get(model)
        if cache is None or cache.max_bytes != max_bytes:
            cache = _caches[model] = FeatureCache(max_bytes)
    with cache.lock:
        if cache.weights != current:
            cache.entries.clear()
            cache.bytes = 0
            cache.weights = current
    return cache
