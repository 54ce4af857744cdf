"""The worker's decode loop: one forward per step over the running rows, newcomers admitted
between steps (admission within about one decode step), long prompts prefilled in slices that
take turns with steps.

    loop = StepLoop(runner, scheduler)          # when step_loop_reason(...) is None
    loop.serve(batch)                           # returns once no row is left

The rows' KV lives in an hf_patch.running_batch.RunningBatch across steps. Admission runs the
newcomers' prompts as one prefill generate() of one new token (the runner's call: it reads the
store, computes only the uncached suffix, shares common prefixes in the batch, commits the
prompt), whose RowSampler picks each newcomer's first token with its own options; their KV is
then spliced into the running batch. A step feeds every row's last token, samples with a
RowSampler over the batch's ids (each row's own tokens from its first real column: penalties,
logit_bias, hooks, logprobs, temperature/top_k/top_p/min_p, the request's own generator), and
streams the tokens to the requests as RowStreamer does (one event per request and step; a
greedy row stands for its n equal choices). A row ends at its max_tokens, its EOS (never fed
nor stored), its stop string (the request thread says so) or its client's hang-up; it is then
removed and its prompt + reply KV committed under its key (cache_prompt=false rows never are),
and its request is told it is done once all its rows are.

Who decides what: the scheduler picks newcomers (`Scheduler.take_newcomers`: FIFO, within
max_batch_size rows and max_batch_tokens = rows x padded width, a newcomer taking a free slot
at the batch's width at no cost; it stops at a request the loop cannot take, so the loop
drains and the worker runs that one its own way) and the long prompt whose next slice is due
(every `slice_every` steps, `Runner.prefill`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from demo.engine import batching
from demo.engine.generation import Generation, Params
from demo.engine.sampling import Row, RowSampler

__all__ = ["StepLoop", "step_loop_reason"]

log = logging.getLogger(__name__)

# The generation config's own logits processors the loop applies (before each row's own
# options, as generate() orders them): those that read no position or prompt length, so a row
# gets the same from them alone and in a padded batch. Any other (min_new_tokens, forced BOS,
# a begin-suppress list, ...) sends the batch to the generate() path.
_ROW_INDEPENDENT = {
    "SuppressTokensLogitsProcessor",
    "NoBadWordsLogitsProcessor",
    "SequenceBiasLogitsProcessor",
}


def step_loop_reason(model, processor=None) -> str | None:
    """Why requests on ``model`` cannot decode in the step loop (the engine then keeps the
    chunked generate() path for all of them), or None. Per request, `StepLoop.takes` says."""
    from demo.model import vision_batch
    from hf_patch.running_batch import unsupported_reason

    if processor is not None or vision_batch.rule_for(model) is not None:
        # image rows share generate() calls with text rows (demo.model.vision_batch)
        return "a vision-language model (image and text requests share generate() calls)"
    reason = unsupported_reason(model)
    if reason is not None:
        return reason
    return None


def _by_cache_prompt(gens: list[Generation]):
    """``gens`` in groups of one ``cache_prompt`` value (True first; such groups are admitted
    apart), each request asked just before its group whether its client left
    (``gone_before_running``: then answered, and left out); empty groups are skipped."""
    for cache_prompt in (True, False):
        group = [g for g in gens if g.params.cache_prompt == cache_prompt and not g.gone_before_running()]
        if group:
            yield group


class StepLoop:
    """The running rows of the worker (see the module). One worker thread owns it."""

    def __init__(self, runner, scheduler, slice_every: int = 1, on_step: Callable[[int], None] | None = None):
        from hf_patch import ragged_attention
        from hf_patch.running_batch import RunningBatch

        if slice_every < 1:
            raise ValueError(f"slice_every must be >= 1, got {slice_every}")
        self.runner, self.scheduler, self.slice_every = runner, scheduler, slice_every
        self.on_step = on_step  # on_step(rows that made a token): the rows-per-step metric
        pad = runner.config(Params(1, temperature=0.0)).pad_token_id
        self.batch = RunningBatch(runner.model, runner.store, pad, sorted(runner.eos))
        # probe the model for the CPU decode kernel (and compile it) now, not in the first step
        if self.batch.layout.stateful:
            log.info(
                "decoding in a step loop, each row's recurrent state kept in its slot (hf_patch.slot_states); "
                "newcomers join through prefill calls"
            )
        if ragged_attention.verify(runner.model):
            log.info("decode steps read each row's own columns (hf_patch.ragged_attention)")
            if self.batch.packed:  # probed now too
                log.info("newcomers' prompts are computed inside decode steps (RunningBatch.seat)")
            if self.batch.pools:  # probed now too
                log.info(
                    "running rows read their cached prefixes from the pool in place (RunningBatch.pools)"
                )
        self.rows: list[Row | None] = []  # per slot of the batch: (request, its row), None: free
        self.made: list[int] = []  # per slot: tokens its row made so far
        self.sampler: RowSampler | None = None  # over the live slots `sampled`, in order
        self.sampled: list[int] = []
        self.failed: set[int] = set()  # id() of requests whose hook raised (told already)
        self.admitting: list[Generation] = []  # the requests `_admit` is taking in
        self.processors: list = []  # the generation config's (see `ready`)
        self._refused: set[str] = set()  # reasons logged once

    def ready(self) -> bool:
        """Whether the model's generation config (read now: it may change between batches) adds
        only logits processors the loop applies; if not, the batch takes the generate() path
        (the reason logged once)."""
        model = self.runner.model
        config = self.runner.config(Params(1, temperature=0.0))
        try:
            processors = model._get_logits_processor(
                generation_config=config,
                input_ids_seq_length=1,
                encoder_input_ids=torch.zeros((1, 1), dtype=torch.long, device=model.device),
                device=model.device,
                model_kwargs={},
            )
        except Exception as e:  # a transformers release without this (private) method
            reason = f"the generation config's logits processors cannot be built here: {e!r}"
        else:
            other = sorted({type(p).__name__ for p in processors} - _ROW_INDEPENDENT)
            if not other:
                self.processors = list(processors)
                return True
            reason = f"the generation config adds {', '.join(other)}, which the step loop does not apply"
        if reason not in self._refused:
            self._refused.add(reason)
            log.warning("decoding in generate() calls, not the step loop: %s", reason)
        return False

    def takes(self, gen: Generation) -> bool:
        """Whether ``gen`` can be a row of the loop: text only, and no LoRA adapter loaded (while
        one is, every request runs in generate() calls, mixed adapters through PEFT's
        adapter_names; rows already decoding finish as the base model, `_base`)."""
        adapters = self.runner.adapters
        if gen.inputs or gen.params.adapter is not None or (adapters is not None and len(adapters) > 0):
            return False
        # a recurrent model's rows prefilled without the store are prefilled together only when
        # they need no padding (`_admit`): a request whose rows differ in length runs elsewhere
        return not self._plain_stateful(gen) or len({len(gen.contexts[r]) for r in gen.open_rows}) <= 1

    def _plain_stateful(self, gen: Generation) -> bool:
        """Whether ``gen``'s prefill runs without a RadixCache on a model with recurrent state:
        then its padded rows would carry their pads in their states (stock's batched prefill)."""
        return self.batch.layout.stateful and (self.runner.store is None or not gen.params.cache_prompt)

    def _base(self):
        """The model computing as the base while LoRA adapters are loaded (a no-op otherwise)."""
        adapters = self.runner.adapters
        if adapters is None or adapters.peft is None:
            return contextlib.nullcontext()
        return adapters.peft.disable_adapter()

    # -- the loop -----------------------------------------------------------------------------
    def serve(self, first: list[Generation]) -> None:
        """Admit ``first`` and decode until no row is left, admitting newcomers between steps.
        Every request gets its ("done", cached) or ("error", exc) event. Never raises for a
        generation failure: the rows then all get the error and the loop ends."""
        steps = 0
        try:
            with self.runner.lock:
                self._join(first)
            while self._live():
                with self.runner.lock:
                    if self.scheduler.queued:
                        due = steps % self.slice_every == 0
                        newcomers, slice_, aside = self.scheduler.take_newcomers(
                            len(self._live()), self.batch.kv_width, due, self.takes, self.batch.size
                        )
                        if slice_ is not None:
                            self.scheduler.requeue(self.runner.prefill(slice_))
                        if aside is not None:
                            self._aside(aside)
                        if newcomers:
                            self._join(newcomers)
                    if self._live():
                        self._step()
                        steps += 1
                    self._retire_gone()
        except Exception as e:  # report to every request still running; the worker keeps serving
            log.exception("the step loop failed")
            for gen in [*self._gens(), *self.admitting]:  # those being admitted too: none hangs
                self._close(gen, ("error", e))
            self.batch.clear()
            self.rows, self.made, self.sampler = [], [], None
        finally:
            # no row is left: ids of requests that failed mean nothing now (a later request's
            # Generation may get the same id())
            self.admitting, self.failed = [], set()
            self.scheduler.set_running([])

    def _aside(self, gen: Generation) -> None:
        """Run ``gen`` (too wide to join the rows) for one decode chunk in its own generate()
        call on the generate() path, then queue it again (or it is done): the running rows wait
        that chunk, never its whole reply, and it is never starved by narrower newcomers."""
        chunk = max(1, self.scheduler.decode_chunk or 16)
        paused = self.runner.run([gen], lambda generated: generated >= chunk, self.on_step)
        self.scheduler.asides += 1
        for g in paused:
            g.paused_at = time.perf_counter()
        self.scheduler.requeue(paused)

    def _gens(self) -> list[Generation]:
        return list(dict.fromkeys(r.gen for r in self.rows if r is not None))

    def _live(self) -> list[int]:
        """The slots holding a row."""
        return [i for i, r in enumerate(self.rows) if r is not None]

    # -- admission ------------------------------------------------------------------------------
    def _join(self, gens: list[Generation]) -> None:
        """Newcomers join: seated for the next step to compute their prompts (where the batch
        packs: RunningBatch.seat), else through an admission prefill (`_admit`)."""
        if not self.batch.packed:
            self._admit(gens)
            return
        self.admitting = list(gens)
        # n sampled rows of one prompt: one prefill call computes the prompt once for all
        # (hf_patch.batch_share); seated, each row would compute it. Split before either runs:
        # the prefill call can end one of a request's rows (its first token an EOS), and the
        # row left must not be seated a second time.
        single = [g for g in gens if len(g.open_rows) == 1]
        for group in _by_cache_prompt([g for g in gens if len(g.open_rows) > 1]):
            self._admit_group(group)
        for group in _by_cache_prompt(single):
            self._seat(group)
        self.admitting = []
        self.scheduler.set_running(self._gens())

    def uncached(self, gen: Generation) -> int:
        """The prompt tokens seating ``gen`` computes (the admission budget's count where rows
        join inside steps): its widest open row's context less the longest prefix the store
        holds for it (`Runner.held`: a lookup under its key); the whole context where no
        lookup applies (a request for the generate() path: no adapter state read here)."""
        plain = max(1, gen.width - gen.prefilled)
        row = max(gen.open_rows, key=lambda r: len(gen.contexts[r]), default=None)
        if row is None or not self.takes(gen):
            return plain
        held = self.runner.held(gen, gen.contexts[row])
        return plain if held is None else max(1, len(gen.contexts[row]) - held)

    def _seat(self, gens: list[Generation]) -> None:
        """Seat ``gens``' rows (their contexts: prompt, or prompt and reply so far) for the next
        step, which computes their uncached tokens beside the running rows' and samples their
        first tokens with everyone's (the step's RowSampler: each row's own options)."""
        from hf_patch.running_batch import prefill_keys

        runner = self.runner
        rows = [(row.gen, row.row) for row in batching.layout(gens)[0]]
        self.scheduler.batch_sizes.observe(len(gens))  # requests per admission
        cache = runner.cache(gens, [g for g, _ in rows])
        keys = None
        if cache is not None:
            with self._base():  # keyed as the base model computes it
                keys = prefill_keys(runner.model, cache, len(rows))
        try:
            slots, cached = self.batch.seat([g.contexts[r] for g, r in rows], keys)
        except Exception as e:  # (a store read) the newcomers get the error; the running rows go on
            log.exception("seating newcomers failed")
            for g in gens:
                self._close(g, ("error", e))
            # the seat may have re-laid the batch out first (wider, more slots): the running
            # rows' columns moved, so the sampler is rebuilt over them
            self._occupy([], [])
            return
        for (g, _), hit in zip(rows, cached):
            if g.cached is None:  # a sliced prompt counted its store reads in its first slice
                g.cached = hit
        self._occupy(slots, rows)

    def _occupy(self, slots: list[int], rows: list[tuple[Generation, int]]) -> None:
        """Rows (request, row) just put in ``slots`` of the batch (which may have grown)."""
        grow = self.batch.size - len(self.rows)
        self.rows += [None] * grow
        self.made += [0] * grow
        for slot, (g, r) in zip(slots, rows):
            self.rows[slot], self.made[slot] = Row(g, r, 0), g.replied(r)
        self.sampler = None  # rebuilt over the new layout at the next step

    def _admit(self, gens: list[Generation]) -> None:
        """Prefill ``gens`` (one generate() of one token per cache_prompt group) and splice their
        rows into the batch; their first tokens are streamed. If anything past the prefill call
        raises, `serve` answers ``gens`` with the error too (`admitting`)."""
        self.admitting = list(gens)
        for group in _by_cache_prompt(gens):
            if self._plain_stateful(group[0]):  # rows of one length together: no padding
                lengths: dict[int, list[Generation]] = {}
                for g in group:
                    lengths.setdefault(len(g.contexts[g.open_rows[0]]), []).append(g)
                for same in lengths.values():
                    self._admit_group(same)
            else:
                self._admit_group(group)
        self.admitting = []
        self.scheduler.set_running(self._gens())

    def _admit_group(self, gens: list[Generation]) -> None:
        from transformers import DynamicCache

        from hf_patch.running_batch import prefill_keys, prefill_tensors

        runner = self.runner
        # a row's context: its prompt, plus what it generated before on the generate() path (a
        # reply run aside, or paused there): it goes on from there
        prefill_rows, width = batching.layout(gens)
        rows = [(row.gen, row.row) for row in prefill_rows]
        config = runner.config(Params(1, temperature=0.0))
        ids, mask = batching.padded_inputs(prefill_rows, width, config.pad_token_id)
        self.scheduler.batch_sizes.observe(len(gens))  # requests per generate() call
        failed: set[int] = set()

        def fail(i: int, exc: Exception, length: int) -> None:
            failed.add(i)
            self._fail(prefill_rows[i].gen, exc)

        sampler = RowSampler(prefill_rows, lambda i: i in failed, fail)
        cache = runner.cache(gens, [g for g, _ in rows])
        layout = self.batch.layout
        arg = "past_key_values"  # (hf_patch hands a RadixCache to a Mamba model as cache_params)
        if cache is None and layout.stateful:  # the layers stock builds for it
            model_config = runner.model.config
            cache = DynamicCache(config=model_config.get_text_config(decoder=True))
            arg = layout.cache_arg
        cache = cache if cache is not None else DynamicCache()
        device = runner.model.device
        try:
            out = runner.generate(
                [g for g, _ in rows],
                ids.to(device),
                attention_mask=mask.to(device),
                generation_config=config,
                logits_processor=[sampler],
                **{arg: cache},
            )
        except Exception as e:  # the newcomers get the error; the running rows go on
            log.exception("admission prefill failed")
            for g in gens:
                self._close(g, ("error", e))
            return
        first = out[:, -1].to("cpu")
        logprobs = sampler.recorder.take(first, sampler.tops) if sampler.recorder is not None else None
        cached = list(getattr(cache, "cached_tokens", None) or [0] * len(rows))
        for i, (g, _) in enumerate(rows):
            if g.cached is None:  # a sliced prompt counted its store reads in its first slice
                g.cached = cached[i] if i < len(cached) else 0
        kv, states = prefill_tensors(runner.model, cache, mask)
        with self._base():  # keyed as the base model computed it
            keys = prefill_keys(runner.model, cache, len(rows))
        new = self.batch.admit(kv, ids, mask, first.tolist(), keys, states=states)
        self._occupy(new, rows)
        self._emit(new, first.tolist(), logprobs)
        self._end(new, first.tolist())

    # -- one step -------------------------------------------------------------------------------
    def _step(self) -> None:
        from hf_patch.running_batch import JoinFailed

        with self._base():
            started = time.perf_counter()
            try:
                logits = self.batch.step()
            except JoinFailed as e:  # the newcomers' prompts failed (memory, say): they get the
                log.exception("the step computing newcomers' prompts failed")  # error, the rest go on
                self._drop(e.slots, e.__cause__)
                if not self._live():
                    return
                logits = self.batch.step()
            # (on CUDA the launch and what waits for it; on a CPU the whole forward)
            self.scheduler.forward_seconds.observe(time.perf_counter() - started)
        if self.sampler is None:
            pads = self.batch.pads
            self.sampled = self._live()  # the slots the sampler's rows are, in order
            rows = [Row(self.rows[i].gen, self.rows[i].row, pads[i]) for i in self.sampled]

            def fail(i: int, exc: Exception, length: int) -> None:
                self._fail(rows[i].gen, exc)

            self.sampler = RowSampler(rows, lambda i: id(rows[i].gen) in self.failed, fail)
        sampler, live = self.sampler, self.sampled
        index = torch.tensor(live, dtype=torch.long)
        ids = self.batch.ids[index].to(logits.device)
        logits = logits[index.to(logits.device)]
        for processor in self.processors:
            logits = processor(ids, logits)
        scores = sampler(ids, logits)
        tokens = scores.argmax(dim=-1).to("cpu")
        logprobs = sampler.recorder.take(tokens, sampler.tops) if sampler.recorder is not None else None
        tokens = tokens.tolist()
        full = [self.batch.pad_id] * self.batch.size
        for slot, token in zip(live, tokens):
            full[slot] = token
        self.batch.set_next(full)
        self._emit(live, tokens, logprobs)
        self._end(live, tokens)

    def _drop(self, slots: list[int], exc: BaseException) -> None:
        """Rows the batch removed without a token (JoinFailed): their requests get ``exc``."""
        for i in slots:
            gen = self.rows[i].gen
            self.rows[i], self.made[i] = None, 0
            self._close(gen, ("error", exc))
        self._compact()
        self.sampler = None
        self.scheduler.set_running(self._gens())

    def _compact(self) -> None:
        """Let the batch drop free slots and leading padding (RunningBatch.compact), rows
        following their slots."""
        moved = self.batch.compact()
        if moved is not None:  # new slot j holds old slot moved[j]
            free = self.batch.size - len(moved)
            self.rows = [self.rows[i] for i in moved] + [None] * free
            self.made = [self.made[i] for i in moved] + [0] * free

    def _emit(self, indices: list[int], tokens: list[int], logprobs) -> None:
        """Send each request its rows' tokens of this step (one event per request)."""
        out: dict[int, tuple[Generation, list, list]] = {}
        made = 0
        for k, i in enumerate(indices):
            row = self.rows[i]
            gen, p = row.gen, row.gen.params
            if id(gen) in self.failed:
                continue
            self.made[i] += 1
            made += 1
            _, ids, lps = out.setdefault(id(gen), (gen, [[] for _ in range(p.n)], [None] * p.n))
            lp = logprobs[k] if logprobs is not None else None
            for choice in [row.row] if p.rows == p.n else range(p.n):  # a greedy row: all n
                ids[choice].append(tokens[k])
                lps[choice] = lp
        for gen, ids, lps in out.values():
            gen.generated += 1
            gen._events.put(("ids", ids, lps if gen.params.top_logprobs is not None else None))
        if self.on_step is not None and made:
            self.on_step(made)

    def _end(self, indices: list[int], tokens: list[int]) -> None:
        """Remove the rows of ``indices`` that ended with this token (committing their KV)."""
        eos = self.runner.eos
        ended = []
        for k, i in enumerate(indices):
            row = self.rows[i]
            gen = row.gen
            if (
                id(gen) in self.failed
                or tokens[k] in eos
                or self.made[i] >= gen.params.max_new_tokens
                or gen.row_stopped(row.row)
                or gen.client_gone()
            ):
                ended.append(i)
        self._remove(ended)

    def _retire_gone(self) -> None:
        """Rows whose request was cancelled or stopped between steps (client gone, stop string,
        shutdown) leave now: they cost no more than the step under way."""
        self._remove(
            [
                i
                for i, r in enumerate(self.rows)
                if r is not None
                and (id(r.gen) in self.failed or r.gen.cancelled.is_set() or r.gen.row_stopped(r.row))
            ]
        )

    def _remove(self, ended: list[int]) -> None:
        if not ended:
            return
        gone = set(ended)
        for i in ended:
            row = self.rows[i]
            row.gen.row_done[row.row] = True
        self.batch.remove(ended, commit=True)
        leaving = {id(self.rows[i].gen): self.rows[i].gen for i in ended}
        for i in gone:
            self.rows[i], self.made[i] = None, 0
        self._compact()
        self.sampler = None  # rebuilt over the new layout at the next step
        still = {id(r.gen) for r in self.rows if r is not None}
        for key, gen in leaving.items():
            if key not in still:
                self._close(gen)
                self.failed.discard(key)
        self.scheduler.set_running(self._gens())

    def _fail(self, gen: Generation, exc: Exception) -> None:
        """A row's hook raised: its request ends with that error; the other rows go on."""
        log.warning("a row's hook failed; its request ends with the error: %r", exc)
        if id(gen) not in self.failed:
            self.failed.add(id(gen))
            self._close(gen, ("error", exc))

    @staticmethod
    def _close(gen: Generation, event: tuple | None = None) -> None:
        if gen.finished.is_set():
            return
        gen._events.put(event or ("done", gen.cached or 0))
        gen.finished.set()
