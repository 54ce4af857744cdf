"""Two LoRA adapters and the base under concurrent clients, against the base alone.

Saves two random LoRA adapters (peft, r=8 on q/k/v/o, init_lora_weights=False) over the model,
then starts three `python -m demo` servers on 127.0.0.1:

- base only: `--clients` clients all ask the base model;
- with adapters: `--lora-modules a=... b=...`, client c asks model [base, a, b][c % 3];
- the same server, every client asking adapter a (LoRA's own cost, no mixing).

The servers run at once and take turns, `--rounds` rounds of `--seconds` each (drift of a
shared machine's load cancels out of the per-round ratio). Each client sends, back to back, a
shared table (~470 tokens) plus a question of its own (non-streaming, greedy, `--max-tokens`).
Prints requests/s of both servers and the median per-round ratio, the mean batch size (rows of different adapters share a generate() through PEFT's
adapter_names) and the hit rate per model: cached_tokens / prompt_tokens summed over its
requests (each model caches its own copy of the table; none reads another's).

    python benchmarks/bench_adapters.py                    # built-in model, 16 clients, 3 x 15 s each
    python benchmarks/bench_adapters.py --rounds 5 --seconds 20
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_http import start_server, table  # noqa: E402


def save_adapters(model: str, root: str) -> dict[str, str]:
    """Two random LoRA adapters over the built-in ``model`` (or a checkpoint directory)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from demo.model.loading import BUILTIN, build_builtin

    paths = {}
    for name, seed in (("a", 1), ("b", 2)):
        base = build_builtin(model)[0] if model in BUILTIN else AutoModelForCausalLM.from_pretrained(model)
        torch.manual_seed(seed)
        config = LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            init_lora_weights=False,
        )
        paths[name] = os.path.join(root, name)
        get_peft_model(base, config).save_pretrained(paths[name])
    return paths


def one(url: str, model: str, content: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=300)
    out = {"model": model, "status": r.status_code, "total": time.perf_counter() - t0}
    if r.status_code == 200:
        usage = r.json()["usage"]
        out.update(prompt=usage["prompt_tokens"], cached=usage["prompt_tokens_details"]["cached_tokens"])
    return out


def load(url: str, models: list[str], args) -> tuple[list[dict], float]:
    """``args.clients`` clients sending back to back for ``args.seconds``; client c asks
    ``models[c % len(models)]``. Returns (results, wall seconds)."""
    doc = table(25)
    results: list[dict] = []
    deadline = time.perf_counter() + args.seconds

    def client(c: int) -> None:
        k = 0
        while time.perf_counter() < deadline:
            content = doc + f"Client {c}, question {k}: who is from Lima? ({time.perf_counter_ns()})"
            results.append(one(url, models[c % len(models)], content, args.max_tokens))
            k += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(client, range(args.clients)))
    return results, time.perf_counter() - t0


def mean_batch(url: str) -> float:
    metrics = requests.get(url + "/metrics", timeout=30).text
    sums = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith(("radixkv_batch_size_sum", "radixkv_batch_size_count"))
    }
    return sums["radixkv_batch_size_sum"] / max(1, sums["radixkv_batch_size_count"])


def report(label: str, results: list[dict], wall: float, batch: float) -> float:
    ok = [r for r in results if r["status"] == 200]
    rate = len(ok) / wall
    per = collections.defaultdict(lambda: [0, 0, 0])
    for r in ok:
        per[r["model"]][0] += 1
        per[r["model"]][1] += r["cached"]
        per[r["model"]][2] += r["prompt"]
    hits = "  ".join(f"{m}: {n} req, hit rate {c / p:.3f}" for m, (n, c, p) in sorted(per.items()))
    print(
        f"{label:<22} {len(ok):>5} {rate:>7.2f} {batch:>10.2f}   {hits}   (errors: {len(results) - len(ok)})"
    )
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin", help="built-in name or checkpoint directory")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=15.0, help="per server and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each server in turn (drift cancels)")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    base = "builtin" if args.model == "builtin" else os.path.basename(os.path.normpath(args.model))
    with tempfile.TemporaryDirectory() as root:
        paths = save_adapters(args.model, root)
        lora = ["--lora-modules", f"a={paths['a']}", f"b={paths['b']}"]
        servers = {
            "base only": ([base], start_server(True, args.model, None, ["--max-queue", "64"])),
            "adapter a only": (["a"], start_server(True, args.model, None, ["--max-queue", "64", *lora])),
            "base + adapters a, b": (
                [base, "a", "b"],
                start_server(True, args.model, None, ["--max-queue", "64", *lora]),
            ),
        }
        try:
            for models, (
                _,
                url,
            ) in servers.values():  # each model's copy of the table cached, as in steady state
                for model in models:
                    one(url, model, table(25) + "warm-up", 2)
            results = {label: [] for label in servers}
            walls = {label: 0.0 for label in servers}
            ratios = []
            for _ in range(args.rounds):
                rates = {}
                for label, (models, (_, url)) in servers.items():
                    done, wall = load(url, models, args)
                    results[label] += done
                    walls[label] += wall
                    rates[label] = sum(r["status"] == 200 for r in done) / wall
                ratios.append(
                    (
                        rates["base + adapters a, b"] / rates["base only"],
                        rates["adapter a only"] / rates["base only"],
                    )
                )
            print(f"{args.clients} clients, {args.rounds} rounds of {args.seconds:.0f} s per server, "
                  f"{args.max_tokens} new tokens, model {args.model}")  # fmt: skip
            print(f"{'server':<22} {'done':>5} {'req/s':>7} {'mean batch':>10}   per model")
            for label, (_, (_, url)) in servers.items():
                report(label, results[label], walls[label], mean_batch(url))
        finally:
            for _, (proc, _) in servers.values():
                proc.terminate()
                proc.wait(timeout=60)
    mixed, single = ([r[i] for r in ratios] for i in (0, 1))
    print(f"\nrequests/s against the base alone, median of {args.rounds} rounds:")
    print(
        f"  base + two adapters (mixed batches): {statistics.median(mixed):.2f}x  ({', '.join(f'{r:.2f}' for r in mixed)})"
    )
    print(
        f"  one adapter for every request:       {statistics.median(single):.2f}x  ({', '.join(f'{r:.2f}' for r in single)})"
    )


if __name__ == "__main__":
    main()
