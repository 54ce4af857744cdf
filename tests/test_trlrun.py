"""trlrun.RadixRollouts in real TRL runs: GRPO and RLOO of 3 steps on a tiny random model (built
from a config and saved with its tokenizer to a local directory, which the runs load), rewards
from a function, single turn, with a tool, with a two-turn environment, with LoRA (peft). fp32,
CPU. Each run with the callback is compared with

- the same run without it (same seeds): every rollout's completion ids, the logged losses,
  gradient norms, entropies and rewards, and the final weights are equal (TRL's generate() path
  computes no rollout logprobs; the losses are computed from the training forward's);
- each of its generate() calls replayed on a fresh model loaded from the directory and given the
  weights the trainer's model had at that call (LoRA's included): a stock forward over the
  sequences it generated gives its logits (within 1e-4, fp32 rounding; not the sampled tokens
  again, which a rounding difference at a near-tie can flip). Every step's weights differ from
  the last step's, and under the previous step's weights the logits are far off: a stale prefix
  would be caught.

and its ``cached_tokens`` show the reuse expected: each prompt's G rows compute it once, and a
later turn reads the turns before it.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

trl = pytest.importorskip("trl")  # the trl extra (setup.cfg); the dev extra has it
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

from hf_patch.keys import model_walk  # noqa: E402
from hf_patch.keys.adapters import unwrap_peft  # noqa: E402
from tests.hf_models import one_torch_thread  # noqa: E402, F401  (autouse)
from tests.trl_models import Pinger, ping, tiny_llama, tool_bias, tool_tokenizer  # noqa: E402
from trlrun import RadixRollouts, budget  # noqa: E402

SYSTEM = "You are a careful assistant of the radixkv project. Answer briefly, and call a tool when one helps."
G = 4  # completions per prompt
STEPS = 3
LOGGED = ("loss", "grad_norm", "entropy", "reward")


@pytest.fixture(autouse=True)
def quiet_trl(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental


def _data(n: int = 8) -> Dataset:
    return Dataset.from_list(
        [
            {
                "prompt": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"What is {i} plus {i}?"},
                ]
            }
            for i in range(n)
        ]
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama and its tokenizer, saved where every run loads them from."""
    path = tmp_path_factory.mktemp("tiny-tool-llama")
    tok = tool_tokenizer()
    tiny_llama(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


class Recorder:
    """Wraps the generating model's own ``generate`` (below RadixRollouts' wrapper, which takes it
    as the generate it calls): each call's inputs, weights, sequences and per-step logits (asked
    for with ``output_logits``; TRL is handed the sequences, as it asked)."""

    def __init__(self, model):
        self.model, self.original, self.calls = model, model.generate, []
        self.step = lambda: None  # the trainer's step counter, once there is a trainer
        model.generate = self

    def __call__(self, *args, **kwargs):
        assert not args
        weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        out = self.original(**kwargs, output_logits=True, return_dict_in_generate=True)
        self.calls.append(
            {
                "mask": kwargs["attention_mask"],
                "sequences": out.sequences,
                "logits": torch.stack(out.logits, 1),  # (rows, new tokens, vocab)
                "weights": weights,
                "step": self.step(),
            }
        )
        return out.sequences


def _replay(model_dir, record, weights, peft_config) -> float:
    """The largest difference between ``record``'s generate() logits and a stock forward, over
    the sequences it generated, of a fresh model loaded from ``model_dir`` and given ``weights``."""
    from peft import get_peft_model

    fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if peft_config is not None:
        fresh = unwrap_peft(get_peft_model(fresh, copy.deepcopy(peft_config)))
    fresh.load_state_dict(weights, strict=True)
    seq, logits = record["sequences"], record["logits"]
    prompt, new = record["mask"].shape[1], logits.shape[1]
    mask = torch.cat([record["mask"], torch.ones(seq.shape[0], seq.shape[1] - prompt, dtype=torch.long)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # generate()'s, under left padding
    with torch.no_grad():
        forward = fresh(input_ids=seq, attention_mask=mask, position_ids=positions).logits
    return (forward[:, prompt - 1 : prompt - 1 + new] - logits).abs().max().item()


def _assert_replays(model_dir, recorder: Recorder, peft_config=None) -> None:
    """Every call generated from the weights the model had then: its logits equal a fresh model's
    given those weights (fp32 rounding apart); each step's weights differ from the previous
    step's, and under the previous step's weights the logits are far off (a stale prefix or stale
    weights would be caught)."""
    calls = recorder.calls
    for i, record in enumerate(calls):
        assert _replay(model_dir, record, record["weights"], peft_config) < 1e-4, i
    steps = [c for i, c in enumerate(calls) if i == 0 or c["step"] != calls[i - 1]["step"]]
    assert [c["step"] for c in steps] == list(range(STEPS))
    for before, after in zip(steps, steps[1:]):
        changed = [k for k, v in after["weights"].items() if not torch.equal(v, before["weights"][k])]
        assert changed, "the optimizer step changed no weight"
        if peft_config is not None:
            assert all("lora_" in k for k in changed), changed  # LoRA trains the adapter only
        assert _replay(model_dir, after, before["weights"], peft_config) > 1e-3


def _train(
    radix: RadixRollouts | None,
    model_dir,
    *,
    trainer="grpo",
    completion=16,
    watch=None,
    record=False,
    **kwargs,
):
    """One TRL run of STEPS steps; returns (every rollout's completion ids, logged values, the
    trained model's state dict, the trainer, the Recorder or None)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    rollouts: list = []

    def reward(completions, completion_ids, **_):
        rollouts.append(copy.deepcopy(completion_ids))
        return [float(len(ids) % 5) + 0.1 * (ids[-1] % 3 if ids else 0) for ids in completion_ids]

    options = dict(
        output_dir="/tmp/radixkv-trlrun-test",  # nothing is saved (save_strategy="no")
        per_device_train_batch_size=2 * G,
        num_generations=G,
        max_completion_length=completion,
        max_steps=STEPS,
        learning_rate=0.05,
        report_to="none",
        logging_steps=1,
        use_cpu=True,
        seed=0,
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        beta=0.0,
        bf16=False,  # TRL's configs default to bf16 (CPU autocast in the rollouts too): fp32 here
    )
    tools = kwargs.pop("tools", None)
    env = kwargs.pop("environment_factory", None)
    if tools or env:
        options.update(max_tool_calling_iterations=2, generation_kwargs={"sequence_bias": tool_bias(tok)})
    options.update(kwargs.pop("config", {}))
    config_cls, trainer_cls = (GRPOConfig, GRPOTrainer) if trainer == "grpo" else (RLOOConfig, RLOOTrainer)
    extra = {"tools": tools} if tools else {}
    if env:
        extra["environment_factory"] = env
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    recorder = Recorder(model) if record else None
    built = trainer_cls(
        model=model,
        reward_funcs=reward,
        args=config_cls(**options),
        train_dataset=_data(),
        processing_class=tok,
        callbacks=[radix] if radix is not None else None,
        **extra,
        **kwargs,
    )
    if watch is not None:
        built.model.register_forward_pre_hook(watch)
    if recorder is not None:
        recorder.step = lambda: built.state.global_step
    built.train()
    logged = [{k: e[k] for k in LOGGED if k in e} for e in built.state.log_history if "loss" in e]
    state = {k: v.detach().clone() for k, v in built.model.state_dict().items()}
    return rollouts, logged, state, built, recorder


def _assert_same_run(stock, radix) -> None:
    assert len(radix[0]) == len(stock[0]) == STEPS
    for step, (a, b) in enumerate(zip(stock[0], radix[0])):
        assert a == b, f"step {step}: the rollouts differ"
    assert radix[1] == stock[1]  # losses, gradient norms, entropies, rewards
    assert stock[2].keys() == radix[2].keys()
    for name, value in stock[2].items():
        assert torch.equal(value, radix[2][name]), name


def _prompt_lengths(tok, n: int, tools=None) -> list[int]:
    return [
        len(
            tok.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True, return_dict=False)
        )
        for row in _data(n)
    ]


def _count_walks(monkeypatch) -> list:
    """Every model walk built from now on (hf_patch.keys.model_walk: a call on a model whose
    structure is unchanged builds none)."""
    built: list = []
    build = model_walk._build

    def counting(model):
        built.append(type(model).__name__)
        return build(model)

    monkeypatch.setattr(model_walk, "_build", counting)
    return built


def _assert_later_turns_read_earlier_ones(radix: RadixRollouts, share: float) -> None:
    calls = list(radix.calls)
    later = [c for i, c in enumerate(calls) if i and c["round"] == calls[i - 1]["round"]]
    assert later, "no rollout called the tool"
    for call in later:  # prompt + completion so far were committed by the turn before
        assert call["cached_tokens"] >= share * call["prompt_tokens"], call


def test_grpo_single_turn_equals_stock_and_frees_the_pool_before_training(model_dir, monkeypatch):
    seen: list = []  # at every forward the trainer makes itself: was the pool released?
    radix = RadixRollouts()

    def watch(module, args):
        if not radix.generating:
            seen.append(radix.store is None)

    stock = _train(None, model_dir)
    walks = _count_walks(monkeypatch)
    ours = _train(radix, model_dir, watch=watch, record=True)
    _assert_same_run(stock, ours)
    _assert_replays(model_dir, ours[4])
    stats = radix.stats
    assert stats["rounds"] == stats["calls"] == stats["releases"] == STEPS
    assert seen and all(seen), "a training forward ran while the rollout pool was allocated"
    # Each prompt's G rows: its whole blocks are computed once and read by the other G - 1 rows.
    lengths = _prompt_lengths(ours[3].processing_class, 2 * STEPS)
    floor = sum((G - 1) * ((n - 1) // 16 * 16) for n in lengths)
    assert stats["cached_tokens"] >= floor > 0
    assert stats["rows"] == 2 * G * STEPS and stats["prompt_tokens"] == G * sum(lengths)
    assert radix.store is None  # released at the end of training too
    # The weights check read a kept walk: training steps change no module structure.
    assert walks == ["LlamaForCausalLM"], walks


def test_rloo_with_a_kept_pool_flushes_each_steps_stale_kv(model_dir):
    """release=False: the pool outlives the rounds; each round finds the weights changed by the
    optimizer step and flushes what the old weights computed before reading anything."""
    radix = RadixRollouts(release=False)
    stock = _train(None, model_dir, trainer="rloo")
    ours = _train(radix, model_dir, trainer="rloo", record=True)
    _assert_same_run(stock, ours)
    _assert_replays(model_dir, ours[4])
    assert radix.store is None  # on_train_end releases even a kept pool
    assert radix.stats["rounds"] == STEPS and radix.stats["releases"] == 1
    assert radix.stats["leftover_blocks"] == 0
    assert radix.stats["cached_tokens"] > 0


def test_grpo_with_a_tool_equals_stock_and_reads_each_turns_history(model_dir):
    radix = RadixRollouts()
    stock = _train(None, model_dir, tools=[ping], completion=48)
    ours = _train(radix, model_dir, tools=[ping], completion=48, record=True)
    _assert_same_run(stock, ours)
    _assert_replays(model_dir, ours[4])
    assert radix.stats["calls"] > STEPS
    _assert_later_turns_read_earlier_ones(radix, 0.7)


def test_grpo_with_an_environment_equals_stock_and_reads_each_turns_history(model_dir):
    radix = RadixRollouts()
    stock = _train(None, model_dir, environment_factory=Pinger, completion=48)
    ours = _train(radix, model_dir, environment_factory=Pinger, completion=48, record=True)
    _assert_same_run(stock, ours)
    _assert_replays(model_dir, ours[4])
    assert radix.stats["calls"] > STEPS
    _assert_later_turns_read_earlier_ones(radix, 0.7)


def test_grpo_lora_with_a_tool_equals_stock_and_drops_each_trained_adapters_kv(model_dir):
    """PEFT: the optimizer trains the adapter only; every step changes its digest, so the next
    round misses the last one's prefixes, and a kept pool drops them at the round's start."""
    from peft import LoraConfig

    def lora():
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])

    radix = RadixRollouts(release=False)
    stock = _train(None, model_dir, peft_config=lora(), tools=[ping], completion=48)
    ours = _train(radix, model_dir, peft_config=lora(), tools=[ping], completion=48, record=True)
    _assert_same_run(stock, ours)
    _assert_replays(model_dir, ours[4], lora())
    assert radix.stats["rounds"] == STEPS
    assert radix.stats["leftover_blocks"] == 0
    assert radix.stats["cached_tokens"] > 0
    _assert_later_turns_read_earlier_ones(radix, 0.7)


# -- memory and attaching, without a trainer ----------------------------------------------------
def _model():
    tok = tool_tokenizer()
    return tiny_llama(tok), tok


def _generate(model, tok, n: int = 2):
    ids = tok([SYSTEM + " one", SYSTEM + " two"][:n], return_tensors="pt", padding=True)
    with torch.no_grad():
        return model.generate(**ids, max_new_tokens=4, do_sample=False)


def test_the_pool_keeps_to_its_budget():
    model, tok = _model()
    per_token = 2 * 1 * 16 * 4 * 2  # layers x kv heads x head dim x fp32 x (K, V)
    radix = RadixRollouts(budget_bytes=64 * 1024)
    radix.attach(model)
    _generate(model, tok)
    assert radix.store.pool.nbytes <= 64 * 1024 and radix.stats["pool_bytes"] == radix.store.pool.nbytes
    assert radix.store.pool.bytes_per_token == per_token
    radix.detach()
    # A fraction of what is free then (here the free memory is fixed), capped at max_tokens.
    assert budget.pool_bytes("cpu", per_token, budget_fraction=0.5, max_tokens=10**9) == pytest.approx(
        0.5 * budget.free_bytes("cpu"), rel=0.05
    )
    assert budget.pool_bytes("cpu", per_token, budget_bytes=10**9, max_tokens=100) == 100 * per_token
    with pytest.raises(ValueError, match="at most one"):
        RadixRollouts(budget_bytes=1, budget_fraction=0.5)
    with pytest.raises(ValueError, match="budget_fraction"):
        budget.pool_bytes("cpu", per_token, budget_fraction=1.5)
    assert budget.free_bytes("cpu") > 0


def test_a_fraction_budget_reads_the_free_memory_when_the_round_starts(monkeypatch):
    model, tok = _model()
    monkeypatch.setattr(budget, "free_bytes", lambda device: 4 << 20)
    radix = RadixRollouts(budget_fraction=0.25)
    radix.attach(model)
    _generate(model, tok)
    assert (1 << 20) - 16 * 256 < radix.store.pool.nbytes <= 1 << 20  # whole blocks of 16 tokens


def test_release_frees_the_pools_memory():
    model, tok = _model()
    radix = RadixRollouts()
    radix.attach(model)
    _generate(model, tok)
    pool = weakref.ref(radix.store.pool.k[0].untyped_storage())
    assert pool() is not None
    model(**tok(["x"], return_tensors="pt"))  # a forward outside generate(): a training forward
    gc.collect()
    assert radix.store is None and pool() is None


def test_attach_wraps_only_uncached_calls_and_detach_restores_generate():
    import hf_patch

    model, tok = _model()
    reference = _generate(model, tok)
    radix = RadixRollouts()
    radix.attach(model)
    radix.attach(model)  # idempotent
    assert torch.equal(_generate(model, tok), reference)
    assert torch.equal(_generate(model, tok), reference)  # the second call reads the first's prompt
    assert radix.stats["calls"] == 2 and radix.calls[-1]["cached_tokens"] > 0
    own = hf_patch.RadixCache()
    ids = tok([SYSTEM], return_tensors="pt")
    with torch.no_grad():
        model.generate(**ids, past_key_values=own, max_new_tokens=2, do_sample=False)
        model.generate(**ids, use_cache=False, max_new_tokens=2, do_sample=False)
    assert radix.stats["calls"] == 2  # the caller's own cache, and no cache at all: left alone
    with pytest.raises(RuntimeError, match="already wrapped"):
        RadixRollouts().attach(model)
    radix.detach()
    assert "generate" not in vars(model) and radix.store is None
    assert torch.equal(_generate(model, tok), reference)


def test_detach_puts_back_a_generate_another_library_set_on_the_instance():
    model, tok = _model()
    theirs = model.generate  # e.g. a patching library's own wrapper, as an instance attribute
    model.generate = lambda *a, **k: theirs(*a, **k)
    mine = model.generate
    radix = RadixRollouts()
    radix.attach(model)
    assert model.generate is not mine
    _generate(model, tok)
    radix.detach()
    assert vars(model)["generate"] is mine


def test_rollouts_in_train_mode_with_dropout_run_without_the_cache(caplog):
    """Stock gives each row's prompt its own dropout noise in train mode; a shared prefix would
    give all of a prompt's rows one: such calls run as stock's, with one warning."""
    tok = tool_tokenizer()
    model = tiny_llama(tok)
    model.config.attention_dropout = 0.3
    model.train()
    radix = RadixRollouts()
    radix.attach(model)
    with caplog.at_level("WARNING", logger="trlrun.rollouts"):
        _generate(model, tok)
        _generate(model, tok)
    assert radix.stats["calls"] == 0 and radix.store is None
    assert sum("dropout on" in r.getMessage() for r in caplog.records) == 1
    model.eval()  # no dropout drawn: the cache again
    _generate(model, tok)
    assert radix.stats["calls"] == 1
    radix.detach()


def test_a_kept_pool_is_released_anyway_where_the_weights_cannot_be_watched(caplog):
    model, tok = _model()
    for p in model.parameters():
        p.ds_id = 0  # how DeepSpeed ZeRO-3 marks its parameters (their data swapped every step)
    radix = RadixRollouts(release=False)
    with caplog.at_level("WARNING", logger="trlrun.rollouts"):
        radix.attach(model)
    assert any("ZeRO-3" in r.getMessage() for r in caplog.records)
    _generate(model, tok)
    assert radix.store is not None
    model(**tok(["x"], return_tensors="pt"))  # a training forward
    assert radix.store is None
    radix.detach()


def test_the_tested_trl_release_is_the_extras_and_the_installed_one():
    import configparser
    from pathlib import Path

    from trlrun.rollouts import TESTED_TRL, check_trl

    low, high = TESTED_TRL
    config = configparser.ConfigParser()
    config.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    extras = config["options.extras_require"]
    for extra in ("trl", "dev"):
        assert f"trl>={low},<{high}" in extras[extra].split(), extra
    assert check_trl() == trl.__version__ and trl.__version__.startswith(f"{low}.")
