"""One request between the HTTP thread and the generate() worker: its choices, streamed out.

The worker feeds token ids (one per choice per step, plus logprobs when asked) into the
request's queue; the request's own thread turns them into text deltas per choice, cuts at
stop strings and tells the worker which choices to stop.

A request is `rows` rows of the worker's batches: n sampled choices are n rows, greedy
choices (all equal) one row copied to each. What a row needs to pause and resume in a later
batch lives here, never in the batch: its context (prompt + reply so far), whether it is done,
the request's random generator (demo.engine.sampling) and its per-row processors (`hooks`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

from demo.engine.processors import TokenLogprobs
from demo.engine.textstream import TextStream

# How often (seconds) a waiting request asks its `alive` callback whether the client is there.
ALIVE_EVERY = 0.25
# How often (seconds) the worker asks it too, between decode steps (`Generation.client_gone`):
# a request whose client left is cut within a step or two, whenever its own thread looks.
WORKER_ALIVE_EVERY = 0.02
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
    top_k: int = 0  # 0: off; else sample among the k most likely tokens (vLLM's extra option)
    min_p: float = 0.0  # 0: off; else drop tokens below min_p x the top token's probability
    repetition_penalty: float = 1.0  # 1: off; transformers' (CTRL's) over the row's prompt and reply
    # A checked llguidance grammar the reply must match: each row gets its own matcher as its
    # RowHook (demo.engine.constrained.GrammarHook, made by Engine.submit)
    grammar: str | None = None

    def __post_init__(self) -> None:
        checks = (
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
            ("n", self.n >= 1, ">= 1"),
            ("temperature", self.temperature >= 0.0, ">= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", self.top_k >= 0, ">= 0 (0: off)"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1] (0: off)"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "> 0 (1: off)"),
        )
        for name, ok, allowed in checks:
            if not ok:
                raise ValueError(f"Params.{name} must be {allowed}, got {getattr(self, name)!r}")

    @property
    def sampled(self) -> bool:
        """Whether choices are sampled (else greedy: argmax, the sampling options unused)."""
        return self.temperature >= GREEDY_BELOW

    @property
    def rows(self) -> int:
        """Rows of a batch this request takes: n sampled choices, or one greedy row for all n."""
        return self.n if self.sampled else 1


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
        hooks=None,
    ):
        self.prompt_ids, self.params, self.namespace = prompt_ids, params, namespace
        self.snapshot_at: list[int] | None = None  # RadixCache(snapshot_at=) for this prompt
        # Model inputs beside the ids (an image's pixel_values, grids, token types: made for this
        # request's prompt alone), merged with the batch's other rows (demo.model.vision_batch).
        self.inputs = inputs or {}
        # Whether it must run alone and unpaused (image inputs no batch rule merges, placeholder
        # ids in a text prompt): the engine decides at submit; until then, one with inputs does.
        self.alone = bool(self.inputs)
        self.batch_group = batch_group  # requests of different groups never share a generate()
        # The adapter (demo.model.adapters.Adapter) its first generate() ran under: a resumed
        # chunk runs only under that same load of it.
        self.adapter = None
        # Per row: what its next generate() feeds (the prompt, then what earlier decode chunks
        # generated: a paused request resumes in a re-formed batch), and whether it has ended.
        self.contexts: list[list[int]] = [prompt_ids] * params.rows
        self.row_done = [False] * params.rows
        # The request's random generator (demo.engine.sampling; from its seed, else random),
        # created on its first sampled step and carried across pauses.
        self.rng = None
        # Per row: an extra logits processor applied to that row only (demo.engine.sampling.
        # RowHook), or None; it lives here, so its state survives pauses.
        self.hooks = list(hooks) if hooks is not None else [None] * params.rows
        if len(self.hooks) != params.rows:
            raise ValueError(f"hooks: one per row ({params.rows}), got {len(self.hooks)}")
        self.cached: int | None = None  # the prompt's cached tokens, fixed by its first chunk
        # Prefill slices (demo.engine.scheduler): prompt tokens committed to the store so far,
        # and the end of the slice the worker is to compute next (0: none; the scheduler sets it).
        self.prefilled = 0
        self.slice_to = 0
        # leading prompt tokens the store held when the scheduler first asked (None: not asked;
        # a long prompt's slices start past them)
        self.prompt_held: int | None = None
        self.submitted = time.perf_counter()
        self.started: float | None = None  # first admitted to a batch
        self.paused_at = 0.0  # when it last paused (perf_counter)
        self.cancelled = threading.Event()
        self.stopped = [False] * params.n  # per choice, read by the worker's stopping criterion
        self.result: Result | None = None
        # ("ids", [[id, ...] per choice], [TokenLogprobs | None per choice] | None) | ("done", cached)
        # | ("error", exc); a choice whose row made no step this time gets [] (and None)
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
        self._worker_checked = 0.0  # last `alive` poll by the worker (client_gone)

    def replied(self, row: int) -> int:
        """Tokens of row ``row``'s reply already in its context (earlier decode chunks)."""
        return len(self.contexts[row]) - len(self.prompt_ids)

    @property
    def open_rows(self) -> list[int]:
        """The rows still generating (a resumed request brings only these)."""
        return [r for r, done in enumerate(self.row_done) if not done]

    @property
    def width(self) -> int:
        """The longest context among the open rows (its padded width in a batch)."""
        return max((len(self.contexts[r]) for r in self.open_rows), default=len(self.prompt_ids))

    def row_stopped(self, row: int) -> bool:
        """Whether the client side ended row ``row``'s choice (stop string); a greedy row
        standing for n equal choices ends when they all have."""
        return self.stopped[row] if self.params.rows == self.params.n else all(self.stopped)

    def cancel(self) -> None:
        self.cancelled.set()

    def client_gone(self) -> bool:
        """For the worker, before it runs this request and between its decode steps: whether its
        client hung up (polled at most every WORKER_ALIVE_EVERY s). If so the request is
        cancelled and its thread told at once, so the hang-up is answered (and counted, 499)
        when it happens and costs no more than the step under way."""
        if self.alive is None or self.cancelled.is_set():
            return self.cancelled.is_set()
        now = time.monotonic()
        if now - self._worker_checked < WORKER_ALIVE_EVERY:
            return False
        self._worker_checked = now
        try:
            alive = self.alive()
        except Exception:  # a check that fails must never cancel a live request
            return False
        if alive:
            return False
        self.cancel()
        self._events.put(("gone",))
        return True

    def gone_before_running(self) -> bool:
        """For the worker, about to run this request: True, with the request answered ("done",
        what it had) and finished, when its client left (`client_gone`); False otherwise."""
        if not self.client_gone():
            return False
        self._events.put(("done", self.cached or 0))
        self.finished.set()
        return True

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
            if event is not None and event[0] == "gone":  # the worker saw the hang-up first
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
                if not ids:  # this choice's row was not in this step
                    continue
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
