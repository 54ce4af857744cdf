"""A saved tiny model + tokenizer and an OpenAI batch file, for the batchrun tests, and the stock
generate() answers every result line must equal."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

WORDS = "the cache prefix token block tree node pool key value model request reply prompt chat".split()


def save_tiny_model(directory: Path) -> Path:
    """demo's built-in tiny Llama and BPE tokenizer (chat template included), saved as a checkpoint
    (what ``python -m demo save-builtin DIR --name builtin-tiny`` writes)."""
    from demo.save_builtin import save_builtin

    save_builtin(str(directory), "builtin-tiny")
    return directory


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def write_requests(path: Path, questions_per_system: int = 5) -> list[str]:
    """Chats over two long system prompts, completions, and bad lines; returns the raw lines."""
    rng = random.Random(0)
    systems = [text(rng, 70), text(rng, 90)]
    lines = []
    for q in range(questions_per_system):
        for s, system in enumerate(systems):
            body = {
                "model": "tiny",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": text(rng, 3 + q)},
                ],
                "max_tokens": 5,
                "temperature": 0,
            }
            lines.append(
                {"custom_id": f"chat-{s}-{q}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            )
    lines.append({"custom_id": "cmpl-text", "url": "/v1/completions",
                  "body": {"prompt": systems[0] + " and more", "max_tokens": 4, "temperature": 0}})  # fmt: skip
    lines.append({"custom_id": "cmpl-ids", "url": "/v1/completions",
                  "body": {"prompt": [40, 41, 42, 43, 44, 45], "max_tokens": 3, "temperature": 0}})  # fmt: skip
    raw = [json.dumps(line) for line in lines]
    raw.insert(3, "{not json")
    raw.insert(6, json.dumps({"custom_id": "bad-url", "url": "/v1/embeddings", "body": {"input": "x"}}))
    raw.insert(8, json.dumps({"custom_id": "chat-0-0", "url": "/v1/completions", "body": {"prompt": "dup"}}))
    raw.append(json.dumps({"custom_id": "two", "url": "/v1/completions", "body": {"prompt": "x", "n": 2}}))
    raw.append(
        json.dumps(
            {"custom_id": "logprobs", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 2}}
        )
    )
    path.write_text("\n".join(raw) + "\n\n", encoding="utf-8")
    return raw


BAD = {3: "not JSON", 6: "url must be one of", 8: "duplicate custom_id 'chat-0-0'", -2: "n must be 1",
       -1: "unsupported body field(s) ['logprobs']"}  # fmt: skip


def stock_answers(model_dir: Path, raw_lines: list[str]) -> dict[str, tuple[str, str]]:
    """custom_id -> (text, finish_reason) from stock generate(), one prompt at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    answers = {}
    for raw in raw_lines:
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            continue
        body = line["body"]
        if line["custom_id"] in answers or line["url"] == "/v1/embeddings" or set(body) & {"n", "logprobs"}:
            continue
        if "messages" in body:
            ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        elif isinstance(body["prompt"], str):
            ids = tokenizer(body["prompt"])["input_ids"]
        else:
            ids = body["prompt"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=body["max_tokens"], do_sample=False)
        new = out[0, len(ids) :].tolist()
        eos = tokenizer.eos_token_id
        finish = "stop" if eos in new else "length"
        new = new[: new.index(eos)] if eos in new else new
        answers[line["custom_id"]] = (tokenizer.decode(new, skip_special_tokens=True), finish)
    return answers


def check_results(output: Path, raw_lines: list[str], answers: dict[str, tuple[str, str]]) -> list[dict]:
    """Every line answered, in input order; bad lines as errors; the rest equal to stock."""
    results = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    assert len(results) == len(raw_lines)
    bad = {i % len(raw_lines): message for i, message in BAD.items()}
    for i, (raw, result) in enumerate(zip(raw_lines, results)):
        if i in bad:
            assert result["response"]["status_code"] == 400 and result["response"]["body"] is None
            assert bad[i] in result["error"], (i, result["error"])
            continue
        custom_id = json.loads(raw)["custom_id"]
        assert result["custom_id"] == custom_id and result["error"] is None
        body = result["response"]["body"]
        choice = body["choices"][0]
        got = choice["message"]["content"] if body["object"] == "chat.completion" else choice["text"]
        assert (got, choice["finish_reason"]) == answers[custom_id], custom_id
    return results
