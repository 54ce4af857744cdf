"""Batched generation: the requests the scheduler hands out run as rows of one generate() call.

    key = batch_key(gen)                  # None: the request runs alone (images)
    paused = run_batch(runner, gens, pause)

Which requests share a batch (`batch_key`): the same adapter batch group (demo.model.adapters:
the base and plain LoRA adapters mix through PEFT's adapter_names) and equal cache_prompt (a
RadixCache reads and writes every row, or none). Everything else about a request is its rows'
own: sampling (greedy or temperature/top_p/top_k/min_p, seed), penalties, logit_bias, logprobs
(demo.engine.sampling.RowSampler), prompt (left-padded to the longest), max_tokens, stop
strings, EOS, n (n sampled choices are n rows), its client, and its cache namespace (tenant,
cache_salt): the RadixCache takes one namespace per row, so tenants share a batch but never a
prefix (only the operator's pinned task prompts, through a SharedPrefix), and its images: a
VLM request's inputs beside the ids (pixel_values, grids, token types) are merged with the other
rows' as the family's processor would batch them (`image_inputs`, demo.model.vision_batch); a
family without a merge rule runs each image request alone, never paused.

Rows finish on their own: `RowStop` (a StoppingCriteria returning one bool per row) stops a
row at its max_tokens, its EOS, its stop string or its client's hang-up; generate() then
feeds that row pad tokens, which `RowStreamer` does not forward, and the request is told it is
done once all its rows are, while the others go on. generate()'s max_new_tokens is the batch's
largest. A row paused by ``pause(generated)`` keeps its reply in its context and resumes in a
later batch from its committed KV (demo.engine.scheduler). Reuse per row: the cache preloads
the common column count min_i(pad_i + match_i) (hf_patch.request), and rows that match less get
their own prefix computed alone first (hf_patch.batch_share, which also computes the prompt of
n sampled choices once), so a row's `cached_tokens` is what its own namespace held.
"""

from __future__ import annotations

import logging
import threading

import torch
from transformers.generation.logits_process import LogitsProcessor
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from demo.engine.generation import Generation, Params
from demo.engine.sampling import Row, RowSampler
from demo.model import vision, vision_batch

log = logging.getLogger(__name__)


def batch_key(gen: Generation) -> tuple | None:
    """Requests with equal keys can be rows of one generate() call; None: run alone (image
    inputs whose family has no merge rule: `Generation.alone`, set by the engine at submit)."""
    if gen.alone:
        return None
    return (gen.batch_group, gen.params.cache_prompt)


def chunkable(gen: Generation) -> bool:
    """Whether the request may pause between decode chunks and resume in a re-formed batch
    (with cache_prompt=false it recomputes its context on resume)."""
    return batch_key(gen) is not None


class Rows:
    """The batch's rows (``rows[i]``: a `Row`, input row i) and which are still generating."""

    def __init__(
        self, rows: list[Row], width: int, eos: set[int], cache, pause=None, placeholders=frozenset()
    ):
        self.rows, self.width, self.eos, self.cache = rows, width, eos, cache
        # A row whose reply holds one of these ids (an image placeholder) is not paused: resumed,
        # its context would count as an image's token without pixels (demo.model.vision_batch).
        self.placeholders = placeholders
        self.gens: list[Generation] = list(dict.fromkeys(r.gen for r in rows))  # in row order
        self.of_gen = {id(g): [i for i, r in enumerate(rows) if r.gen is g] for g in self.gens}
        self.pause = pause  # pause(generated) -> True: every open row pauses at this step
        self.open_gen = {id(g): True for g in self.gens}  # the request not yet told it is done
        self.paused = [False] * len(rows)  # stopped for now, to resume in a later batch
        self.settled = [False] * len(rows)  # ended and every token up to its end forwarded
        self.new_ids: list[list[int]] = [[] for _ in rows]  # this call's forwarded tokens
        # Per row: tokens forwarded, and the sequence length at which RowStop ended it. Which
        # of put() and the stopping criteria comes first in a step differs between
        # transformers releases (5.23: criteria first), so a row is closed once both agree.
        self.sent = [0] * len(rows)
        self.ended: list[int | None] = [None] * len(rows)
        self._lock = threading.Lock()  # close() from the worker, close_all() after an error

    def cached(self, gen: Generation) -> int:
        """What ``gen``'s prompt read from the store: in its first chunk (later chunks read the
        request's own reply back, which is no prompt reuse)."""
        if gen.cached is not None:
            return gen.cached
        i = self.of_gen[id(gen)][0]
        return self.cache.cached_tokens[i] if self.cache is not None and self.cache.cached_tokens else 0

    def close(self, gen: Generation, event: tuple | None = None) -> None:
        """``gen`` is done: tell it (once), with its cached-token count."""
        with self._lock:
            if not self.open_gen[id(gen)]:
                return
            self.open_gen[id(gen)] = False
        gen._events.put(event or ("done", self.cached(gen)))
        gen.finished.set()

    def wants(self, i: int) -> bool:
        """Row i's next token is part of its reply."""
        return (
            self.open_gen[id(self.rows[i].gen)]
            and not self.settled[i]
            and (self.ended[i] is None or self.width + self.sent[i] < self.ended[i])
        )

    def closed(self, i: int) -> bool:
        """Row i makes no more tokens of its reply in this call (RowSampler skips it)."""
        return self.ended[i] is not None or not self.open_gen[id(self.rows[i].gen)]

    def settle(self, i: int) -> None:
        """Row i has ended and every token up to its end was forwarded: a row that ended for
        good is done; its request is told once all its rows here are settled and none paused
        (a lone request is answered after its commit, at the end of the call, as before)."""
        if self.ended[i] is None or self.width + self.sent[i] < self.ended[i] or self.settled[i]:
            return
        self.settled[i] = True
        row = self.rows[i]
        if not self.paused[i]:
            row.gen.row_done[row.row] = True
        mine = self.of_gen[id(row.gen)]
        if len(self.gens) > 1 and all(self.settled[j] and not self.paused[j] for j in mine):
            self.close(row.gen)

    def fail(self, i: int, exc: Exception, length: int) -> None:
        """Row i's request failed on its own (its hook raised): it gets the error, its rows end
        at ``length`` (fed padding from then on), the other requests go on."""
        log.warning("a row's hook failed; its request ends with the error: %r", exc)
        gen = self.rows[i].gen
        for j in self.of_gen[id(gen)]:
            if self.ended[j] is None:
                self.ended[j] = length
        self.close(gen, ("error", exc))

    def close_all(self, event: tuple | None = None) -> None:
        for g in self.gens:
            self.close(g, event)


class RowStreamer(BaseStreamer):
    """Sends each request its rows' tokens of every step (and their logprobs), one event per
    request and step; the first put() is the padded prompt; later ones are [rows] or [rows, 1]."""

    def __init__(self, rows: Rows, sampler: RowSampler, on_step=None):
        self.rows, self.sampler, self.seen_prompt = rows, sampler, False
        self.on_step = on_step  # on_step(rows that made a token): the rows-per-step metric

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        rows = self.rows
        tokens = value.reshape(len(rows.rows), -1)[:, -1]
        recorder = self.sampler.recorder
        logprobs = recorder.take(tokens, self.sampler.tops) if recorder is not None else None
        out: dict[int, tuple[list, list]] = {}
        for i, (row, token) in enumerate(zip(rows.rows, tokens.tolist())):
            if not rows.wants(i):
                continue
            rows.sent[i] += 1
            rows.new_ids[i].append(token)
            gen = row.gen
            ids, lps = out.setdefault(id(gen), ([[] for _ in range(gen.params.n)], [None] * gen.params.n))
            lp = logprobs[i] if logprobs is not None else None
            # a greedy row stands for all n (equal) choices
            for choice in [row.row] if gen.params.rows == gen.params.n else range(gen.params.n):
                ids[choice].append(token)
                lps[choice] = lp
        for gen in rows.gens:
            if id(gen) in out:
                ids, lps = out[id(gen)]
                gen.generated += 1
                gen._events.put(("ids", ids, lps if gen.params.top_logprobs is not None else None))
        for i in range(len(rows.rows)):  # after the tokens: a request told it is done has them all
            rows.settle(i)
        if self.on_step is not None and out:
            self.on_step(sum(len(rows.of_gen[k]) for k in out))

    def end(self) -> None:
        pass


class RowStop(StoppingCriteria):
    """Per row: True once the row reached its max_tokens, emitted EOS, hit its stop string
    or lost its client (asked here, between steps: a gone client's row costs a step or two,
    not the request thread's next poll), or pauses (unless its reply holds a placeholder id:
    it then runs on to its end). Closing a row here tells its request it is done right away."""

    def __init__(self, rows: Rows):
        self.rows = rows

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.BoolTensor:
        rows, length = self.rows, input_ids.shape[1]
        generated = length - rows.width
        last = input_ids[:, -1].tolist()
        pause = rows.pause is not None and generated > 0 and rows.pause(generated)
        for i, row in enumerate(rows.rows):
            if rows.ended[i] is not None:
                continue
            gen = row.gen
            if (
                gen.client_gone()  # cancelled, or its client left: the worker looks itself
                or gen.row_stopped(row.row)
                or gen.replied(row.row) + generated >= gen.params.max_new_tokens
                or (generated > 0 and last[i] in rows.eos)
            ):
                rows.ended[i] = length
                rows.settle(i)
            elif pause and (
                not rows.placeholders or rows.placeholders.isdisjoint(input_ids[i, rows.width :].tolist())
            ):
                rows.ended[i], rows.paused[i] = length, True
                rows.settle(i)
        return torch.tensor([e is not None for e in rows.ended], dtype=torch.bool, device=input_ids.device)


class _Started(LogitsProcessor):
    """``done`` once generate() has its first logits (before any row draws or streams a token)."""

    def __init__(self):
        self.done = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.done = True
        return scores


def layout(gens: list[Generation]) -> tuple[list[Row], int]:
    """The batch's rows (each request's open rows, in order) and the padded width."""
    width = max(g.width for g in gens)
    rows = [Row(g, r, width - len(g.contexts[r])) for g in gens for r in g.open_rows]
    return rows, width


def padded_inputs(rows: list[Row], width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both ``[len(rows), width]`` int64 on the CPU: each row's context
    (its prompt, then what it generated before) left-padded with ``pad_id`` from ``row.start``."""
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, row.start :] = torch.tensor(row.gen.contexts[row.row])
        mask[i, row.start :] = 1
    return ids, mask


def image_inputs(rule, rows: list[Row], width: int) -> dict:
    """The batch's model inputs beside the ids: each row's request's image inputs (a resumed
    row's context is its prompt and reply so far; n sampled rows each carry the request's
    images) merged by the family's ``rule`` (demo.model.vision_batch); {} for a text batch.
    The prefix cache drops the items it serves (hf_patch), so a resumed row's images cost no
    vision forward when their KV is in the store."""
    if not any(r.gen.inputs for r in rows):
        return {}
    merged = [
        vision_batch.RowInputs(r.gen.inputs, len(r.gen.prompt_ids), len(r.gen.contexts[r.row])) for r in rows
    ]
    if rule is None:  # the scheduler keeps such requests alone: one row
        if len(rows) != 1 or merged[0].context_len != merged[0].prompt_len:
            raise ValueError("image inputs without a batch rule must run alone and unpaused")
        return dict(rows[0].gen.inputs)
    return vision_batch.merge(rule, merged, width)


def run_batch(runner, gens: list[Generation], pause=None, on_step=None) -> list[Generation]:
    """One left-padded generate() for ``gens`` (one batch_key) over each open row's context (its
    prompt, then what earlier chunks generated), with the rows' image inputs merged
    (`image_inputs`). Every request gets its ("done", cached) or ("error", exc) event, except
    those paused by ``pause(generated)`` (see Rows), which are returned to be queued again: they
    resume from their committed KV. ``on_step(rows)`` is called once per decoding step. Never
    raises for a generation failure; a batch holding images that fails before its first token
    runs its requests one by one instead, so a request whose images its model refuses fails
    alone."""
    rows, width = layout(gens)
    remaining = max(g.params.max_new_tokens - min(g.replied(r) for r in g.open_rows) for g in gens)
    config = runner.config(Params(remaining, temperature=0.0))
    ids, mask = padded_inputs(rows, width, config.pad_token_id)
    cache = runner.cache(gens, [r.gen for r in rows])
    state = Rows(rows, width, runner.eos, cache, pause, runner.placeholders)
    sampler = RowSampler(rows, state.closed, state.fail)
    started = _Started()
    try:
        inputs = image_inputs(runner.image_rule, rows, width)
        runner.generate(
            [r.gen for r in rows],
            ids.to(runner.model.device),
            attention_mask=mask.to(runner.model.device),
            past_key_values=cache,
            generation_config=config,
            logits_processor=[started, sampler],
            streamer=RowStreamer(state, sampler, on_step),
            stopping_criteria=StoppingCriteriaList([RowStop(state)]),
            **vision.on_model(inputs, runner.model),
        )
    except Exception as e:  # report to every request still waiting; the worker keeps serving
        if not started.done and len(state.gens) > 1 and any(g.inputs for g in state.gens):
            # Nothing was drawn, streamed or stored yet: one request's images (inputs its
            # model refuses) must not fail the others, so each runs alone and only its own fails.
            log.warning("a batch holding images failed before its first token (%r): its %d "
                        "requests run one by one", e, len(state.gens))  # fmt: skip
            return [p for g in state.gens for p in run_batch(runner, [g], pause, on_step)]
        log.exception("batched generate failed")
        state.close_all(("error", e))
        return []
    paused = []
    for g in state.gens:
        mine = state.of_gen[id(g)]
        if any(state.paused[i] for i in mine) and not g.cancelled.is_set():
            g.cached = state.cached(g)
            for i in mine:
                if state.paused[i]:
                    r = rows[i].row
                    g.contexts[r] = g.contexts[r] + state.new_ids[i]
            state.open_gen[id(g)] = False  # not done: it resumes in a later batch
            paused.append(g)
    state.close_all()
    return paused
