"""Reasoning models: the ``<think>...</think>`` block of a reply as ``reasoning_content``.

    fmt = reasoning.choose("auto", template)            # None: no reasoning split for this model
    split = ReasoningSplit(fmt, inside=fmt.opens_in(prompt_text))
    reasoning, content = split.feed(delta)              # per streamed delta, then split.finish()

Models write their reasoning between two tags, either both in the reply (Qwen3 with
``enable_thinking``, QwQ) or with the opening tag already in the generation prompt (DeepSeek-R1's
template ends with ``<think>\\n``; Qwen3 with ``enable_thinking=False`` puts an empty block in
the prompt). So whether a reply starts inside the block is decided per request from the
prompt: the last tag the prompt holds (`ReasoningFormat.opens_in`). A reply that opens the
block itself has it at its start (after whitespace); a tag later in the text is content. An
unterminated block (the reply hit max_tokens while thinking) stays reasoning, streamed or not.

The split is incremental: text that could be the start of a tag is held back until it can
no longer be one, so a streamed reply splits exactly as the whole reply does.
"""

from __future__ import annotations

from dataclasses import dataclass

# --reasoning-parser values: vLLM's names for the two <think> conventions (both are handled by
# the per-request rule above), "auto" (from the template) and "none".
PARSERS = ("auto", "none", "deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ReasoningFormat:
    start: str = "<think>"
    end: str = "</think>"

    def opens_in(self, prompt_text: str) -> bool:
        """Whether a reply to ``prompt_text`` starts inside the block (the prompt's last tag opens it)."""
        return prompt_text.rfind(self.start) > prompt_text.rfind(self.end)


THINK = ReasoningFormat()


def choose(parser: str, template: str | None) -> ReasoningFormat | None:
    """The format of ``--reasoning-parser`` ``parser`` for a model with chat ``template``."""
    if parser not in PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {parser!r}")
    if parser == "none":
        return None
    if parser == "auto":
        return (
            THINK if isinstance(template, str) and THINK.start in template and THINK.end in template else None
        )
    return THINK


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplit:
    """One reply's text, split into (reasoning, content) deltas as it arrives.

    >>> s = ReasoningSplit(THINK, inside=False)
    >>> [s.feed(t) for t in ("<thi", "nk>plan</th", "ink>\\n\\nanswer")], s.finish()
    ([('', ''), ('plan', ''), ('', 'answer')], ('', ''))
    """

    def __init__(self, fmt: ReasoningFormat, inside: bool):
        self.fmt = fmt
        # "open": may still open with the start tag; "reasoning"; "after": just closed (leading
        # newlines dropped); "content"
        self._state = "open"
        self._inside = inside
        self._pending = ""
        self.reasoning = ""  # all released so far
        self.content = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        reasoning, content = "", ""
        while self._pending:
            before = (self._state, self._pending)
            if self._state == "open":
                stripped = self._pending.lstrip()
                if stripped.startswith(self.fmt.start):
                    self._pending, self._state = stripped[len(self.fmt.start) :], "reasoning"
                elif stripped and not self.fmt.start.startswith(stripped):
                    self._state = "reasoning" if self._inside else "content"
                else:
                    break  # only whitespace, or a prefix of the tag so far
            elif self._state == "reasoning":
                cut = self._pending.find(self.fmt.end)
                if cut >= 0:
                    reasoning += self._pending[:cut]
                    self._pending, self._state = self._pending[cut + len(self.fmt.end) :], "after"
                else:
                    keep = held_back(self._pending, self.fmt.end)
                    reasoning += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
            elif self._state == "after":
                stripped = self._pending.lstrip("\n")
                if not stripped:
                    self._pending = ""
                    break
                self._pending, self._state = stripped, "content"
            else:
                content += self._pending
                self._pending = ""
            if (self._state, self._pending) == before:  # no progress: wait for more text
                break
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The reply ended: what was held back (a partial tag is text of its block)."""
        pending, self._pending = self._pending, ""
        if self._state == "open":  # whitespace or a partial tag only: text of the block it is in
            self._state = "reasoning" if self._inside else "content"
        if self._state == "after":
            pending = ""
        if self._state == "reasoning":
            self.reasoning += pending
            return pending, ""
        self.content += pending
        return "", pending


def split(fmt: ReasoningFormat, inside: bool, text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole reply."""
    s = ReasoningSplit(fmt, inside)
    s.feed(text)
    s.finish()
    return s.reasoning, s.content
