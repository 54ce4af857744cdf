"""Gemma 3- and LLaVA-NeXT-style checkpoints served over HTTP (waitress in this process), asked
with the openai client: each reply equals offline stock generate() of the processor's own
inputs; a second question about an image reads it from the store and never runs the vision
tower; another image with the same text reads only the text before it; an image request and a
text request sent at once both answer as stock.

(Qwen2.5-VL and LLaVA-OneVision processors need a video processor, which needs torchvision,
not installed here: their keys are tested through generate() in tests/test_hf_vlm_families.py.)"""

from __future__ import annotations

import concurrent.futures
import uuid

import pytest
from transformers import AutoModelForImageTextToText, AutoProcessor

from demo.api.app import build_engine, create_app
from demo.api.server import serving
from demo.config import Config
from tests.demo_checkpoints import data_url, pil, png
from tests.demo_vlm_checkpoints import save_gemma3, save_llava_next

BLOCK = 4
MAX_NEW = 5
SAVERS = {"gemma3": save_gemma3, "llava_next": save_llava_next}


@pytest.fixture(scope="module", params=sorted(SAVERS))
def served(request, tmp_path_factory):
    """(openai client, engine, reference model, reference processor) for one family."""
    import openai

    path = SAVERS[request.param](tmp_path_factory.mktemp("vlm") / request.param)
    config = Config(model=path, block_size=BLOCK, cache_tokens=1 << 13, limit_images=2, served_name="m")
    engine = build_engine(config)
    reference = AutoModelForImageTextToText.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)
    with serving(create_app(config, engine)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield client, engine, reference


class Tower:
    def __init__(self, model) -> None:
        self.calls = 0
        model.model.vision_tower.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))


def user(*parts) -> list[dict]:
    content = [
        {"type": "image_url", "image_url": {"url": p}}
        if p.startswith("data:")
        else {"type": "text", "text": p}
        for p in parts
    ]
    return [{"role": "user", "content": content}]


def stock(reference, messages) -> tuple[list[int], str]:
    """Prompt ids and the stock greedy reply of the processor's inputs from the same bytes."""
    import base64

    model, processor = reference
    conv = []
    for m in messages:
        content = [
            {"type": "image", "image": pil(base64.b64decode(p["image_url"]["url"].split(",", 1)[1]))}
            if p["type"] == "image_url"
            else p
            for p in m["content"]
        ]
        conv.append({"role": m["role"], "content": content})
    inputs = processor.apply_chat_template(
        conv, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
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
