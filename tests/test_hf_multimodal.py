"""Images in the cache key, against stock generate() of the same inputs: the same image reuses
through it without running the vision tower, another image reuses only the text before it, a
match ending inside an image feeds the model that image's remaining placeholders, batches mix
images; a family the key does not know runs without reuse. Tiny VLMs from configs
(tests/vlm_models.py), random pixels."""

from __future__ import annotations

import weakref

import pytest

import hf_patch
from tests.hf_models import (
    assert_same_as_stock,
    block_floor,
    expected_full_hit,
    ids,
    left_pad,
    one_torch_thread,  # noqa: F401  (autouse)
    stock,
    tokens,
)
from tests.vlm_models import IMAGE, VLMS, build_vlm, image, pixels

BS = 4
KEYED = ["llava", "vipllava", "idefics3", "smolvlm", "internvl"]


def text(n: int, seed: int) -> list[int]:
    return tokens(n, seed=seed, high=IMAGE - 2)  # never an image, begin- or end-of-image id


class VisionCalls:
    """Images the vision tower encodes (its input batch), per generate() call."""

    def __init__(self, model) -> None:
        tower = getattr(model.model, "vision_tower", None) or model.model.vision_model
        self.images: list[int] = []
        tower.register_forward_hook(lambda module, args, kwargs, out: self.images.append(self._count(args, kwargs)),
                                    with_kwargs=True)  # fmt: skip

    @staticmethod
    def _count(args, kwargs) -> int:
        pixel_values = args[0] if args else kwargs["pixel_values"]
        return pixel_values.shape[0]

    def during(self, call):
        before = len(self.images)
        result = call()
        return result, sum(self.images[before:])


# The model is shared by this module's tests and so is its image feature cache: each test uses
# images of its own.
@pytest.fixture(scope="module", params=KEYED)
def vlm(request):
    name = request.param
    return name, build_vlm(name), VLMS[name][2]


def check(model, prompt, store, name, images, **kwargs):
    """Stock vs RadixCache on ``prompt`` with ``images`` (per row); returns (cached_tokens,
    images the vision tower encoded in the cached call)."""
    inputs = pixels(name, images)
    ref = stock(model, prompt, **inputs, **kwargs)
    calls = VisionCalls.registry[model]
    (cache, _), encoded = calls.during(
        lambda: assert_same_as_stock(model, prompt, store, reference=ref, **inputs, **kwargs)
    )
    return cache.cached_tokens, encoded


# model -> its VisionCalls. Keyed by the model itself: an id() may be a collected model's, whose
# hook never fires (counted 0 tower calls once in a full run).
VisionCalls.registry = weakref.WeakKeyDictionary()


@pytest.fixture
def store(vlm):
    _, model, _ = vlm
    if model not in VisionCalls.registry:  # one hook per model
        VisionCalls.registry[model] = VisionCalls(model)
    return hf_patch.build_store(model, block_size=BS, budget_tokens=2048)


def test_the_same_image_reuses_through_it_and_skips_the_vision_tower(vlm, store, monkeypatch):
    name, model, n = vlm
    preamble, question = text(10, 1801), text(6, 1802)
    prompt = ids(preamble + [IMAGE] * n + question)
    length = prompt.shape[1]
    assert check(model, prompt, store, name, [[image(1)]]) == ([0], 1)
    assert check(model, prompt, store, name, [[image(1)]]) == ([expected_full_hit(length, BS)], 0)
    # Another image, same ids: only the preamble before it is reused; its tower runs again.
    assert check(model, prompt, store, name, [[image(2)]]) == ([block_floor(10, BS)], 1)
    # Another question about the first image: whole blocks through the image. The last block
    # of the image holds question tokens, so the match ends inside the image: the model gets
    # its remaining placeholders with their features, known from the first call (no tower).
    other = ids(preamble + [IMAGE] * n + text(6, 1803))
    reused = block_floor(10 + n, BS)
    assert 10 < reused < 10 + n
    assert check(model, other, store, name, [[image(1)]]) == ([reused], 0)
    # The same without the feature cache: the tower encodes the image, the served rows are cut.
    monkeypatch.setenv("RADIXKV_IMAGE_FEATURES_BYTES", "0")
    third = ids(preamble + [IMAGE] * n + text(6, 1804))
    assert check(model, third, store, name, [[image(1)]]) == ([reused], 1)
    monkeypatch.delenv("RADIXKV_IMAGE_FEATURES_BYTES")
    # A known image after another preamble: no KV to reuse, but no tower either.
    moved = ids(text(7, 1805) + [IMAGE] * n + question)
    assert check(model, moved, store, name, [[image(2)]]) == ([0], 0)
    # Several returned sequences: the rows are expanded before the match, so the tower runs and
    # the served image's features are cut out after it; still a full hit.
    sampled = dict(num_return_sequences=2, do_sample=True, seed=4)
    hit = expected_full_hit(length, BS)
    assert check(model, prompt, store, name, [[image(1)]], **sampled) == ([hit, hit], 1)


def test_two_images_of_which_the_second_differs(vlm, store):
    """Reuse stops where the second image starts; only the second image is encoded."""
    name, model, n = vlm
    a, b, c = text(5, 1811), text(3, 1812), text(4, 1813)
    prompt = ids(a + [IMAGE] * n + b + [IMAGE] * n + c)
    assert check(model, prompt, store, name, [[image(11), image(12)]]) == ([0], 2)
    second = 5 + n + 3  # the second image's first column, a block boundary here
    assert second % BS == 0
    assert check(model, prompt, store, name, [[image(11), image(13)]]) == ([second], 1)
    assert check(model, prompt, store, name, [[image(11), image(12)]]) == (
        [expected_full_hit(prompt.shape[1], BS)],
        0,
    )


def test_a_left_padded_batch_mixing_images(vlm, store):
    name, model, n = vlm
    rows = [text(6, 1821) + [IMAGE] * n + text(6, 1822), [IMAGE] * n + text(4, 1823)]
    input_ids, mask = left_pad(rows)
    images = [[image(15)], [image(16)]]
    kwargs = dict(attention_mask=mask, pad_token_id=0)
    assert check(model, input_ids, store, name, images, **kwargs) == ([0, 0], 2)
    # Row 0 full hit: n + 8 columns; row 1 (8 pads) full hit: n tokens -> column n + 8 too.
    assert check(model, input_ids, store, name, images, **kwargs) == ([n + 8, n], 0)
    # Three sequences per prompt: rows are expanded before the match; every image is encoded,
    # the served placeholders' features are cut out.
    sampled = dict(num_return_sequences=3, do_sample=True, seed=7, **kwargs)
    assert check(model, input_ids, store, name, images, **sampled) == ([n + 8] * 3 + [n] * 3, 2)
    # The rows' images swapped: each row reuses only what precedes its image (row 0: a block of
    # its 6 text tokens; row 1's image is its first token). Both images' features are known.
    swapped = [[image(16)], [image(15)]]
    assert check(model, input_ids, store, name, swapped, **kwargs) == ([4, 0], 0)


def test_a_family_the_key_does_not_know_runs_without_reuse(caplog):
    model = build_vlm("paligemma")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=2048)
    prompt = ids(text(6, 1831) + [IMAGE] * VLMS["paligemma"][2] + text(6, 1832))
    hf_patch.keys.inputs._logged.difference_update(
        [r for r in hf_patch.keys.inputs._logged if "pixel_values" in r]
    )
    with caplog.at_level("WARNING", logger="hf_patch.keys.inputs"):
        for _ in range(2):
            cache, _ = assert_same_as_stock(model, prompt, store, pixel_values=image(1).unsqueeze(0))
            assert cache.cached_tokens == [0]
    assert len([r for r in caplog.records if "pixel_values" in r.getMessage()]) == 1  # once, naming why
    stats = store.stats()
    assert stats["uncacheable_requests"] == 2 and stats["cached_blocks"] == 0
