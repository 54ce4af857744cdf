"""hf_patch.ragged_attention: a RunningBatch step through the ragged decode kernel gives the
logits and tokens of the SDPA step (rows at different paddings, a free slot, rows admitted
later); the model's attention setting is restored after every step; models whose attention does
not go through transformers' functions, or with options the kernel lacks, keep SDPA; the
switch is off without numba, with RADIXKV_RAGGED_ATTENTION=0 and off float32 CPU models."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import DynamicCache

from cuda_ext import ragged_decode
from hf_patch import ragged_attention
from hf_patch.running_batch import RunningBatch
from tests.hf_models import EOS, PAD, build, left_pad, one_torch_thread, tokens  # noqa: F401

pytestmark = pytest.mark.skipif(
    not ragged_decode.available(), reason="numba is not installed (the demo extra)"
)


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    real = ragged_decode.ragged_decode

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(ragged_decode, "ragged_decode", counted)
    return calls


def admit(batch: RunningBatch, model, prompts: list[list[int]]) -> list[int]:
    ids, mask = left_pad(prompts)
    cache = DynamicCache()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, past_key_values=cache, max_new_tokens=1, do_sample=False,
            pad_token_id=PAD, eos_token_id=EOS, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    first = out.logits[0].argmax(dim=-1).tolist()
    return batch.admit([(layer.keys, layer.values) for layer in cache.layers], ids, mask, first)


def decode(model, ragged: bool, monkeypatch) -> list[torch.Tensor]:
    """Rows of 5, 23 and 11 tokens, a row removed (its slot free), two rows admitted later (one
    into the free slot, one wider than the batch): the logits of every step."""
    monkeypatch.setenv("RADIXKV_RAGGED_ATTENTION", "1" if ragged else "0")
    batch = RunningBatch(model, None, PAD, [EOS])
    admit(batch, model, [tokens(5, 1), tokens(23, 2), tokens(11, 3)])
    seen = []

    def steps(n):
        for _ in range(n):
            logits = batch.step()
            seen.append(logits)
            batch.set_next(logits.argmax(dim=-1).tolist())

    steps(3)
    batch.remove([0], commit=False)
    steps(2)
    admit(batch, model, [tokens(4, 4)])
    steps(2)
    admit(batch, model, [tokens(40, 5)])
    steps(3)
    return seen


# granite scales attention by its config's multiplier, not 1/sqrt(head_dim)
@pytest.mark.parametrize("family", ["llama-sdpa", "qwen3", "gpt-bigcode-mqa", "deepseek-v3-mla", "granite"])
def test_step_through_the_kernel_equals_sdpa(family, kernel_calls, monkeypatch):
    model = build(family)
    want = decode(model, False, monkeypatch)
    assert kernel_calls == []
    assert ragged_attention.verify(model) is False  # off: not probed
    monkeypatch.setenv("RADIXKV_RAGGED_ATTENTION", "1")
    assert ragged_attention.verify(model) is True
    kernel_calls.clear()
    got = decode(model, True, monkeypatch)
    layers = model.config.num_hidden_layers
    assert len(kernel_calls) == layers * len(got)  # every layer of every step
    assert model.config._attn_implementation == "sdpa"
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(dim=-1), b.argmax(dim=-1))


def test_attention_setting_restored_when_the_forward_raises():
    model = build("llama-sdpa")
    with pytest.raises(RuntimeError, match="boom"):
        with ragged_attention.columns(model, [0], 1) as kwargs:
            assert kwargs and model.config._attn_implementation == ragged_attention.NAME
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    ("family", "why"),
    [
        ("falcon", "0 of its 2 layers called"),  # attention computed in the model's own code
        ("diffllama", "4 of its 2 layers called"),  # two attention calls per layer
        ("stablelm", "ran in 0 of its 2 layers"),  # extra forward kwargs are not passed on
    ],
)
def test_models_it_does_not_fit_keep_their_attention(family, why, kernel_calls, caplog):
    model = build(family)
    before = model.config._attn_implementation
    with caplog.at_level(logging.WARNING, logger="hf_patch.ragged_attention"):
        assert ragged_attention.verify(model) is False
    assert why in caplog.text
    kernel_calls.clear()  # the probe's own
    with ragged_attention.columns(model, [0], 1) as kwargs:
        assert kwargs == {}
        assert model.config._attn_implementation == before
    caplog.clear()
    assert ragged_attention.verify(model) is False  # remembered: probed and logged once
    assert caplog.text == ""
    assert kernel_calls == []


@pytest.mark.parametrize("family", ["llama-eager", "gemma2-sliding"])  # softcapping needs eager
def test_eager_models_keep_eager(family, kernel_calls, caplog):
    model = build(family)
    with caplog.at_level(logging.WARNING, logger="hf_patch.ragged_attention"):
        assert ragged_attention.verify(model) is False
        with ragged_attention.columns(model, [0], 1) as kwargs:
            assert kwargs == {}
            assert model.config._attn_implementation == "eager"
    assert caplog.text == "" and kernel_calls == []  # nothing probed


def test_off_without_numba_by_env_and_off_float32_cpu(monkeypatch):
    model = build("llama-sdpa")
    monkeypatch.setenv("RADIXKV_RAGGED_ATTENTION", "0")
    with ragged_attention.columns(model, [0], 1) as kwargs:
        assert kwargs == {}
    monkeypatch.delenv("RADIXKV_RAGGED_ATTENTION")
    with ragged_attention.columns(model, [0], 1) as kwargs:
        assert kwargs
    monkeypatch.setattr(ragged_decode, "numba", None)
    with ragged_attention.columns(model, [0], 1) as kwargs:
        assert kwargs == {}
    monkeypatch.undo()
    half = build("llama-sdpa").to(torch.bfloat16)
    with ragged_attention.columns(half, [0], 1) as kwargs:
        assert kwargs == {}
    assert getattr(half, "_radixkv_ragged_ok", None) is None  # never probed


def test_a_kernel_that_computed_wrong_is_refused(monkeypatch, caplog):
    model = build("llama-sdpa")
    real = ragged_decode.ragged_decode
    monkeypatch.setattr(ragged_decode, "ragged_decode", lambda *a: real(*a) * 1.01)
    with caplog.at_level(logging.WARNING, logger="hf_patch.ragged_attention"):
        assert ragged_attention.verify(model) is False
    assert "logits differ from SDPA's" in caplog.text


@pytest.mark.parametrize(
    "kwargs",
    [
        {"softcap": 30.0},
        {"s_aux": torch.zeros(4)},
        {"sliding_window": 4},
        {"dropout": 0.1},
        {"training": True},
    ],
)
def test_calls_the_kernel_does_not_compute_go_to_sdpa(kwargs, kernel_calls, monkeypatch):
    """The registered function hands a call with options the kernel lacks to transformers' SDPA
    function, plan or not (what SDPA then does with them is SDPA's)."""
    from transformers.integrations import sdpa_attention

    seen = []
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", lambda *a, **k: seen.append(k) or "sdpa")
    module = torch.nn.Module()
    module.train(kwargs.pop("training", False))
    q, k = torch.zeros(1, 4, 1, 8), torch.zeros(1, 2, 3, 8)
    plan = (torch.zeros(1, dtype=torch.long).numpy(), 3)
    assert ragged_attention._attention(module, q, k, k, None, radixkv_columns=plan, **kwargs) == "sdpa"
    assert kernel_calls == [] and len(seen) == 1 and "radixkv_columns" not in seen[0]
    # a plan whose columns are not this layer's KV width: SDPA too
    module.train(False)
    assert ragged_attention._attention(module, q, k, k, None, radixkv_columns=(plan[0], 2)) == "sdpa"
    assert kernel_calls == [] and len(seen) == 2
    # the same call without the option runs the kernel
    module.train(False)
    out, _ = ragged_attention._attention(module, q, k, k, None, radixkv_columns=plan)
    assert out.shape == (1, 1, 4, 8) and kernel_calls == [1]


def test_a_composite_model_is_not_switched(kernel_calls):
    """A vision-language model's sub-configs hold their own attention settings (the setter would
    overwrite them all): it keeps SDPA, and its vision tower's eager setting stays."""
    from tests.vlm_models import build_vlm

    model = build_vlm("llava")
    model.config.vision_config._attn_implementation = "eager"
    assert ragged_attention.verify(model) is False
    with ragged_attention.columns(model, [0], 1) as kwargs:
        assert kwargs == {}
    assert model.config.vision_config._attn_implementation == "eager"
    assert model.config.text_config._attn_implementation == "sdpa"
    assert kernel_calls == []


def test_compiles_without_a_disk_cache_where_numba_has_none(monkeypatch):
    real, asked = ragged_decode._jit, []

    def jit(cache):
        asked.append(cache)
        if cache:
            raise RuntimeError("cannot cache function 'decode': no locator available for file")
        return real(cache)

    monkeypatch.setattr(ragged_decode, "_jit", jit)
    monkeypatch.setattr(ragged_decode, "_kernel", None)
    q, k = torch.randn(2, 2, 4), torch.randn(2, 1, 5, 4)
    out = ragged_decode.ragged_decode(q, k, k, [0, 2], 5, 0.5)
    assert asked == [True, False] and torch.isfinite(out).all()
