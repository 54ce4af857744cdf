"""Incremental detokenization with stop strings: token ids in, safe text deltas out."""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    """Turns a growing list of generated token ids into text deltas, cutting at stop strings.

    A delta is released only when it can no longer change: text that ends in an incomplete
    UTF-8 sequence ("\\ufffd") or that could be the start of a stop string is held back.
    When a stop string appears, `stopped` turns True and the text ends just before it.

    Cost: a reply's first ``2 * WINDOW`` ids are decoded whole at each push. Past them, a push
    decodes a window: the ids since the last *anchor* plus at least ``CONTEXT`` ids before it,
    whose text decoded alone when the anchor was set is the end of the whole text then (a
    context starting inside a character split over byte tokens is not); the window's text must
    start with it, and the text is then the anchor's text plus the rest of the window's. Every
    ``WINDOW`` ids the anchor moves on, and the whole decode is compared with that text first.
    So a push costs O(WINDOW + n / WINDOW) decoded ids instead of O(n) (a 4,000-token reply:
    ~20x less, and those decodes hold the GIL the step loop wants). A decoder whose text the
    window cannot reproduce fails a comparison (none of the tokenizers library's decoders was
    seen to: transformers' space clean-up rewrites the context, which the window sees; a byte
    fallback decoder fuses a run of byte tokens, which the context's start keeps whole), and
    the stream decodes every id whole from then on. An anchor is set only where the text does
    not end in an incomplete character.

    >>> s = TextStream(lambda ids: "".join(map(chr, ids)), stop=["END"])
    >>> [s.push([ord(c)]) for c in "ab EN"], s.push([ord("D")]), s.stopped, s.text
    (['a', 'b', ' ', '', ''], '', True, 'ab ')
    """

    WINDOW = 64  # ids between two anchors (each checked against a whole decode)
    CONTEXT = 6  # ids before the anchor decoded with the window's

    def __init__(self, decode, stop: Sequence[str] = ()):
        self._decode = decode  # list[int] -> str
        self._stop = [s for s in stop if s]
        self._ids: list[int] = []
        self.text = ""  # released so far
        self.stopped = False
        self._anchor = 0  # ids before it: their text is self._head (checked against a whole decode)
        self._head = ""
        self._context = ""  # the text of ids[_start:_anchor] decoded alone (see _context_of)
        self._start = 0
        self._whole = False  # True: the window did not reproduce a whole decode; decode all ids

    def _full(self) -> str:
        """The text of every id so far: ``self._decode(self._ids)``, read through the window
        where it reproduces that (see the class)."""
        ids = self._ids
        if self._whole or len(ids) < 2 * self.WINDOW:
            return self._decode(ids)
        window = self._decode(ids[self._start :]) if self._anchor and self._context else None
        if window is None or not window.startswith(self._context):
            # no anchor yet; context ids with no text (the window's first decoded id would be
            # a new one: decoders treat a sequence's first token apart, e.g. dropping its
            # space); or the new ids rewrote the context's text
            full = None
        else:
            full = self._head + window[len(self._context) :]
        if full is None or len(ids) - self._anchor >= self.WINDOW:
            whole = self._decode(ids)
            if full is not None and full != whole:
                self._whole = True  # this decoder's text depends on more than the window
                return whole
            full = whole
            # never anchor inside an incomplete character; after an anchor with no context,
            # not again before WINDOW more ids (each try decodes up to 3 x CONTEXT contexts)
            retry = not self._anchor or self._context or len(ids) - self._anchor >= self.WINDOW
            if retry and not whole.endswith("\ufffd"):
                self._anchor, self._head = len(ids), whole
                self._context = self._context_of(whole)
        return full

    def _context_of(self, whole: str) -> str:
        """The text of the ids before the anchor, decoded alone from the first start, CONTEXT
        ids back or further, whose text is the end of ``whole`` and at least CONTEXT characters
        long; '' (no window until the next anchor) if none within 4 x CONTEXT ids. A start
        inside a character (its bytes split over byte tokens) decodes to U+FFFD alone, and so
        does the window from there (a byte fallback decoder fuses a whole run of byte tokens):
        its text would not be the whole decode's. A short text (context ids that are mostly
        skipped special tokens) would let transformers' space clean-up, which rewrites patterns
        such as " ' " and " n't" over the whole string, span the context's start unseen."""
        ids, end = self._ids, len(self._ids)
        for start in range(end - self.CONTEXT, end - 4 * self.CONTEXT - 1, -1):
            if start < 0:
                break
            text = self._decode(ids[start:end])
            if len(text) >= self.CONTEXT and whole.endswith(text):
                self._start = start
                return text
        return ""

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; return the newly released text ('' if none)."""
        if self.stopped:
            return ""
        self._ids.extend(ids)
        full = self._full()
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
