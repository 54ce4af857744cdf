"""``RadixRollouts``: a ``TrainerCallback`` that gives the rollouts a trainer generates with the
training model's own ``generate()`` (TRL's GRPOTrainer and RLOOTrainer without vLLM: single
turn, ``tools``, ``environment_factory``) a prefix cache, exact against stock generate().

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., callbacks=[RadixRollouts()])

What it does, on the model the trainer holds (``on_init_end`` / ``on_train_begin``):

- wraps the generating model's ``generate`` (the transformers model; under PEFT the base model
  PEFT's generate ends in) as an instance attribute: a call without a cache of its own gets a
  ``hf_patch.RadixCache`` on the rollout pool. The G completions of one prompt are G rows of
  one batch: in-batch sharing computes their prompt once; each tool turn re-generates prompt +
  history + tool result, of which everything but the new tokens is in the pool already;
- keeps one pool per *rollout round* (every generate() call between two training forwards):
  built on the round's first call, at most its budget (bytes, or a fraction of the memory free
  then: ``trlrun.budget``), and, with ``release=True`` (default), dropped before the next forward
  of the model that is not a rollout (TRL's log-prob and loss forwards, the backward after them),
  so its memory goes back to training (the moment TRL's vLLM colocate mode puts vLLM to sleep).
  With ``release=False`` the pool stays allocated; each round then first drops the prefixes of
  adapter weights gone (a LoRA step), and a base weight change flushes it (hf_patch);
- counts what it did in ``stats`` (rounds, calls, rows, prompt tokens, prompt tokens read from
  the pool, the largest pool and its most used blocks).

Correctness does not depend on the rounds: every call checks the weights (hf_patch.keys.weights)
and keys rows by the active adapter's weights digest, so nothing computed under other weights is
ever read, whatever the schedule.

Not covered: TRL's ``use_vllm`` (vLLM generates, not this model) and
``use_transformers_continuous_batching`` (``generate_batch``, its own paged cache); calls that
pass their own cache or ``use_cache=False`` run as they are.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading

import torch
from transformers import TrainerCallback

import hf_patch
from hf_patch.keys.adapters import unwrap_peft
from hf_patch.keys.weights import drop_stale_adapters, flush_if_weights_changed
from hf_patch.model_spec import model_layout
from trlrun.budget import DEFAULT_MAX_TOKENS, pool_bytes

logger = logging.getLogger(__name__)

_MARK = "_radixkv_rollouts"
# The trl releases the callback is tested with, [from, to): setup.cfg's trl extra and
# tests/test_trlrun.py hold the same range. How TRL calls generate() moves between releases.
TESTED_TRL = ("1.16", "1.17")


def check_trl() -> str | None:
    """The installed trl's version (None without trl); a warning when it is outside TESTED_TRL."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("trl")
    except PackageNotFoundError:
        return None
    from hf_patch.patch import _in_range

    low, high = TESTED_TRL
    if not _in_range(found, low, high):
        logger.warning(
            "trl %s is outside the range RadixRollouts is tested with (>=%s,<%s): pip install 'trl>=%s,<%s'",
            found, low, high, low, high,
        )  # fmt: skip
    return found


class RadixRollouts(TrainerCallback):
    """Prefix reuse for a trainer's rollouts (see the module docstring).

    Args:
        budget_bytes: the pool's size in bytes; or
        budget_fraction: the share of the memory free on the model's device when a round's pool
            is built (default 0.25 when neither is given);
        max_tokens: at most this many tokens of KV whatever the budget (default 2**20);
        block_size: tokens per block (hf_patch.build_store's default: 16);
        release: drop the pool before each training forward (default True), or keep it;
        namespace: a namespace for every row (hf_patch.RadixCache).
    """

    def __init__(
        self,
        *,
        budget_bytes: int | None = None,
        budget_fraction: float | None = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        block_size: int | None = None,
        release: bool = True,
        namespace=None,
    ) -> None:
        if budget_bytes is not None and budget_fraction is not None:
            raise ValueError("give at most one of budget_bytes= and budget_fraction=")
        self.budget_bytes = budget_bytes
        self.budget_fraction = budget_fraction
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.release_after_rollout = release
        self.namespace = namespace
        self.model = None  # the model the trainer holds (a PeftModel under PEFT)
        self.target = None  # the transformers model whose generate() is wrapped
        self.store = None  # the current round's pool, or None between rounds
        self._round_open = False
        self._generating = 0  # generate() calls of the target running now
        self._hook = None
        self._previous = _NONE  # the target's own instance attribute "generate" before attach
        self._unwatchable: str | None = None  # why the weights cannot be watched across steps
        self._dropout_warned = False
        self._lock = threading.RLock()
        self.stats = {
            "rounds": 0,
            "calls": 0,
            "rows": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "releases": 0,
            "pool_bytes": 0,  # the largest pool built
            "peak_used_blocks": 0,  # the most blocks cached or pinned at the end of a call
            # a kept pool (release=False): the most blocks still in use once a round's start
            # dropped what the weights since made stale (0: nothing outlives its weights)
            "leftover_blocks": 0,
        }
        # The last calls, newest last: {"round", "rows", "prompt_tokens", "cached_tokens",
        # "used_blocks"} (used_blocks: cached or pinned in the pool after the call).
        self.calls: collections.deque = collections.deque(maxlen=1024)

    @property
    def generating(self) -> bool:
        """Whether a rollout's generate() is running now (its forwards are not training's)."""
        return self._generating > 0

    # -- TrainerCallback events ------------------------------------------------------------
    def on_init_end(self, args, state, control, model=None, **kwargs):
        check_trl()
        if model is not None:
            self.attach(model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        for option in ("use_vllm", "use_transformers_continuous_batching"):
            if getattr(args, option, False):
                logger.warning("RadixRollouts: %s=True, so the rollouts do not go through generate()", option)
        if model is not None:
            self.attach(model)

    def on_train_end(self, args, state, control, **kwargs):
        self.release()

    # -- attaching -------------------------------------------------------------------------
    def attach(self, model) -> None:
        """Wrap ``model``'s generating model (idempotent for the same model; another model
        replaces the first)."""
        with self._lock:
            if model is self.model:
                return
            if self.model is not None:
                self.detach()
            target = unwrap_peft(model)
            if getattr(target.__dict__.get("generate"), _MARK, None) is not None:
                raise RuntimeError(
                    f"{type(target).__name__}.generate is already wrapped by another RadixRollouts"
                )
            original = target.generate  # bound: the class's, or an instance attribute already there
            self._previous = target.__dict__.get("generate", _NONE)  # what detach puts back

            @functools.wraps(original)
            def generate(*args, **kwargs):
                return self._generate(original, args, kwargs)

            setattr(generate, _MARK, self)
            target.generate = generate
            self.model, self.target = model, target
            self._unwatchable = _sharded_reason(model)
            if self._unwatchable is not None and not self.release_after_rollout:
                logger.warning(
                    "RadixRollouts(release=False): %s, so a kept pool could not tell one step's "
                    "weights from the next; the pool is released after every round instead",
                    self._unwatchable,
                )
            self._hook = model.register_forward_pre_hook(self._before_forward)

    def detach(self) -> None:
        """Undo ``attach``: the model's generate() is stock again, the pool dropped."""
        with self._lock:
            if self.target is not None and getattr(self.target.__dict__.get("generate"), _MARK, None) is self:
                if self._previous is _NONE:
                    del self.target.generate
                else:  # an instance attribute that was there before attach (another library's wrapper)
                    self.target.generate = self._previous
            self._previous = _NONE
            if self._hook is not None:
                self._hook.remove()
            self.release()
            self.model = self.target = self._hook = None

    def release(self) -> None:
        """Drop the current pool (its memory is freed once no running call holds it)."""
        with self._lock:
            if self.store is not None:
                self.stats["releases"] += 1
            self.store = None
            self._round_open = False

    # -- the wrapped generate() ------------------------------------------------------------
    def _before_forward(self, module, args) -> None:
        if self._generating:
            return  # a forward of a rollout (PEFT's wrapper never sees these; a plain model does)
        self._round_open = False  # a training forward ends the round
        if (self.release_after_rollout or self._unwatchable is not None) and self.store is not None:
            self.release()

    def _reusable(self, kwargs: dict) -> bool:
        if kwargs.get("past_key_values") is not None or kwargs.get("cache_params") is not None:
            return False  # the caller's own cache
        config = kwargs.get("generation_config") or self.target.generation_config
        return kwargs.get("use_cache", getattr(config, "use_cache", True)) is not False

    def _pool(self):
        """The round's store: built on its first call; a kept pool drops stale adapters' KV."""
        with self._lock:
            if self.store is None:
                layout = model_layout(self.target)
                per_token = sum(s.bytes_per_token for s in layout.specs)
                nbytes = pool_bytes(
                    self.target.device,
                    per_token,
                    budget_bytes=self.budget_bytes,
                    budget_fraction=self.budget_fraction,
                    max_tokens=self.max_tokens,
                )
                self.store = hf_patch.build_store(self.target, self.block_size, budget_bytes=nbytes)
                self.stats["pool_bytes"] = max(self.stats["pool_bytes"], self.store.pool.nbytes)
                self._round_open = True
                self.stats["rounds"] += 1
            elif not self._round_open:
                # What the last round cached under weights changed since is dropped now, not
                # left to age out: the base model's by a flush, an adapter's by its digest.
                flush_if_weights_changed(self.store, self.target)
                drop_stale_adapters(self.target, self.store)
                stats = self.store.stats()
                used = stats["num_blocks"] - stats["free_blocks"]
                self.stats["leftover_blocks"] = max(self.stats["leftover_blocks"], used)
                self._round_open = True
                self.stats["rounds"] += 1
            return self.store

    def _generate(self, original, args: tuple, kwargs: dict):
        if not self._reusable(kwargs):
            return original(*args, **kwargs)
        if self.target.training and _active_dropout(self.target):
            # TRL generates in train mode (GRPOConfig.disable_dropout defaults to False): stock
            # gives each row's prompt its own dropout noise, a shared prefix would give all G rows
            # one; so these calls run as stock's
            if not self._dropout_warned:
                self._dropout_warned = True
                logger.warning(
                    "RadixRollouts: the model generates in train mode with dropout on, where a "
                    "shared prompt would get one dropout mask for all its rows: the rollouts run "
                    "without the cache (set disable_dropout=True in the trainer's config, or eval())"
                )
            return original(*args, **kwargs)
        store = self._pool()
        cache = hf_patch.RadixCache(store=store, namespace=self.namespace)
        with self._lock:
            self._generating += 1
        try:
            output = original(*args, **{**kwargs, "past_key_values": cache})
        finally:
            with self._lock:
                self._generating -= 1
        self._count(args, kwargs, cache, store)
        return output

    def _count(self, args: tuple, kwargs: dict, cache, store) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        stats = store.stats()
        if isinstance(mask, torch.Tensor):
            prompt = int(mask.sum())
        else:
            prompt = ids.numel() if isinstance(ids, torch.Tensor) else 0
        used = stats["num_blocks"] - stats["free_blocks"]
        with self._lock:
            s = self.stats
            s["calls"] += 1
            s["rows"] += len(cache.cached_tokens)
            s["cached_tokens"] += sum(cache.cached_tokens)
            s["prompt_tokens"] += prompt
            s["peak_used_blocks"] = max(s["peak_used_blocks"], used)
            self.calls.append(
                {
                    "round": s["rounds"],
                    "rows": len(cache.cached_tokens),
                    "prompt_tokens": prompt,
                    "cached_tokens": sum(cache.cached_tokens),
                    "used_blocks": used,
                }
            )


_NONE = object()  # no instance attribute "generate" before attach


def _active_dropout(model) -> bool:
    """Whether a forward of ``model`` in train mode draws dropout noise (a Dropout module with
    p > 0, or an attention dropout in its config)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
    config = getattr(model, "config", None)
    return any(float(getattr(config, name, 0) or 0) > 0 for name in ("attention_dropout", "attn_pdrop"))


def _sharded_reason(model) -> str | None:
    """Why the trainer's parameters are not the tensors the optimizer updates, or None: under
    DeepSpeed ZeRO-3 the gathered parameters get their data put back with ``param.data = ...``
    every step (versions never move, addresses repeat), under FSDP the flat parameters."""
    for module in model.modules():
        if type(module).__name__ in ("FullyShardedDataParallel", "FSDPModule") or hasattr(
            module, "_fsdp_wrapped_module"
        ):
            return "the model is wrapped by FSDP"
    for p in model.parameters():
        if hasattr(p, "ds_id"):
            return "its parameters are DeepSpeed ZeRO-3's"
    return None
