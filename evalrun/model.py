"""``RadixLM``: lm-eval's HuggingFace backend (``HFLM``) with radixkv's prefix cache.

    python -m evalrun --model radixkv --model_args pretrained=DIR,dtype=float32 --tasks ...
    lm_eval.simple_evaluate(model=evalrun.RadixLM(pretrained=DIR), tasks=[...])

A subclass, so every ``--model_args`` of ``--model hf`` keeps its meaning (dtype, peft,
max_length, logits_cache, softmax_dtype, mixed_precision_dtype, think_end_token, ...). What
changes is where the model runs:

- ``loglikelihood`` (and ``loglikelihood_rolling``, whose windows HFLM scores through
  ``_loglikelihood_tokens``): ``hf_patch.score`` computes each input from the first position
  the store does not hold, inputs sorted so those sharing a preamble run together;
- ``generate_until``: requests sorted by (generation arguments, context tokens), cut into
  batches of ``batch_size``, each run by HFLM's own ``generate_until`` (stop sequences, think
  tokens, decoding as ``--model hf``), its ``generate()`` given a ``RadixCache``.

Results come back in lm-eval's order. Own arguments: ``cache_tokens`` (store budget per rank,
tokens), ``block_size``, ``host_cache_bytes`` (a host-memory tier), ``cache_file`` (restored at
start when it exists, written after each request type that cached something new, a write that
fails only logged; one file per rank, ``NAME.rankR.EXT``, under several ranks) and ``split`` (``affine`` | ``docs``, see
evalrun.ranks).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import lm_eval.models  # noqa: F401  (registers lm-eval's own model names before ours)
import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

import hf_patch
from evalrun import figures as cache_figures
from evalrun.ranks import Ranks, check_split, start_cpu_ranks
from hf_patch.keys.adapters import unwrap_peft
from radixkv import CacheFileError, pack_tokens

logger = logging.getLogger(__name__)


def _positive(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def rank_path(path: str, ranks: Ranks) -> Path:
    """``path`` for this rank: itself with one rank, ``NAME.rankR.EXT`` with several."""
    p = Path(path)
    return p if ranks.world == 1 else p.with_name(f"{p.stem}.rank{ranks.rank}{p.suffix}")


def _restorable(path: Path | None) -> Path | None:
    """``path`` when it holds a cache file to start from; None when there is none yet. Raises
    ValueError, before any work, where no cache file could ever be written."""
    if path is None:
        return None
    if path.is_dir():
        raise ValueError(
            f"cache_file {path} is a directory; give a file path such as {path / 'kv.safetensors'}"
        )
    if not path.parent.is_dir():
        raise ValueError(f"cache_file {path}: directory {path.parent} does not exist")
    return path if path.exists() else None


@register_model("radixkv")
class RadixLM(HFLM):
    """HFLM whose forwards read and fill a radixkv prefix store (one per rank)."""

    def __init__(
        self,
        pretrained,
        cache_tokens: int | None = None,
        block_size: int | None = None,
        host_cache_bytes: int | None = None,
        cache_file: str | None = None,
        split: str = "affine",
        **kwargs,
    ) -> None:
        cache_tokens = _positive("cache_tokens", cache_tokens)
        host_cache_bytes = _positive("host_cache_bytes", host_cache_bytes)
        check_split(split)
        if pretrained in ("builtin", "builtin-tiny") and not Path(pretrained).is_dir():
            raise ValueError(
                f"pretrained={pretrained}: evalrun loads a checkpoint folder or Hub id; write the "
                f"built-in model to a folder with `python -m demo save-builtin DIR` and pass pretrained=DIR"
            )
        start_cpu_ranks()
        super().__init__(pretrained, **kwargs)
        if self.backend != "causal":
            raise ValueError(
                "--model radixkv serves decoder-only (causal) models; use --model hf for seq2seq"
            )
        self.ranks = Ranks.of(getattr(self, "accelerator", None), split)
        self._rank, self._world_size = self.ranks.evaluator_view
        self.cache_file = rank_path(cache_file, self.ranks) if cache_file else None
        restore = _restorable(self.cache_file)
        try:
            self.store = hf_patch.build_store(
                self._kv_model, block_size=block_size, budget_tokens=cache_tokens,
                host_cache_bytes=host_cache_bytes, restore=restore,
            )  # fmt: skip
        except hf_patch.UnsupportedModelError as exc:
            raise hf_patch.UnsupportedModelError(
                f"--model radixkv cannot serve this model ({exc}); use --model hf"
            ) from None
        except CacheFileError as exc:  # damaged, or another model's: left as it is, never overwritten
            raise type(exc)(f"cache_file {restore}: {exc} (delete it or pass another cache_file)") from None
        if restore is not None:
            logger.info("evalrun: restored %s (%d blocks)", restore, self.store.stats()["cached_blocks"])
        self._baseline = self.store.stats()
        self._saved_inserted = self._baseline["inserted_tokens"]
        self._auto_batch_size: int | None = None
        self.figures = cache_figures.register(cache_figures.CacheFigures(rank=self.ranks.rank))

    @property
    def _kv_model(self):
        """The transformers model the forwards run on (a PEFT wrapper's, as generate() sees it)."""
        return unwrap_peft(self.model)

    # -- request types: timed, figures updated, cache file written ------------------------------
    @contextlib.contextmanager
    def _phase(self):
        started = time.perf_counter()
        yield
        self.figures.seconds += time.perf_counter() - started
        stats = self.store.stats()
        self.figures.prompt_tokens = stats["query_tokens"] - self._baseline["query_tokens"]
        self.figures.cached_tokens = stats["hit_tokens"] - self._baseline["hit_tokens"]
        if self.cache_file is not None and stats["inserted_tokens"] > self._saved_inserted:
            try:
                result = hf_patch.save_cache(self._kv_model, self.cache_file, self.store)
            except OSError as exc:  # a full disk: the file keeps its previous content; the results stand
                logger.warning("evalrun: could not save %s (%s); a rerun starts colder", self.cache_file, exc)
                return
            self._saved_inserted = stats["inserted_tokens"]
            logger.info("evalrun: saved %s (%s)", self.cache_file, result)

    def _quiet(self, disable_tqdm: bool) -> bool:
        return disable_tqdm or self.ranks.rank != 0

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        with self._phase():
            return super().loglikelihood(requests, disable_tqdm=self._quiet(disable_tqdm))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        with self._phase():
            return super().loglikelihood_rolling(requests, disable_tqdm=self._quiet(disable_tqdm))

    def generate_until(self, requests, disable_tqdm: bool = False):
        with self._phase():
            return self._generate_until(requests, self._quiet(disable_tqdm))

    # -- scoring --------------------------------------------------------------------------------
    def _rows_per_batch(self, override_bs: int | None = None) -> int:
        if override_bs:
            return int(override_bs)
        if self.batch_size == "auto":  # detected once per model (HFLM detects per call)
            if self._auto_batch_size is None:
                self._auto_batch_size = int(self._detect_batch_size())
            return self._auto_batch_size
        return int(self.batch_size)

    def _autocast(self):
        """HFLM's mixed precision (``mixed_precision_dtype``) around our forwards too."""
        dtype = self.mixed_precision_dtype
        return torch.autocast(device_type=self.device.type, dtype=dtype, enabled=dtype is not None)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        pairs = [(context, continuation) for _, context, continuation in requests]
        mine = self.ranks.mine([pack_tokens(c + k[:-1]) for c, k in pairs], self.store.block_size)
        bar = tqdm(total=len(mine), disable=self._quiet(disable_tqdm), desc="Running loglikelihood requests")
        try:
            with self._autocast():
                scores = hf_patch.score(
                    self.model, [pairs[i] for i in mine], store=self.store,
                    batch_size=self._rows_per_batch(override_bs), max_length=self.max_length,
                    softmax_dtype=self.softmax_dtype, dedupe=self.logits_cache, progress=bar.update,
                )  # fmt: skip
        finally:
            bar.close()
        answers = self.ranks.gather(
            {i: (s.logprob, s.is_greedy) for i, s in zip(mine, scores)}, len(requests)
        )
        for (request_str, _, _), answer in zip(requests, answers):
            if request_str is not None:  # None: a rolling window, recorded per text by HFLM
                self.cache_hook.add_partial("loglikelihood", request_str, answer)
        return answers

    # -- generation -----------------------------------------------------------------------------
    def _generate_until(self, requests, quiet: bool) -> list[str]:
        contexts = [pack_tokens(self.tok_encode(r.args[0])) for r in requests]
        kinds = [json.dumps(r.args[1], sort_keys=True, default=repr) for r in requests]
        mine = sorted(self.ranks.mine(contexts, self.store.block_size), key=lambda i: (kinds[i], contexts[i]))
        rows = self._rows_per_batch()
        batches: list[list[int]] = []
        for i in mine:
            if batches and len(batches[-1]) < rows and kinds[batches[-1][0]] == kinds[i]:
                batches[-1].append(i)
            else:
                batches.append([i])
        results: dict[int, str] = {}
        bar = tqdm(total=len(mine), disable=quiet, desc="Running generate_until requests")
        saved = self.batch_size_per_gpu
        self.batch_size_per_gpu = rows  # HFLM's loop then runs each batch as one chunk, detecting nothing
        try:
            for batch in batches:
                texts = super().generate_until([requests[i] for i in batch], disable_tqdm=True)
                results.update(zip(batch, texts))
                bar.update(len(batch))
        finally:
            self.batch_size_per_gpu = saved
            bar.close()
        return self.ranks.gather(results, len(requests))

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        cache = hf_patch.RadixCache(store=self.store)
        return super()._model_generate(context, max_length, stop, past_key_values=cache, **generation_kwargs)
