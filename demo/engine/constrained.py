"""Constrained decoding: a grammar per row of a generate() call, through llguidance.

    grammars = Grammars(tokenizer, vocab_size, eos_ids)   # one per engine (the token trie)
    grammar = grammars.check(lark_text)                    # ValueError naming what is unsupported
    hook = GrammarHook(grammars.start(grammar), len(prompt_ids))   # one per row of a request

A grammar is one row's own option, like its temperature or logit_bias: ``GrammarHook`` is a
demo.engine.sampling.RowHook, carried on the request (``Generation.hooks[row]``) and called
by the batch's RowSampler for that row only, so a constrained request is an ordinary row of
any running batch (any other options beside it) and pauses and resumes like any other. Each
call masks the row's logits (every token its grammar cannot take next gets -inf) after
advancing the row's matcher by the row's own tokens it has not consumed yet: the token chosen
at a step is only seen at the next call, and after a pause the row's context (prompt + reply
so far) comes back whole, so the hook counts the reply tokens it consumed (``fed``) and
catches up from there. Once the grammar is complete only EOS is allowed, so the row ends.

A matcher in an error state is never taken for a complete grammar (llguidance stops it either
way): a grammar with no way on (a schema whose $ref cycles allow no finite value, where
demo.api.schema_refs did not see it) ends the request with a 400 ``unsupported_schema``, a token
the matcher refused (the mask was not honoured) with GrammarError; either way the row's
request fails alone, and no reply is answered as if it matched.

The grammar only chooses among tokens: what is cached (prompt and reply KV) is computed from
the token ids as always, keyed as always; nothing about the grammar enters the prefix cache.

Why llguidance (benchmarks/bench_grammar.py, figures in docs/agents.md): JSON schemas and Lark
grammars with embedded JSON (``%json{...}``, which the tool-call formats need), errors that
name the unsupported schema keyword, and a mask per token in tens of microseconds on CPU.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from demo.errors import ApiError

# JSON as json.dumps writes it (", " and ": "), which is also how chat templates re-render a
# call's arguments (tojson): a constrained reply re-renders to the same text next turn. No free
# whitespace: a model could otherwise spend its tokens on it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_lark(schema: dict | None) -> str:
    """A Lark grammar of one JSON value matching ``schema`` (None: any JSON object)."""
    schema = {"type": "object"} if schema is None else schema
    schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    return "start: %json" + json.dumps(schema, ensure_ascii=False, separators=(",", ":")) + "\n"


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(scores: torch.Tensor, mask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """scores[r, t] = -inf where bit t of row r's mask is 0. scores: [rows, vocab] (any device);
    mask: int32 [rows, ceil(vocab / 32)], bit t % 32 of word t // 32 (llguidance's layout).
    Logits past the mask's width are -inf in ``rows`` (default: all), the constrained ones.
    Plain tensor ops: llguidance's own helper is torch.compile'd, which costs seconds (and a
    C++ compiler) on a server's first constrained request."""
    mask = mask.to(scores.device, non_blocking=True)
    bits = _BITS.to(scores.device)
    allowed = ((mask.unsqueeze(-1) >> bits) & 1).reshape(mask.shape[0], -1)[:, : scores.shape[1]]
    if allowed.shape[1] < scores.shape[1]:  # logits past the mask's width: never allowed
        index = torch.arange(scores.shape[0]) if rows is None else torch.tensor(list(rows), dtype=torch.long)
        scores[index.to(scores.device), allowed.shape[1] :] = -float("inf")
    scores[:, : allowed.shape[1]].masked_fill_(allowed == 0, -float("inf"))


class GrammarError(RuntimeError):
    """A row's matcher refused the token the row took: the mask was not honoured (a defect here,
    not the client's)."""


@dataclass
class RowGrammar:
    """One row's grammar state: the llguidance matcher and how many reply tokens it consumed."""

    matcher: object  # llguidance.LLMatcher
    eos: tuple[int, ...]  # the ids that end the row once the grammar is complete
    vocab: int  # the matcher's vocabulary (its mask's width in bits, rounded up to 32)
    fed: int = 0


class Grammars:
    """Compiles and checks grammars for one tokenizer. ``vocab_size``: the logits' width.

    The llguidance tokenizer (a trie over the vocabulary) is built on first use, once."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        self._hf, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._ll = None

    def _tokenizer(self):
        if self._ll is None:
            import llguidance.hf

            self._ll = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        return self._ll

    def literal(self, text: str) -> str:
        """``text`` as a Lark expression in which each added token of the tokenizer (a marker
        such as ``<tool_call>`` or ``[TOOL_CALLS]``) is that token, ``<[id]>``: llguidance
        treats added tokens as special, never as their text, so a marker must be named by id."""
        added = {
            t.content: i for i, t in self._hf.added_tokens_decoder.items() if t.content and t.content in text
        }
        out, rest = [], text
        while rest:
            hits = [(rest.find(m), -len(m), m) for m in added if m in rest]
            if not hits:
                out.append(json.dumps(rest, ensure_ascii=False))
                break
            at, _, marker = min(hits)
            if at:
                out.append(json.dumps(rest[:at], ensure_ascii=False))
            out.append(f"<[{added[marker]}]>")
            rest = rest[at + len(marker) :]
        return " ".join(out) if out else '""'

    def check(self, lark: str) -> str:
        """The llguidance grammar of ``lark`` (a Lark grammar, %json allowed); raises ValueError
        with llguidance's message (naming the unsupported keyword or the syntax error)."""
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer())
        if is_error:
            raise ValueError(messages[0] if messages else "invalid grammar")
        return grammar

    def start(self, grammar: str) -> RowGrammar:
        """A fresh matcher at the grammar's start (ValueError if it cannot be built)."""
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return RowGrammar(matcher, tuple(self.eos_ids), self.vocab_size)


class GrammarHook:
    """One row's grammar as a RowHook (demo.engine.sampling): ``hook(ids, scores)``.

    ids: [t] int64, the row's own tokens (its prompt of ``prompt_length`` tokens, then its reply
    so far, across pauses); scores: [vocab] float, masked in place and returned. Keeps a
    [1, vocab/32] int32 bitmask; owns ``state`` (the matcher), which only this row advances."""

    def __init__(self, state: RowGrammar, prompt_length: int):
        import llguidance.torch as lt

        self._lt, self.state, self.prompt_length = lt, state, prompt_length
        self._mask = None
        self._eos = None  # the EOS ids as a tensor on the scores' device

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        state = self._advance(ids)
        self._check(state)
        if state.matcher.is_stopped():  # complete: only EOS
            if self._eos is None or self._eos.device != scores.device:
                self._eos = torch.tensor(state.eos, dtype=torch.long, device=scores.device)
            keep = scores[self._eos]
            scores.fill_(-float("inf"))
            scores[self._eos] = keep
            return scores
        if self._mask is None:
            # the matcher's width (logits may be wider: those past it are never this row's)
            self._mask = self._lt.allocate_token_bitmask(1, state.vocab)
        self._lt.fill_next_token_bitmask(state.matcher, self._mask, 0)
        self._check(state)  # (the mask is where a grammar with no way on is found)
        # In place on the row's [vocab] (a view of the sampler's copy): no copy per step
        apply_bitmask(scores.unsqueeze(0), self._mask)
        return scores

    @staticmethod
    def _check(state: RowGrammar) -> None:
        """ApiError 400 if the matcher is in an error state: stopped, but not complete."""
        if state.matcher.is_error():
            raise ApiError(
                400,
                f"the reply cannot go on after {state.fed} tokens: its grammar has no continuation "
                f"(the schema allows no complete value here): {state.matcher.get_error()[:300]}",
                code="unsupported_schema",
            )

    def _advance(self, ids: torch.Tensor) -> RowGrammar:
        """Feed the matcher the reply tokens in ``ids`` it has not consumed yet (GrammarError if
        it refuses one)."""
        state = self.state
        reply = ids.shape[0] - self.prompt_length
        if state.fed < reply:
            for k, token in enumerate(ids[self.prompt_length + state.fed :].tolist()):
                if state.matcher.is_stopped():
                    break  # nothing after the grammar's end is the reply's (EOS ends the row)
                if not state.matcher.consume_token(token):
                    raise GrammarError(
                        f"the grammar refused token {token} at reply token {state.fed + k}: "
                        f"{state.matcher.get_error()[:300]}"
                    )
        state.fed = max(state.fed, reply)
        return state
