"""Each row of a batch with its own sampling options, inside one stock generate() call.

    sampler = RowSampler(rows)          # rows: the batch's Row records, row i = input row i
    model.generate(..., do_sample=False, logits_processor=[sampler])

generate() runs greedy; `RowSampler`, its last logits processor, gives every row what the
request alone would get:

1. the row's own transforms, over the row's own tokens (its prompt and reply, never another
   row's padding): repetition_penalty, frequency/presence penalties (tokens after its prompt),
   logit_bias, then the row's hook (`RowHook`, e.g. a grammar's mask);
2. logprobs (rows that asked): log_softmax of that, before temperature (demo.engine.processors);
3. a sampled row: temperature, top_k, top_p, min_p (transformers' own warpers, in generate()'s
   order), softmax, then one draw from the request's own generator; the draw is *forced*: every
   other logit becomes -inf, so generate()'s argmax picks it. A greedy row is left as is.

The draw is torch.multinomial's own (for one sample: argmax(probs / q), q ~ Exp(1) filled
over [n, vocab] for the request's n choices at once), so a seeded request draws exactly what
stock sampled generate() after torch.manual_seed(seed) draws, whatever shares its batch, and
across pauses: the generator lives on the request (demo.engine.generation.Generation.rng).
Rows of the request that ended still consume their share of each draw, as in stock generate().

Cost: per step a few [1, vocab] operations per row with options; rows with none are skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from demo.engine.generation import Generation
from demo.engine.processors import LogitBias, LogprobRecorder, OpenAIPenalties

__all__ = ["Row", "RowHook", "RowSampler", "generator"]


class RowHook(Protocol):
    """A per-row logits processor a request carries (``Generation.hooks[row]``, one object per
    row: e.g. a grammar matcher of constrained decoding). Called once per step of that row,
    after the penalties and logit_bias, before logprobs and sampling:

        scores = hook(ids, scores)   # ids: [t] int64, the row's own tokens (prompt + reply so
                                     # far, no padding, across pauses); scores: [vocab] float32

    It returns the new scores (may be the same tensor, changed in place). It lives on the
    request, so its state survives a pause; the tokens it has not seen yet are ids[len seen:]
    (a hook that keeps state advances by those). It must not keep ``scores``. If it raises, its
    request ends with that error; the other rows of the batch go on."""

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Row:
    """Input row i of a batch: ``gen``'s row ``row``, whose own tokens start at column
    ``start`` of the padded input (its context is columns start .. width-1)."""

    gen: Generation
    row: int
    start: int


def generator(gen: Generation, device) -> torch.Generator:
    """The request's generator on ``device``: seeded from its seed (int64 onto torch's uint64
    one to one; torch's own mapping of negatives sends -2**63 onto 2**63 - 1), else from the
    OS. Created once, then carried across pauses."""
    if gen.rng is None:
        rng = torch.Generator(device=device)
        if gen.params.seed is None:
            rng.seed()
        else:
            rng.manual_seed(gen.params.seed % 2**64)
        gen.rng = rng
    return gen.rng


class _Transforms:
    """One row's own transforms (step 1), built once per batch."""

    def __init__(self, row: Row):
        gen, p = row.gen, row.gen.params
        self.repetition = (
            RepetitionPenaltyLogitsProcessor(p.repetition_penalty) if p.repetition_penalty != 1.0 else None
        )
        self.openai = (
            OpenAIPenalties(len(gen.prompt_ids), p.frequency_penalty, p.presence_penalty)
            if p.frequency_penalty or p.presence_penalty
            else None
        )
        self.bias = LogitBias(dict(p.logit_bias)) if p.logit_bias else None
        self.hook = gen.hooks[row.row]

    def __bool__(self) -> bool:
        return any(x is not None for x in (self.repetition, self.openai, self.bias, self.hook))

    def __call__(self, own: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """own: [1, t] the row's tokens; scores: [1, vocab] -> [1, vocab]."""
        if self.repetition is not None:
            scores = self.repetition(own, scores)
        if self.openai is not None:
            scores = self.openai(own, scores)
        if self.bias is not None:
            scores = self.bias(own, scores)
        if self.hook is not None:
            scores = self.hook(own[0], scores[0]).reshape(1, -1)
        return scores


def _warpers(p) -> list[LogitsProcessor]:
    """A sampled row's warpers, as generate() builds them for its options (same order)."""
    out: list[LogitsProcessor] = []
    if p.temperature != 1.0:
        out.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k > 0:
        out.append(TopKLogitsWarper(top_k=p.top_k))
    if p.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=p.top_p))
    if p.min_p > 0.0:
        out.append(MinPLogitsWarper(min_p=p.min_p))
    return out


class RowSampler(LogitsProcessor):
    """Per-row options and sampling for one generate() call over ``rows`` (see the module).

    input_ids: [B, L] (B = len(rows)); scores: [B, vocab] float -> [B, vocab]. `recorder`
    (None when no row asked for logprobs) holds each step's log-probabilities for the streamer.
    Rows whose ``closed(i)`` is True (ended, fed padding) are skipped."""

    def __init__(self, rows: list[Row], closed=lambda i: False, fail=None):
        self.rows, self.closed = rows, closed
        # fail(i, exc, length): row i's hook raised; its request ends with that error, alone
        # (None: the error propagates and fails the whole call).
        self.fail = fail
        self.transforms = [_Transforms(r) for r in rows]
        self.warpers = [_warpers(r.gen.params) if r.gen.params.sampled else None for r in rows]
        tops = [r.gen.params.top_logprobs for r in rows]
        self.tops = tops
        wanted = [k for k in tops if k is not None]
        self.recorder = LogprobRecorder(max(wanted)) if wanted else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if any(self.transforms):
            scores = scores.clone()
            for i, (row, transform) in enumerate(zip(self.rows, self.transforms)):
                if transform and not self.closed(i):
                    try:
                        scores[i] = transform(input_ids[i : i + 1, row.start :], scores[i : i + 1])[0]
                    except Exception as e:
                        if self.fail is None:
                            raise
                        self.fail(i, e, input_ids.shape[1])
        if self.recorder is not None:
            self.recorder(input_ids, scores)
        if not any(w is not None for w in self.warpers):
            return scores
        out = scores.clone()
        draws: dict[int, torch.Tensor] = {}  # id(gen) -> [n, vocab] Exp(1) of this step
        for i, (row, warpers) in enumerate(zip(self.rows, self.warpers)):
            if warpers is None:
                continue
            gen = row.gen
            q = draws.get(id(gen))
            if q is None:  # one draw per request and step, over all its n rows (as stock)
                shape = (gen.params.n, scores.shape[1])
                q = torch.empty(shape, dtype=scores.dtype, device=scores.device)
                q.exponential_(1, generator=generator(gen, scores.device))
                draws[id(gen)] = q
            if self.closed(i):
                continue
            x = scores[i : i + 1]
            for warp in warpers:
                x = warp(input_ids[i : i + 1], x)
            probs = torch.softmax(x, dim=-1)
            token = int((probs[0] / q[row.row]).argmax())
            out[i] = -math.inf
            out[i, token] = 0.0
        return out
