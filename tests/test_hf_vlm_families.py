"""The VLM families people run (Gemma 3, LLaVA-NeXT, LLaVA-OneVision, Mistral 3, Qwen2-VL,
Qwen2.5-VL, Qwen3-VL), keyed and reused, each against stock generate() on the same tiny model
(tests/vlm_models.py): cold, the same image again (reuse through it, no encoder call), another
image (reuse stops before it), another question (a match ending inside or right after an
image), a left-padded batch mixing image sizes and text-only rows, videos, and the inputs
checked against the ids (token types)."""

from __future__ import annotations

import functools

import pytest
import torch

import hf_patch
from tests.hf_models import (
    assert_same_as_stock,
    block_floor,
    expected_full_hit,
    left_pad,
    one_torch_thread,  # noqa: F401  (autouse)
    stock,
    tokens,
)
from tests.vlm_models import IMAGE, VIDEO, Item, build_vlm, family_inputs, images_encoded, token_types

BS = 4
FAMILIES = [
    "gemma3",
    "glm4v",
    "llama4",
    "llava_next",
    "llava_onevision",
    "mistral3",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
]
VIDEO_FAMILIES = ["llava_next_video", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def text(n: int, seed: int) -> list[int]:
    return tokens(n, seed=seed, high=IMAGE - 5)  # never a placeholder or delimiter id


class Encoded:
    """Items the model's image / video encoders are asked for (per generate() call)."""

    def __init__(self, model) -> None:
        self.items = 0
        self.depth = 0  # Qwen3-VL's video encoder calls its image encoder: count the outer call
        base = model.base_model  # where generate() looks for get_image_features
        for modality in ("image", "video"):
            original = getattr(base, f"get_{modality}_features", None)
            if original is not None:
                setattr(base, f"get_{modality}_features", self._wrap(original))

    def _wrap(self, original):
        @functools.wraps(original)
        def counted(*args, **kwargs):
            self.depth += 1
            try:
                out = original(*args, **kwargs)
            finally:
                self.depth -= 1
            if self.depth == 0:
                self.items += images_encoded(out, args, kwargs)
            return out

        return counted


@functools.cache
def model_of(name: str):
    model = build_vlm(name)
    model.encoded = Encoded(model)
    return model


@pytest.fixture(params=FAMILIES)
def family(request):
    name = request.param
    model = model_of(name)
    return name, model, hf_patch.build_store(model, block_size=BS, budget_tokens=4096)


def prompt(name, model, rows):
    """``rows``: per row a list of text token lists and Items -> (input_ids, mask, kwargs, spans)
    with spans[row] = [(first placeholder column, one past the last)] per item."""
    items = [[p for p in row if isinstance(p, Item)] for row in rows]
    item_tokens, kwargs = family_inputs(name, model, items)
    flat = []
    for row, mine in zip(rows, item_tokens):
        it = iter(mine)
        flat.append([t for p in row for t in (next(it) if isinstance(p, Item) else p)])
    input_ids, mask = left_pad(flat)
    kwargs.update(token_types(name, input_ids))
    if len(rows) > 1:
        kwargs.update(attention_mask=mask, pad_token_id=0)
    return input_ids, kwargs


def placeholder_span(row: torch.Tensor) -> tuple[int, int]:
    cols = ((row == IMAGE) | (row == VIDEO)).nonzero().flatten().tolist()
    return cols[0], cols[-1] + 1


def check(model, input_ids, store, kwargs, **gen):
    """Stock vs RadixCache; returns (cached_tokens, items encoded in the cached call)."""
    ref = stock(model, input_ids, **kwargs, **gen)
    before = model.encoded.items
    cache, _ = assert_same_as_stock(model, input_ids, store, reference=ref, **kwargs, **gen)
    return cache.cached_tokens, model.encoded.items - before


def test_same_image_other_image_other_question(family):
    name, model, store = family
    pre, question = text(10, 2001), text(6, 2002)
    ids, kw = prompt(name, model, [[pre, Item(2001), question]])
    start, _ = placeholder_span(ids[0])
    n = ids.shape[1]
    assert check(model, ids, store, kw) == ([0], 1)
    assert check(model, ids, store, kw) == ([expected_full_hit(n, BS)], 0)  # encoder skipped
    # Another image (same size, same ids): only what precedes its first placeholder.
    ids2, kw2 = prompt(name, model, [[pre, Item(2003), question]])
    assert torch.equal(ids2, ids)
    assert check(model, ids2, store, kw2) == ([block_floor(start, BS)], 1)
    # Another question about the first image: its features are known, no encoder call.
    ids3, kw3 = prompt(name, model, [[pre, Item(2001), text(6, 2004)]])
    reused = block_floor(ids.shape[1] - 6, BS)
    assert check(model, ids3, store, kw3) == ([reused], 0)
    # The same without the feature cache: served image not encoded, a partly served one is.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXKV_IMAGE_FEATURES_BYTES", "0")
        ids4, kw4 = prompt(name, model, [[pre, Item(2001), text(6, 2005)]])
        _, end = placeholder_span(ids4[0])
        assert check(model, ids4, store, kw4) == ([reused], 0 if reused >= end else 1)


@pytest.mark.parametrize("name", [f for f in FAMILIES if f != "gemma3"])  # Gemma 3: one size
def test_another_size_of_an_image_keys_apart(name):
    """A size / grid variant of an image keys apart (its tokens may even be the same)."""
    model = model_of(name)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    pre, question = text(9, 2011), text(5, 2012)
    ids, kw = prompt(name, model, [[pre, Item(2011, 1), question]])
    start, _ = placeholder_span(ids[0])
    check(model, ids, store, kw)
    ids2, kw2 = prompt(name, model, [[pre, Item(2011, 2), question]])
    cached, _ = check(model, ids2, store, kw2)
    assert cached == [block_floor(start, BS)]


@pytest.mark.parametrize("where", ["inside", "right after"])
def test_a_match_ending_inside_or_right_after_an_image(family, where):
    """The second question diverges right after the image (and its end delimiter): choose the
    preamble so that the last whole block ends inside the image, or exactly at its end."""
    name, model, store = family
    for pre_len in range(2, 14):
        pre = text(pre_len, 2021)
        ids, kw = prompt(name, model, [[pre, Item(2021), text(5, 2022)]])
        start, end = placeholder_span(ids[0])
        q = ids.shape[1] - 5  # the first question token
        m = block_floor(q, BS)
        if (where == "inside" and start < m < end) or (where == "right after" and end <= m == q):
            break
    else:
        raise AssertionError(f"no preamble puts a block boundary {where} the image")
    check(model, ids, store, kw)
    ids2, kw2 = prompt(name, model, [[pre, Item(2021), text(5, 2023)]])
    assert check(model, ids2, store, kw2) == ([m], 0)
    # Then a second image after the cached first one and its question.
    ids3, kw3 = prompt(
        name,
        model,
        [[pre, Item(2021), text(5, 2022), Item(2026 if where == "inside" else 2027, 1), text(3, 2025)]],
    )
    assert check(model, ids3, store, kw3) == ([expected_full_hit(ids.shape[1], BS)], 1)


def test_a_left_padded_batch_mixing_image_sizes_and_text_rows(family):
    name, model, store = family
    rows = [
        [text(6, 2031), Item(2031, 1), text(5, 2032)],
        [text(9, 2033)],
        [Item(2034, 2), text(3, 2035)],
    ]
    ids, kw = prompt(name, model, rows)
    n_real = kw["attention_mask"].sum(dim=1).tolist()
    assert check(model, ids, store, kw) == ([0, 0, 0], 2)
    hits = [expected_full_hit(n, BS) for n in n_real]
    cached, encoded = check(model, ids, store, kw)
    # The batch preloads min(pad + match) columns: each row gets that less its padding.
    common = min(p + h for p, h in zip([ids.shape[1] - n for n in n_real], hits))
    assert cached == [max(0, common - (ids.shape[1] - n)) for n in n_real]
    served = [placeholder_span(ids[r])[1] <= common for r in (0, 2)]
    assert encoded == 2 - sum(served)


@pytest.mark.parametrize("name", ["gemma3", "glm4v", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_token_types_must_be_the_ones_the_ids_imply(name, caplog):
    model = model_of(name)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    ids, kw = prompt(name, model, [[text(8, 2041), Item(2041), text(4, 2042)]])
    (key,) = kw.keys() & {"mm_token_type_ids", "token_type_ids"}
    check(model, ids, store, kw)
    # Without them the model attends / positions differently: keyed apart from the call above.
    without = {k: v for k, v in kw.items() if k != key}
    start, _ = placeholder_span(ids[0])
    assert check(model, ids, store, without)[0] == [block_floor(start, BS)]
    # Token types that disagree with the ids: the call runs without the store, logged once.
    wrong = dict(kw, **{key: torch.zeros_like(kw[key])})
    hf_patch.keys.inputs._logged.difference_update([r for r in hf_patch.keys.inputs._logged if key in r])
    with caplog.at_level("WARNING", logger="hf_patch.keys.inputs"):
        assert check(model, ids, store, wrong) == ([0], 1)
        check(model, ids, store, wrong)
    assert len([r for r in caplog.records if key in r.getMessage()]) == 1


@pytest.mark.parametrize("name", VIDEO_FAMILIES)
def test_videos(name):
    model = model_of(name)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    pre = text(7, 2051)
    ids, kw = prompt(name, model, [[pre, Item(2051, video=True), text(4, 2052)]])
    start, _ = placeholder_span(ids[0])
    assert check(model, ids, store, kw) == ([0], 1)
    assert check(model, ids, store, kw) == ([expected_full_hit(ids.shape[1], BS)], 0)
    other, kw2 = prompt(name, model, [[pre, Item(2053, video=True), text(4, 2052)]])
    assert check(model, other, store, kw2) == ([block_floor(start, BS)], 1)
    # A video and an image in one prompt; then the same prompt again.
    mixed, kw3 = prompt(
        name, model, [[pre, Item(2051, video=True), text(3, 2054), Item(2055), text(3, 2056)]]
    )
    check(model, mixed, store, kw3)
    assert check(model, mixed, store, kw3) == ([expected_full_hit(mixed.shape[1], BS)], 0)


def test_qwen_seconds_per_grid_are_keyed():
    """Qwen2.5-VL's temporal positions depend on seconds per grid: another value, another key."""
    name = "qwen2_5_vl"
    model = model_of(name)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    ids, kw = prompt(name, model, [[text(7, 2061), Item(2061, video=True), text(4, 2062)]])
    start, _ = placeholder_span(ids[0])
    check(model, ids, store, dict(kw, second_per_grid_ts=torch.tensor([1.0])))
    assert check(model, ids, store, dict(kw, second_per_grid_ts=torch.tensor([2.0])))[0] == [
        block_floor(start, BS)
    ]


def test_glm4v_videos_are_not_keyed():
    """GLM-4V's video placeholders are its image id (only mm_token_type_ids tell them apart):
    pixel_values_videos stays off the allowlist, so such a call runs without the store."""
    from hf_patch.keys.inputs import unkeyed_inputs
    from hf_patch.keys.multimodal import keyed_inputs

    keyed = keyed_inputs(model_of("glm4v"))
    assert {"pixel_values", "image_grid_thw", "mm_token_type_ids"} <= keyed
    assert unkeyed_inputs(
        {"pixel_values_videos": torch.zeros(1), "video_grid_thw": torch.zeros(1)}, keyed
    ) == [
        "pixel_values_videos",
        "video_grid_thw",
    ]


# Llama 4 and Qwen3-VL's deepstack: stock generate() itself fails to expand their encoder outputs.
@pytest.mark.parametrize("name", ["gemma3", "llava_next", "mistral3", "qwen2_vl", "qwen2_5_vl"])
def test_several_sequences_per_prompt(name):
    """Rows expanded before the match: every item is encoded and the served placeholders'
    features are cut out after encoding; still a full hit, equal to stock's samples."""
    model = model_of(name)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    ids, kw = prompt(name, model, [[text(6, 2071), Item(2071, 1), text(4, 2072)]])
    sampled = dict(num_return_sequences=2, do_sample=True, seed=3)
    check(model, ids, store, kw)
    hit = expected_full_hit(ids.shape[1], BS)
    assert check(model, ids, store, kw, **sampled) == ([hit, hit], 1)


def test_unreadable_image_inputs_run_as_stock(caplog):
    """Mistral 3 without image_sizes: not keyed (the key cannot tell the images' sizes), the
    call runs as stock generate() and fails with stock's own error; nothing pinned."""
    name = "mistral3"
    model = model_of(name)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    ids, kw = prompt(name, model, [[text(6, 2081), Item(2081), text(4, 2082)]])
    bad = {k: v for k, v in kw.items() if k != "image_sizes"}
    with caplog.at_level("WARNING", logger="hf_patch.keys.inputs"):
        with pytest.raises(Exception) as stock_error:
            stock(model, ids, **bad)
        with pytest.raises(type(stock_error.value)):
            model.generate(ids, **bad, past_key_values=hf_patch.RadixCache(store=store), max_new_tokens=2)
    assert store.stats()["uncacheable_requests"] == 1 and store.stats()["pinned_blocks"] == 0


def test_onevision_images_of_a_multi_image_row():
    """LLaVA-OneVision with batch_num_images (the processor's multi-image prompts): an image's
    features depend on how many images its row has, so that count is in its key, and a call
    encodes its images all or none."""
    name = "llava_onevision"
    model = model_of(name)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    pre, mid, post = text(5, 2091), text(3, 2092), text(4, 2093)

    def two(a, b):
        _, kw = family_inputs(name, model, [[Item(a), Item(b)]])
        kw["batch_num_images"] = torch.tensor([2])
        with torch.no_grad():  # base tile only in a multi-image row: ask the encoder for its rows
            rows = model.model.get_image_features(**{k: kw[k] for k in ("pixel_values", "image_sizes")},
                                                  batch_num_images=kw["batch_num_images"]).pooler_output  # fmt: skip
        ids = torch.tensor([pre + [IMAGE] * len(rows[0]) + mid + [IMAGE] * len(rows[1]) + post])
        return ids, kw, len(pre) + len(rows[0]) + len(mid)

    ids, kw, _ = two(2091, 2092)
    assert check(model, ids, store, kw) == ([0], 2)
    assert check(model, ids, store, kw) == ([expected_full_hit(ids.shape[1], BS)], 0)
    other, kw2, second = two(2091, 2093)
    # The first image is served or known, the second is new: both are encoded (all or none).
    cached, encoded = check(model, other, store, kw2)
    assert cached == [block_floor(second, BS)] and encoded == 2
    # The first image alone in its row (any-resolution tiles, other placeholders): keyed apart.
    alone, kw3 = prompt(name, model, [[pre, Item(2091), post]])
    assert check(model, alone, store, dict(kw3, batch_num_images=torch.tensor([1]))) == (
        [block_floor(5, BS)],
        1,
    )


@pytest.mark.parametrize("name", ["aya_vision", "glm46v", "llava_next_video", "qwen3_vl_moe"])
def test_variants_of_the_tested_families(name):
    """Aya Vision (LLaVA's layout), GLM-4.6V (GLM-4V's code), LLaVA-NeXT-Video (LLaVA-NeXT's
    images), Qwen3-VL-MoE (Qwen3-VL with MoE layers): the layouts tested above."""
    model = model_of(name)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    test_same_image_other_image_other_question((name, model, store))


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl", "glm4v"])
def test_m_rope_never_reads_rope_deltas_a_previous_call_left(name):
    """A resumed prefix gets the positions of a full prefill even when the model holds another
    call's rope_deltas: cached text, then the same text with an image after it, then the image
    prompt again, each with poisoned rope_deltas."""
    model = model_of(name)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    pre = text(9, 2101)
    plain, kw_plain = prompt(name, model, [[pre, text(3, 2102)]])
    with_image, kw_image = prompt(name, model, [[pre, Item(2101, 2), text(4, 2103)]])
    for ids, kw, expected in (
        (plain, kw_plain, 0),
        (with_image, kw_image, block_floor(9, BS)),
        (with_image, kw_image, expected_full_hit(with_image.shape[1], BS)),
    ):
        model.model.rope_deltas = torch.tensor([[37]])
        ref = stock(model, ids, **kw)
        model.model.rope_deltas = torch.tensor([[-11]])
        cache, _ = assert_same_as_stock(model, ids, store, reference=ref, **kw)
        assert cache.cached_tokens == [expected]


@pytest.mark.parametrize("name", ["gemma3", "qwen2_vl"])
def test_text_only_rows_with_zero_token_types_share_their_prefix(name):
    """A cold text-only batch on a VLM, with the all-zero token types its processor returns:
    the rows' common prefix is computed once (in-batch sharing), equal to stock."""
    model = model_of(name)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    doc = text(12, 2111)
    ids, kw = prompt(name, model, [[doc, text(3, 2112)], [doc, text(5, 2113)], [doc, text(2, 2114)]])
    assert not any(v.any() for k, v in kw.items() if k.endswith("token_type_ids"))
    cached, _ = check(model, ids, store, kw)
    pads = (kw["attention_mask"] == 0).sum(dim=1).tolist()
    common = min(pad + block_floor(12, BS) for pad in pads)  # the batch preloads one column count
    assert cached[1:] == [common - pad for pad in pads[1:]]  # computed once by row 0, read by the others
