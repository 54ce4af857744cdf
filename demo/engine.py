"""Generation: prompts to token ids, one worker thread running generate(), streamed text out.

Concurrency model: HTTP handling is concurrent (threaded server), generation is not. Every
request becomes a `Generation` (demo.generation) in one FIFO queue served by a single worker
thread, so one generate() runs at a time (the honest choice on a CPU, and what keeps `seed`
exact: the global RNG is seeded right before that request's generate). The request's own
thread reads token ids from the worker through a queue and turns them into text.

A request's n sampled choices are n rows of one generate() call (num_return_sequences).
With the prefix cache on, the prompt is first committed by a one-token greedy pass, so the
n rows read its KV from the store instead of computing the prompt n times. n greedy choices
are equal: one row is generated and copied.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections.abc import Hashable, Sequence

import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList

from demo import chat_tokens, processors
from demo.generation import Disconnected, Generation, Params, Result, Stopped, Streamer
from demo.model import CHAT_TEMPLATE

__all__ = ["Busy", "Disconnected", "Engine", "Generation", "Params", "Result"]

log = logging.getLogger(__name__)


class Busy(RuntimeError):
    """The generation queue is full."""


# Below this temperature, sampling is greedy (vLLM's _SAMPLING_EPS): logits / 1e-45 overflow to
# inf and the softmax to NaN, which made generate() raise on a valid request.
GREEDY_BELOW = 1e-5


class Engine:
    """Owns the model, the tokenizer, the KV store (None with reuse off) and the worker."""

    def __init__(
        self,
        model,
        tokenizer,
        context: int,
        *,
        reuse: bool = True,
        block_size: int = 16,
        cache_tokens: int | None = None,
        max_queue: int = 32,
    ):
        self.model, self.tokenizer, self.context = model, tokenizer, context
        self.store = None
        if reuse:
            import hf_patch  # noqa: F401  (importing installs the generate() integration)

            self._radix_cache = hf_patch.RadixCache
            self.store = hf_patch.build_store(model, block_size=block_size, budget_tokens=cache_tokens)
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queue)
        self._eos = self._eos_ids()
        self._worker = threading.Thread(target=self._serve, name="radixkv-generate", daemon=True)
        self._worker.start()

    # -- prompts ---------------------------------------------------------------------------
    def chat_ids(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of a chat prompt ending with the assistant's turn; control tokens inside
        message contents are plain text (demo.chat_tokens). Raises ValueError."""
        template = None if getattr(self.tokenizer, "chat_template", None) else CHAT_TEMPLATE
        return chat_tokens.chat_ids(self.tokenizer, list(messages), template)

    def text_ids(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- generation ------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: Params, namespace: Hashable = None) -> Generation:
        """Queue a request; raises Busy if the queue is full. Iterate the result for text."""
        gen = Generation(prompt_ids, params, namespace, self.decode, self._eos)
        try:
            self._jobs.put_nowait(gen)
        except queue.Full:
            raise Busy(f"{self._jobs.maxsize} requests are already waiting") from None
        return gen

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def _serve(self) -> None:
        while True:
            gen = self._jobs.get()
            gen.started = time.perf_counter()
            try:
                cached = self._generate(gen) if not gen.cancelled.is_set() else 0
                gen._events.put(("done", cached))
            except Exception as e:  # report to the request; the worker keeps serving
                log.exception("generate failed")
                gen._events.put(("error", e))
            finally:
                gen.finished.set()

    def _config(self, p: Params):
        cfg = copy.deepcopy(self.model.generation_config)
        cfg.max_new_tokens, cfg.min_new_tokens, cfg.max_length = p.max_new_tokens, None, None
        cfg.do_sample = p.temperature >= GREEDY_BELOW
        cfg.temperature, cfg.top_p, cfg.top_k = (
            (p.temperature, p.top_p, 0) if cfg.do_sample else (1.0, 1.0, None)
        )
        cfg.num_return_sequences = p.n if cfg.do_sample else 1
        if cfg.pad_token_id is None:
            cfg.pad_token_id = (
                self.tokenizer.pad_token_id
                if self.tokenizer.pad_token_id is not None
                else min(self._eos, default=0)
            )
        return cfg

    def _cache(self, gen: Generation):
        """A RadixCache on the store, or None: reuse off, or the request said cache_prompt=false
        (then plain generate(): the store is neither read nor written)."""
        if self.store is None or not gen.params.cache_prompt:
            return None
        return self._radix_cache(store=self.store, namespace=gen.namespace)

    def _generate(self, gen: Generation) -> int:
        """Run generate() for the request; returns the prompt tokens read from the store."""
        p = gen.params
        ids = torch.tensor([gen.prompt_ids], device=self.model.device)
        cache = self._cache(gen)
        cached = None
        rows = p.n if p.temperature >= GREEDY_BELOW else 1
        if cache is not None and rows > 1:
            # Commit the prompt once (a greedy one-token pass: no RNG used), so the n rows
            # below read it from the store instead of each computing it.
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=cache,
                generation_config=self._config(Params(1, temperature=0.0)),
            )
            cached = cache.cached_tokens[0] if cache.cached_tokens else 0
        logits_processor, recorder = processors.build(
            len(gen.prompt_ids),
            p.frequency_penalty,
            p.presence_penalty,
            dict(p.logit_bias),
            p.top_logprobs,
        )
        if p.seed is not None:
            torch.manual_seed(p.seed)
        self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            generation_config=self._config(p),
            logits_processor=logits_processor,
            streamer=Streamer(gen, recorder, rows),
            stopping_criteria=StoppingCriteriaList([Stopped(gen, rows)]),
        )
        if cached is None:
            cached = cache.cached_tokens[0] if cache is not None and cache.cached_tokens else 0
        return cached

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        return set(eos)

    # -- cache -----------------------------------------------------------------------------
    def stats(self) -> dict:
        return self.store.stats() if self.store is not None else {}

    def flush(self) -> None:
        if self.store is not None:
            self.store.flush()

    def check_invariants(self) -> None:
        if self.store is not None:
            self.store.check_invariants()
