"""The demo's scheduler: which queued requests run next, and when a running batch makes way.

Every request becomes a `Generation` (demo.engine.generation) in a FIFO queue of at most `max_queue`.
`next_batch()` takes the oldest and the queued requests that can share its generate() call
(demo.engine.batching.batch_key: the same adapter group and cache_prompt; sampling options and
images never keep a request out, except images of a family without a batch rule), oldest
first, within `max_batch_size` rows (n sampled choices are n rows) and `max_batch_tokens`
(rows x padded width: pixels are not counted). After `decode_chunk` steps a batch pauses if any
request waits (`pause_for`): its requests queue again behind the waiting ones, carrying what
they generated (and their random generator, per-row hooks), and resume from their committed KV
(continuous batching in chunks). The scheduler never touches the model: demo.engine.runner
executes what it hands out.

A long prompt does not stall the rows decoding beside it: a request whose prompt has more than
`prefill_chunk` tokens left to compute, taken while others wait, is handed out alone for one
slice (`Generation.slice_to`: the runner computes and commits that much of its prompt) and
queues again behind them, so slices and decode chunks take turns; it joins a batch once the
whole prompt but its last token is in the store, reading it from there. (Alone, it is
prefilled at once.)

With the step loop (demo.engine.step_loop), nothing pauses: between two steps
`take_newcomers` hands out the queued requests that join the running rows, a due slice of a
long prompt, and a request too wide to join them (run aside, one decode chunk at a time).
`max_prefill_tokens` (0: none) is the admission budget of one step (vLLM's
max_num_batched_tokens, SGLang's chunked prefill size in spirit): newcomers join only while the
prompt tokens they compute (`prefill_cost`) stay within it, the first in line always, the rest
at the next steps in order; it also bounds the first batch of an idle loop (`next_batch`).

A queue place is taken with `reserve()` before the prompt is tokenised, so a full queue
refuses at no cost; `submit(gen, slot)` then fills it. Thread-safe: HTTP threads reserve and
submit, the engine's one worker takes batches.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence

from demo.engine import batching
from demo.engine.generation import Generation
from demo.metrics import BATCH_SIZE_BUCKETS, FORWARD_BUCKETS, Histogram

__all__ = ["Busy", "Scheduler", "Slot"]


class Busy(RuntimeError):
    """The generation queue is full."""


class Slot:
    """A reserved place in the queue (`Scheduler.reserve()`); a context manager that gives the
    place back unless `Scheduler.submit` used it."""

    def __init__(self, scheduler: Scheduler):
        self._scheduler, self.used = scheduler, False

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc) -> None:
        self._scheduler._give_back(self)


class Scheduler:
    """The request queue, batch selection and the pause decision of continuous batching."""

    def __init__(self, max_queue: int = 32, max_batch_size: int = 8, max_batch_tokens: int = 16384,
                 decode_chunk: int = 16, prefill_chunk: int = 0, max_prefill_tokens: int = 0):  # fmt: skip
        if max_queue < 1 or max_batch_size < 1 or max_batch_tokens < 1:
            raise ValueError("max_queue, max_batch_size and max_batch_tokens must be >= 1")
        if decode_chunk < 0:
            raise ValueError(f"decode_chunk must be >= 0 (0: never pause), got {decode_chunk}")
        self.max_queue, self.max_batch_size, self.max_batch_tokens = (
            max_queue,
            max_batch_size,
            max_batch_tokens,
        )
        if prefill_chunk < 0:
            raise ValueError(
                f"prefill_chunk must be >= 0 (0: a prompt is prefilled at once), got {prefill_chunk}"
            )
        self.decode_chunk, self.prefill_chunk = decode_chunk, prefill_chunk
        if max_prefill_tokens < 0:
            raise ValueError(
                f"max_prefill_tokens must be >= 0 (0: no budget, every newcomer that fits joins), got {max_prefill_tokens}"
            )
        self.max_prefill_tokens = max_prefill_tokens
        # the columns a newcomer takes in the step loop's KV (`take_newcomers`; the engine sets
        # StepLoop.columns where running rows read their cached prefixes from the pool)
        self.columns: Callable[[Generation], int] = lambda gen: gen.width
        # leading tokens of a request's prompt the store holds (`_long`: a prompt the store
        # mostly holds is no long prompt; the engine sets Runner.held; None: unknown)
        self.held: Callable[[Generation], int | None] = lambda gen: None
        self._cond = threading.Condition()
        self._waiting: deque[Generation] = deque()
        self._reserved = 0  # slots handed out, not yet submitted
        self._running: list[Generation] = []  # the batch now running (read by /get_load)
        self._closed: Exception | None = None  # set by close(): what every request is told
        # Observed here, rendered by /metrics.
        self.batch_sizes = Histogram(BATCH_SIZE_BUCKETS)  # requests per generate() call (the worker observes)
        self.queue_waits = Histogram()  # submit -> first admitted to a batch (seconds)
        self.resume_waits = Histogram()  # a paused request: pause -> its next batch (seconds)
        self.rows_per_step = Histogram(BATCH_SIZE_BUCKETS)  # rows making a token, per step
        self.forward_seconds = Histogram(FORWARD_BUCKETS)  # a step-loop forward's wall time
        self.pauses = 0  # requests paused between decode chunks
        self.resumes = 0  # paused requests taken into a batch again
        self.prefill_slices = 0  # slices of long prompts computed between decode chunks
        self.admissions = 0  # requests admitted into a running step loop between decode steps
        self.asides = 0  # decode chunks run aside from the step loop (requests too wide to join)
        # path(gen): which decoding path runs the request (the engine sets it: the step loop's
        # requests and generate()'s never share a batch)
        self.path: Callable[[Generation], Hashable] = lambda gen: None

    # -- admission (HTTP threads) ------------------------------------------------------------
    def reserve(self) -> Slot:
        """A place in the queue for a request about to be submitted; raises Busy if full. O(1)."""
        with self._cond:
            if self._closed is not None:
                raise Busy("the server is shutting down")
            if self._reserved + len(self._waiting) >= self.max_queue:
                raise Busy(f"{self.max_queue} requests are already waiting")
            self._reserved += 1
        return Slot(self)

    def _give_back(self, slot: Slot) -> None:
        with self._cond:
            if not slot.used:
                slot.used = True
                self._reserved -= 1

    def submit(self, gen: Generation, slot: Slot) -> None:
        """Queue ``gen`` in ``slot``. Raises ValueError if the slot was used or given back."""
        with self._cond:
            if slot.used:
                raise ValueError("this queue slot was already used or given back")
            slot.used = True
            self._reserved -= 1
            self._waiting.append(gen)
            self._cond.notify()
        if self._closed is not None:  # reserved before close(), submitted after
            self._cut([gen])

    def close(self, error: Exception) -> None:
        """Shutting down: no more places, and every queued, running or paused request is cut
        (``error`` is what its client hears; the running batch stops at its next decode step,
        its KV so far committed). Idempotent."""
        with self._cond:
            self._closed = error
            gens = [*self._waiting, *self._running]
        self._cut(gens)

    def _cut(self, gens: Sequence[Generation]) -> None:
        for gen in gens:
            if not gen.finished.is_set():
                gen._events.put(("error", self._closed))
            gen.cancel()

    # -- the worker's side ---------------------------------------------------------------------
    def next_batch(self) -> list[Generation]:
        """Wait for a request; return the oldest with the queued ones that can share its
        generate() call, minus those whose client left while they waited (answered here). The
        batch counts as running until `finished()`. May return an empty list."""
        with self._cond:
            while not self._waiting:
                self._cond.wait()
            taken = self._take()
        now = time.perf_counter()
        batch = []
        for gen in taken:
            if gen.slice_to:  # a prefill slice: not admitted yet
                pass
            elif gen.started is None:  # a resumed request waited once, at its start
                gen.started = now
                self.queue_waits.observe(now - gen.submitted)
            else:
                self.resumes += 1
                self.resume_waits.observe(now - gen.paused_at)
            if not gen.gone_before_running():  # cancelled, or its client left while it waited
                batch.append(gen)
        if batch:
            if batch[0].slice_to:
                self.prefill_slices += 1
            self._running = batch
            if self._closed is not None:  # taken while close() ran: stops at its first step
                self._cut(batch)
        return batch

    def finished(self, paused: Sequence[Generation] = ()) -> None:
        """The running batch ended; ``paused`` requests queue again, behind the ones that waited
        for them (time slices of a chunk)."""
        self._running = []
        if paused:
            now = time.perf_counter()
            for gen in paused:
                gen.paused_at = now
            with self._cond:
                self.pauses += sum(gen.started is not None for gen in paused)  # not a prefill slice
                self._waiting.extend(paused)
            if self._closed is not None:
                self._cut(paused)

    # -- the step loop's side (demo.engine.step_loop) -------------------------------------------
    def take_newcomers(
        self,
        rows: int,
        width: int,
        slice_due: bool,
        takes: Callable[[Generation], bool],
        slots: int | None = None,
    ) -> tuple[list[Generation], Generation | None, Generation | None]:
        """Between two steps of a running loop of ``rows`` rows in ``slots`` slots (live or
        free; None: ``rows``) of ``width`` columns, oldest first: (the queued requests that join
        it now, within max_batch_size rows and max_batch_tokens; the long prompt whose next
        prefill slice is due (`Generation.slice_to`); a request *aside*: one that fits no row
        of the loop under max_batch_tokens however few rows run (a prompt far wider than the
        rows), to run one decode chunk on the generate() path). Slices and asides only when
        ``slice_due``; the worker `requeue`s them after. Taking stops at a request that waits
        for a free row, or that the loop cannot take (``takes(gen)`` False): the loop then
        drains and the worker runs that one. Requests whose client left are answered here.

        max_batch_tokens counts rows x padded width (a newcomer's width: ``columns(gen)``, its
        context's by default; where the rows read cached prefixes from the pool, its uncached
        part, and ``width`` the batch's KV columns), except for a newcomer no wider than the
        batch that takes a free slot: that slot's columns are allocated and computed at every
        step anyway (the batch holds slots x padded width whatever the rows), so it adds no KV
        and joins. One that needs another slot or wider columns joins if rows x width after it
        stays within the cap. With a `max_prefill_tokens` budget, newcomers join while their
        `prefill_cost` sum stays within it (the first in line always: none starves); taking stops
        at the first over it. O(queue)."""
        admitted: list[Generation] = []
        prefill = 0  # the admitted newcomers' prompt tokens to compute (`prefill_cost`)
        sliced = aside = None
        slots = rows if slots is None else slots
        if slots < rows:
            raise ValueError(f"take_newcomers: {rows} rows in {slots} slots")
        with self._cond:
            rest: deque[Generation] = deque()
            blocked = False
            while self._waiting:
                gen = self._waiting.popleft()
                if blocked or not takes(gen):
                    blocked = True
                    rest.append(gen)
                    continue
                if self._long(gen):  # its slices first, whenever one is due
                    if slice_due and sliced is None:
                        gen.slice_to = min(gen.prefilled + self.prefill_chunk, len(gen.prompt_ids) - 1)
                        sliced = gen
                    else:
                        rest.append(gen)
                    continue
                new_rows = rows + len(gen.open_rows)
                columns = self.columns(gen)  # (a store lookup where the engine sets it: asked once)
                new_width, new_slots = max(width, columns), max(slots, new_rows)
                free = new_width == width and new_slots == slots  # into free slots: no new KV
                wide = not free and new_width * new_rows > self.max_batch_tokens
                if gen.started is None and new_rows <= self.max_batch_size and not wide:
                    cost = columns if self.prefill_cost == self.columns else self.prefill_cost(gen)
                    if admitted and self.max_prefill_tokens and prefill + cost > self.max_prefill_tokens:
                        blocked = True  # over this step's budget: first in line at the next
                        rest.append(gen)
                        continue
                    admitted.append(gen)
                    prefill += cost
                    rows, width, slots = new_rows, new_width, new_slots
                elif (wide and columns * new_rows > self.max_batch_tokens) or gen.started is not None:
                    # too wide beside the rows (or a reply already run aside): a chunk aside
                    if slice_due and aside is None:
                        aside = gen
                    else:
                        rest.append(gen)
                else:
                    blocked = True
                    rest.append(gen)
            self._waiting = rest
            # running from now on: a close() from here on cuts them (it reads _running), one
            # before was seen above (_closed checked below)
            self._running = [*self._running, *admitted, *(g for g in (sliced, aside) if g is not None)]
        now = time.perf_counter()
        for gen in admitted + ([aside] if aside is not None and aside.started is None else []):
            gen.started = now
            self.queue_waits.observe(now - gen.submitted)
        out = [gen for gen in admitted if not gen.gone_before_running()]
        self.admissions += len(out)
        if sliced is not None:
            self.prefill_slices += 1
        extra = [g for g in (sliced, aside) if g is not None]
        if self._closed is not None:
            self._cut(out + extra)
        return out, sliced, aside

    @staticmethod
    def prefill_cost(gen: Generation) -> int:
        """The tokens admitting ``gen`` computes, as the budget counts them: its longest open
        row's context less what its prefill slices already put in the store (n rows share one
        prompt; a cached prefix is not looked up, so it counts too). O(n)."""
        return max(1, gen.width - gen.prefilled)

    def requeue(self, gens: Sequence[Generation]) -> None:
        """Put ``gens`` (a long prompt after one slice, a reply paused aside) back at the front
        of the queue."""
        with self._cond:
            self._waiting.extendleft(reversed(list(gens)))
        if self._closed is not None:
            self._cut(gens)

    def set_running(self, gens: Sequence[Generation]) -> None:
        """The requests now in the step loop (read by /get_load and close())."""
        with self._cond:
            self._running = list(gens)

    def _take(self) -> list[Generation]:
        """The oldest request (whatever its size), plus the queued ones that can share its
        generate() call, within max_batch_size rows and max_batch_tokens: first requests not
        started yet (oldest first, up to half the rows: a newcomer starts at the next chunk
        boundary instead of behind every paused reply), then the rest oldest first (paused
        replies keep at least half the rows: none starves). Call holding _cond. O(queue)."""
        first = self._waiting.popleft()
        if self._long(first) and self._waiting:  # others wait for the worker: take turns
            first.slice_to = min(first.prefilled + self.prefill_chunk, len(first.prompt_ids) - 1)
            return [first]
        key = batching.batch_key(first)
        path = self.path(first)
        batch, width, rows = [first], first.width, len(first.open_rows)
        if key is None or self.max_batch_size == 1:
            return batch
        newcomer_rows = max(1, self.max_batch_size // 2)
        new = len(first.open_rows) if first.started is None else 0  # newcomers' rows taken
        # the step loop admits this batch in one prefill: within max_prefill_tokens (the first
        # always), the rest join at the next steps in order (take_newcomers)
        budget = self.max_prefill_tokens if path is True else 0
        prefill, over = self.prefill_cost(first), False
        for newcomers_only in (True, False):
            rest: deque[Generation] = deque()  # one pass: no deque.remove
            while self._waiting:
                gen = self._waiting.popleft()
                new_width, new_rows = max(width, gen.width), rows + len(gen.open_rows)
                if (
                    (
                        not newcomers_only
                        or (gen.started is None and new + len(gen.open_rows) <= newcomer_rows)
                    )
                    and new_rows <= self.max_batch_size
                    and new_width * new_rows <= self.max_batch_tokens
                    and batching.batch_key(gen) == key
                    and self.path(gen) == path
                    and not self._long(gen)  # it takes its slices first
                    and not (over := over or (budget > 0 and prefill + self.prefill_cost(gen) > budget))
                ):  # over the budget: it and those behind it (FIFO) join the loop at its next steps
                    batch.append(gen)
                    width, rows = new_width, new_rows
                    prefill += self.prefill_cost(gen)
                    new += len(gen.open_rows) if newcomers_only else 0
                else:
                    rest.append(gen)
            self._waiting = rest
        return batch

    def _long(self, gen: Generation) -> bool:
        """Whether ``gen`` is a long prompt (more than a slice left to compute past what the
        store holds of it; a text request on the prefix cache, not started yet; one with images
        is prefilled whole in its batch) not yet prefilled up to its last token. It is sliced to the end: a batch computes every row
        over the columns its longest uncached row needs, so a remainder left to the batch
        would cost rows x remainder."""
        if not (
            self.prefill_chunk > 0
            and gen.started is None
            and gen.params.cache_prompt
            and batching.batch_key(gen) is not None
            and not gen.inputs  # a slice is ids only: an image's placeholders need its pixels
            and len(gen.prompt_ids) > self.prefill_chunk
            and gen.prefilled < len(gen.prompt_ids) - 1
        ):
            return False
        if gen.prompt_held is None:  # asked once: what the store holds needs no slices
            gen.prompt_held = self.held(gen) or 0
            gen.prefilled = max(gen.prefilled, gen.prompt_held)
        # long: more than a slice left to compute, or its own slices begun (sliced to the end)
        left = len(gen.prompt_ids) - gen.prefilled
        return left > self.prefill_chunk or gen.prompt_held < gen.prefilled < len(gen.prompt_ids) - 1

    def pause_for(self, batch: Sequence[Generation]) -> Callable[[int], bool] | None:
        """pause(generated): True once the batch has made `decode_chunk` steps while any request
        waits, so that it starts within a chunk instead of after the batch (one that cannot
        share this batch's call, another adapter group or cache_prompt, gets the next call to
        itself: time slices). None when this batch never pauses (decode_chunk 0, or its
        requests cannot resume: demo.engine.batching.chunkable)."""
        if not self.decode_chunk or not batch or not batching.chunkable(batch[0]):
            return None

        def pause(generated: int) -> bool:
            return generated >= self.decode_chunk and bool(self._waiting)

        return pause

    # -- load (/get_load, /metrics) ------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Requests submitted and not yet taken by the worker."""
        return len(self._waiting)

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
