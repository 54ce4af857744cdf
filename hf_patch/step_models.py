"""Which models a ``RunningBatch`` decodes (``unsupported_reason``): full-attention decoders with
1-D positions. Its own module because both hf_patch.running_batch (which refuses the others)
and hf_patch.ragged_attention (whose kernel reads the columns such a batch keeps) ask it, and
the first imports the second.
"""

from __future__ import annotations

from hf_patch.model_spec import model_layout

__all__ = ["unsupported_reason"]


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot decode in a RunningBatch, or None: it must be a decoder-only model
    whose layers are all full attention with 1-D rotary or learned positions."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no config"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    layer_types = getattr(text, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return f"layers of types {sorted(set(layer_types))} (only full attention is supported)"
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return "a sliding-window attention model"
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
    if layout.stateful or layout.index_layers or set(layout.kinds) != {"kv"}:
        # rows would need their states (or indexer keys, or shared layers) carried per slot
        return "recurrent, sparse-indexed or shared-KV layers (rows decode in generate() calls)"
    return None
