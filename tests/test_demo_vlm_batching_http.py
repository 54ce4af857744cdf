"""Over HTTP with the openai client (Gemma 3- and LLaVA-style checkpoints saved with their
processors): image requests of other image sizes and a text request, queued together while the
worker is held, are rows of one generate() call, each answering as offline stock generate()."""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import time
import uuid

import pytest

from tests.demo_checkpoints import data_url, pil, png, save_vlm
from tests.demo_vlm_checkpoints import save_gemma3, save_llava_onevision, save_qwen_vl
from tests.engine_gate import Calls, Held

BS = 4
MAX_NEW = 5


SAVERS = {
    "gemma3": save_gemma3,
    "llava": save_vlm,
    "llava_onevision": save_llava_onevision,
    "qwen2_5_vl": save_qwen_vl,
    "qwen3_vl": functools.partial(save_qwen_vl, model_type="qwen3_vl"),
}


@pytest.fixture(scope="module", params=sorted(SAVERS))
def served(request, tmp_path_factory):
    """(openai client, engine, reference model and processor) for one saved checkpoint."""
    import openai
    from transformers import AutoConfig, AutoModelForImageTextToText

    from demo.api.app import build_engine, create_app
    from demo.api.server import serving
    from demo.config import Config
    from demo.model.processors import load_processor

    path = SAVERS[request.param](tmp_path_factory.mktemp("vlm") / request.param)
    config = Config(model=path, block_size=BS, cache_tokens=1 << 13, limit_images=2, served_name="m")
    engine = build_engine(config)
    reference = (
        AutoModelForImageTextToText.from_pretrained(path).eval(),
        load_processor(path, AutoConfig.from_pretrained(path), {}),
    )
    with serving(create_app(config, engine)) as url:
        yield (
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120),
            engine,
            reference,
        )


def chat(*parts) -> list[dict]:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(png(*p))}}
        if isinstance(p, tuple)
        else {"type": "text", "text": p}
        for p in parts
    ]
    return [{"role": "user", "content": content}]


def offline(reference, messages) -> str:
    """Stock greedy reply of the processor's own inputs for ``messages`` (images from the same bytes)."""
    model, processor = reference
    conv = [
        {
            "role": m["role"],
            "content": [
                {"type": "image", "image": pil(base64.b64decode(p["image_url"]["url"].split(",", 1)[1]))}
                if p["type"] == "image_url"
                else p
                for p in m["content"]
            ],
        }
        for m in messages
    ]
    inputs = processor.apply_chat_template(
        conv, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_over_http_image_requests_of_other_sizes_and_a_text_request_share_one_call(served, monkeypatch):
    """Queued while the worker is held: two image requests (images of other sizes) and a text
    request are rows of one generate() call, each answering as stock alone."""
    client, engine, reference = served
    tag = uuid.uuid4().hex
    asked = [
        chat((41, (40, 48)), f"[{tag}] what is this?"),
        chat(f"[{tag}] tell me a story"),
        chat(f"[{tag}] and this wide one?", (42, (96, 40))),
    ]
    want = [offline(reference, m) for m in asked]
    held = Held(engine, monkeypatch)
    calls = Calls(engine, monkeypatch)

    def ask(messages):
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_NEW, temperature=0)
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(ask, m) for m in asked]
        deadline = time.monotonic() + 60
        while engine.queued < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        held.go()
        got = [f.result() for f in futures]
    monkeypatch.undo()
    assert calls.rows == [(3, True)]
    assert got == want
