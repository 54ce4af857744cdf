"""Generation seconds per GRPO step: TRL's default generate(), TRL's transformers continuous
batching option, and trlrun.RadixRollouts, in real GRPOTrainer runs (trl 1.16).

Run by hand (CPU, fp32, random weights; each engine's run in this process, one after another):

    nice -n 10 python -m benchmarks.bench_rl                        # single turn and 3-turn tools
    nice -n 10 python -m benchmarks.bench_rl --modes single --steps 3 --engines default,radix

Workload (the defaults): a random Llama, hidden 512, 8 layers, 8 heads (4 KV heads), over the
test tokenizer (tests/trl_models.py: byte-level BPE, ~330 ids, Qwen3's chat template); 2 prompts
per step, each a 256-token system prompt shared by every prompt plus a 256-token question of its
own (512 tokens; with tools the tool's schema adds to the system prompt), G=8 completions per
prompt (16 rows), 64 sampled tokens per turn (temperature 1, top_p 1, EOS made unlikely: most
turns run their length, some stop early, alike for every engine), learning rate 1e-3. Tools: a
``ping`` tool, ``max_tool_calling_iterations=2``
(up to 3 turns): the model's weights carry a script (``scripted_llama``, the same for every
engine: continuous batching takes no logits processor) that starts a call after ~64 tokens on
average (geometrically), so rollouts have 1-3 turns; ``calls`` is generate() calls per step.

Measured per step: seconds inside the trainer's ``_generate`` (every turn, tool calls, parsing),
the prefill tokens the model computed (all positions fed to forward() in the step minus the
decode positions: with left padding, a padded position counts, since it is computed), the
generated tokens. Step 1 is reported but left out of the median (warm-up). Checked: the default
engine's and radixkv's rollouts are equal token for token (completion ids of every row, every
step), and so are the trained weights after the run; continuous batching samples with its own
generator (``seed``), so its tokens differ from generate()'s under sampling (--greedy checks
equality for it too: all three agree token for token in a single-turn greedy run).

Continuous batching on a CPU: its defaults size the cache from free memory as on a GPU (minutes
of setup per call here); it runs with ``num_blocks`` and ``max_batch_tokens`` set to what the
rollouts need (``--cb-blocks``, ``--cb-batch-tokens``), its prefix sharing (``allow_block_sharing``,
pages of ``--cb-page`` tokens) on.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time

# isort: off
import hf_patch  # noqa: F401  (first: its import sets the OpenMP wait policy before torch loads)
import torch

# isort: on

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hf_patch.keys.adapters import unwrap_peft  # noqa: E402
from tests.trl_models import CALL, ping, tiny_llama, tool_tokenizer  # noqa: E402
from trlrun import RadixRollouts  # noqa: E402


def _words(tok, n: int, seed: int) -> str:
    """Text of about ``n`` tokens: numbered words of the built-in corpus's kind."""
    g = torch.Generator().manual_seed(seed)
    words = ["table", "row", "pilot", "Lima", "answer", "rule", "value", "sum", "check", "page"]
    text, out = "", []
    while len(tok.encode(text, add_special_tokens=False)) < n:
        i = torch.randint(0, len(words), (8,), generator=g).tolist()
        out.append(" ".join(f"{words[k]} {int(torch.randint(0, 100, (1,), generator=g))}" for k in i) + ".")
        text = " ".join(out)
    ids = tok.encode(text, add_special_tokens=False)[:n]
    return tok.decode(ids)


def _data(tok, args) -> Dataset:
    system = "You solve problems step by step. " + _words(tok, args.system_tokens, seed=1)
    rows = []
    for i in range(args.prompts * (args.steps + 1)):
        question = f"Problem {i}: " + _words(tok, args.prompt_tokens - args.system_tokens, seed=100 + i)
        rows.append(
            {"prompt": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        )
    return Dataset.from_list(rows)


SCRIPTED_CALL = f"\n{CALL}\n"  # one token: the tool call's JSON with its newlines


def scripted_llama(tok, args, tools: bool):
    """A random Llama whose embeddings and lm_head carry a script, the same for every engine (no
    logits processor: continuous batching supports neither ``sequence_bias`` nor
    ``suppress_tokens``). Dimensions 0-3 are taken from the random weights:

    - every token's embedding has a constant ``GAMMA`` on dim 0, so the final hidden state's
      dim 0 is positive everywhere; the lm_head reads it to lower EOS's logit (most turns run
      their whole length; not all: dim 0 is not positive at every position) and, with tools, to give ``<tool_call>`` a steady extra logit (a call
      starts after ~``args.turn`` tokens on average, geometrically);
    - the call itself is a chain of bigrams, each token's embedding a large multiple of its own
      dim that only its successor's lm_head row reads: ``<tool_call>`` -> the call's JSON ->
      ``</tool_call>`` -> EOS, certain once started.
    """
    model = tiny_llama(tok, hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads)
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    eos = tok.eos_token_id
    tc, call, end_call = (
        tok.convert_tokens_to_ids(t) for t in ("<tool_call>", SCRIPTED_CALL, "</tool_call>")
    )
    with torch.no_grad():
        emb[:, :4] = 0
        head[:, :4] = 0
        emb[:, 0] = GAMMA
        head[eos, 0] = -1.0
        if tools:
            x = torch.randint(0, len(tok), (1, 64), generator=torch.Generator().manual_seed(0))
            hidden = model.model(input_ids=x).last_hidden_state[0, :, 0].mean()  # the final norm's dim 0
            head[tc, 0] = float(torch.log(torch.tensor(len(tok) / args.turn))) / float(hidden)
            for i, (token, successor) in enumerate(((tc, call), (call, end_call), (end_call, eos)), start=1):
                emb[token] = 0
                emb[token, i] = CHAIN
                head[successor, i] = 1.0
    return model


GAMMA = 0.45  # ~ the norm of a random embedding row (initializer_range 0.02, hidden 512)
CHAIN = 10.0


class Counter:
    """Forward positions and generated tokens during rollouts (a forward pre-hook and wrappers of
    generate / generate_batch on the generating model)."""

    def __init__(self, model):
        self.model = model
        self.fed = self.decode = self.generated = self.calls = 0
        self.active = False
        model.register_forward_pre_hook(self._forward, with_kwargs=True)
        for name in ("generate", "generate_batch"):
            setattr(model, name, self._wrap(getattr(model, name), name))

    def _forward(self, module, args, kwargs):
        if not self.active:
            return
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        self.fed += x.shape[0] * x.shape[1]

    def _wrap(self, original, name):
        def call(*args, **kwargs):
            out = original(*args, **kwargs)
            self.calls += int(self.active)
            if name == "generate":
                ids = kwargs.get("input_ids", args[0] if args else None)
                new = out.shape[1] - ids.shape[1]
                self.generated += ids.shape[0] * new
                self.decode += ids.shape[0] * max(0, new - 1)
            else:
                for o in out.values():
                    n = len(o.generated_tokens)
                    self.generated += n
                    self.decode += max(0, n - 1)
            return out

        return call

    def take(self) -> tuple[int, int, int]:
        prefill, generated, calls = self.fed - self.decode, self.generated, self.calls
        self.fed = self.decode = self.generated = self.calls = 0
        return prefill, generated, calls


def run(engine: str, mode: str, args) -> dict:
    tok = tool_tokenizer()
    tok.add_tokens([SCRIPTED_CALL])
    tools = mode == "tools"
    model = scripted_llama(tok, args, tools)
    rollouts: list = []

    def reward(completion_ids, **_):
        rollouts.append(copy.deepcopy(completion_ids))
        return [float(sum(ids) % 7) for ids in completion_ids]

    generation = {"do_sample": False} if args.greedy else None
    config = GRPOConfig(
        output_dir="/tmp/radixkv-bench-rl",
        per_device_train_batch_size=args.prompts * args.G,
        num_generations=args.G,
        max_completion_length=args.turn if not tools else 3 * args.turn + 64,
        max_tool_calling_iterations=2 if tools else None,
        max_steps=args.steps,
        learning_rate=1e-3,
        beta=0.0,
        bf16=False,  # GRPOConfig's default is bf16 (autocast, on the CPU too): fp32 here
        temperature=1.0,
        report_to="none",
        logging_steps=1,
        use_cpu=True,
        seed=0,
        save_strategy="no",
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        generation_kwargs=generation,
        use_transformers_continuous_batching=engine == "cb",
        transformers_continuous_batching_config={
            "num_blocks": args.cb_blocks,
            "max_batch_tokens": args.cb_batch_tokens,
            "page_size": args.cb_page,
            "seed": 0,
        }
        if engine == "cb"
        else None,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=_data(tok, args),
        processing_class=tok,
        tools=[ping] if tools else None,
    )
    counter = Counter(unwrap_peft(trainer.model))
    radix = None
    if engine == "radix":
        radix = RadixRollouts(budget_bytes=args.radix_budget_mb << 20 if args.radix_budget_mb else None)
        trainer.add_callback(radix)  # attaches on train begin, over the counter's wrapper
    steps: list[dict] = []
    generate = trainer._generate

    def timed(prompts):
        counter.active = True
        load = os.getloadavg()[0]
        started, cpu = time.perf_counter(), time.process_time()
        try:
            return generate(prompts)
        finally:
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
            counter.active = False
            prefill, generated, calls = counter.take()
            steps.append(
                dict(seconds=seconds, cpu=cpu, prefill=prefill, generated=generated, calls=calls, load=load)
            )

    trainer._generate = timed
    trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return dict(steps=steps, rollouts=rollouts, weights=weights, stats=radix.stats if radix else None)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def _median(values):
    return statistics.median(values) if values else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="single,tools")
    ap.add_argument("--engines", default="default,cb,radix")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--G", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--turn", type=int, default=64, help="tokens per turn")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--greedy", action="store_true", help="do_sample=False: every engine's tokens comparable")
    ap.add_argument(
        "--radix-budget-mb", type=int, default=0, help="RadixRollouts(budget_bytes=); 0: its default"
    )
    ap.add_argument("--cb-blocks", type=int, default=256)
    ap.add_argument("--cb-batch-tokens", type=int, default=4096)
    ap.add_argument("--cb-page", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} {_cpu()} ({os.cpu_count()} CPUs), torch "
        f"{torch.__version__}, {args.threads} threads; hidden {args.hidden}, {args.layers} layers, "
        f"G={args.G}, {args.prompts} prompts/step of {args.prompt_tokens} tokens, {args.turn}-token turns"
        f"{', greedy' if args.greedy else ''}"
    )
    ok = True
    for mode in args.modes.split(","):
        results = {}
        for engine in args.engines.split(","):
            results[engine] = r = run(engine, mode, args)
            for i, s in enumerate(r["steps"]):
                print(
                    f"{mode:6s} {engine:7s} step {i + 1}: {s['seconds']:7.2f} s  cpu {s['cpu']:7.2f} s  prefill {s['prefill']:6d}  "
                    f"generated {s['generated']:5d}  calls {s['calls']}  load {s['load']:.2f}",
                    flush=True,
                )
            if r["stats"]:
                print(f"{mode:6s} {engine:7s} stats {r['stats']}")
        base = results.get("default")

        def per_step(r, key):
            return _median([s[key] for s in r["steps"][1:] or r["steps"]])

        for engine, r in results.items():
            sec, cpu = per_step(r, "seconds"), per_step(r, "cpu")
            line = (
                f"{mode:6s} {engine:7s} median of steps 2-{len(r['steps'])}: {sec:7.2f} s/step "
                f"(cpu {cpu:.2f} s), prefill {per_step(r, 'prefill'):.0f} tokens/step"
            )
            for name, other in (("default", base), ("continuous batching", results.get("cb"))):
                if other is not None and other is not r and (engine == "radix" or name == "default"):
                    line += (
                        f", {per_step(other, 'seconds') / sec:.2f}x {name} "
                        f"(cpu {per_step(other, 'cpu') / cpu:.2f}x)"
                    )
            print(line)
        if base is not None:
            for engine, r in results.items():
                if engine == "default" or (engine == "cb" and not args.greedy):
                    continue
                same = r["rollouts"] == base["rollouts"]
                if engine == "radix":
                    same = same and all(torch.equal(base["weights"][k], v) for k, v in r["weights"].items())
                print(
                    f"{mode:6s} {engine:7s} rollouts{' and weights' if engine == 'radix' else ''} equal to default: {same}"
                )
                ok = ok and same
    print(f"# load average at the end (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
