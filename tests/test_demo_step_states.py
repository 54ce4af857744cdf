"""The demo's step loop serving a hybrid (linear-attention + attention) checkpoint: the engine says it
decodes in the step loop with per-row recurrent states, concurrent requests that join and leave at
different steps equal stock generate() of each alone, and a chat's second turn reads its whole first
turn (prompt and reply) from the cache."""

from __future__ import annotations

import concurrent.futures
import logging

import openai
import pytest

from demo.api.app import create_app
from demo.api.server import serving
from demo.config import Config
from tests.demo_checkpoints import stock_reply
from tests.test_demo_hybrid import DOC, checkpoint, prompt_ids, stock  # noqa: F401  (fixtures)

BS = 4


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def served(checkpoint):  # noqa: F811
    lines = Lines()
    logger = logging.getLogger("demo.engine")
    before = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(lines)
    try:
        # prefill_chunk 32: a long prompt arriving while others run is prefilled in slices between steps
        app = create_app(Config(model=checkpoint, block_size=BS, max_batch_size=4, prefill_chunk=32))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(before)
    with serving(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120), lines.lines


def test_concurrent_requests_and_a_second_turn_through_the_step_loop(served, stock):  # noqa: F811
    client, lines = served
    model, tok = stock
    assert any("step loop" in line and "recurrent state" in line for line in lines), lines
    assert not any("not the step loop" in line for line in lines), lines
    asks = [(f"Who is in row {i}?", n) for i, n in ((2, 9), (5, 4), (11, 7))]  # rows leave at different steps

    def ask(q, n):
        messages = [{"role": "user", "content": DOC[: 60 * (1 + n % 3)] + q}]  # different prompt lengths
        return (
            messages,
            n,
            client.chat.completions.create(
                model="qwen35-tiny", messages=messages, max_tokens=n, temperature=0
            ),
        )

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda a: ask(*a), asks))
    for messages, n, r in results:
        assert r.choices[0].message.content == stock_reply(model, tok, prompt_ids(tok, messages), n)[1]
    # the next turn of the first chat, as token ids (its prompt, the reply as generated, more): the
    # prompt and reply were committed with a snapshot at the reply's last whole block (its last
    # token was never fed), so all of that is read
    messages, n, r = results[0]
    first = prompt_ids(tok, messages)
    reply = stock_reply(model, tok, first, n)[0]
    ids = first + reply + tok("\nAnd row 9?", add_special_tokens=False)["input_ids"]
    second = client.completions.create(model="qwen35-tiny", prompt=ids, max_tokens=6, temperature=0)
    assert second.choices[0].text == stock_reply(model, tok, ids, 6)[1]
    fed = len(first) + len(reply) - 1
    assert second.usage.prompt_tokens_details.cached_tokens == fed // BS * BS > len(first)
