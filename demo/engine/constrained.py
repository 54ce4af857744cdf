"""Constrained decoding: a grammar per row of a generate() call, through llguidance.

    grammars = Grammars(tokenizer, vocab_size, eos_ids)   # one per engine (the token trie)
    grammar = grammars.check(lark_text)                    # ValueError naming what is unsupported
    states = [grammars.start(grammar) for each constrained row]  # RowGrammar, or None
    processor = GrammarRows(states, width, before)         # a LogitsProcessor over those rows

Row-aware by design: ``GrammarRows`` holds one ``RowGrammar`` per row (None for an
unconstrained row), masks only its rows' logits (every token the row's grammar cannot take
next gets -inf) and advances each row's matcher with the token that row chose. The chosen
token of a step is only seen at the next call (in ``input_ids``), so a row's state counts the
reply tokens it has consumed (``fed``) and catches up from ``input_ids`` at each call; a
request paused between decode chunks keeps its RowGrammar and resumes where it stopped (the
tokens of earlier chunks sit in its context, left of ``width``). Once a row's grammar is
complete only EOS is allowed, so the row ends there.

The grammar only chooses among tokens: what is cached (prompt and reply KV) is computed from
the token ids as always, keyed as always; nothing about the grammar enters the prefix cache.

Why llguidance (benchmarks/bench_grammar.py, figures in docs/agents.md): JSON schemas and Lark
grammars with embedded JSON (``%json{...}``, which the tool-call formats need), errors that
name the unsupported schema keyword, and a mask per token in tens of microseconds on CPU.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import LogitsProcessor

log = logging.getLogger(__name__)

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


@dataclass
class RowGrammar:
    """One row's grammar state: the llguidance matcher and how many reply tokens it consumed."""

    matcher: object  # llguidance.LLMatcher
    eos: tuple[int, ...]  # the ids that end the row once the grammar is complete
    vocab: int  # the matcher's vocabulary (its mask's width in bits, rounded up to 32)
    fed: int = 0
    broken: bool = False  # the matcher refused a token (logged); the row is no longer masked


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


class GrammarRows(LogitsProcessor):
    """Masks the rows that have a grammar; leaves the others' scores as they are.

    states: one RowGrammar or None per row (generate()'s rows, in order); width: the input's
    column count at the call's first step; before: per row, the reply tokens already in its
    input (earlier decode chunks), which its RowGrammar has consumed. scores: [rows, vocab].
    """

    def __init__(self, states: Sequence[RowGrammar | None], width: int, before: Sequence[int] | None = None):
        import llguidance.torch as lt

        self._lt = lt
        self.states, self.width = list(states), width
        self.before = list(before) if before is not None else [0] * len(self.states)
        self._mask = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        active = [i for i, s in enumerate(self.states) if s is not None]
        if not active:
            return scores
        if self._mask is None:
            vocab = self.states[active[0]].vocab  # the matchers' width (logits may be wider)
            self._mask = self._lt.allocate_token_bitmask(len(self.states), vocab)
        generated = input_ids.shape[1] - self.width
        masked, complete = [], []
        for i in active:
            state = self._advance(i, input_ids, generated)
            if state.broken:
                continue  # logged: leave the row unmasked
            if state.matcher.is_stopped():
                complete.append(i)  # the grammar is complete: only EOS (or pad after it)
                continue
            self._lt.fill_next_token_bitmask(state.matcher, self._mask, i)
            masked.append(i)
        if complete:
            for i in complete:
                eos = torch.tensor(self.states[i].eos, dtype=torch.long, device=scores.device)
                keep = scores[i, eos]
                scores[i] = -float("inf")
                scores[i, eos] = keep
        if not masked:
            return scores
        free = [i for i in range(len(self.states)) if i not in masked]
        if free:
            self._mask[free] = -1  # all bits set: those rows keep every token
        # In place, as generate() allows: no copy of the [rows, vocab] scores per step
        apply_bitmask(scores, self._mask, masked)
        return scores

    def _advance(self, i: int, input_ids: torch.LongTensor, generated: int) -> RowGrammar:
        """Feed row i's matcher the reply tokens it has not seen (its last step's choice)."""
        state = self.states[i]
        total = self.before[i] + generated  # reply tokens in row i's input now
        if state.fed < total and not state.broken:
            start = self.width - self.before[i] + state.fed
            for token in input_ids[i, start : self.width + generated].tolist():
                if state.matcher.is_stopped():
                    break  # pad tokens after the row's EOS
                if not state.matcher.consume_token(token):
                    log.warning(
                        "row %d: the grammar refused token %d: %s", i, token, state.matcher.get_error()
                    )
                    state.broken = True
                    break
        state.fed = total
        return state
