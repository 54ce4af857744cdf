"""Tiny seeded models, prompts, an offline tokenizer and the stock-vs-RadixCache oracle for hf_patch tests.

Every model is built from a config with random weights (no hub), fp32, eval mode. Sizes are
chosen so one generate() call takes tens of milliseconds on two CPU cores.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import hf_patch

VOCAB = 128
PAD, BOS, EOS = 0, 1, 2
FIRST_TOKEN = 3  # prompts never contain pad / bos / eos ids
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    tie_word_embeddings=False,
)
WINDOW = 8  # every sliding-window family gets a window far smaller than the prompts (~40-80 tokens)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models run fastest on one intra-op thread, and a second one spin-waits badly on a busy
    2-core machine (20x slower). Import this name into a test module to make it apply there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, **{**BASE, **overrides})


def _sliding(model_type: str, layer_types: list[str], **overrides):
    return _cfg(
        model_type,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        sliding_window=WINDOW,
        **overrides,
    )


SW, FULL = "sliding_attention", "full_attention"

# name -> (config factory, attn_implementation or None for the model's default)
FAMILY_CONFIGS = {
    "llama-sdpa": (lambda: _cfg("llama"), "sdpa"),
    "llama-eager": (lambda: _cfg("llama"), "eager"),
    "qwen2-sliding": (
        lambda: _cfg(
            "qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2
        ),
        "sdpa",
    ),
    "mistral-sliding": (lambda: _cfg("mistral", sliding_window=WINDOW), "sdpa"),
    "gpt2": (
        lambda: GPT2Config(
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=512,
            bos_token_id=BOS,
            eos_token_id=EOS,
            pad_token_id=PAD,
        ),
        "sdpa",
    ),
    "phi3": (lambda: _cfg("phi3"), "sdpa"),
    "gemma2-sliding": (lambda: _sliding("gemma2", [SW, FULL, SW], head_dim=16), "eager"),
    "qwen3": (lambda: _cfg("qwen3", head_dim=16), "sdpa"),
    "gemma3-text-sliding": (lambda: _sliding("gemma3_text", [SW, SW, FULL], head_dim=16), "sdpa"),
    "cohere": (lambda: _cfg("cohere"), "sdpa"),
    "cohere2-sliding": (lambda: _sliding("cohere2", [SW, SW, FULL], head_dim=16), "sdpa"),
    "stablelm": (lambda: _cfg("stablelm"), "sdpa"),
    "granite": (lambda: _cfg("granite"), "sdpa"),
    "olmo2": (lambda: _cfg("olmo2"), "sdpa"),
    "olmo3-sliding": (lambda: _sliding("olmo3", [SW, SW, FULL]), "sdpa"),
    "starcoder2-sliding": (lambda: _cfg("starcoder2", sliding_window=WINDOW), "sdpa"),
    "gpt-neox": (lambda: _cfg("gpt_neox"), "sdpa"),
    "falcon": (lambda: _cfg("falcon"), "sdpa"),
    "phi": (lambda: _cfg("phi"), "sdpa"),
    "glm4": (lambda: _cfg("glm4", head_dim=16), "sdpa"),
    "exaone4-sliding": (lambda: _sliding("exaone4", [SW, SW, FULL]), "sdpa"),
    "smollm3-norope": (lambda: _cfg("smollm3", num_hidden_layers=4, no_rope_layer_interval=2), "sdpa"),
    "gpt-bigcode-mqa": (
        lambda: _cfg("gpt_bigcode", n_embd=64, n_layer=2, n_head=4, multi_query=True),
        "sdpa",
    ),
    "gpt-oss-sinks": (
        lambda: _sliding(
            "gpt_oss",
            [SW, FULL],
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        "eager",
    ),
    "deepseek-v3-mla": (
        lambda: _cfg(
            "deepseek_v3",
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=32,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        "sdpa",
    ),
    "gemma4-text-sliding": (
        lambda: _sliding(
            "gemma4_text",
            [SW, FULL, SW],
            head_dim=16,
            global_head_dim=16,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=VOCAB,
            num_kv_shared_layers=0,
        ),
        "sdpa",
    ),
    "llama4-text-chunked": (
        lambda: _cfg(
            "llama4_text",
            num_hidden_layers=4,
            head_dim=16,
            attention_chunk_size=WINDOW,
            num_local_experts=2,
            intermediate_size_mlp=128,
            layer_types=["chunked_attention", FULL] * 2,
            no_rope_layers=[1, 0, 1, 0],
        ),
        "sdpa",
    ),
    "gemma": (lambda: _cfg("gemma", head_dim=16), "sdpa"),
    "vaultgemma-sliding": (lambda: _sliding("vaultgemma", [SW, FULL], head_dim=16), "eager"),
    "granite-swa": (lambda: _sliding("granite_swa", [FULL, SW, SW]), "eager"),
    "diffllama": (lambda: _cfg("diffllama"), "sdpa"),
    "biogpt": (lambda: _cfg("biogpt"), "sdpa"),
    "xglm-sinusoidal": (
        lambda: _cfg("xglm", d_model=64, num_layers=2, attention_heads=4, ffn_dim=128),
        "eager",
    ),
    "gpt-neo-local": (
        lambda: _cfg("gpt_neo", num_layers=2, attention_types=[[["global", "local"], 1]], window_size=WINDOW),
        "eager",
    ),
    "gptj": (lambda: _cfg("gptj", n_embd=64, n_layer=2, n_head=4, rotary_dim=8), "eager"),
    "codegen": (lambda: _cfg("codegen", n_embd=64, n_layer=2, n_head=4, rotary_dim=8), "eager"),
    "ministral-sliding": (
        lambda: _sliding(
            "ministral",
            [SW, FULL],
            head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        "sdpa",
    ),
    "lfm2-attention-only": (lambda: _cfg("lfm2", layer_types=[FULL, FULL]), "sdpa"),
}
FAMILIES = tuple(FAMILY_CONFIGS)


def build(name: str, seed: int = 0):
    """A fresh model of family ``name`` with weights drawn from ``seed`` (callers may mutate it)."""
    make_config, attn = FAMILY_CONFIGS[name]
    config = make_config()
    if attn is not None:
        config._attn_implementation = attn
    torch.manual_seed(seed)
    if isinstance(config, GPT2Config):
        model = GPT2LMHeadModel(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    return model.float().eval()


@functools.cache
def shared(name: str, seed: int = 0):
    """A cached model for read-only use: tests must not change its weights or generation config."""
    return build(name, seed)


def store_for(model, block_size: int = 4, budget_tokens: int = 4096):
    return hf_patch.build_store(model, block_size=block_size, budget_tokens=budget_tokens)


def tokens(n: int, seed: int, low: int = FIRST_TOKEN, high: int = VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=g).tolist()


def ids(*rows: list[int]) -> torch.Tensor:
    """Equal-length rows -> ``[B, T]`` int64."""
    return torch.tensor(rows, dtype=torch.long)


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad rows of different lengths -> (input_ids, attention_mask)."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return input_ids, mask


def block_floor(n: int, block_size: int) -> int:
    return n // block_size * block_size


def expected_full_hit(prompt_len: int, block_size: int) -> int:
    """cached_tokens of a prompt that is entirely in the store: one token is always recomputed."""
    return block_floor(prompt_len - 1, block_size)


# -- the oracle ---------------------------------------------------------------------------------
LOGITS_ATOL = 1e-5


def _generate(model, input_ids, seed, kwargs):
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(input_ids, **kwargs)


def _with_defaults(gen_kwargs: dict) -> dict:
    gen_kwargs.setdefault("max_new_tokens", 6)
    gen_kwargs.setdefault("output_logits", True)
    gen_kwargs.setdefault("return_dict_in_generate", True)
    gen_kwargs.setdefault("do_sample", False)
    return gen_kwargs


def stock(model, input_ids, *, seed: int | None = None, **gen_kwargs):
    """Stock generate() (no cache argument) with assert_same_as_stock's defaults: the reference
    to pass as ``reference=``. Never pass a RadixCache output there: that compares the cache
    with itself, and the fully cached case is exactly where it could drift from stock."""
    assert "past_key_values" not in gen_kwargs
    return _generate(model, input_ids, seed, _with_defaults(gen_kwargs))


def greedy_reply(model, prompt: list[int], new: int) -> list[int]:
    """Stock greedy generate() of one prompt alone: the reply's token ids (EOS ends it)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=PAD, eos_token_id=EOS
        )
    return out[0, len(prompt) :].tolist()


def poison_free_blocks(store) -> None:
    """NaN into every free block of ``store``'s pool (a block a reader still uses must be pinned,
    so never among them)."""
    with store._lock:
        taken = store.pool.allocate(store.pool.num_free)
        for t in (*store.pool.k, *store.pool.v):
            t[taken] = float("nan")
        store.pool.free(taken)


def assert_outputs_equal(ref, out, atol: float = LOGITS_ATOL) -> None:
    """Same sequences; logits / scores / sequences_scores within ``atol`` where present."""
    ref_seq = ref if isinstance(ref, torch.Tensor) else ref.sequences
    out_seq = out if isinstance(out, torch.Tensor) else out.sequences
    assert torch.equal(ref_seq, out_seq), (
        f"sequences differ:\nstock {ref_seq.tolist()}\nradix {out_seq.tolist()}"
    )
    if isinstance(ref, torch.Tensor):
        return
    for field in ("logits", "scores"):
        a, b = getattr(ref, field, None), getattr(out, field, None)
        assert (a is None) == (b is None), field
        if a is None:
            continue
        assert len(a) == len(b), f"{field}: {len(a)} steps vs {len(b)}"
        for step, (x, y) in enumerate(zip(a, b)):
            finite = torch.isfinite(x)
            assert torch.equal(finite, torch.isfinite(y)), f"{field} step {step}: -inf pattern differs"
            diff = (x[finite] - y[finite]).abs().max().item() if finite.any() else 0.0
            assert diff <= atol, f"{field} step {step}: max abs diff {diff:.3g} > {atol}"
    a, b = getattr(ref, "sequences_scores", None), getattr(out, "sequences_scores", None)
    assert (a is None) == (b is None)
    if a is not None:
        assert torch.allclose(a, b, atol=atol, rtol=0), (
            f"sequences_scores differ: {a.tolist()} vs {b.tolist()}"
        )


def assert_same_as_stock(
    model,
    input_ids,
    store=None,
    *,
    cache: hf_patch.RadixCache | None = None,
    namespace=None,
    seed: int | None = None,
    reference=None,
    check_invariants: bool = True,
    **gen_kwargs,
):
    """Generate with stock generate() (no cache argument) and with a RadixCache; assert equal.

    ``seed``: ``torch.manual_seed(seed)`` before each call (sampling). ``reference``: a stock
    output computed earlier by ``stock()`` with the same arguments (skips the stock call). Unless the caller overrides them, asks for
    ``output_logits`` and ``return_dict_in_generate``. Returns ``(cache, output)``.
    """
    _with_defaults(gen_kwargs)
    if reference is None:
        reference = stock(model, input_ids, seed=seed, **gen_kwargs)
    if cache is None:
        cache = hf_patch.RadixCache(store=store, namespace=namespace)
    out = _generate(model, input_ids, seed, {**gen_kwargs, "past_key_values": cache})
    assert_outputs_equal(reference, out)
    assert len(cache.cached_tokens) == sequences(out).shape[0], (
        "cached_tokens: one entry per returned sequence"
    )
    if check_invariants:
        used = cache.store if cache.store is not None else hf_patch.default_store(model)
        if used.remote is not None:  # a sidecar's writer pins local blocks while it copies them
            assert used.remote.flush(60)
        used.check_invariants()
        assert used.stats()["pinned_blocks"] == 0, "a finished request left blocks pinned"
    return cache, out


def sequences(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.sequences


@functools.cache
def tokenizer():
    """An offline word-level tokenizer over the tiny models' vocabulary: id i <-> word "w{i}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {PAD: "<pad>", BOS: "<s>", EOS: "</s>"}
    vocab = {special.get(i, f"w{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
