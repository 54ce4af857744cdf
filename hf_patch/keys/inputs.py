"""Which generate() arguments the cache key covers: an allowlist, never a denylist.

generate() splits its keyword arguments into generation settings (``GenerationConfig`` fields:
how tokens are chosen, never what the prompt's KV is) and model inputs (``model_kwargs``:
everything passed on to ``forward``). A model input can change the KV of the prompt
(``token_type_ids``, custom ``position_ids``, a 4-D mask, ``pixel_values``, a model's own
kwargs), and the key holds only token ids, extra ids, namespaces and the adapter. So a call that
passes any model input outside ``KEYED_INPUTS`` runs without the store: nothing read, nothing
committed, output exactly stock's, counted as an uncacheable request and logged once per
argument name.
"""

from __future__ import annotations

import inspect
import logging
import threading

from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

logger = logging.getLogger(__name__)

# Model inputs whose effect on the KV the key covers (ids and the left-padding mask, checked
# per call in hf_patch.request), or that do not touch the KV at all.
KEYED_INPUTS = frozenset(
    {
        "input_ids",
        "inputs",
        "attention_mask",  # 2-D left padding; any other mask turns reuse off in Request.preload
        "inputs_embeds",  # reused only with RadixCache(extra_ids=...), see hf_patch.patch
        "past_key_values",
        "cache_params",  # the Mamba families' name for the cache (hf_patch.patch checks it is ours)
        "use_cache",
        "logits_to_keep",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
# generate()'s own arguments that are not GenerationConfig fields (and never reach forward).
_GENERATE_ARGS = frozenset(
    {"tokenizer", "assistant_tokenizer", "target_tokenizer", "trust_remote_code", "custom_generate"}
    | set(inspect.signature(GenerationMixin.generate).parameters)
)
_CONFIG_FIELDS = frozenset(vars(GenerationConfig()))
_logged: set[str] = set()
_lock = threading.Lock()


def unkeyed_inputs(kwargs: dict, also_keyed: frozenset[str] = frozenset()) -> list[str]:
    """Names of the model inputs in generate()'s ``kwargs`` that the key does not cover
    (``also_keyed``: inputs the caller keys for this model, e.g. hf_patch.keys.multimodal's images)."""
    return sorted(
        name
        for name, value in kwargs.items()
        if value is not None
        and name not in KEYED_INPUTS
        and name not in also_keyed
        and name not in _GENERATE_ARGS
        and name not in _CONFIG_FIELDS
    )


def log_once(reason: str) -> None:
    """One log line per distinct reason for the process's lifetime."""
    with _lock:
        if reason in _logged:
            return
        _logged.add(reason)
    logger.warning("radixkv: generating without the prefix cache: %s", reason)
