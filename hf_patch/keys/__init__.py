"""What a row's KV depends on besides its token ids, and how each part enters the cache key.

``row_key``: the key itself (namespace root, per-token extra ids folded into key tokens,
``SharedPrefix``); ``weights``: which model (scope) and whether its weights changed;
``adapters``: the active PEFT adapter per row; ``multimodal``: image / video content ids over
their placeholder spans (``vlm_families``: the families keyed and their input layouts,
``item_layout``: where an item sits in them), ``encoder_outputs`` and ``image_features``
(encoded items by content id, fed back to the model); ``inputs``: the allowlist of model inputs
the key covers (anything else runs the call uncached).
"""

from hf_patch.keys.row_key import RowKey, SharedPrefix, combine, fold, namespace_salt, row_key

__all__ = ["RowKey", "SharedPrefix", "combine", "fold", "namespace_salt", "row_key"]
