"""OpenAI's sampling options as transformers logits processors, and a recorder of logprobs.

demo.engine.sampling.RowSampler applies these to each row of a batch on its own (a row's own
tokens, its own options); `LogprobRecorder` records after the penalties and logit_bias but
before temperature and top_p: the model's distribution as the request reshaped it, the same
for a greedy and a sampled request.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import LogitsProcessor

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

    def take(self, tokens: torch.Tensor, tops=None) -> list[TokenLogprobs | None]:
        """tokens: [rows] chosen ids -> one TokenLogprobs per row (CPU floats). ``tops``: per
        row, how many alternatives it asked for (at most `top`), None for a row that asked for
        no logprobs (its entry is None); default: `top` for every row."""
        logprobs = self._steps.popleft()
        tokens = tokens.to(logprobs.device).reshape(-1, 1)
        chosen = logprobs.gather(1, tokens).squeeze(1).tolist()
        tops = [self.top] * len(chosen) if tops is None else tops
        if self.top:
            values, ids = logprobs.topk(min(self.top, logprobs.shape[1]), dim=-1)
            values, ids = values.tolist(), ids.tolist()
        else:
            values = ids = [[] for _ in chosen]
        return [
            None
            if k is None
            else TokenLogprobs(
                t, _finite(c), tuple((i, _finite(v)) for i, v in zip(row_ids[:k], row_values[:k]))
            )
            for t, c, row_ids, row_values, k in zip(tokens.reshape(-1).tolist(), chosen, ids, values, tops)
        ]
