"""Tiny seeded hybrid / recurrent / sparse-indexed / shared-KV models for the radixkv hybrid work.

The companion of ``tests/hf_models.py`` (same vocabulary, special ids and ``BASE`` sizes): every model is
built from a config with random weights (no hub), fp32, eval mode, small enough that one ``generate()`` of
~80 prompt tokens + 6 new tokens takes well under a second on one CPU thread.

Every config mixes its layer kinds (at least two attention-bearing and two recurrent layers where the family
has both), uses a recurrent / SSD chunk size far below the prompt length where the config has one (so cuts at
and off a chunk boundary are both testable), and an ``index_topk`` below the prompt length for the
sparse-indexed (DSA) families, so the sparse selection really matters.

``layer_pattern(model)`` spells out the per-layer cache classes that ``DynamicCache(config=...)`` builds:

    A   DynamicLayer                                    full attention KV
    S   DynamicSlidingWindowLayer                       sliding / chunked attention KV
    L   LinearAttentionLayer                            conv + recurrent state only (mamba, GDN, KDA, conv)
    H   LinearAttentionAndFullAttentionLayer            both, in one layer ("hybrid")
    HS  LinearAttentionAndSlidingWindowAttentionLayer   both, sliding ("hybrid_sliding")
    I   DynamicIndexedLayer                             MLA / attention KV + DSA indexer keys
    D   DummyLayer                                      no cache (mlp / moe layer, or a KV-sharing consumer)
    C / Z  DeepSeek-V4 compressed sparse (CSA) / heavily compressed (HCA) layers (model-registered classes)

A family whose cache class is not built from ``DynamicCache(config)`` (MiniMax builds its own
``MiniMaxCache``) or that keeps its recurrent state outside the cache (RecurrentGemma keeps it on the
modules) is still listed; see ``CACHE_NOTES``.
"""

from __future__ import annotations

import importlib

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers import cache_utils as cu

VOCAB = 128
PAD, BOS, EOS = 0, 1, 2
FIRST_TOKEN = 3  # prompts never contain pad / bos / eos ids
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    tie_word_embeddings=False,
)
WINDOW = 8  # sliding-window layers get a window far smaller than the prompts (~80-130 tokens)
CHUNK = 16  # Mamba-2 / SSD chunk size and MiniMax lightning block size, where the config has the field
TOPK = 16  # DSA index_topk: far below the prompt length
INDEX_HEADS = 16
GDN_CHUNK = 64  # the torch gated-delta-rule / KDA kernels' fixed chunk size (not a config field)

LIN, FULL, SW, IDX = "linear_attention", "full_attention", "sliding_attention", "indexed_attention"
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _cfg(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, **{**BASE, **overrides})


def _gdn(**kw):
    """Gated-DeltaNet (Qwen3.5 / Qwen3-Next / OLMo-hybrid style) linear-attention sizes."""
    return dict(
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        head_dim=16,
        **kw,
    )


def _mla(**kw):
    """Small MLA sizes (DeepSeek-V3 style) shared by the DSA / KDA families."""
    return dict(
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        head_dim=8,
        num_key_value_heads=4,
        **kw,
    )


def _dsa(**kw):
    return _mla(index_topk=TOPK, index_head_dim=16, index_n_heads=INDEX_HEADS, **kw)


def _moe(**kw):
    return dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, **kw)


def _mamba2(**kw):
    """Mamba-2 mixer sizes with the bamba / granite / falcon-h1 field names."""
    return dict(
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=CHUNK,
        **kw,
    )


# name -> (config factory, attn_implementation or None for the model's default)
HYBRID_CONFIGS = {
    # -- attention + LinearAttentionLayer ------------------------------------------------------------
    "qwen3_5_text": (lambda: _cfg("qwen3_5_text", layer_types=[LIN, FULL, LIN, FULL], **_gdn()), "sdpa"),
    # the composite (vision + text) config: AutoModelForCausalLM builds the same text-only Qwen3_5ForCausalLM
    "qwen3_5": (
        lambda: AutoConfig.for_model(
            "qwen3_5",
            text_config=HYBRID_CONFIGS["qwen3_5_text"][0]().to_dict(),
            vision_config=dict(
                depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64
            ),
            tie_word_embeddings=False,
        ),
        "sdpa",
    ),
    "qwen3_5_moe_text": (
        lambda: _cfg(
            "qwen3_5_moe_text",
            layer_types=[LIN, FULL, LIN, FULL],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **_gdn(),
        ),
        "sdpa",
    ),
    "qwen3_next": (
        lambda: _cfg(
            "qwen3_next",
            layer_types=[LIN, FULL, LIN, FULL],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **_gdn(),
        ),
        "sdpa",
    ),
    "kimi_linear": (
        lambda: _cfg(
            "kimi_linear",
            layer_types=[LIN, FULL, LIN, FULL],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            linear_head_dim=16,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_token=2,
            num_shared_experts=1,
            moe_intermediate_size=32,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            num_key_value_heads=4,
        ),
        "sdpa",
    ),
    "olmo_hybrid": (
        lambda: _cfg(
            "olmo_hybrid",
            layer_types=[LIN, FULL, LIN, FULL],
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            initializer_range=0.1,  # 0.02: 3 of 8 prompts continue with one constant token
        ),
        "sdpa",
    ),
    "jamba": (
        lambda: _cfg(
            "jamba",
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
        ),
        "sdpa",
    ),
    "bailing_hybrid": (
        lambda: _cfg(
            "bailing_hybrid",
            num_hidden_layers=4,
            layer_group_size=2,
            layer_types=[LIN, FULL, LIN, FULL],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            first_k_dense_replace=1,
            linear_head_dim=16,
            linear_num_heads=4,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_token=2,
            num_shared_experts=1,
            num_expert_group=1,
            topk_group=1,
            moe_intermediate_size=32,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            head_dim=16,
            num_key_value_heads=4,
            num_nextn_predict_layers=0,
            rope_parameters=ROPE,
        ),
        "sdpa",
    ),
    "nemotron_h": (
        lambda: _cfg(
            "nemotron_h",
            layers_block_type=[LIN, FULL, "moe", LIN, FULL, "mlp"],
            head_dim=16,
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=1,
            conv_kernel=4,
            expand=1,
            chunk_size=CHUNK,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32,
        ),
        "sdpa",
    ),
    "recurrent_gemma": (
        lambda: _cfg(
            "recurrent_gemma",
            num_hidden_layers=6,
            lru_width=64,
            attention_window_size=WINDOW,
            conv1d_width=4,
            block_types=["recurrent", "recurrent", "attention"],
            head_dim=16,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            w_init_variance_scale=1.0,
            final_w_init_variance_scale=1.0,
        ),
        "sdpa",
    ),
    "lfm3": (
        lambda: _cfg(
            "lfm3",
            num_hidden_layers=6,
            layer_types=["conv", FULL, "conv", SW, "conv", FULL],
            sliding_window=WINDOW,
            head_dim=16,
            conv_L_cache=3,
            tie_word_embeddings=True,
        ),
        "sdpa",
    ),
    "minimax": (
        lambda: _cfg(
            "minimax",
            layer_types=[FULL, LIN, FULL, LIN],
            head_dim=16,
            num_local_experts=2,
            num_experts_per_tok=1,
            block_size=CHUNK,
            initializer_range=0.1,  # 0.02: some prompts continue with one constant token
        ),
        "sdpa",
    ),
    # -- recurrent only / mixed in-layer -----------------------------------------------------------
    "mamba": (
        lambda: _cfg(
            "mamba",
            num_hidden_layers=4,
            state_size=8,
            expand=2,
            conv_kernel=4,
            time_step_rank=8,
            intermediate_size=128,
            use_mambapy=False,
        ),
        None,
    ),
    "mamba2": (
        lambda: _cfg(
            "mamba2",
            num_hidden_layers=4,
            num_heads=4,
            head_dim=32,
            state_size=16,
            n_groups=1,
            expand=2,
            conv_kernel=4,
            time_step_rank=8,
            chunk_size=CHUNK,
        ),
        None,
    ),
    "falcon_mamba": (
        lambda: _cfg(
            "falcon_mamba",
            num_hidden_layers=4,
            state_size=8,
            expand=2,
            conv_kernel=4,
            time_step_rank=8,
            intermediate_size=128,
            use_mambapy=False,
        ),
        None,
    ),
    "bamba": (lambda: _cfg("bamba", num_hidden_layers=5, attn_layer_indices=[1, 3], **_mamba2()), "sdpa"),
    "granitemoehybrid": (
        lambda: _cfg(
            "granitemoehybrid",
            num_hidden_layers=5,
            layer_types=[LIN, FULL, LIN, FULL, LIN],
            num_local_experts=2,
            num_experts_per_tok=1,
            shared_intermediate_size=64,
            **_mamba2(),
        ),
        "sdpa",
    ),
    "falcon_h1": (
        lambda: _cfg("falcon_h1", mamba_d_ssm=64, head_dim=16, **{**_mamba2(), "mamba_d_head": 16}),
        "sdpa",
    ),
    "zamba": (
        lambda: _cfg(
            "zamba",
            num_hidden_layers=6,
            attn_layer_period=3,
            attn_layer_offset=1,
            attention_hidden_size=128,
            attention_head_dim=32,
            n_mamba_heads=2,
            initializer_range=0.2,  # 0.02 echoes the last prompt token forever
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
            tie_word_embeddings=True,
        ),
        "sdpa",
    ),
    "zamba2": (
        lambda: _cfg(
            "zamba2",
            num_hidden_layers=6,
            layers_block_type=[LIN, "hybrid", LIN, LIN, "hybrid", LIN],
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_ngroups=1,
            n_mamba_heads=4,
            chunk_size=CHUNK,
            attention_head_dim=32,
            num_mem_blocks=1,
            adapter_rank=8,
            tie_word_embeddings=True,
            initializer_range=0.1,  # 0.02 echoes the last prompt token forever
        ),
        "sdpa",
    ),
    "zaya": (
        lambda: _cfg(
            "zaya",
            layer_types=["hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding"],
            sliding_window=WINDOW,
            head_dim=16,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=64,
            router_hidden_size=16,
            tie_word_embeddings=False,  # tied (any init) gives one constant token per prompt
        ),
        "sdpa",
    ),
    "inkling_text": (
        lambda: _cfg(
            "inkling_text",
            layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            head_dim=16,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=16,
            sliding_window_size=WINDOW,
            d_rel=4,
            rel_extent=64,
            conv_kernel_size=4,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            logits_mup_width_multiplier=1.0,
        ),
        "sdpa",
    ),
    # -- DynamicIndexedLayer (DSA) -----------------------------------------------------------------
    "deepseek_v32": (
        lambda: _cfg(
            "deepseek_v32",
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            rope_parameters=ROPE,
            **_dsa(**_moe()),
        ),
        "eager",
    ),
    "glm_moe_dsa": (
        lambda: _cfg(
            "glm_moe_dsa",
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            rope_parameters=ROPE,
            **_dsa(**_moe()),
        ),
        "eager",
    ),
    "hy_v4": (
        lambda: _cfg(
            "hy_v4",
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            indexer_types=["full", "shared", "full", "shared"],
            hc_mult=2,
            rope_parameters=ROPE,
            **_dsa(**_moe()),
        ),
        "eager",
    ),
    "axk2": (
        lambda: _cfg(
            "axk2",
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            n_group=None,
            topk_group=None,
            gated_norm_rank=8,
            rope_parameters=ROPE,
            **_dsa(**_moe()),
        ),
        "eager",
    ),
    "dots3_note_text": (
        lambda: _cfg(
            "dots3_note_text",
            num_hidden_layers=6,
            layer_types=[IDX, IDX, SW, SW, SW, IDX],
            sliding_window=WINDOW,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse", "sparse"],
            shared_experts_intermediate_size=32,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=4,
            swa_q_lora_rank=32,
            swa_kv_lora_rank=32,
            swa_head_dim=24,
            swa_qk_nope_head_dim=16,
            swa_v_head_dim=16,
            **_dsa(**_moe()),
        ),
        "eager",
    ),
    "qwen4_exp_text": (
        lambda: _cfg(
            "qwen4_exp_text",
            num_hidden_layers=4,
            layer_types=[LIN, IDX, LIN, IDX],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            hc_count=2,
            hc_lowrank=8,
            indexer_n_heads=INDEX_HEADS,
            indexer_kv_heads=1,
            indexer_head_dim=16,
            indexer_budget=TOPK,
            indexer_compress_ratio=4,
            ple_layer_ids=[1, 3],
            ple_embed_dim=32,
            heads_per_ngram=2,
            ngram_vocab_size_base=512,
            split_ngram_parts=4,
            **_gdn(),
        ),
        "eager",
    ),
    # -- shared KV -------------------------------------------------------------------------------------
    "gemma3n_text": (
        lambda: _cfg(
            "gemma3n_text",
            num_hidden_layers=6,
            layer_types=[SW, SW, FULL, SW, SW, FULL],
            sliding_window=WINDOW,
            head_dim=16,
            intermediate_size=[128] * 6,
            activation_sparsity_pattern=[0.0] * 6,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=16,
            laurel_rank=8,
            altup_num_inputs=2,
            num_kv_shared_layers=3,
            tie_word_embeddings=True,
        ),
        "sdpa",
    ),
    # -- compressed caches -----------------------------------------------------------------------------
    "deepseek_v4": (
        lambda: _cfg(
            "deepseek_v4",
            layer_types=[
                "heavily_compressed_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
            ],
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            num_key_value_heads=1,
            head_dim=32,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            hc_mult=2,
            sliding_window=WINDOW,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            index_n_heads=INDEX_HEADS,
            index_head_dim=16,
            index_topk=TOPK // 4,
            num_nextn_predict_layers=0,
            partial_rotary_factor=0.25,
        ),
        "eager",
    ),
}
HYBRID_FAMILIES = tuple(HYBRID_CONFIGS)

# layer_pattern() of every family (stable: tests may assert it)
PATTERNS = {
    "qwen3_5_text": "L A L A",
    "qwen3_5": "L A L A",
    "qwen3_5_moe_text": "L A L A",
    "qwen3_next": "L A L A",
    "kimi_linear": "L A L A",
    "olmo_hybrid": "L A L A",
    "jamba": "L A L A",
    "bailing_hybrid": "L A L A",
    "nemotron_h": "L A D L A D",
    "recurrent_gemma": "L L S L L S",
    "lfm3": "L A L S L A",
    "minimax": "A L A L",
    "mamba": "L L L L",
    "mamba2": "L L L L",
    "falcon_mamba": "L L L L",
    "bamba": "L A L A L",
    "granitemoehybrid": "L A L A L",
    "falcon_h1": "H H H H",
    "zamba": "L L H L H L",
    "zamba2": "L H L L H L",
    "zaya": "H HS H HS",
    "inkling_text": "HS H HS H",
    "deepseek_v32": "I I I I",
    "glm_moe_dsa": "I I I I",
    "hy_v4": "I I I I",
    "axk2": "I I I I",
    "dots3_note_text": "I I S S S I",
    "qwen4_exp_text": "L I L I",
    "gemma3n_text": "S S A D D D",
    "deepseek_v4": "Z C Z C",
}

# Pass ``suppress_tokens=SUPPRESS`` to generate(): a generated PAD has a zero embedding (padding_idx), every
# DSA index score is then 0 and the top-k tie-break depends on absolute cache positions (so on left padding).
SUPPRESS = [PAD, BOS, EOS]

# Mamba-1 mixers ignore the cached SSM state on a multi-token forward (mamba_selective_scan has no initial
# state): a cached multi-token continuation is wrong in stock transformers; one token at a time is exact.
MAMBA1_MULTI_TOKEN_BROKEN = ("mamba", "falcon_mamba", "jamba", "zamba")

# What a cache consumer must know beyond DynamicCache(config) for the family.
CACHE_NOTES = {
    "minimax": "generate() builds MiniMaxCache() (no config): attention KV in .layers, the lightning-"
    "attention state in .linear_cache[layer_idx]; DynamicCache is rejected by the model.",
    "recurrent_gemma": "the recurrent (rg_lru.recurrent_states) and conv (conv1d_state) states live on the "
    "model's modules, not in the cache; the cache's LinearAttentionLayers stay empty.",
    "deepseek_v4": "DynamicCache(config) works only after the modeling module is imported (it registers the "
    "'compressed_sparse_attention' / 'heavily_compressed_attention' layer classes); left padding changes the "
    "outputs (padding-dependent).",
    "mamba": "the cache goes in as cache_params=, the 2-D mask must have the local length, and generate() "
    "never slices input_ids against a cache_params cache (feed only the uncached suffix).",
    "mamba2": "as mamba (cache_params=, local-length mask, no generate() slicing).",
    "falcon_mamba": "as mamba (cache_params=, local-length mask, no generate() slicing).",
    "qwen4_exp_text": "conv state 2 holds the last ngram_size-1 input ids (int64); the indexer position ids "
    "live only on the first indexed layer (.indexer_position_ids, [3, batch, seq]).",
    "hy_v4": "'shared' indexer layers keep no indexer keys: they reuse the previous full layer's top-k.",
    "gemma3n_text": "the last num_kv_shared_layers layers are DummyLayers reading the KV of the last unshared "
    "layer of their type during the same forward.",
}


def cache_kwarg(model) -> str:
    """The forward / generate() keyword the family takes its cache under."""
    return "cache_params" if "mamba" in type(model).__name__.lower() else "past_key_values"


_KIND = [
    # most derived first
    ("LinearAttentionAndSlidingWindowAttentionLayer", "HS"),
    ("LinearAttentionAndFullAttentionLayer", "H"),
    ("LinearAttentionLayer", "L"),
    ("DynamicIndexedLayer", "I"),
    ("DynamicSlidingWindowLayer", "S"),
    ("DynamicLayer", "A"),
    ("DummyLayer", "D"),
]


def _layer_letter(layer) -> str:
    name = type(layer).__name__
    if name == "DeepseekV4CSACache":
        return "C"
    if name == "DeepseekV4HCACache":
        return "Z"
    for cls_name, letter in _KIND:
        if isinstance(layer, getattr(cu, cls_name)):
            return letter
    return "?" + name


def _import_modeling(config) -> None:
    """Import the family's modeling module (registers model-defined cache layer classes, e.g. DeepSeek-V4)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(config.model_type)
    importlib.import_module(f"transformers.models.{module}.modeling_{module}")


def make_cache(model):
    """The cache generate() would build for ``model`` (DynamicCache(config) except MiniMax)."""
    config = model.config.get_text_config(decoder=True)
    if config.model_type == "minimax":
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        return MiniMaxCache()
    _import_modeling(config)
    return DynamicCache(config=config)


def layer_pattern(model) -> str:
    """The layer kinds of ``DynamicCache(config=model.config.get_text_config(decoder=True)).layers`` as
    letters separated by spaces (see the module docstring), e.g. ``"L A L A"``."""
    config = model.config.get_text_config(decoder=True)
    _import_modeling(config)
    cache = DynamicCache(config=config)
    return " ".join(_layer_letter(layer) for layer in cache.layers)


def build_hybrid(name: str, seed: int = 0, configure=None):
    """A fresh model of family ``name`` with weights drawn from ``seed`` (callers may mutate it);
    ``configure(config)`` may change the config first."""
    make_config, attn = HYBRID_CONFIGS[name]
    config = make_config()
    if configure is not None:
        configure(config)
    if attn is not None:
        config._attn_implementation = attn
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    return model.float().eval()


def save_hybrid(directory, name: str, seed: int = 0):
    """Family ``name``'s tiny config as a checkpoint folder with demo's byte-level BPE tokenizer
    (512 tokens, chat template included): what batchrun and evalrun load by path."""
    from demo.model.loading import build_tokenizer

    tokenizer = build_tokenizer(512)

    def for_tokenizer(config) -> None:
        config.vocab_size = len(tokenizer)
        for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
            if hasattr(config, key):
                setattr(config, key, getattr(tokenizer, key))

    build_hybrid(name, seed, configure=for_tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tokens(n: int, seed: int, low: int = FIRST_TOKEN, high: int = VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=g).tolist()
