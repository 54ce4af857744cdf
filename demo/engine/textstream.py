"""Incremental detokenization with stop strings: token ids in, safe text deltas out."""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """Turns a growing list of generated token ids into text deltas, cutting at stop strings.

    A delta is released only when it can no longer change: text that ends in an incomplete
    UTF-8 sequence ("\\ufffd") or that could be the start of a stop string is held back.
    When a stop string appears, `stopped` turns True and the text ends just before it.
    Each `push` re-decodes all ids, O(n) per token, O(n^2) per reply: fine for replies of
    a few thousand tokens.

    >>> s = TextStream(lambda ids: "".join(map(chr, ids)), stop=["END"])
    >>> [s.push([ord(c)]) for c in "ab EN"], s.push([ord("D")]), s.stopped, s.text
    (['a', 'b', ' ', '', ''], '', True, 'ab ')
    """

    def __init__(self, decode, stop: Sequence[str] = ()):
        self._decode = decode  # list[int] -> str
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; return the newly released text ('' if none)."""
        if self.stopped:
            return ""
        self._ids.extend(ids)
        full = self._decode(self._ids)
        cut = self._find_stop(full)
        if cut is not None:
            self.stopped = True
            return self._release(full[:cut])
        return self._release(full[: len(full) - self._holdback(full)])

    def finish(self) -> str:
        """Generation ended: release what was held back (a partial stop string is plain text)."""
        if self.stopped:
            return ""
        full = self._decode(self._ids)
        return self._release(full.rstrip("\ufffd") if full.endswith("\ufffd") else full)

    def _release(self, upto: str) -> str:
        # A decoder may rewrite earlier text (rare); never retract what was sent.
        if not upto.startswith(self.text) or len(upto) <= len(self.text):
            return ""
        delta, self.text = upto[len(self.text) :], upto
        return delta

    def _find_stop(self, full: str) -> int | None:
        # Only the unreleased tail (plus the longest stop's overlap) can hold a new match.
        start = max(0, len(self.text) - max((len(s) for s in self._stop), default=0))
        hits = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, full: str) -> int:
        # An incomplete character may complete a stop string ("ab" + half of "é" with stop
        # "abé"): look for stop prefixes before the trailing "\ufffd"s and hold back both.
        # Taking the larger of the two instead released "ab", and the stop leaked.
        text = full.rstrip("\ufffd")
        # Only the unreleased tail can hold a stop prefix: one reaching into released text
        # would have been held back when that text was released. Bounding k by the tail keeps
        # a long stop string from costing O(len(stop) * len(text)) on every token.
        room = max(0, len(text) - len(self.text))
        best = 0
        for s in self._stop:  # longest suffix of `text` that is a proper prefix of a stop
            for k in range(min(len(s) - 1, room), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return len(full) - len(text) + best
