"""Generation: prompts to token ids, one worker thread running generate(), streamed text out.

Concurrency model: HTTP handling is concurrent (threaded server), generation is not. Every
request becomes a `Generation` in one FIFO queue served by a single worker thread, so one
generate() runs at a time (the honest choice on a CPU, and what keeps `seed` exact: the
global RNG is seeded right before that request's generate). The request's own thread
reads token ids from the worker through a queue and turns them into text.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from demo.model import CHAT_TEMPLATE
from demo.textstream import TextStream

log = logging.getLogger(__name__)


class Busy(RuntimeError):
    """The generation queue is full."""


class Disconnected(RuntimeError):
    """The client went away: the generation was cancelled and its result is nobody's."""


# Below this temperature, sampling is greedy (vLLM's _SAMPLING_EPS): logits / 1e-45 overflow to
# inf and the softmax to NaN, which made generate() raise on a valid request.
GREEDY_BELOW = 1e-5
# How often (seconds) a waiting request asks its `alive` callback whether the client is there.
ALIVE_EVERY = 0.25


@dataclass(frozen=True)
class Params:
    max_new_tokens: int
    temperature: float = 1.0  # below GREEDY_BELOW: greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Result:
    text: str
    finish_reason: str  # "stop" (eos, stop string, cancelled) or "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    queue_s: float  # submit -> worker starts this request
    ttft_s: float  # submit -> first generated token
    total_s: float


class Generation:
    """One request. Iterate for text deltas; `result` is set once iteration has ended.

    Dropping out of the iteration early (client gone) must be followed by `cancel()`, which
    stops generate() at its next step and so frees the worker.
    """

    def __init__(self, prompt_ids: list[int], params: Params, namespace: Hashable, decode, eos: set[int]):
        self.prompt_ids, self.params, self.namespace = prompt_ids, params, namespace
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.cancelled = threading.Event()
        self.result: Result | None = None
        self._events: queue.Queue = queue.Queue()  # ("ids", list) | ("done", cached) | ("error", exc)
        self._text = TextStream(decode, params.stop)
        self._eos = eos
        # Set by the HTTP layer: returns False once the client has hung up. Without it a
        # non-streaming request (which writes nothing until the end) would keep the single
        # worker generating for nobody, as would a stream still queued or holding text back.
        self.alive = None
        self.generated = 0  # tokens the worker produced, read or not (the worker writes it)
        self.finished = threading.Event()  # the worker is done with this request
        self._checked = time.monotonic()  # last `alive` poll

    def cancel(self) -> None:
        self.cancelled.set()

    def _next_event(self) -> tuple:
        # Polls `alive` by the clock, not only on idle waits: tokens may arrive faster than
        # the poll interval for the whole reply.
        while True:
            try:
                event = self._events.get(timeout=ALIVE_EVERY) if self.alive else self._events.get()
            except queue.Empty:
                event = None
            now = time.monotonic()
            if self.alive is not None and now - self._checked >= ALIVE_EVERY:
                self._checked = now
                if not self.alive():
                    self.cancel()  # the worker skips it if queued, stops it if running
                    raise Disconnected("the client closed the connection")
            if event is not None:
                return event

    def __iter__(self) -> Iterator[str]:
        ids: list[int] = []
        ttft = None
        counted = None  # ids up to the one that completed a stop string
        self._checked = time.monotonic()
        while True:
            kind, value = self._next_event()
            if kind == "error":
                raise value
            if kind == "ids":
                ttft = time.perf_counter() - self.submitted if ttft is None else ttft
                ids.extend(value)
                delta = self._text.push(value)
                if self._text.stopped and counted is None:
                    # The worker runs ahead until it sees the cancel: the tokens it made
                    # after the stop are not part of the reply (nor of usage), else
                    # completion_tokens would depend on thread scheduling.
                    counted = len(ids)
                    self.cancel()  # stop string seen: no need to generate further
            else:  # "done"
                delta = self._text.finish()
            if delta:
                yield delta
            if kind == "done":
                break
        now = time.perf_counter()
        ids = ids if counted is None else ids[:counted]
        if self._text.stopped or (ids and ids[-1] in self._eos) or len(ids) < self.params.max_new_tokens:
            reason = "stop"
        else:
            reason = "length"
        self.result = Result(
            text=self._text.text,
            finish_reason=reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(ids),
            cached_tokens=value,
            queue_s=(self.started or now) - self.submitted,
            ttft_s=now - self.submitted if ttft is None else ttft,
            total_s=now - self.submitted,
        )

    def collect(self) -> Result:
        """Run to the end (non-streaming)."""
        for _ in self:
            pass
        return self.result


class _Streamer(BaseStreamer):
    """Forwards generated ids to the request's queue; the first put() is the prompt."""

    def __init__(self, gen: Generation):
        self.gen, self.seen_prompt = gen, False

    def put(self, value: torch.Tensor) -> None:
        if self.seen_prompt:
            ids = value.reshape(-1).tolist()
            self.gen.generated += len(ids)
            self.gen._events.put(("ids", ids))
        self.seen_prompt = True

    def end(self) -> None:
        pass


class _Cancelled(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full(
            (input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device
        )


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
        """Token ids of a chat prompt ending with the assistant's turn. Raises ValueError."""
        tok = self.tokenizer
        template = None if getattr(tok, "chat_template", None) else CHAT_TEMPLATE
        try:
            text = tok.apply_chat_template(
                list(messages), chat_template=template, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # jinja TemplateError: the model's template refused the messages
            raise ValueError(f"the chat template rejected the messages: {e}") from None
        return tok(text, add_special_tokens=False)["input_ids"]

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
            cache = None
            try:
                if not gen.cancelled.is_set():
                    cache = self._generate(gen)
                gen._events.put(("done", cache.cached_tokens[0] if cache and cache.cached_tokens else 0))
            except Exception as e:  # report to the request; the worker keeps serving
                log.exception("generate failed")
                gen._events.put(("error", e))
            finally:
                gen.finished.set()

    def _generate(self, gen: Generation):
        p = gen.params
        cfg = copy.deepcopy(self.model.generation_config)
        cfg.max_new_tokens, cfg.min_new_tokens, cfg.max_length = p.max_new_tokens, None, None
        cfg.do_sample = p.temperature >= GREEDY_BELOW
        cfg.temperature, cfg.top_p, cfg.top_k = (
            (p.temperature, p.top_p, 0) if cfg.do_sample else (1.0, 1.0, None)
        )
        if cfg.pad_token_id is None:
            cfg.pad_token_id = (
                self.tokenizer.pad_token_id
                if self.tokenizer.pad_token_id is not None
                else min(self._eos, default=0)
            )
        ids = torch.tensor([gen.prompt_ids], device=self.model.device)
        cache = (
            self._radix_cache(store=self.store, namespace=gen.namespace) if self.store is not None else None
        )
        if p.seed is not None:
            torch.manual_seed(p.seed)
        self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            generation_config=cfg,
            streamer=_Streamer(gen),
            stopping_criteria=StoppingCriteriaList([_Cancelled(gen.cancelled)]),
        )
        return cache

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
