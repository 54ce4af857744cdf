"""The demo's engine: prompts to token ids, one worker thread, streamed text out.

Concurrency model: HTTP handling is concurrent (threaded server); one worker thread decodes:
in a step loop over the model's forward (demo.engine.step_loop: newcomers admitted between
steps) where the model allows, else one generate() at a time. The engine is a scheduler plus a runner, as serving engines split it:

- demo.engine.scheduler.Scheduler owns the queue: admission (`reserve`, `submit`), which queued
  requests share the next generate() call, and when a running batch pauses so that a waiting
  request can join (continuous batching in decode chunks); it never touches the model.
- demo.engine.runner.Runner executes a batch: generate() with the request options' config, a
  RadixCache over the store (one namespace per row), PEFT adapters per row, the rows' image
  inputs merged as the family's processor batches them (demo.model.vision_batch), under the
  model lock (adapters load and unload between calls).

The worker loop (`_serve`) is the only place the two meet: take a batch, run it (in the step
loop until no row is left, or one generate() call), queue what paused again. A request's own thread reads token ids from the worker through its Generation
(demo.engine.generation) and turns them into text.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable

from demo.engine.generation import Disconnected, Generation, Params, Result
from demo.engine.prompts import Prompts
from demo.engine.runner import Runner
from demo.engine.scheduler import Busy, Scheduler, Slot
from demo.engine.step_loop import StepLoop, step_loop_reason

__all__ = ["Busy", "Disconnected", "Engine", "Generation", "Params", "Result"]

log = logging.getLogger(__name__)


class Engine(Prompts):
    """Owns the model, the tokenizer, the KV store (None with reuse off), the scheduler, the
    runner and the worker thread. Its prompt side (chat templates, tokenising, decoding) is
    demo.engine.prompts.Prompts, which a front end's RemoteEngine shares."""

    def __init__(
        self,
        model,
        tokenizer,
        context: int,
        *,
        reuse: bool = True,
        block_size: int = 16,
        cache_tokens: int | None = None,
        sidecar: str | None = None,
        max_queue: int = 32,
        max_batch_size: int = 32,
        max_batch_tokens: int = 16384,
        decode_chunk: int = 16,
        prefill_chunk: int = 256,
        max_prefill_tokens: int | None = None,
        adapters=None,
        processor=None,
        step_loop: bool = True,
    ):
        self.model, self.tokenizer, self.context = model, tokenizer, context
        # demo.model.adapters.Adapters over ``model`` (None: this engine serves the base model only), and
        # a vision-language model's processor (demo.model.vision; None: text only).
        self.adapters, self.processor = adapters, processor
        Prompts.__init__(self, tokenizer, processor)
        # Prefill slices need the store (a slice commits its KV for the next to read).
        self.scheduler = Scheduler(
            max_queue,
            max_batch_size,
            max_batch_tokens,
            decode_chunk,
            prefill_chunk if reuse else 0,
            max_prefill_tokens or 0,
        )
        self.store = None
        if reuse:
            import hf_patch  # importing installs the generate() integration

            self.store = hf_patch.build_store(
                model, block_size=block_size, budget_tokens=cache_tokens, sidecar=sidecar
            )
        if adapters is not None:
            adapters.store = self.store  # an unloaded adapter's KV is dropped from it
        self.runner = Runner(model, tokenizer, self.store, adapters, processor)
        # The input vocabulary, and the logits' width (logit_bias and grammars index it)
        self.vocab_size, self.logits_size = self.runner.vocab_size, self.runner.grammars.vocab_size
        # Decoding: a step loop over forward() with newcomers admitted between steps
        # (demo.engine.step_loop), or, where the model or the engine's setup does not allow it,
        # generate() calls paused every decode_chunk steps. Decided here, once.
        self.loop: StepLoop | None = None
        # a long prompt's slices start past what the store holds (keyed as the base model)
        self.scheduler.held = lambda gen: (
            None if self.runner.adapters else self.runner.held(gen, gen.prompt_ids)
        )
        reason = step_loop_reason(model, processor) if step_loop else "turned off"
        if reason is None:
            self.loop = StepLoop(self.runner, self.scheduler, on_step=self.scheduler.rows_per_step.observe)
            self.scheduler.path = self.loop.takes
            if self.loop.batch.pools:  # rows x columns counts their own KV (prefixes read from the pool)
                self.scheduler.columns = self.loop.uncached
            if self.loop.batch.packed:  # the budget counts what seating computes (cached prefixes not)
                self.scheduler.prefill_cost = self.loop.uncached
                if max_prefill_tokens is None:
                    # newcomers' prompts are computed inside steps: bound what they add to one (twice
                    # the decode tokens of a full batch, at least 64; docs/batching.md#the-admission-budget)
                    self.scheduler.max_prefill_tokens = max(64, 2 * max_batch_size)
                    log.info(
                        "newcomers join inside decode steps, within %d prompt tokens a step",
                        self.scheduler.max_prefill_tokens,
                    )
        else:
            log.info("decoding in generate() calls of --decode-chunk steps, not the step loop: %s", reason)
        self._worker = threading.Thread(target=self._serve, name="radixkv-generate", daemon=True)
        self._worker.start()

    @property
    def snapshots(self) -> bool:
        """Whether the store keeps recurrent-state snapshots (chat prompts then carry hints)."""
        return self.store is not None and self.store.states is not None

    # -- requests ----------------------------------------------------------------------------
    def reserve(self) -> Slot:
        """A place in the queue for a request about to be submitted; raises Busy if full. O(1)."""
        return self.scheduler.reserve()

    def submit(
        self,
        prompt_ids: list[int],
        params: Params,
        namespace: Hashable = None,
        slot: Slot | None = None,
        inputs: dict | None = None,
        hooks=None,
        snapshot_at: list[int] | None = None,
        events=None,
    ) -> Generation:
        """Queue a request in `slot` (default: reserve one now; raises Busy if the queue is
        full). ``inputs``: model inputs beside the ids (a VLM's processor outputs for this
        prompt: pixel_values, grids, token types), merged with the batch's other rows where the
        family allows (demo.model.vision_batch), else the request runs alone. ``hooks``: one
        demo.engine.sampling.RowHook (or None) per row of the request (``params.rows``),
        applied to that row's logits only; a ``params.grammar`` makes them (one matcher per
        row). ``snapshot_at``: prompt positions where a later prompt is likely to part from this
        one (``message_ends``), for a store with recurrent-state snapshots. ``events``: where the
        worker puts the request's events (anything with ``put``: demo.core.engine_process sends
        them to a front end's process); default the Generation's own queue. Iterate the result
        for text (unless ``events`` took them)."""
        if params.grammar is not None:
            if hooks is not None:
                raise ValueError("a request with a grammar takes no other hooks")
            hooks = self.runner.grammar_hooks(prompt_ids, params)  # (ValueError before a slot is taken)
        slot = slot or self.reserve()
        group = self.adapters.batch_group(params.adapter) if self.adapters is not None else None
        gen = Generation(prompt_ids, params, namespace, self.decode, self.runner.eos, inputs, group, hooks)
        gen.alone = self.runner.runs_alone(prompt_ids, inputs)
        gen.snapshot_at = snapshot_at
        if events is not None:
            gen._events = events
        self.scheduler.submit(gen, slot)
        return gen

    def shutdown(self, wait: float) -> None:
        """Stop taking requests and cut those queued or running (each answered 503), then wait
        up to ``wait`` seconds for the running generate() call to stop at its next step, so that
        the KV it computed is in the store for the shutdown save."""
        from demo.errors import ApiError

        self.scheduler.close(
            ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
        )
        # The step loop releases the lock between steps, and a row cut by close() leaves (its KV
        # committed) at the end of the iteration that sees the cut: wait until no request runs.
        deadline, lock = time.monotonic() + max(0.0, wait), self.exclusive()
        while True:
            if lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                try:
                    if not self.scheduler.running:
                        return
                finally:
                    lock.release()
            if time.monotonic() >= deadline:
                log.warning("shutdown: the running batch did not stop within %.1fs", wait)
                return
            time.sleep(0.005)

    def exclusive(self) -> threading.RLock:
        """The model lock: held, no generate() runs (the worker waits for it between batches)."""
        return self.runner.lock

    def _serve(self) -> None:
        while True:
            batch = self.scheduler.next_batch()
            if not batch:
                continue
            paused: list[Generation] = []
            try:
                if batch[0].slice_to:  # one slice of a long prompt, between decode chunks
                    paused = self.runner.prefill(batch[0])
                    continue
                if self.loop is not None and self.loop.takes(batch[0]) and self.loop.ready():
                    self.loop.serve(batch)  # until no row is left; admits newcomers itself
                    continue
                self.scheduler.batch_sizes.observe(len(batch))
                pause = self.scheduler.pause_for(batch) if self.store is not None else None
                paused = self.runner.run(batch, pause, self.scheduler.rows_per_step.observe)
            finally:
                self.scheduler.finished(paused)

    # -- load ------------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        """Requests submitted and not yet taken by the worker."""
        return self.scheduler.queued

    @property
    def running(self) -> int:
        """Requests in the generate() call now running (0 when idle)."""
        return self.scheduler.running

    @property
    def load_tokens(self) -> int:
        """Prompt and generated tokens running or queued (the SGLang gateway's load signal)."""
        return self.scheduler.load_tokens

    # -- cache -----------------------------------------------------------------------------
    def stats(self) -> dict:
        return self.store.stats() if self.store is not None else {}

    def flush(self) -> None:
        if self.store is not None:
            self.store.flush()

    def check_invariants(self) -> None:
        if self.store is not None:
            self.store.check_invariants()
