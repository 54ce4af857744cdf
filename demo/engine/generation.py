"""One request between the HTTP thread and the generate() worker: its choices, streamed out.

The worker feeds token ids (one per choice per step, plus logprobs when asked) into the
request's queue; the request's own thread turns them into text deltas per choice, cuts at
stop strings and tells the worker which choices to stop.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from demo.engine.processors import LogprobRecorder, TokenLogprobs
from demo.engine.textstream import TextStream

# How often (seconds) a waiting request asks its `alive` callback whether the client is there.
ALIVE_EVERY = 0.25
# Below this temperature, sampling is greedy (vLLM's _SAMPLING_EPS): logits / 1e-45 overflow to
# inf and the softmax to NaN, which made generate() raise on a valid request.
GREEDY_BELOW = 1e-5


class Disconnected(RuntimeError):
    """The client went away: the generation was cancelled and its result is nobody's."""


@dataclass(frozen=True)
class Params:
    max_new_tokens: int
    temperature: float = 1.0  # below GREEDY_BELOW: greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1  # choices, generated as rows of one batch
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    top_logprobs: int | None = None  # None: no logprobs
    cache_prompt: bool = True  # False: generate without the prefix cache (no read, no write)
    adapter: str | None = None  # the LoRA adapter computing the reply (demo.model.adapters); None: the base
    grammar: str | None = None  # an llguidance grammar the reply must match (demo.engine.constrained)


@dataclass(frozen=True)
class Delta:
    """New output of one choice: released text and the logprobs of the tokens that arrived."""

    index: int
    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: str  # "stop" (eos, stop string, cancelled) or "length"
    completion_tokens: int
    logprobs: tuple[TokenLogprobs, ...] | None  # per counted token; None if not asked for


@dataclass(frozen=True)
class Result:
    choices: tuple[Choice, ...]
    prompt_tokens: int
    completion_tokens: int  # over all choices
    cached_tokens: int  # prompt tokens served from the prefix cache
    queue_s: float  # submit -> worker starts this request
    ttft_s: float  # submit -> first generated token
    total_s: float

    @property
    def text(self) -> str:  # the first choice's, for n=1 callers
        return self.choices[0].text

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason


class _ChoiceState:
    def __init__(self, decode, stop):
        self.stream = TextStream(decode, stop)
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.done = False  # eos or stop string seen: later tokens are not part of this choice


class Generation:
    """One request. Iterate for `Delta`s; `result` is set once iteration has ended.

    Dropping out of the iteration early (client gone) must be followed by `cancel()`, which
    stops generate() at its next step and so frees the worker.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        params: Params,
        namespace: Hashable,
        decode,
        eos: set[int],
        inputs: dict | None = None,
        batch_group: Hashable = None,
    ):
        self.prompt_ids, self.params, self.namespace = prompt_ids, params, namespace
        # Model inputs beside the ids (an image's pixel_values): such a request runs alone.
        self.inputs = inputs or {}
        self.batch_group = batch_group  # requests of different groups never share a generate()
        # The adapter (demo.model.adapters.Adapter) its first generate() ran under: a resumed
        # chunk runs only under that same load of it.
        self.adapter = None
        # What the next generate() of this request feeds: the prompt, then what earlier decode
        # chunks generated (demo.engine.batching: a paused request resumes in a re-formed batch).
        self.context_ids = prompt_ids
        self.cached: int | None = None  # the prompt's cached tokens, fixed by its first chunk
        # Its rows' grammar states (demo.engine.constrained), made by its first generate() and
        # carried across decode chunks; None without a grammar
        self.grammar_states: list | None = None
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.cancelled = threading.Event()
        self.stopped = [False] * params.n  # per choice, read by the worker's stopping criterion
        self.result: Result | None = None
        # ("ids", [[id, ...] per choice], [TokenLogprobs per choice] | None) | ("done", cached) | ("error", exc)
        self._events: queue.Queue = queue.Queue()
        self._choices = [_ChoiceState(decode, params.stop) for _ in range(params.n)]
        self._eos = eos
        # Set by the HTTP layer: returns False once the client has hung up. Without it a
        # non-streaming request (which writes nothing until the end) would keep the single
        # worker generating for nobody, as would a stream still queued or holding text back.
        self.alive = None
        self.generated = 0  # decoding steps the worker made, read or not (the worker writes it)
        self.finished = threading.Event()  # the worker is done with this request
        self._checked = time.monotonic()  # last `alive` poll

    @property
    def replied(self) -> int:
        """Tokens of the reply already in ``context_ids`` (earlier decode chunks)."""
        return len(self.context_ids) - len(self.prompt_ids)

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

    def _push(self, index: int, ids: list[int], logprobs) -> Delta | None:
        c = self._choices[index]
        if c.done:  # the worker runs ahead until it sees the stop: not part of the reply
            return None
        for k, token in enumerate(ids):
            c.ids.append(token)
            if logprobs is not None:
                c.logprobs.append(logprobs)
            if token in self._eos:
                c.done, ids = True, ids[: k + 1]
                break
        text = c.stream.push(ids)
        if c.stream.stopped:
            # Tokens up to the one completing the stop string count; later ones never reach
            # c.ids, else completion_tokens would depend on thread scheduling.
            c.done = self.stopped[index] = True
        if all(c.done for c in self._choices):
            self.cancel()  # nothing left to generate for: free the worker now
        return Delta(index, text, (logprobs,) if logprobs is not None else ())

    def __iter__(self) -> Iterator[Delta]:
        ttft = None
        self._checked = time.monotonic()
        while True:
            event = self._next_event()
            kind, value = event[0], event[1]
            if kind == "error":
                raise value
            if kind == "done":
                break
            ttft = time.perf_counter() - self.submitted if ttft is None else ttft
            logprobs = event[2]
            for i, ids in enumerate(value):
                delta = self._push(i, ids, logprobs[i] if logprobs is not None else None)
                if delta is not None and (delta.text or delta.logprobs):
                    yield delta
        for i, c in enumerate(self._choices):
            text = c.stream.finish()
            if text:
                yield Delta(i, text)
        now = time.perf_counter()
        choices = tuple(self._choice(i, c) for i, c in enumerate(self._choices))
        self.result = Result(
            choices=choices,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=sum(c.completion_tokens for c in choices),
            cached_tokens=value,
            queue_s=(self.started or now) - self.submitted,
            ttft_s=now - self.submitted if ttft is None else ttft,
            total_s=now - self.submitted,
        )

    def _choice(self, index: int, c: _ChoiceState) -> Choice:
        ids = c.ids
        if c.stream.stopped or (ids and ids[-1] in self._eos) or len(ids) < self.params.max_new_tokens:
            reason = "stop"
        else:
            reason = "length"
        logprobs = tuple(c.logprobs) if self.params.top_logprobs is not None else None
        return Choice(index, c.stream.text, reason, len(ids), logprobs)

    def collect(self) -> Result:
        """Run to the end (non-streaming)."""
        for _ in self:
            pass
        return self.result


class Streamer(BaseStreamer):
    """Forwards generated ids (and their logprobs) to the request's queue; the first put()
    is the prompt. `value`: [rows] ids per decoding step, one per generate() row; with one
    row for n choices (greedy: the n choices are equal) each row is copied to every choice."""

    def __init__(self, gen: Generation, recorder: LogprobRecorder | None, rows: int):
        self.gen, self.recorder, self.rows, self.seen_prompt = gen, recorder, rows, False

    def put(self, value: torch.Tensor) -> None:
        if self.seen_prompt:
            rows = value.reshape(self.rows, -1)
            # One token per row and step in sampling and greedy search (the only modes used).
            logprobs = self.recorder.take(rows[:, -1]) if self.recorder is not None else None
            copies = self.gen.params.n // self.rows
            ids = [r for r in rows.tolist() for _ in range(copies)]
            logprobs = [lp for lp in logprobs for _ in range(copies)] if logprobs is not None else None
            self.gen.generated += rows.shape[1]
            self.gen._events.put(("ids", ids, logprobs))
        self.seen_prompt = True

    def end(self) -> None:
        pass


class Stopped(StoppingCriteria):
    """Per row: True once the request is cancelled or that row's choice hit its stop string
    (a single row standing for n equal choices stops when they all have)."""

    def __init__(self, gen: Generation, rows: int):
        self.gen, self.rows = gen, rows

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.BoolTensor:
        stopped = self.gen.stopped
        if self.gen.cancelled.is_set():
            flags = [True] * self.rows
        else:
            flags = stopped if self.rows == len(stopped) else [all(stopped)] * self.rows
        return torch.tensor(flags, dtype=torch.bool, device=input_ids.device)
