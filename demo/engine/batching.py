"""Batched generation: queued requests that can share a generate() call run as its rows.

    key = batch_key(gen)                  # None: the request runs alone
    run_batch(runner, gens)               # gens: >= 2 requests with one key

Which requests share a batch (`batch_key`): n == 1, no seed (a seed must own the global RNG
for its whole generation), no model inputs beside the ids (images), the same adapter batch
group (demo.model.adapters: the base and plain LoRA adapters mix through PEFT's adapter_names), equal
cache_prompt, equal sampling (greedy, or the same temperature and top_p), penalties,
logit_bias and logprobs setting: generate() applies its warpers and our processors to every
row alike. Everything else about a row is its own: prompt (left-padded to the longest),
max_tokens, stop strings, EOS, its client, and its cache namespace (tenant, cache_salt): the
RadixCache takes one namespace per row, so tenants share a batch but never a prefix (only the
operator's pinned task prompts, through a SharedPrefix).

Rows finish on their own: `RowStop` (a StoppingCriteria returning one bool per row) stops a
row at its max_tokens, its EOS, its stop string or its client's hang-up; generate() then
feeds that row pad tokens, which `RowStreamer` does not forward, and the row's request is
told it is done at once, while the others go on. generate()'s max_new_tokens is the batch's
largest. Reuse per row: the cache preloads the common column count min_i(pad_i + match_i)
(hf_patch.request), and rows that match less get their own prefix computed alone first
(hf_patch.batch_share), so a row's `cached_tokens` is what its own namespace held, whatever
the other rows' tenants had cached.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from demo.engine import processors
from demo.engine.generation import Generation

log = logging.getLogger(__name__)


def batch_key(gen: Generation, greedy_below: float) -> tuple | None:
    """Requests with equal keys can be rows of one generate() call; None: run alone."""
    p = gen.params
    if p.n != 1 or p.seed is not None or gen.inputs:
        return None
    sampling = ("sample", p.temperature, p.top_p) if p.temperature >= greedy_below else ("greedy",)
    return (
        gen.batch_group,
        p.cache_prompt,
        sampling,
        p.frequency_penalty,
        p.presence_penalty,
        p.logit_bias,
        p.top_logprobs,
    )


def chunkable(gen: Generation, greedy_below: float) -> bool:
    """Whether the request may pause between decode chunks and resume in a re-formed batch:
    batchable, on the prefix cache (it resumes from its own committed KV), no penalties (they
    count the reply from the prompt's end, which a resumed context moves)."""
    p = gen.params
    return (
        batch_key(gen, greedy_below) is not None
        and p.cache_prompt
        and not (p.frequency_penalty or p.presence_penalty)
    )


class Rows:
    """The batch's requests and which of them are still generating. Row i = gens[i]."""

    def __init__(self, gens: list[Generation], width: int, eos: set[int], cache, pause=None):
        self.gens, self.width, self.eos, self.cache = gens, width, eos, cache
        self.pause = pause  # pause(generated) -> True: every open row pauses at this step
        self.open = [True] * len(gens)
        self.paused = [False] * len(gens)  # stopped for now, to resume in a later batch
        self.before = [g.replied for g in gens]  # reply tokens of earlier chunks
        self.new_ids: list[list[int]] = [[] for _ in gens]  # this call's forwarded tokens
        # Per row: tokens forwarded, and the sequence length at which RowStop ended it. Which
        # of put() and the stopping criteria comes first in a step differs between
        # transformers releases (5.23: criteria first), so a row is closed once both agree.
        self.sent = [0] * len(gens)
        self.ended: list[int | None] = [None] * len(gens)
        self._lock = threading.Lock()  # close() from the worker, close_all() after an error

    def cached(self, i: int) -> int:
        """What row i's prompt read from the store: in its first chunk (later chunks read the
        request's own reply back, which is no prompt reuse)."""
        if self.gens[i].cached is not None:
            return self.gens[i].cached
        return self.cache.cached_tokens[i] if self.cache is not None and self.cache.cached_tokens else 0

    def close(self, i: int, event: tuple | None = None) -> None:
        """Row i's request is done: tell it (once), with its cached-token count."""
        with self._lock:
            if not self.open[i]:
                return
            self.open[i] = False
        gen = self.gens[i]
        gen._events.put(event or ("done", self.cached(i)))
        gen.finished.set()

    def wants(self, i: int) -> bool:
        """Row i's next token is part of its reply."""
        return self.open[i] and (self.ended[i] is None or self.width + self.sent[i] < self.ended[i])

    def settle(self, i: int) -> None:
        """Close row i once it has ended and every token up to its end was forwarded (a paused
        row stops forwarding; its request stays open)."""
        if self.ended[i] is not None and self.width + self.sent[i] >= self.ended[i]:
            if self.paused[i]:
                with self._lock:
                    self.open[i] = False
            elif len(self.gens) > 1:  # a lone request is answered after its commit, as before
                self.close(i)

    def close_all(self, event: tuple | None = None) -> None:
        for i in range(len(self.gens)):
            self.close(i, event)


class RowStreamer(BaseStreamer):
    """Sends each open row its token of every step (and its logprobs); the first put() is the
    padded prompt [rows, width]; later ones are [rows] or [rows, 1]."""

    def __init__(self, rows: Rows, recorder: processors.LogprobRecorder | None):
        self.rows, self.recorder, self.seen_prompt = rows, recorder, False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        tokens = value.reshape(len(self.rows.gens), -1)[:, -1]
        logprobs = self.recorder.take(tokens) if self.recorder is not None else None
        for i, (gen, token) in enumerate(zip(self.rows.gens, tokens.tolist())):
            if self.rows.wants(i):
                self.rows.sent[i] += 1
                self.rows.new_ids[i].append(token)
                gen.generated += 1
                gen._events.put(("ids", [[token]], [logprobs[i]] if logprobs is not None else None))
            self.rows.settle(i)

    def end(self) -> None:
        pass


class RowStop(StoppingCriteria):
    """Per row: True once the row reached its max_tokens, emitted EOS, hit its stop string
    or lost its client. Closing a row here tells its request it is done right away."""

    def __init__(self, rows: Rows):
        self.rows = rows

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.BoolTensor:
        rows, length = self.rows, input_ids.shape[1]
        generated = length - rows.width
        last = input_ids[:, -1].tolist()
        pause = rows.pause is not None and generated > 0 and rows.pause(generated)
        for i, gen in enumerate(rows.gens):
            if rows.ended[i] is not None:
                continue
            if (
                gen.cancelled.is_set()
                or gen.stopped[0]
                or rows.before[i] + generated >= gen.params.max_new_tokens
                or (generated > 0 and last[i] in rows.eos)
            ):
                rows.ended[i] = length
                rows.settle(i)
            elif pause:
                rows.ended[i], rows.paused[i] = length, True
                rows.settle(i)
        return torch.tensor([e is not None for e in rows.ended], dtype=torch.bool, device=input_ids.device)


def run_batch(runner, gens: list[Generation], pause=None) -> list[Generation]:
    """One left-padded generate() for `gens` (all with one batch_key) over each request's
    context (its prompt, then what earlier chunks generated). Every request gets its ("done",
    cached) or ("error", exc) event, except those paused by ``pause(generated)`` (see Rows),
    which are returned to be queued again: they resume from their committed KV. Never raises
    for a generation failure."""
    width = max(len(g.context_ids) for g in gens)
    first = gens[0].params
    remaining = max(g.params.max_new_tokens - g.replied for g in gens)
    config = runner.config(dataclasses.replace(first, max_new_tokens=remaining))
    ids = torch.full((len(gens), width), config.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(gens), width), dtype=torch.long)
    for i, g in enumerate(gens):
        ids[i, width - len(g.context_ids) :] = torch.tensor(g.context_ids)
        mask[i, width - len(g.context_ids) :] = 1
    cache = runner.cache(gens)
    rows = Rows(gens, width, runner.eos, cache, pause)
    try:
        logits_processor, recorder = processors.build(
            width,
            first.frequency_penalty,
            first.presence_penalty,
            dict(first.logit_bias),
            first.top_logprobs,
            runner.grammar_rows(gens, width),  # per row: requests with and without a grammar mix
        )
        runner.generate(
            gens,
            ids.to(runner.model.device),
            attention_mask=mask.to(runner.model.device),
            past_key_values=cache,
            generation_config=config,
            logits_processor=logits_processor,
            streamer=RowStreamer(rows, recorder),
            stopping_criteria=StoppingCriteriaList([RowStop(rows)]),
        )
    except Exception as e:  # report to every row still waiting; the worker keeps serving
        log.exception("batched generate failed")
        for i in range(len(gens)):
            if rows.paused[i]:  # reopened so that they hear of the error too
                rows.paused[i], rows.open[i] = False, True
        rows.close_all(("error", e))
        return []
    paused = []
    for i, g in enumerate(gens):
        if rows.paused[i]:
            g.cached = rows.cached(i)
            g.context_ids = g.context_ids + rows.new_ids[i]
            paused.append(g)
    rows.close_all()
    return paused
