"""OpenAI's sampling options as transformers logits processors, and a recorder of logprobs.

generate() runs its own processors first (suppress_tokens, repetition_penalty, ...), then the
ones passed in `logits_processor` (these, in list order), then the sampling warpers
(temperature, top_p). So `LogprobRecorder`, placed last in our list, sees the distribution
after penalties and logit_bias but before temperature and top_p: the model's distribution as
the request reshaped it, the same for a greedy and a sampled request.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList

# OpenAI reports -9999.0 for a token the distribution excludes; -inf is not valid JSON.
MIN_LOGPROB = -9999.0


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's additive penalties over the tokens generated so far (never the prompt's):

        logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty

    input_ids: [rows, prompt_length + t]; scores: [rows, vocab] -> new scores, same shape.
    """

    def __init__(self, prompt_length: int, frequency: float, presence: float):
        self.prompt_length, self.frequency, self.presence = prompt_length, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_length :]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones_like(generated, dtype=scores.dtype)
        )
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: add bias[token] to that token's logit on every step.

    `bias`: {token id: value in [-100, 100]}, ids already checked against the vocabulary."""

    def __init__(self, bias: dict[int, float]):
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        ids, values = self.ids.to(scores.device), self.values.to(scores.device, scores.dtype)
        return scores.index_add(1, ids, values.expand(scores.shape[0], -1))


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token of one row: its logprob and the `top` most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def _finite(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


class LogprobRecorder(LogitsProcessor):
    """Records log_softmax(scores) each step; `take(tokens)` pairs the oldest record with the
    tokens generate() chose from it (the streamer's put). A FIFO, not a single slot: a
    deferred stop check (transformers on mps) streams tokens one step late.

    Leaves the scores unchanged. Holds at most a couple of [rows, vocab] float tensors.
    """

    def __init__(self, top: int):
        self.top = top
        self._steps: deque[torch.Tensor] = deque()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._steps.append(torch.log_softmax(scores.float(), dim=-1))
        return scores

    def take(self, tokens: torch.Tensor) -> list[TokenLogprobs]:
        """tokens: [rows] chosen ids -> one TokenLogprobs per row (CPU floats)."""
        logprobs = self._steps.popleft()
        tokens = tokens.to(logprobs.device).reshape(-1, 1)
        chosen = logprobs.gather(1, tokens).squeeze(1).tolist()
        if self.top:
            values, ids = logprobs.topk(min(self.top, logprobs.shape[1]), dim=-1)
            values, ids = values.tolist(), ids.tolist()
        else:
            values = ids = [[] for _ in chosen]
        return [
            TokenLogprobs(t, _finite(c), tuple((i, _finite(v)) for i, v in zip(row_ids, row_values)))
            for t, c, row_ids, row_values in zip(tokens.reshape(-1).tolist(), chosen, ids, values)
        ]


def build(
    prompt_length: int,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    logit_bias: dict[int, float] | None = None,
    top_logprobs: int | None = None,
    grammar: LogitsProcessor | None = None,
) -> tuple[LogitsProcessorList, LogprobRecorder | None]:
    """The processors a request needs (none for the defaults) and its recorder (None unless
    logprobs were asked for; top_logprobs=0 records the chosen token's logprob only).
    ``grammar``: demo.engine.constrained.GrammarRows, after penalties and bias (its -inf stay
    -inf) and before the recorder (logprobs are of the distribution the grammar allowed)."""
    out = LogitsProcessorList()
    if frequency_penalty or presence_penalty:
        out.append(OpenAIPenalties(prompt_length, frequency_penalty, presence_penalty))
    if logit_bias:
        out.append(LogitBias(logit_bias))
    if grammar is not None:
        out.append(grammar)
    recorder = None
    if top_logprobs is not None:
        recorder = LogprobRecorder(top_logprobs)
        out.append(recorder)
    return out, recorder
