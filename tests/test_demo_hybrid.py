"""The demo serving a hybrid (linear-attention + attention) checkpoint on its generate() path:
replies equal stock generate() of the chat template's prompt, the next turn reads the history from the cache, and
concurrent requests that pause and resume (their rows computed from their snapshots) still equal
stock."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from demo.api.app import create_app
from demo.api.server import serving
from demo.config import Config
from demo.model.loading import build_tokenizer, unreadable_ids
from tests.demo_checkpoints import stock_reply

DOC = "".join(f"| row {i} | Lima | pilot | {20 + i} |\n" for i in range(12))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3.5-style model (linear attention 3:1) with the built-in tokenizer and template."""
    tok = build_tokenizer(512)
    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.suppress_tokens = unreadable_ids(tok)
    path = tmp_path_factory.mktemp("hybrid") / "qwen35-tiny"
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def stock(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval(), AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def client(checkpoint):
    # the generate() path (hybrid models the step loop refuses, adapters; the step loop's own
    # tests: tests/test_demo_step_states.py); decode_chunk 3: rows of a batch with a waiting
    # request pause after 3 steps and resume later
    config = Config(model=checkpoint, block_size=4, decode_chunk=3, max_batch_size=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("demo.engine.engine.step_loop_reason", lambda model, processor=None: "turned off")
        app = create_app(config)
    with serving(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def prompt_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_two_turns_equal_stock_and_the_second_reads_the_history(client, stock):
    model, tok = stock
    messages = [{"role": "user", "content": DOC + "Who is in row 7?"}]
    first = client.chat.completions.create(
        model="qwen35-tiny", messages=messages, max_tokens=8, temperature=0
    )
    assert first.choices[0].message.content == stock_reply(model, tok, prompt_ids(tok, messages), 8)[1]
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And row 9?"},
    ]
    second = client.chat.completions.create(
        model="qwen35-tiny", messages=messages, max_tokens=8, temperature=0
    )
    ids = prompt_ids(tok, messages)
    assert second.usage.prompt_tokens == len(ids)
    assert second.choices[0].message.content == stock_reply(model, tok, ids, 8)[1]
    assert second.usage.prompt_tokens_details.cached_tokens >= len(prompt_ids(tok, messages[:1])) - 4


def test_concurrent_requests_pause_resume_and_equal_stock(client, stock):
    model, tok = stock
    questions = [f"Who is in row {i}?" for i in (2, 5, 8)]

    def ask(q):
        messages = [{"role": "user", "content": DOC + q}]
        r = client.chat.completions.create(
            model="qwen35-tiny", messages=messages, max_tokens=10, temperature=0
        )
        return messages, r

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(ask, questions))
    for messages, r in results:
        assert r.choices[0].message.content == stock_reply(model, tok, prompt_ids(tok, messages), 10)[1]
    assert sum(r.usage.prompt_tokens_details.cached_tokens for _, r in results) > 0


def test_a_shared_system_prompt_is_reused_whole_from_the_second_request(client, stock):
    """vLLM issue 40696's case through the API: the first request takes a snapshot where its
    system message ends (demo.model.chat_tokens.message_ends), so the second, another question
    under the same system prompt, reuses all of it, not only the snapshot interval's multiples."""
    model, tok = stock
    system = {"role": "system", "content": "You answer from this table.\n" + DOC}
    head = tok(  # the system turn rendered alone, floored to the server's block size
        tok.apply_chat_template([system], add_generation_prompt=False, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    end = len(head) // 4 * 4
    cached = []
    for q in ("Who is in row 3?", "Who is in row 11?"):
        messages = [system, {"role": "user", "content": q}]
        r = client.chat.completions.create(
            model="qwen35-tiny", messages=messages, max_tokens=6, temperature=0
        )
        assert r.choices[0].message.content == stock_reply(model, tok, prompt_ids(tok, messages), 6)[1]
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached[1] == end, (cached, end)
