"""Constrained decoding overhead: greedy tokens/s with and without a JSON schema, per library.

The same model, prompt and token count for every run: the constrained runs decode a schema
whose output is long (an array of 24 short strings); the unconstrained baseline decodes the
same number of tokens (EOS held off with min_new_tokens). Each library runs as a logits
processor masking the one row (llguidance as the demo runs it: a RowHook inside RowSampler). Also reports the grammar's compile time (the first request
with a schema pays it) and the per-token overhead against the baseline of the same run.

    python benchmarks/bench_grammar.py                          # built-in model, llguidance + xgrammar
    python benchmarks/bench_grammar.py --libs llguidance --repeats 5
    python benchmarks/bench_grammar.py --libs llguidance --rows 4  # 4 constrained rows, one call

Needs llguidance (the demo's choice) and, to compare, xgrammar (pip install xgrammar).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers.generation.logits_process import LogitsProcessor

from demo.engine.constrained import GrammarHook, Grammars, json_lark
from demo.engine.generation import Generation, Params
from demo.engine.sampling import Row, RowSampler
from demo.model.loading import build_builtin

SCHEMA = {
    "type": "object",
    "properties": {
        "names": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "minItems": 24,
            "maxItems": 24,
        },
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["names", "count"],
    "additionalProperties": False,
}


class XgrammarRow(LogitsProcessor):
    """xgrammar as a one-row logits processor (its documented matcher + bitmask calls)."""

    def __init__(self, xgr, compiled, vocab: int, width: int):
        self.xgr, self.width = xgr, width
        self.matcher = xgr.GrammarMatcher(compiled)
        self.mask = xgr.allocate_token_bitmask(1, vocab)

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.width:
            self.matcher.accept_token(int(input_ids[0, -1]))
        if self.matcher.is_terminated():
            return scores
        self.matcher.fill_next_token_bitmask(self.mask)
        self.xgr.apply_token_bitmask_inplace(scores, self.mask.to(scores.device))
        return scores


class Timed(LogitsProcessor):
    """Adds up the time spent inside ``inner`` (the grammar's own cost, apart from the model)."""

    def __init__(self, inner):
        self.inner, self.seconds = inner, 0.0

    def __call__(self, input_ids, scores):
        t0 = time.perf_counter()
        out = self.inner(input_ids, scores)
        self.seconds += time.perf_counter() - t0
        return out


def timed_generate(model, ids, processors, max_new: int, min_new: int = 0) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        do_sample=False,
        logits_processor=processors,
    )
    return time.perf_counter() - t0, out.shape[1] - ids.shape[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin")
    p.add_argument("--libs", nargs="+", default=["llguidance", "xgrammar"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-new", type=int, default=400)
    p.add_argument("--rows", type=int, default=1, help="constrained rows in one call (llguidance only)")
    args = p.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    model, tok = build_builtin(args.model)
    vocab = model.config.vocab_size
    if args.rows > 1 and args.libs != ["llguidance"]:
        p.error("--rows > 1 measures llguidance only (--libs llguidance)")
    ids = torch.tensor([tok("<|user|>Give me names as JSON.<|end|><|assistant|>")["input_ids"]] * args.rows)
    eos = [tok.eos_token_id]
    print(f"model {args.model}, load {os.getloadavg()[0]:.2f}")

    runs: dict[str, tuple[list[float], int]] = {}
    inside: dict[str, list[float]] = {}
    for lib in args.libs:
        times, n = [], 0
        inside[lib] = []
        for r in range(args.repeats + 1):
            if lib == "llguidance":
                t0 = time.perf_counter()
                grammars = Grammars(tok, vocab, eos)
                grammar = grammars.check(json_lark(SCHEMA))
                states = [grammars.start(grammar) for _ in range(args.rows)]
                compile_s = time.perf_counter() - t0
                # as the demo runs it: each row's RowHook, called by the batch's RowSampler
                gens = [
                    Generation(ids[0].tolist(), Params(args.max_new, temperature=0.0), None, tok.decode,
                               set(eos), hooks=[GrammarHook(state, ids.shape[1])])
                    for state in states
                ]  # fmt: skip
                proc = [RowSampler([Row(g, 0, 0) for g in gens])]
            else:
                import xgrammar as xgr

                t0 = time.perf_counter()
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
                compiled = xgr.GrammarCompiler(info).compile_json_schema(
                    SCHEMA, any_whitespace=False, separators=(", ", ": ")
                )
                compile_s = time.perf_counter() - t0
                proc = [XgrammarRow(xgr, compiled, vocab, ids.shape[1])]
            proc = [Timed(proc[0])]
            took, n = timed_generate(model, ids, proc, args.max_new)
            if r:
                inside[lib].append(proc[0].seconds / n)
            if r == 0:
                print(f"{lib}: compile (tokenizer + schema) {compile_s * 1000:.1f} ms, {n} tokens")
                continue  # warm-up
            times.append(took)
        runs[lib] = (times, n)

    tokens = min(n for _, n in runs.values())
    base = []
    for r in range(args.repeats + 1):
        took, _ = timed_generate(model, ids, [], tokens, min_new=tokens)
        if r:
            base.append(took)
    b = statistics.median(base)
    print(
        f"{'run':<12} {'tokens':>6} {'tok/s':>8} {'ms/token':>9} {'vs plain':>9} {'in grammar ms/token':>20}"
    )
    print(f"{'plain':<12} {tokens:>6} {tokens / b:>8.1f} {b / tokens * 1000:>9.3f} {'':>9} {'':>20}")
    for lib, (times, n) in runs.items():
        t = statistics.median(times)
        g = statistics.median(inside[lib]) * 1000
        print(
            f"{lib:<12} {n:>6} {n / t:>8.1f} {t / n * 1000:>9.3f} {(t / n) / (b / tokens):>8.2f}x {g:>20.3f}"
        )
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
