"""Generation: prompts to token ids, one worker thread running generate(), streamed text out.

Concurrency model: HTTP handling is concurrent (threaded server); one worker thread runs one
generate() at a time. Every request becomes a `Generation` (demo.generation) in a FIFO queue
of at most `max_queue`; the worker takes the oldest and, if its options allow
(demo.batching.batch_key), up to `max_batch_size` - 1 more queued requests with the same
options (of any tenant), within `max_batch_tokens` (rows x padded prompt length), and runs
them as rows of one left-padded generate() (demo.batching). A request with a seed runs
alone (the global RNG is seeded right before its generate, so its output is exact). After
`decode_chunk` steps a batch pauses if a request that could join it waits: its requests queue
again behind that one, carrying what they generated, and resume from their committed KV
(continuous batching in chunks, `_pause_for`). The request's own thread reads token ids from
the worker through a queue and turns them into text.

A queue place is taken with `reserve()` before the prompt is tokenised, so a full queue
refuses at no cost; `submit(..., slot)` then fills it.

Adapters (demo.adapters) and images (demo.vision): a request's adapter is part of its batch key
(rows of the base and plain LoRA adapters share a call through PEFT's adapter_names), a request
with pixel inputs runs alone; the worker holds the model lock (``exclusive()``) while it
generates, so adapters load and unload between generate() calls.

A request's n sampled choices are n rows of one generate() call (num_return_sequences).
With the prefix cache on, the prompt is first committed by a one-token greedy pass, so the
n rows read its KV from the store instead of computing the prompt n times. n greedy choices
are equal: one row is generated and copied.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Hashable, Sequence

import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList

from demo import batching, chat_tokens, processors, vision
from demo.generation import Disconnected, Generation, Params, Result, Stopped, Streamer
from demo.metrics import BATCH_SIZE_BUCKETS, Histogram
from demo.model import CHAT_TEMPLATE

__all__ = ["Busy", "Disconnected", "Engine", "Generation", "Params", "Result"]

log = logging.getLogger(__name__)


class Busy(RuntimeError):
    """The generation queue is full."""


class Slot:
    """A reserved place in the generation queue (`Engine.reserve()`); a context manager that
    gives the place back unless `Engine.submit` used it."""

    def __init__(self, engine: Engine):
        self._engine, self.used = engine, False

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc) -> None:
        self._engine._give_back(self)


# Below this temperature, sampling is greedy (vLLM's _SAMPLING_EPS): logits / 1e-45 overflow to
# inf and the softmax to NaN, which made generate() raise on a valid request.
GREEDY_BELOW = 1e-5
# The cache namespace of the operator's task prompts: pinned once, read by every tenant (each
# request's own text after them stays in its tenant's namespace: hf_patch.SharedPrefix).
PUBLIC_NAMESPACE = "radixkv:task-prompts"


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
        max_batch_size: int = 8,
        max_batch_tokens: int = 16384,
        decode_chunk: int = 16,
        adapters=None,
        processor=None,
    ):
        self.model, self.tokenizer, self.context = model, tokenizer, context
        # demo.adapters.Adapters over ``model`` (None: this engine serves the base model only), and
        # a vision-language model's processor (demo.vision; None: text only).
        self.adapters, self.processor = adapters, processor
        # Held by the worker while it generates: adapters load and unload between generate() calls.
        self._model_lock = adapters.lock if adapters is not None else threading.RLock()
        self.store = None
        if reuse:
            import hf_patch  # noqa: F401  (importing installs the generate() integration)

            self._radix_cache = hf_patch.RadixCache
            self.store = hf_patch.build_store(model, block_size=block_size, budget_tokens=cache_tokens)
        if adapters is not None:
            adapters.store = self.store  # an unloaded adapter's KV is dropped from it
        if max_queue < 1 or max_batch_size < 1 or max_batch_tokens < 1:
            raise ValueError("max_queue, max_batch_size and max_batch_tokens must be >= 1")
        if decode_chunk < 0:
            raise ValueError(f"decode_chunk must be >= 0 (0: never pause), got {decode_chunk}")
        self.decode_chunk = decode_chunk
        self.max_queue, self.max_batch_size, self.max_batch_tokens = (
            max_queue,
            max_batch_size,
            max_batch_tokens,
        )
        self._cond = threading.Condition()
        self._waiting: deque[Generation] = deque()
        self._reserved = 0  # slots handed out, not yet submitted
        self._running: list[Generation] = []  # the worker's current batch (read by /get_load)
        # Observed by the worker, rendered by /metrics.
        self.batch_sizes = Histogram(BATCH_SIZE_BUCKETS)
        self.queue_waits = Histogram()
        self._eos = self._eos_ids()
        # Token prefixes pinned under PUBLIC_NAMESPACE (the operator's task prompts, longest
        # first): a request starting with one reads it there, whatever its tenant.
        self._public: list[list[int]] = []
        self._worker = threading.Thread(target=self._serve, name="radixkv-generate", daemon=True)
        self._worker.start()

    # -- prompts ---------------------------------------------------------------------------
    def chat_ids(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of a chat prompt ending with the assistant's turn; control tokens inside
        message contents are plain text (demo.chat_tokens). Raises ValueError. A vision-language
        model's chats are rendered by its processor (demo.vision), images or not."""
        if self.processor is not None:
            return vision.render(self.processor, list(messages), []).ids
        template = None if getattr(self.tokenizer, "chat_template", None) else CHAT_TEMPLATE
        return chat_tokens.chat_ids(self.tokenizer, list(messages), template)

    def text_ids(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt)["input_ids"]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # -- generation ------------------------------------------------------------------------
    def reserve(self) -> Slot:
        """A place in the queue for a request about to be submitted; raises Busy if full. O(1)."""
        with self._cond:
            if self._reserved + len(self._waiting) >= self.max_queue:
                raise Busy(f"{self.max_queue} requests are already waiting")
            self._reserved += 1
        return Slot(self)

    def _give_back(self, slot: Slot) -> None:
        with self._cond:
            if not slot.used:
                slot.used = True
                self._reserved -= 1

    def submit(
        self,
        prompt_ids: list[int],
        params: Params,
        namespace: Hashable = None,
        slot: Slot | None = None,
        inputs: dict | None = None,
    ) -> Generation:
        """Queue a request in `slot` (default: reserve one now; raises Busy if the queue is
        full). ``inputs``: model inputs beside the ids (a VLM's pixel_values). Iterate the
        result for text."""
        slot = slot or self.reserve()
        group = self.adapters.batch_group(params.adapter) if self.adapters is not None else None
        gen = Generation(prompt_ids, params, namespace, self.decode, self._eos, inputs, group)
        with self._cond:
            if slot.used:
                raise ValueError("this queue slot was already used or given back")
            slot.used = True
            self._reserved -= 1
            self._waiting.append(gen)
            self._cond.notify()
        return gen

    @property
    def queued(self) -> int:
        """Requests submitted and not yet taken by the worker."""
        return len(self._waiting)

    def _take(self) -> list[Generation]:
        """The oldest request, plus the queued ones that can share its generate() call
        (oldest first, within max_batch_size and max_batch_tokens). Call holding _cond."""
        first = self._waiting.popleft()
        key = batching.batch_key(first, GREEDY_BELOW)
        batch, width = [first], len(first.context_ids)
        if key is None or self.max_batch_size == 1:
            return batch
        rest: deque[Generation] = deque()  # one pass, O(queue): no deque.remove
        while self._waiting:
            gen = self._waiting.popleft()
            new_width = max(width, len(gen.context_ids))
            if (
                len(batch) < self.max_batch_size
                and new_width * (len(batch) + 1) <= self.max_batch_tokens
                and batching.batch_key(gen, GREEDY_BELOW) == key
            ):
                batch.append(gen)
                width = new_width
            else:
                rest.append(gen)
        self._waiting = rest
        return batch

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._waiting:
                    self._cond.wait()
                taken = self._take()
            now = time.perf_counter()
            batch = []
            for gen in taken:
                if gen.started is None:  # a resumed request waited once, at its start
                    gen.started = now
                    self.queue_waits.observe(now - gen.submitted)
                if gen.cancelled.is_set():  # its client left while it waited
                    gen._events.put(("done", gen.cached or 0))
                    gen.finished.set()
                else:
                    batch.append(gen)
            if not batch:
                continue
            self.batch_sizes.observe(len(batch))
            self._running = batch
            try:
                with self._model_lock:
                    self._run([gen for gen in batch if self._adapter_present(gen)])
            finally:
                self._running = []

    def _adapter_present(self, gen: Generation) -> bool:
        """Whether ``gen``'s adapter is still loaded; if not, it gets the API's 404 (it was
        unloaded while the request waited). Call holding the model lock."""
        name = gen.params.adapter
        if name is None or (self.adapters is not None and self.adapters.get(name) is not None):
            return True
        from demo.schema import ApiError

        gen._events.put(
            ("error", ApiError(404, f"The model '{name}' does not exist", "model", "model_not_found"))
        )
        gen.finished.set()
        return False

    # -- adapters --------------------------------------------------------------------------
    def exclusive(self) -> threading.RLock:
        """The model lock: held, no generate() runs (the worker waits for it between calls)."""
        return self._model_lock

    def generate(self, gens: Sequence[Generation], *args, **kwargs):
        """``model.generate(*args, **kwargs)`` for rows ``gens``, each under its own adapter."""
        if self.adapters is None:
            return self.model.generate(*args, **kwargs)
        return self.adapters.generate([g.params.adapter for g in gens], *args, **kwargs)

    def _run(self, batch: list[Generation]) -> None:
        if not batch:
            return
        chunked = self.decode_chunk > 0 and self.store is not None
        chunked = chunked and batching.chunkable(batch[0], GREEDY_BELOW)
        if len(batch) > 1 or chunked:
            paused = batching.run_batch(self, batch, self._pause_for(batch) if chunked else None)
            if paused:  # behind the requests that waited for them: time slices of a chunk
                with self._cond:
                    self._waiting.extend(paused)
            return
        gen = batch[0]
        try:
            gen._events.put(("done", self._generate(gen)))
        except Exception as e:  # report to the request; the worker keeps serving
            log.exception("generate failed")
            gen._events.put(("error", e))
        finally:
            gen.finished.set()

    def _pause_for(self, batch: list[Generation]):
        """pause(generated): True once the batch has made `decode_chunk` steps while a request
        that could share its generate() call waits, so that the request starts within a chunk
        instead of after the batch (continuous batching in chunks). The paused rows queue
        behind it and resume from their committed KV (whole blocks hit, at most a partial
        block recomputed), so long replies take turns with new requests in a full batch."""
        key = batching.batch_key(batch[0], GREEDY_BELOW)

        def pause(generated: int) -> bool:
            if generated < self.decode_chunk:
                return False
            with self._cond:
                return any(batching.batch_key(g, GREEDY_BELOW) == key for g in self._waiting)

        return pause

    @property
    def running(self) -> int:
        """Requests in the generate() call now running (0 when idle)."""
        return len(self._running)

    @property
    def load_tokens(self) -> int:
        """Tokens the worker holds or has queued: prompt plus generated tokens of the requests
        now running, prompt tokens of the queued ones (the SGLang gateway's load signal)."""
        running = sum(len(g.prompt_ids) + g.generated for g in self._running)
        return running + sum(len(g.prompt_ids) for g in list(self._waiting))

    def _config(self, p: Params):
        cfg = copy.deepcopy(self.model.generation_config)
        cfg.max_new_tokens, cfg.min_new_tokens, cfg.max_length = p.max_new_tokens, None, None
        cfg.do_sample = p.temperature >= GREEDY_BELOW
        cfg.temperature, cfg.top_p, cfg.top_k = (
            (p.temperature, p.top_p, 0) if cfg.do_sample else (1.0, 1.0, None)
        )
        cfg.num_return_sequences = p.n if cfg.do_sample else 1
        # A row that ends before the others (a batch's row, one of n choices) is fed the pad
        # token until the call ends. hf_patch commits a row up to its first EOS, so an EOS as
        # the pad keeps those fillers out of the cache; any other id would be cached as if
        # generated. (Left-pad columns are masked: their id does not matter.)
        eos = cfg.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if eos:
            cfg.pad_token_id = eos[0]
        elif cfg.pad_token_id is None:
            cfg.pad_token_id = (
                self.tokenizer.pad_token_id
                if self.tokenizer.pad_token_id is not None
                else min(self._eos, default=0)
            )
        return cfg

    def set_public_prefixes(self, prefixes: Sequence[Sequence[int]]) -> None:
        """Token prefixes whose KV is pinned under PUBLIC_NAMESPACE (demo.task_prompts)."""
        self._public = sorted((list(p) for p in prefixes), key=len, reverse=True)

    def shared_prefix(self, prompt_ids: Sequence[int]):
        """``hf_patch.SharedPrefix`` over the longest public prefix ``prompt_ids`` starts with,
        or None. The rest of the prompt stays keyed by the request's own namespace."""
        from hf_patch import SharedPrefix  # set only with reuse on: hf_patch is imported

        for p in self._public:
            if len(prompt_ids) >= len(p) and list(prompt_ids[: len(p)]) == p:
                return SharedPrefix(PUBLIC_NAMESPACE, len(p))
        return None

    def _cache(self, gens: Sequence[Generation]):
        """A RadixCache on the store for ``gens`` (one request, or the rows of a batch, each
        with its own namespace), or None: reuse off, or the request said cache_prompt=false
        (then plain generate(): the store is neither read nor written)."""
        if self.store is None or not gens[0].params.cache_prompt:
            return None
        namespace = gens[0].namespace if len(gens) == 1 else [g.namespace for g in gens]
        shared = [self.shared_prefix(g.prompt_ids) for g in gens] if self._public else None
        return self._radix_cache(store=self.store, namespace=namespace, shared_prefix=shared)

    def _generate(self, gen: Generation) -> int:
        """Run generate() for the request; returns the prompt tokens read from the store."""
        p = gen.params
        ids = torch.tensor([gen.prompt_ids], device=self.model.device)
        inputs = vision.on_model(gen.inputs, self.model)
        cache = self._cache([gen])
        cached = None
        rows = p.n if p.temperature >= GREEDY_BELOW else 1
        if cache is not None and rows > 1:
            # Commit the prompt once (a greedy one-token pass: no RNG used), so the n rows
            # below read it from the store instead of each computing it.
            self.generate(
                [gen],
                ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=cache,
                generation_config=self._config(Params(1, temperature=0.0)),
                **inputs,
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
            # int64 seeds (schema.SEED_MIN..SEED_MAX) onto torch's uint64 range one to one;
            # torch's own mapping of negatives (2**64 - 1 + seed) sends -2**63 onto 2**63 - 1.
            torch.manual_seed(p.seed % 2**64)
        self.generate(
            [gen],
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            generation_config=self._config(p),
            logits_processor=logits_processor,
            streamer=Streamer(gen, recorder, rows),
            stopping_criteria=StoppingCriteriaList([Stopped(gen, rows)]),
            **inputs,
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
