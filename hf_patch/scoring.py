"""Scoring with prefix reuse: continuation log-likelihoods, the forward-only twin of generate().

    scores = hf_patch.score(model, [(context_ids, continuation_ids), ...], store=store)
    scores[i].logprob, scores[i].is_greedy, scores[i].token_logprobs, scores[i].cached_tokens
    totals = hf_patch.score_rolling(model, [token_ids, ...], prefix_token=bos, max_length=2048)

A pair's model input is ``(context + continuation)[:-1]``, left-truncated to ``max_length``
tokens (as lm-eval's HFLM does); the logits of its last ``len(continuation)`` positions score
the continuation. Only those positions must go through the model: the rest of the input (a
few-shot preamble, the question) is read from the store where it is cached, and computed and
committed where it is not, so the next question's preamble hits. Everything generate() does
for a prompt happens here too, through the same functions (hf_patch.call): the same store,
row keys (namespace, PEFT adapter), in-batch sharing (rows of a batch that share an uncached
prefix compute it once) and store counters. Pairs with the same input (one-token answers to
one question) are computed once.

fp32 results equal an uncached forward of the same input to float rounding (~1e-6 per token):
the cached KV was computed for the same tokens at the same positions.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hf_patch.cache import RadixCache
from hf_patch.call import key_parts, open_request, sharing
from hf_patch.keys.adapters import unwrap_peft
from hf_patch.model_spec import accepts
from hf_patch.planning.batches import plan_batches
from hf_patch.stores import default_store
from radixkv import KVStore, PackedTokens, pack_tokens

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Score:
    """One (context, continuation) pair's result.

    ``logprob``: the sum of ``token_logprobs``, the continuation tokens' log-probabilities;
    ``is_greedy``: every continuation token is the argmax at its position; ``cached_tokens``: the
    input tokens read from the store (shared by the pairs computed from one input).
    """

    logprob: float
    is_greedy: bool
    token_logprobs: tuple[float, ...]
    cached_tokens: int


@dataclass
class _Row:
    """One distinct model input and the pairs scored from it (their continuations end it)."""

    ids: list[int]
    packed: PackedTokens
    keep: int = 0  # trailing positions whose logits are needed (the longest member continuation)
    members: list[int] = field(default_factory=list)


def _rows(pairs, max_length: int | None, dedupe: bool) -> tuple[list[_Row], list[list[int]]]:
    """Distinct inputs and every pair's continuation, validating the pairs (ValueError names one)."""
    rows: list[_Row] = []
    seen: dict[PackedTokens, int] = {}
    conts: list[list[int]] = []
    for i, pair in enumerate(pairs):
        try:
            context, continuation = pair
            if hasattr(context, "ndim") or hasattr(continuation, "ndim"):
                raise TypeError("got an array: pass ids.tolist()")
            context, continuation = list(context), list(continuation)
            pack_tokens(context + continuation)  # refuses non-int ids
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"pair {i}: expected (context ids, continuation ids) lists of ints: {exc}"
            ) from None
        if not context or not continuation:
            raise ValueError(f"pair {i}: the context and the continuation must each have a token")
        if max_length is not None and len(continuation) > max_length:
            raise ValueError(
                f"pair {i}: a {len(continuation)}-token continuation exceeds max_length={max_length}"
            )
        full = context + continuation
        ids = (full[-(max_length + 1) :] if max_length is not None else full)[:-1]
        key = pack_tokens(ids)
        r = seen.get(key) if dedupe else None
        if r is None:
            r = len(rows)
            rows.append(_Row(ids, key))
            if dedupe:
                seen[key] = r
        rows[r].keep = max(rows[r].keep, len(continuation))
        rows[r].members.append(i)
        conts.append(continuation)
    return rows, conts


def _cached_logits(model, request, cache: RadixCache, ids, mask, keep: list[int]) -> torch.Tensor:
    """Logits ``[B, max(keep), V]`` of the last columns of a left-padded batch, the reusable
    prefix of every row read from the store (and shared prefixes computed once), the rows
    committed afterwards."""
    width = ids.shape[1]
    if request.layout.stateful:  # each row from its own snapshot, its logits from its own forward
        request.preload(
            ids, mask, max_length=width, eos_token_ids=[], prompt_only=True,
            keys=key_parts(model, cache, ids.shape, 1), keep=keep, score=True,
        )  # fmt: skip
        request.commit(ids)
        k = max(keep)
        return torch.cat(
            [F.pad(lg, (0, 0, k - lg.shape[1], 0)) for lg in request.row_logits], dim=0
        )  # [B, k, V], rows' own logits right-aligned
    request.preload(
        ids, mask, max_length=width, eos_token_ids=[], prompt_only=True,
        keys=key_parts(model, cache, ids.shape, 1), share=sharing(model, request, {}), keep=keep,
    )  # fmt: skip
    start, k = request.common, max(keep)
    kwargs = {"logits_to_keep": k} if accepts(model, "logits_to_keep") else {}
    if accepts(model, "position_ids"):  # real token j sits at position j in every row (generate()'s rule)
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, start:]
    device = model.device
    out = model(
        input_ids=ids[:, start:].to(device),
        # generate() drops an all-ones mask too: no padding, the causal mask is the model's own.
        attention_mask=None if bool(mask.all()) else mask.to(device),
        past_key_values=cache,
        use_cache=True,
        **{name: v.to(device) if torch.is_tensor(v) else v for name, v in kwargs.items()},
    )
    request.commit(ids)
    return out.logits[:, -k:]


def _plain_logits(model, rows: list[_Row]) -> list[torch.Tensor]:
    """Each row's last ``keep`` logits from one right-padded forward without any cache (lm-eval
    HFLM's own computation): for calls whose KV the key cannot cover."""
    width = max(len(r.ids) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r.ids)] = torch.tensor(r.ids)
    logits = model(input_ids=ids.to(model.device)).logits
    extra = logits.shape[1] - width  # leading positions of virtual tokens (PEFT prompt learning)
    return [logits[i, extra + len(r.ids) - r.keep : extra + len(r.ids)] for i, r in enumerate(rows)]


def _score_batch(model, store, namespace, rows: list[_Row], conts, softmax_dtype, plain, out: list) -> None:
    """Score every member pair of ``rows`` (one batch) into ``out``; ``plain``: without the store."""
    width = max(len(r.ids) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r.ids) :] = torch.tensor(r.ids)
        mask[i, width - len(r.ids) :] = 1
    cache = RadixCache(store=store, namespace=namespace)
    with contextlib.nullcontext() if plain else open_request(model, cache) as request:
        if plain or request.uncacheable:
            per_row = _plain_logits(model, rows)
            cached = [0] * len(rows)
        else:
            logits = _cached_logits(model, request, cache, ids, mask, [r.keep for r in rows])
            per_row = [logits[i, logits.shape[1] - r.keep :] for i, r in enumerate(rows)]
            cached = cache.cached_tokens
    for r, row_logits, hit in zip(rows, per_row, cached):
        # Outside the caller's autocast (lm-eval's mixed_precision_dtype), as HFLM computes it:
        # CUDA autocast would run it in fp32 whatever the logits' dtype or softmax_dtype.
        with torch.autocast(device_type=row_logits.device.type, enabled=False):
            logprobs = F.log_softmax(row_logits, dim=-1, dtype=softmax_dtype)  # [keep, V]
        greedy = logprobs.argmax(dim=-1)
        for i in r.members:
            cont = torch.tensor(conts[i], device=logprobs.device)
            n = len(cont)
            token_lp = logprobs[-n:].gather(1, cont.unsqueeze(1)).squeeze(1)
            is_greedy = bool((greedy[-n:] == cont).all())
            out[i] = Score(float(token_lp.sum()), is_greedy, tuple(token_lp.tolist()), hit)


@torch.no_grad()
def score(
    model,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    store: KVStore | None = None,
    namespace: Hashable = None,
    batch_size: int = 8,
    max_length: int | None = None,
    max_batch_tokens: int | None = None,
    softmax_dtype: torch.dtype | None = None,
    dedupe: bool = True,
    progress: Callable[[int], None] | None = None,
) -> list[Score]:
    """Log-likelihood of each continuation given its context; results in input order.

    ``pairs``: ``(context ids, continuation ids)``, both non-empty lists of ints. ``store``:
    default, the model's own store; ``namespace``: one hashable for every pair (RadixCache's
    per-row list is refused: pairs are reordered and deduplicated into rows). Batches hold at most
    ``batch_size`` rows and ``max_batch_tokens`` padded tokens, inputs sorted by their token
    bytes (pairs sharing a preamble run together). ``max_length``: inputs longer than this are
    left-truncated (lm-eval's rule). ``softmax_dtype``: the dtype of the log-softmax (default
    the logits'). ``dedupe``: pairs with the same input share one row (lm-eval's
    ``logits_cache``). ``progress(n)``: called after each batch with the pairs it finished.

    Raises ValueError, scoring nothing, for a pair it cannot read. Side effects: forwards of
    ``model``; each input is committed to the store (with its in-batch shared prefixes).
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for name, value in (("max_length", max_length), ("max_batch_tokens", max_batch_tokens)):
        if value is not None and (
            not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if isinstance(namespace, list):  # RadixCache's per-row form: rows here are sorted and deduplicated
        raise ValueError(
            "score takes one namespace for every pair, got a list: call score once per namespace"
        )
    rows, conts = _rows(pairs, max_length, dedupe)
    target = unwrap_peft(model)
    # PEFT prompt learning: its wrapper's forward prepends virtual tokens, so no KV of ours is
    # valid for it; score it as lm-eval does, without the store.
    plain = getattr(getattr(target, "active_peft_config", None), "is_prompt_learning", False)
    block_size = 1 if plain else (store if store is not None else default_store(target)).block_size
    batches = plan_batches(
        [r.packed for r in rows], [""] * len(rows), block_size, max_batch_tokens or sys.maxsize, batch_size,
        [0] * len(rows), keep=[r.keep for r in rows],
    )  # fmt: skip
    out: list[Score | None] = [None] * len(conts)
    for batch in batches:
        members = [rows[i] for i in batch]
        _score_batch(target, store, namespace, members, conts, softmax_dtype, plain, out)
        if progress is not None:
            progress(sum(len(r.members) for r in members))
    return out  # type: ignore[return-value]


def rolling_windows(tokens: Sequence[int], prefix_token: int, max_length: int) -> list[tuple[list, list]]:
    """The (context, continuation) windows that score a whole text, as lm-eval's
    ``loglikelihood_rolling`` cuts them: consecutive runs of ``max_length`` tokens; the first is
    conditioned on ``prefix_token`` alone, each later one on the tokens before it that fill its
    input up to ``max_length`` (one token for a full window; more for a shorter last window).

    >>> rolling_windows([5, 6, 7, 8, 9], prefix_token=1, max_length=2)
    [([1], [5, 6]), ([6], [7, 8]), ([7, 8], [9])]
    """
    tokens = list(tokens)
    if not tokens:
        return []
    first = min(max_length, len(tokens))
    windows = [([prefix_token], tokens[:first])]
    start = first
    while start < len(tokens):
        end = min(start + max_length, len(tokens))
        windows.append((tokens[end - max_length - 1 : start], tokens[start:end]))
        start = end
    return windows


def score_rolling(
    model, texts: Sequence[Sequence[int]], *, prefix_token: int, max_length: int, **score_kwargs
) -> list[float]:
    """Log-likelihood of each whole text (token ids), summed over its ``rolling_windows``.

    ``score_kwargs``: as ``score`` (store, namespace, batch_size, ...). A window's tokens are all
    scored, so only what precedes them can come from the store: the prefix token, or the
    previous window's tail; texts scored before hit no more than that.
    """
    windows, owner = [], []
    for i, text in enumerate(texts):
        for window in rolling_windows(text, prefix_token, max_length):
            windows.append(window)
            owner.append(i)
    totals = [0.0] * len(texts)
    for i, s in zip(owner, score(model, windows, max_length=max_length, **score_kwargs)):
        totals[i] += s.logprob
    return totals
