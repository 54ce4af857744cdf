"""Gemma 3-, LLaVA-NeXT-, LLaVA-OneVision-, Qwen2-VL-, Qwen2.5-VL- and Qwen3-VL-style checkpoints
served over HTTP (waitress in this process), asked with the openai client: each reply equals
offline stock generate() of the processor's own inputs; a second question about an image reads
it from the store and never runs the vision tower; another image with the same text reads only
the text before it; an image request and a text request sent at once both answer as stock.

Videos (``video_url`` parts, written by PyAV here): without torchvision the OneVision and Qwen-VL
processors are built without their video processor (demo.model.processors), here and in the
server alike, and a video part is a 400 naming torchvision (Gemma 3 and LLaVA-NeXT: a 400, they
take no videos). With torchvision (by hand: docs/vlm.md) the video test runs: the server's frames
(sampled before decoding, demo.api.videos) give the same reply as the processor sampling every
decoded frame itself, and a second question reads the video from the store."""

from __future__ import annotations

import concurrent.futures
import functools
import importlib.util
import uuid

import openai
import pytest
from transformers import AutoConfig, AutoModelForImageTextToText

from demo.api import videos
from demo.api.app import build_engine, create_app
from demo.api.images import ImagePart
from demo.api.server import serving
from demo.config import Config
from demo.model import vision
from demo.model.processors import has_videos, load_processor, videos_dropped
from tests.demo_checkpoints import data_url, pil, png
from tests.demo_vlm_checkpoints import (
    decoded,
    mp4,
    save_gemma3,
    save_llava_next,
    save_llava_onevision,
    save_qwen_vl,
)

BLOCK = 4
MAX_NEW = 5
SAVERS = {
    "gemma3": save_gemma3,
    "llava_next": save_llava_next,
    "llava_onevision": save_llava_onevision,
    "qwen2_5_vl": save_qwen_vl,
    "qwen2_vl": functools.partial(save_qwen_vl, model_type="qwen2_vl"),
    "qwen3_vl": functools.partial(save_qwen_vl, model_type="qwen3_vl"),
}


VIDEOS = [
    "llava_onevision",
    "qwen2_5_vl",
    "qwen2_vl",
    "qwen3_vl",
]  # the families here whose processors take videos
TORCHVISION = importlib.util.find_spec("torchvision") is not None


def _serve(family: str, tmp_path_factory, saver=None, **options):
    """(openai client, engine, (reference model, reference processor)) for one family (its
    checkpoint written by ``saver``, default SAVERS'; ``options``: the Config's, over these)."""
    import openai

    path = (saver or SAVERS[family])(tmp_path_factory.mktemp("vlm") / family)
    config = Config(
        **{
            "model": path,
            "block_size": BLOCK,
            "cache_tokens": 1 << 13,
            "limit_images": 2,
            "max_video_frames": 6,
            "served_name": "m",
            **options,
        }
    )
    engine = build_engine(config)
    # AutoProcessor's, or without its video processor where torchvision is missing (as the server)
    processor = load_processor(path, AutoConfig.from_pretrained(path), {})
    reference = AutoModelForImageTextToText.from_pretrained(path).eval(), processor
    with serving(create_app(config, engine)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, engine, reference


@pytest.fixture(scope="module", params=sorted(SAVERS))
def served(request, tmp_path_factory):
    yield from _serve(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=VIDEOS)
def served_videos(request, tmp_path_factory):
    yield from _serve(request.param, tmp_path_factory)


def model_type(engine) -> str:
    return engine.model.config.model_type


class Tower:
    def __init__(self, model) -> None:
        self.calls = 0
        tower = getattr(model.model, "vision_tower", None) or model.model.visual  # Qwen-VL: visual
        tower.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))


def user(*parts) -> list[dict]:
    def part(p: str) -> dict:
        if not p.startswith("data:"):
            return {"type": "text", "text": p}
        kind = "video_url" if p.startswith("data:video/") else "image_url"
        return {"type": kind, kind: {"url": p}}

    return [{"role": "user", "content": [part(p) for p in parts]}]


def stock(reference, messages, frames: int | None = None) -> tuple[list[int], str]:
    """Prompt ids and the stock greedy reply of the processor's inputs from the same bytes: images
    as PIL images, videos as every frame with their metadata (the processor samples them), or with
    ``frames``: that many frames at vLLM's indices (``linspace(0, total - 1, frames)``), their
    metadata saying so, not sampled again (as vLLM hands them to the processor)."""
    import base64

    import numpy as np

    model, processor = reference
    conv, metadata = [], []
    for m in messages:
        content = []
        for p in m["content"]:
            if p["type"] == "text":
                content.append(p)
                continue
            raw = base64.b64decode(p[p["type"]]["url"].split(",", 1)[1])
            if p["type"] == "image_url":
                content.append({"type": "image", "image": pil(raw)})
            else:
                every, meta = decoded(raw)
                if frames is not None:
                    meta.frames_indices = np.linspace(0, len(every) - 1, frames).astype(int).tolist()
                    every = every[meta.frames_indices]
                content.append({"type": "video", "video": every})
                metadata.append(meta)
        conv.append({"role": m["role"], "content": content})
    inputs = processor.apply_chat_template(
        conv, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
        processor_kwargs=({"video_metadata": metadata} | ({} if frames is None else {"do_sample_frames": False})
                          if metadata else None),
    )  # fmt: skip
    out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, processor.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def ask(client, messages):
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_NEW, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def test_a_second_question_about_an_image_and_another_image(served):
    client, engine, reference = served
    tower = Tower(engine.model)
    image_id = reference[0].config.image_token_id
    a = data_url(png(31, (40, 48)))
    first = user(a, f"[{uuid.uuid4().hex}] what is in this picture?")
    ids1, reply1 = stock(reference, first)
    assert ask(client, first) == (reply1, 0) and tower.calls == 1
    second = user(a, f"[{uuid.uuid4().hex}] and its colour?")
    ids2, reply2 = stock(reference, second)
    shared = next(i for i, (x, y) in enumerate(zip(ids1, ids2)) if x != y)
    last_placeholder = max(i for i, t in enumerate(ids2) if t == image_id)
    assert shared > last_placeholder  # the question differs only after the image
    assert ask(client, second) == (reply2, shared // BLOCK * BLOCK)
    assert tower.calls == 1  # served whole blocks and known features: no vision forward
    # Another image, the same text: only what precedes the image's first placeholder.
    other = user(data_url(png(32, (40, 48))), first[0]["content"][1]["text"])
    ids3, reply3 = stock(reference, other)
    assert ids3 == ids1
    assert ask(client, other) == (reply3, ids3.index(image_id) // BLOCK * BLOCK) and tower.calls == 2


def test_an_image_request_and_a_text_request_at_once(served):
    client, _, reference = served
    tag = uuid.uuid4().hex
    asks = [user(data_url(png(33, (48, 40))), f"[{tag}] what is this?"), user(f"[{tag}] tell me a story")]
    stocks = [stock(reference, m) for m in asks]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda m: ask(client, m), asks))
    assert [reply for reply, _ in answers] == [reply for _, reply in stocks]
    # A new image: at most the text before it was cached (the template's head, by an earlier
    # request); the text request shares at most the template's head with the image request.
    image_at = stocks[0][0].index(reference[0].config.image_token_id)
    shared = next(i for i, (x, y) in enumerate(zip(stocks[0][0], stocks[1][0])) if x != y)
    assert answers[0][1] <= image_at // BLOCK * BLOCK and answers[1][1] <= shared // BLOCK * BLOCK


def video_url(seed: int) -> str:
    return data_url(mp4(seed, frames=12, size=(48, 40), fps=10), "video/mp4")


@pytest.mark.skipif(
    not TORCHVISION, reason="torchvision is not installed: transformers' video processors need it"
)
def test_a_second_question_about_a_video(served_videos):
    """The processor's own frame sampling (Qwen2.5-VL: 2 per second, at least 4; OneVision: 4),
    then as an image: equal to stock, a second question reads the video from the store."""
    client, engine, reference = served_videos
    assert has_videos(engine.processor)
    tower = Tower(engine.model)
    video_id = reference[0].config.video_token_id
    clip = video_url(41)
    first = user(clip, f"[{uuid.uuid4().hex}] what happens in this video?")
    ids1, reply1 = stock(reference, first)
    assert video_id in ids1 and ask(client, first) == (reply1, 0) and tower.calls >= 1
    calls = tower.calls
    second = user(clip, f"[{uuid.uuid4().hex}] and then?")
    ids2, reply2 = stock(reference, second)
    shared = next(i for i, (x, y) in enumerate(zip(ids1, ids2)) if x != y)
    assert shared > max(i for i, t in enumerate(ids2) if t == video_id)
    assert ask(client, second) == (reply2, shared // BLOCK * BLOCK) and tower.calls == calls
    # A video and an image in one request, then a broken video: a 400, and the server goes on.
    both = user(clip, data_url(png(42)), "compare them")
    assert ask(client, both)[0] == stock(reference, both)[1]
    with pytest.raises(openai.BadRequestError, match="cannot be decoded"):
        ask(client, user(data_url(b"\x00" * 512, "video/mp4"), "what is this?"))
    # One frame: Qwen2-VL's and OneVision's sampling refuse it, Qwen3-VL's processor after it.
    with pytest.raises(openai.BadRequestError, match="frame sampling refuses this video|processor refused"):
        ask(client, user(data_url(mp4(45, frames=1), "video/mp4"), "what is this?"))
    # 4 s at 10 fps: Qwen-VL samples 2 per second (8 frames: over --max-video-frames 6), OneVision 4.
    long = user(data_url(mp4(46, frames=40), "video/mp4"), "and this one?")
    if model_type(engine) == "llava_onevision":
        assert ask(client, long)[0] == stock(reference, long)[1]
    else:
        with pytest.raises(
            openai.BadRequestError, match=r"handed 8 frames .* more than 6 \(--max-video-frames\)"
        ):
            ask(client, long)
    assert ask(client, second) == (reply2, (len(ids2) - 1) // BLOCK * BLOCK)  # all but the last token


@pytest.fixture(scope="module")
def served_unsampled(tmp_path_factory):
    """A Qwen2.5-VL checkpoint whose processor samples no frames, served with --video-frames 4."""
    saver = functools.partial(save_qwen_vl, samples=False)
    yield from _serve("qwen2_5_vl", tmp_path_factory, saver, video_frames=4)


@pytest.mark.skipif(
    not TORCHVISION, reason="torchvision is not installed: transformers' video processors need it"
)
def test_a_processor_that_samples_no_frames_gets_frames_spread_evenly(served_unsampled):
    """10 s at 30 fps (300 frames: over --max-video-frames 6 were every frame taken): 4 frames at
    vLLM's indices, equal to stock given those frames and their metadata; second_per_grid_ts from
    the sampled rate (4 frames in 10 s: 0.4 fps, 2 frames a temporal patch: 5 s); a second
    question reads the video from the store."""
    client, engine, reference = served_unsampled
    assert has_videos(engine.processor) and not engine.processor.video_processor.do_sample_frames
    tower = Tower(engine.model)
    clip = data_url(mp4(47, frames=300, size=(16, 16), fps=30), "video/mp4")
    first = user(clip, f"[{uuid.uuid4().hex}] what happens in this video?")
    ids1, reply1 = stock(reference, first, frames=4)
    assert ask(client, first) == (reply1, 0) and tower.calls >= 1
    calls = tower.calls
    second = user(clip, f"[{uuid.uuid4().hex}] and then?")
    ids2, reply2 = stock(reference, second, frames=4)
    shared = next(i for i, (x, y) in enumerate(zip(ids1, ids2)) if x != y)
    assert ask(client, second) == (reply2, shared // BLOCK * BLOCK) and tower.calls == calls
    # What the server handed the processor: the frames and metadata of demo.api.videos.
    sample = vision.frame_sampler(engine.processor, 4)
    clips = videos.load_videos([ImagePart(clip, "p")], Config().media_policy, sample)
    assert clips[0].metadata["frames_indices"] == [0, 99, 199, 299]
    prompt = vision.render(engine.processor, first, [], clips)
    assert prompt.ids == ids1 and prompt.inputs["video_grid_thw"][0, 0].item() == 2  # 4 frames / 2
    assert prompt.inputs["second_per_grid_ts"].tolist() == [pytest.approx(5.0)]


def test_hostile_parts_are_400s_and_the_server_goes_on(served):
    """A broken image; a video to Gemma 3 and LLaVA-NeXT (they take no videos) and, without
    torchvision, to Qwen-VL and OneVision (no video processor): each a 400 naming why, before the
    video is read; then the server answers as stock."""
    client, engine, reference = served
    with pytest.raises(openai.BadRequestError, match="cannot be decoded") as e:
        ask(client, user(data_url(png(44)[:100]), "what is this?"))
    assert e.value.body["param"] == "messages[0].content[0]" and e.value.body["code"] == "invalid_image"
    assert has_videos(engine.processor) == (TORCHVISION and model_type(engine) in VIDEOS)
    if not has_videos(engine.processor):  # else: test_a_second_question_about_a_video
        why = "needs torchvision" if videos_dropped(engine.processor) else "takes no videos"
        assert videos_dropped(engine.processor) == (model_type(engine) in VIDEOS)
        with pytest.raises(
            openai.BadRequestError, match=f"the model m cannot take videos here: .*{why}"
        ) as e:
            ask(client, user(f"[{uuid.uuid4().hex}] what happens?", video_url(43)))
        assert e.value.body["param"] == "messages[0].content[1]" and e.value.body["code"] == "invalid_video"
    question = user(data_url(png(44)), f"[{uuid.uuid4().hex}] what is this?")
    assert ask(client, question)[0] == stock(reference, question)[1]
