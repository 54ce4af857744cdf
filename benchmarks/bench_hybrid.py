"""Hybrid and recurrent models (issue 40): a cached document's TTFT, snapshot memory against the
snapshot interval, and a shared system prompt's reuse (vLLM issue 40696's case).

Run by hand (CPU, fp32, random weights; a Qwen3.5-style text model, ``linear_attention`` and
``full_attention`` layers 3:1, and a Mamba-2; ``--layers`` / ``--hidden`` size both, 8 x 1024 by
default: at hidden 512 on two threads a 2,000-token forward costs only ~37 one-token forwards, and
the few short forwards a cached request runs weigh on its TTFT; part 1 prints that ratio):

    python benchmarks/bench_hybrid.py                          # all three parts, both models
    python benchmarks/bench_hybrid.py --parts qa --models qwen3_5
    python benchmarks/bench_hybrid.py --quick                  # a tiny run in seconds: the script works

1. ``qa``: a ``--doc``-token document (2,000) + 30-token questions, TTFT (``max_new_tokens=1``)
   of stock generate() (no cache) and of RadixCache for question 1 (cold), question 2 (reuses
   the document but at most one snapshot interval) and question 3 (all of it), medians of
   ``--rounds`` rounds, each round a new document and a new store, stock and RadixCache taking
   turns. Every RadixCache output is checked against stock's (token equal, logits printed).
2. ``intervals``: per ``--intervals`` value, the first request's snapshots (count, bytes, against
   the document's KV bytes), its TTFT and the second question's, as ratios to stock; then the
   snapshot sizes of the two families' default (full-size) configs against their KV per token.
3. ``sysprompt``: a 480-token system prompt + 50 different 40-token questions (Qwen3.5-style
   model), per ``--prompt-intervals`` value: the share of the system prompt reused per request
   (``cached_tokens / 480``) for request 2 and for requests 2..50.

Every figure is a ratio to a baseline measured in the same run; the load average is printed
beside each.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hf_patch  # noqa: E402
from hf_patch import RadixCache  # noqa: E402

LIN, FULL = "linear_attention", "full_attention"
VOCAB = 32000
BLOCK = 16
LOGIT_WARN = 1e-3  # fp32: a stale or misplaced state moves logits by 1e-2 and more


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


# -- models ------------------------------------------------------------------------------------------
def qwen3_5_config(layers: int, hidden: int):
    """Qwen3.5 text's shape, scaled down: 3 Gated-DeltaNet layers to 1 full-attention layer,
    head dim 64, GQA 4:1, linear attention with twice the value heads of key heads."""
    heads = max(2, hidden // 64)
    config = AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=64,
        layer_types=[FULL if i % 4 == 3 else LIN for i in range(layers)],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=max(1, heads // 2),
        linear_num_value_heads=heads,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._attn_implementation = "sdpa"
    return config


def mamba2_config(layers: int, hidden: int):
    """Mamba-2's shape (head dim 64, state 128, expand 2, conv 4), scaled down. Chunk size 64, not
    the default 256: transformers' reference (CPU) scan pads every forward to a whole chunk, so a
    30-token forward would cost a 256-token one on both sides."""
    return AutoConfig.for_model(
        "mamba2",
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_heads=2 * hidden // 64,
        head_dim=64,
        state_size=128,
        n_groups=1,
        expand=2,
        conv_kernel=4,
        chunk_size=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


CONFIGS = {"qwen3_5": qwen3_5_config, "mamba2": mamba2_config}


def build(name: str, layers: int, hidden: int):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(CONFIGS[name](layers, hidden))
    return model.float().eval()


def describe(name: str, model) -> str:
    c = model.config
    kinds = hf_patch.model_spec.model_layout(model).kinds
    pattern = "".join({"kv": "A", "state": "L", "kv+state": "H", "none": "-"}[k] for k in kinds)
    return f"{name}: {c.num_hidden_layers} layers ({pattern}), hidden {c.hidden_size}, vocab {c.vocab_size}, fp32"


# -- timing ------------------------------------------------------------------------------------------
class Forwards:
    """Forward hooks on the model: how many forwards a call ran, their tokens and their time."""

    def __init__(self, model) -> None:
        self.calls: list[tuple[int, float]] = []
        self._t0 = 0.0
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.register_forward_hook(self._post)

    def _pre(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._n = 0 if ids is None else ids.shape[-1]
        self._t0 = time.perf_counter()

    def _post(self, module, args, output) -> None:
        self.calls.append((self._n, time.perf_counter() - self._t0))

    def take(self) -> list[tuple[int, float]]:
        out, self.calls = self.calls, []
        return out


def generate(model, tokens: list[int], store=None, snapshot_at=None) -> dict:
    """One greedy generate() of one new token (its time is the TTFT): seconds, token, logits,
    cached tokens (RadixCache only; ``snapshot_at``: its hints)."""
    input_ids = torch.tensor([tokens])
    kwargs = {}
    cache = None
    if store is not None:
        cache = kwargs["past_key_values"] = RadixCache(store=store, snapshot_at=snapshot_at)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids,
        max_new_tokens=1,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kwargs,
    )
    seconds = time.perf_counter() - t0
    return {
        "s": seconds,
        "token": int(out.sequences[0, -1]),
        "logits": out.logits[0][0],
        "cached": cache.cached_tokens[0] if cache is not None else 0,
    }


class Checks:
    """Every RadixCache output against stock's: the token must be equal (else AssertionError);
    the largest logit difference and the distinct tokens seen are reported."""

    def __init__(self) -> None:
        self.diffs: list[float] = []
        self.tokens: set[int] = set()

    def same(self, ref: dict, got: dict, what: str) -> None:
        assert got["token"] == ref["token"], f"{what}: token {got['token']} != stock's {ref['token']}"
        diff = float((got["logits"] - ref["logits"]).abs().max())
        self.diffs.append(diff)
        self.tokens.add(got["token"])
        if diff > LOGIT_WARN:
            print(f"   WARNING {what}: max |logit diff| {diff:.2e} against stock")

    def line(self) -> str:
        n = len(self.diffs)
        return (
            f"outputs: {n} of {n} tokens equal to stock's ({len(self.tokens)} distinct), "
            f"max |logit diff| {max(self.diffs):.1e}"
        )


def doc_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def questions(rng: random.Random, count: int, length: int) -> list[list[int]]:
    """``count`` questions whose first tokens all differ (so each parts from the others there)."""
    firsts = rng.sample(range(100, VOCAB), count)
    return [[f] + doc_tokens(rng, length - 1) for f in firsts]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f} ms"


def fixed_costs(model, rng: random.Random, doc: int) -> None:
    """A 1-token forward (what every call pays: the Python, the layers' launches, the lm head)
    against the forward over the whole document."""
    ids = torch.tensor([doc_tokens(rng, doc)])
    times = {}
    for n in (1, 30, doc):
        model(input_ids=ids[:, :n], logits_to_keep=1)  # warm
        runs = []
        for _ in range(3 if n < doc else 1):
            t0 = time.perf_counter()
            model(input_ids=ids[:, :n], logits_to_keep=1)
            runs.append(time.perf_counter() - t0)
        times[n] = min(runs)
    print(
        f"   forwards: 1 token {ms(times[1])}, 30 tokens {ms(times[30])}, {doc} tokens {ms(times[doc])} "
        f"= {times[doc] / times[1]:.0f}x a 1-token forward ({load()})"
    )


def warm_up(model, rng: random.Random) -> None:
    store = hf_patch.build_store(model)
    prompt = doc_tokens(rng, 200)
    generate(model, prompt)
    generate(model, prompt, store)
    generate(model, prompt[:150] + doc_tokens(rng, 20), store)


def forwards_line(calls: list[tuple[int, float]], total: float) -> str:
    """The forwards of one call, in order: tokens and milliseconds each, and their share of it."""
    spent = sum(t for _, t in calls)
    each = ", ".join(f"{n} tok {t * 1e3:.0f}" for n, t in calls)
    return f"{len(calls)} forwards ({each} ms) = {spent * 1e3:.1f} of {total * 1e3:.1f} ms"


# -- part 1 ------------------------------------------------------------------------------------------
def part_qa(name: str, model, args) -> None:
    rng = random.Random(1)
    doc_kv = args.doc // BLOCK * BLOCK
    interval = args.interval
    print(
        f"\n1. {name}: {args.doc}-token document + 30-token questions, TTFT (max_new_tokens=1), "
        f"snapshot interval {interval}, medians of {args.rounds} rounds"
    )
    fixed_costs(model, rng, args.doc)
    rows: dict[str, list[float]] = {"stock": [], "q1": [], "q2": [], "q3": []}
    cached: dict[str, list[int]] = {"q1": [], "q2": [], "q3": []}
    calls: dict[str, list] = {}
    checks = Checks()
    loads = []
    for _ in range(args.rounds):
        store = hf_patch.build_store(model, snapshot_interval=interval)
        doc = doc_tokens(rng, args.doc)
        for q, question in zip(("q1", "q2", "q3"), questions(rng, 3, 30)):
            prompt = doc + question
            ref = generate(model, prompt)
            rows["stock"].append(ref["s"])
            args.forwards.take()
            got = generate(model, prompt, store)
            calls[q] = args.forwards.take()
            rows[q].append(got["s"])
            cached[q].append(got["cached"])
            checks.same(ref, got, f"{name} {q}")
        loads.append(os.getloadavg()[0])
        store.check_invariants()
    expect = {"q1": 0, "q2": doc_kv // interval * interval, "q3": doc_kv}
    for q, want in expect.items():
        assert all(c == want for c in cached[q]), f"{q} cached {cached[q]}, expected {want}"
    stock = statistics.median(rows["stock"])
    labels = {
        "stock": "stock generate (no cache)",
        "q1": "question 1 (cold)",
        "q2": "question 2 (same document)",
        "q3": "question 3 (same document)",
    }
    print(f"   {'':<28}{'median':>11}{'min':>11}{'vs stock':>10}{'cached tokens':>15}")
    for key, values in rows.items():
        med = statistics.median(values)
        cell = "" if key == "stock" else f"{cached[key][0]:>6} of {args.doc + 30}"
        print(f"   {labels[key]:<28}{ms(med):>11}{ms(min(values)):>11}{stock / med:>9.1f}x{cell:>15}")
    print(f"   {checks.line()}; load {min(loads):.2f}-{max(loads):.2f}")
    for q in ("q2", "q3"):
        print(f"   where {q}'s time goes (last round): {forwards_line(calls[q], rows[q][-1])}")
    targets = (
        (stock / statistics.median(rows["q2"]), 5, "q2"),
        (stock / statistics.median(rows["q3"]), 10, "q3"),
    )
    print(
        "   targets: "
        + ", ".join(f"{q} {r:.1f}x (>= {t}x: {'met' if r >= t else 'MISSED'})" for r, t, q in targets)
    )


# -- part 2 ------------------------------------------------------------------------------------------
def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def part_intervals(name: str, model, args) -> None:
    rng = random.Random(2)
    doc_kv = args.doc // BLOCK * BLOCK
    probe = hf_patch.build_store(model)
    st = probe.stats()
    snap, per_token = st["snapshot_bytes"], st["bytes_per_token"]
    print(
        f"\n2. {name}: snapshot interval against recompute and memory; {args.doc}-token document, "
        f"medians of {args.rounds} rounds"
    )
    print(
        f"   one snapshot {mib(snap)}; KV {per_token} bytes per token; the document's KV "
        f"({doc_kv} tokens) {mib(doc_kv * per_token)}"
        + (
            f"; a snapshot = the KV of {snap / per_token:.0f} tokens"
            if per_token
            else " (no attention layers)"
        )
    )
    print(
        f"   {'interval':>8}{'snapshots':>10}{'their bytes':>13}{'vs doc KV':>10}"
        f"{'B/doc tok':>10}{'q1 vs stock':>12}{'q2 cached':>10}{'q2 recomputed':>14}{'q2 vs stock':>12}  load"
    )
    checks = Checks()
    for interval in args.intervals:
        stock, q1, q2, snaps, cached = [], [], [], [], []
        for _ in range(args.rounds):
            store = hf_patch.build_store(model, snapshot_interval=interval)
            doc = doc_tokens(rng, args.doc)
            first, second = (doc + q for q in questions(rng, 2, 30))
            ref1 = generate(model, first)
            got1 = generate(model, first, store)
            snaps.append(store.stats()["snapshots"])
            ref2 = generate(model, second)
            got2 = generate(model, second, store)
            checks.same(ref1, got1, f"{name} interval {interval} q1")
            checks.same(ref2, got2, f"{name} interval {interval} q2")
            assert got1["cached"] == 0 and got2["cached"] == doc_kv // interval * interval, (interval, got2)
            stock += [ref1["s"], ref2["s"]]
            q1.append(got1["s"])
            q2.append(got2["s"])
            cached.append(got2["cached"])
        s = statistics.median(stock)
        n = snaps[0]
        vs_kv = f"{n * snap / (doc_kv * per_token):>9.1f}x" if per_token else f"{'n/a':>10}"
        print(
            f"   {interval:>8}{n:>10}{mib(n * snap):>13}{vs_kv}{n * snap / doc_kv:>10.0f}{s / statistics.median(q1):>11.2f}x"
            f"{cached[0]:>10}{args.doc + 30 - cached[0]:>14}{s / statistics.median(q2):>11.1f}x"
            f"  {os.getloadavg()[0]:.2f}"
        )
    print(f"   {checks.line()}")


def default_sizes(args) -> None:
    """Snapshot bytes of the families' default configs (the full-size models), from the shapes the
    cache layers hold (checked against the probe of the benchmark's own configs), in bf16 with the
    recurrent (SSM / delta-rule) state in fp32, as the kernels keep it."""

    def qwen(c, conv_bytes, rec_bytes):
        conv_dim = (
            2 * c.linear_num_key_heads * c.linear_key_head_dim
            + c.linear_num_value_heads * c.linear_value_head_dim
        )
        conv = conv_dim * c.linear_conv_kernel_dim
        rec = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
        lin = sum(t == LIN for t in c.layer_types)
        full = len(c.layer_types) - lin
        return lin * (conv * conv_bytes + rec * rec_bytes), full * 2 * c.num_key_value_heads * c.head_dim

    def mamba(c, conv_bytes, rec_bytes):
        conv = (c.expand * c.hidden_size + 2 * c.n_groups * c.state_size) * c.conv_kernel
        rec = c.num_heads * c.head_dim * c.state_size
        return c.num_hidden_layers * (conv * conv_bytes + rec * rec_bytes), 0

    formulas = {"qwen3_5": (qwen, "qwen3_5_text"), "mamba2": (mamba, "mamba2")}
    print("\n   default (full-size) configs, bf16, recurrent state fp32:")
    for name in args.models:
        formula, model_type = formulas[name]
        small = build(name, 4, 128)  # the formula against the store's own probe, fp32
        snap, kv = formula(small.config, 4, 4)
        st = hf_patch.build_store(small).stats()
        assert (snap, kv * 4) == (st["snapshot_bytes"], st["bytes_per_token"]), (name, snap, kv, st)
        snap, kv = formula(AutoConfig.for_model(model_type), 2, 4)
        kv *= 2
        line = f"   {model_type}: one snapshot {mib(snap)}, KV {kv // 1024} KiB per token"
        if kv:
            line += (
                f"; a snapshot = the KV of {snap / kv:.0f} tokens: snapshots every N tokens add "
                + ", ".join(f"{snap / (n * kv):.1f}x (N={n})" for n in (256, 1024, 2048))
                + " the KV they cover"
            )
        else:
            line += "; no KV, snapshots are all it caches: " + ", ".join(
                f"{2000 // n + 1} per 2,000-token document = {mib((2000 // n + 1) * snap)} at N={n}"
                for n in (256, 1024, 2048)
            )
        print(line)


# -- part 3 ------------------------------------------------------------------------------------------
def part_sysprompt(name: str, model, args) -> None:
    rng = random.Random(3)
    system = doc_tokens(rng, args.system)
    asks = questions(rng, args.requests, 40)
    prompts = [system + q for q in asks]
    print(
        f"\n3. {name}: a {args.system}-token system prompt + {args.requests} different 40-token questions "
        "(vLLM issue 40696: 0% reused on hybrid models)"
    )
    refs = [generate(model, p) for p in prompts]
    stock = statistics.median(r["s"] for r in refs[1:])
    print(f"   stock TTFT, requests 2..{args.requests}: median {ms(stock)} ({load()})")
    print(
        f"   {'interval':>8}{'request 2':>16}{'requests 2..' + str(args.requests):>18}{'3..':>7}"
        f"{'req 1 snapshots':>16}{'bytes':>11}{'vs prompt KV':>13}{'req 1 vs stock':>15}"
        f"{'TTFT 2..':>10}{'vs stock':>9}  load"
    )
    checks = Checks()
    # then with the system prompt's end as a snapshot hint (what the demo passes for a chat's
    # messages: RadixCache(snapshot_at=), demo.model.chat_tokens.message_ends)
    for interval, hint in [(i, None) for i in args.prompt_intervals] + [
        (args.prompt_intervals[0], [args.system])
    ]:
        store = hf_patch.build_store(model, snapshot_interval=interval)
        got = [generate(model, p, store, hint) for p in prompts[:1]]
        st = store.stats()
        n_snaps, snap, per_token = st["snapshots"], st["snapshot_bytes"], st["bytes_per_token"]
        got += [generate(model, p, store, hint) for p in prompts[1:]]
        for i, (ref, g) in enumerate(zip(refs, got)):
            checks.same(ref, g, f"{name} interval {interval} request {i + 1}")
        share = [min(g["cached"], args.system) / args.system for g in got]
        later = share[1:]
        rest = share[2:]
        ttft = statistics.median(g["s"] for g in got[1:])
        kv = args.system * per_token
        label = f"{interval}+hint" if hint else str(interval)
        print(
            f"   {label:>8}{got[1]['cached']:>6} = {100 * share[1]:>5.1f}%"
            f"{100 * statistics.mean(later):>17.1f}%{100 * statistics.mean(rest) if rest else 0:>6.0f}%"
            f"{n_snaps:>16}{mib(n_snaps * snap):>11}{n_snaps * snap / kv:>12.1f}x"
            f"{refs[0]['s'] / got[0]['s']:>14.2f}x{ms(ttft):>10}{stock / ttft:>8.1f}x  {os.getloadavg()[0]:.2f}"
        )
    print(f"   {checks.line()}")
    fits = [n for n in range(BLOCK, 257, BLOCK) if args.system // n * n >= 0.9 * args.system]
    print(
        f"   request 2 reuses the largest multiple of the interval <= {args.system}: >= 90% of it needs an "
        f"interval <= {int(0.1 * args.system) // BLOCK * BLOCK} for any prompt, for this one any of "
        f"{', '.join(map(str, fits))} (block multiples up to 256)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="qa,intervals,sysprompt")
    parser.add_argument("--models", default="qwen3_5,mamba2")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--doc", type=int, default=2000)
    parser.add_argument("--interval", type=int, default=256, help="part 1's snapshot interval")
    parser.add_argument("--intervals", default="64,128,256,512,1024")
    parser.add_argument("--prompt-intervals", default="256,128,64", help="part 3's snapshot intervals")
    parser.add_argument("--system", type=int, default=480)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: 2 if load < 1.5, else 1)")
    parser.add_argument("--quick", action="store_true", help="a tiny run in seconds: the script works")
    args = parser.parse_args()
    if args.quick:  # checks that the script runs: a model this small is all fixed costs
        args.layers, args.hidden, args.doc, args.rounds = 4, 128, 300, 1
        args.intervals, args.requests = "64,128", 5
        print("--quick: a tiny model, figures meaningless (its fixed costs dominate)")
    args.models = args.models.split(",")
    args.intervals = [int(x) for x in args.intervals.split(",")]
    args.prompt_intervals = [int(x) for x in args.prompt_intervals.split(",")]
    threads = args.threads or (2 if os.getloadavg()[0] < 1.5 else 1)
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    print(
        f"torch {torch.__version__}, {threads} thread(s), {os.cpu_count()} CPUs, {load()}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
    )
    parts = args.parts.split(",")
    for name in args.models:
        if name == "mamba2" and parts == ["sysprompt"]:
            continue
        model = build(name, args.layers, args.hidden)
        args.forwards = Forwards(model)
        print(f"\n{describe(name, model)}")
        warm_up(model, random.Random(0))
        if "qa" in parts:
            part_qa(name, model, args)
        if "intervals" in parts:
            part_intervals(name, model, args)
        if "sysprompt" in parts and name == "qwen3_5":
            part_sysprompt(name, model, args)
    if "intervals" in parts:
        default_sizes(args)


if __name__ == "__main__":
    main()
