"""A 10-turn agent loop: share of prompt tokens read from the prefix cache and TTFT per turn,
chat completions (the client resends the whole conversation) vs /v1/responses with
previous_response_id (the server keeps it), and chat completions with cache_prompt=false.

The agent: a ~1,500-token block of instructions and two tool definitions, then per turn a user
question, the model's streamed reply (TTFT = first text delta), a tool call and its result
appended to the conversation. Each mode has its own tag in the instructions (so no mode reads
another's cache), so their random-model replies, and prompt lengths after turn 1, differ a little. Runs the app in this process over HTTP (waitress) with the openai
client, on a checkpoint made from the built-in model with a tool-calling chat template.

    python benchmarks/bench_agents.py                   # built-in model, 10 turns
    python benchmarks/bench_agents.py --model builtin-tiny --turns 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid

import openai

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from demo.api.app import create_app  # noqa: E402
from demo.api.server import serving  # noqa: E402
from demo.config import Config  # noqa: E402
from tests.demo_checkpoints import save_agent_model  # noqa: E402

RULES = " ".join(
    f"Rule {i}: when a traveller asks about city {i}, check the weather and the exchange rate first, "
    "then answer in one short paragraph with the numbers you found."
    for i in range(12)
)
TOOLS = [
    {"name": "get_weather", "description": "Forecast for a city over some days. " * 4,
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city", "days"]}},
    {"name": "exchange_rate", "description": "Exchange rate between two currencies. " * 4,
     "parameters": {"type": "object", "properties": {"base": {"type": "string"}, "quote": {"type": "string"}},
                    "required": ["base", "quote"]}},
]  # fmt: skip
CITIES = [
    "Lima",
    "Paris",
    "Osaka",
    "Rome",
    "Seoul",
    "Quito",
    "Tunis",
    "Vienna",
    "Porto",
    "Lagos",
    "Zagreb",
    "Berlin",
]


def turn_items(t: int) -> tuple[str, dict, str]:
    """Turn t's question, the tool call the agent then makes, and its result."""
    city = CITIES[t % len(CITIES)]
    call = {"name": "get_weather", "arguments": json.dumps({"city": city, "days": 3})}
    return f"Turn {t}: is {city} warm this week?", call, f"{city}: 24 C, sunny"


def streamed_ttft(stream, kind: str) -> tuple[float, str, object]:
    """(seconds to the first text delta, the reply text, the final usage) of a stream."""
    t0, first, text, usage, rid = time.perf_counter(), None, "", None, None
    for ev in stream:
        if kind == "chat":
            delta = ev.choices[0].delta.content if ev.choices else None
            usage = ev.usage or usage
        else:
            delta = ev.delta if ev.type == "response.output_text.delta" else None
            if ev.type in ("response.completed", "response.incomplete"):  # (max_output_tokens cut it)
                usage, rid = ev.response.usage, ev.response.id
        if delta:
            first = first or time.perf_counter() - t0
            text += delta
    return first or time.perf_counter() - t0, text, (usage, rid)


def run(client, mode: str, turns: int, max_tokens: int, tag: str) -> list[tuple[int, int, float]]:
    tools_chat = [{"type": "function", "function": t} for t in TOOLS]
    tools_resp = [{"type": "function", **t} for t in TOOLS]
    instructions = f"[{tag}] You are a travel agent. {RULES}"
    messages = [{"role": "system", "content": instructions}]
    rows, previous, pending = [], None, []
    for t in range(turns):
        question, call, result = turn_items(t)
        call_id = f"call_{t}"
        if mode == "responses":
            items = pending + [{"role": "user", "content": question}]
            stream = client.responses.create(
                model="agent", instructions=instructions, input=items, tools=tools_resp, tool_choice="auto",
                previous_response_id=previous, max_output_tokens=max_tokens, temperature=0, stream=True,
            )  # fmt: skip
            ttft, text, (usage, previous) = streamed_ttft(stream, "responses")
            rows.append((usage.input_tokens, usage.input_tokens_details.cached_tokens, ttft))
            pending = [
                {"type": "function_call", "call_id": call_id, **call},
                {"type": "function_call_output", "call_id": call_id, "output": result},
            ]
        else:
            messages.append({"role": "user", "content": question})
            stream = client.chat.completions.create(
                model="agent", messages=messages, tools=tools_chat, tool_choice="auto", max_tokens=max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"cache_prompt": mode != "chat-no-cache"},
            )  # fmt: skip
            ttft, text, (usage, _) = streamed_ttft(stream, "chat")
            rows.append((usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, ttft))
            # the reply, then (as the agent decided) a tool call and its result
            messages.append({"role": "assistant", "content": text})
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": call}]})  # fmt: skip
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin", choices=["builtin", "builtin-tiny"])
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()
    path = save_agent_model(os.path.join(tempfile.mkdtemp(), "agent"), name=args.model)
    app = create_app(Config(model=path, served_name="agent", block_size=16))
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        print(f"model {args.model} (agent template), load {os.getloadavg()[0]:.2f}")
        results = {}
        for mode in ("chat", "responses", "chat-no-cache"):
            results[mode] = run(client, mode, args.turns, args.max_tokens, uuid.uuid4().hex)
    print(
        f"{'turn':>4} | {'prompt':>6} | {'chat cached':>11} {'ttft s':>7} | {'resp cached':>11} {'ttft s':>7} | {'no cache ttft s':>15}"
    )
    for t in range(args.turns):
        (pc, cc, tc), (pr, cr, tr), (pn, _, tn) = (
            results[m][t] for m in ("chat", "responses", "chat-no-cache")
        )
        print(
            f"{t + 1:>4} | {pc:>6} | {cc / pc:>10.0%} {tc:>8.3f} | {cr / pr:>10.0%} {tr:>8.3f} | {tn:>15.3f}"
        )
    for mode, rows in results.items():
        later = rows[1:]
        share = sum(c for _, c, _ in later) / sum(p for p, _, _ in later)
        print(f"{mode:>14}: turns 2-{args.turns}: {share:.0%} of prompt tokens from cache, median TTFT "
              f"{statistics.median(t for _, _, t in later):.3f} s")  # fmt: skip
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
