"""Which models a ``RunningBatch`` decodes (``unsupported_reason``): decoders with 1-D positions
whose layers keep full-attention KV and / or recurrent state. Its own module because both hf_patch.running_batch (which refuses the others)
and hf_patch.ragged_attention (whose kernel reads the columns such a batch keeps) ask it, and
the first imports the second.
"""

from __future__ import annotations

from hf_patch.model_spec import model_layout

__all__ = ["unsupported_reason"]


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot decode in a RunningBatch, or None: a decoder-only model with 1-D
    rotary or learned positions whose layers keep full-attention KV, recurrent / conv state
    (``ModelLayout.stateful``: per-slot states, hf_patch.slot_states), both, or nothing. Refused:
    sliding windows (the batch keeps no window), sparse-indexed (DSA) keys, KV shared between
    layers (Gemma 3n), compressed caches (DeepSeek-V4), M-RoPE and encoder-decoder models. A
    stateful model is also probed once (hf_patch.running_batch.unsupported_reason)."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no config"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    layer_types = getattr(text, "layer_types", None)
    windowed = {"sliding_attention", "chunked_attention"}
    if layer_types and any(t in windowed for t in layer_types):
        return f"layers of types {sorted(set(layer_types))} (sliding or chunked attention is not supported)"
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return "a sliding-window attention model"
    if getattr(text, "num_kv_shared_layers", 0):
        return "layers that share KV (num_kv_shared_layers: rows decode in generate() calls)"
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    inner = getattr(model, "model", None)
    if (isinstance(rope, dict) and ("mrope_section" in rope or rope.get("rope_type") == "mrope")) or any(
        hasattr(m, "get_rope_index") for m in (model, inner) if m is not None
    ):
        return "M-RoPE (3-D positions)"
    if getattr(model, "get_input_embeddings", None) is None:
        return "the model has no input embeddings"
    try:
        layout = model_layout(model)
    except ValueError as e:  # UnsupportedModelError: no RadixCache call would run either
        return str(e)
    if layout.index_layers or layout.compressors or layout.padding_dependent:
        return "sparse-indexed or compressed attention layers (rows decode in generate() calls)"
    # (an attention-only model: KV in every layer, as before; "none" layers only beside states)
    allowed = {"kv", "state", "kv+state", "none"} if layout.stateful else {"kv"}
    if not set(layout.kinds) <= allowed:
        return f"cache layers of kinds {sorted(set(layout.kinds))} (rows decode in generate() calls)"
    return None
