"""The server's log lines, with what a client wrote in them escaped: one formatter for every log
record of the process (the access log's path, headers, model and adapter names, anything a
handler or library logs).

    log_format.configure()   # python -m demo does this: root handler on stderr, INFO

A request to ``/v1/x%0d%0a1999-01-01 00:00:00,000 INFO demo.api.conventions: FORGED%1b[31m``
used to write a whole fake log line (the path is logged decoded) and a terminal escape. Here
every control character (C0, DEL, C1), the Unicode line and paragraph separators and the bidi
overrides are written as escapes (``\\r``, ``\\n``, ``\\x1b``, ``\\u2028``): a log line is one
line, whatever was in it. A traceback keeps its own line breaks; everything else in it (its
exceptions' messages included, line breaks and all) is escaped the same way.
"""

from __future__ import annotations

import logging
import re

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(m: re.Match) -> str:
    c = m.group(0)
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def escape(text: str) -> str:
    """``text`` with every character that could break or recolour a log line escaped."""
    return _UNSAFE.sub(_escaped, text)


class EscapingFormatter(logging.Formatter):
    """A Formatter whose lines hold no control characters (see the module)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape(super().formatMessage(record))

    def formatException(self, ei) -> str:
        text = super().formatException(ei)
        # An exception's message (and notes) may hold a client's text, line breaks included:
        # escaped whole, so that only the traceback's own lines break it.
        for shown in _messages(ei[1]):
            text = text.replace(shown, escape(shown))
        return "\n".join(escape(line) for line in text.split("\n"))

    def formatStack(self, stack_info: str) -> str:
        return "\n".join(escape(line) for line in super().formatStack(stack_info).split("\n"))


def _messages(exc: BaseException | None) -> list[str]:
    """The texts a traceback prints for ``exc`` and the exceptions chained to it that hold a
    character escape() changes."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        try:
            texts = [str(exc), *(n for n in getattr(exc, "__notes__", ()) if isinstance(n, str))]
        except Exception:  # an exception whose str() fails: the traceback says so itself
            texts = []
        out += [t for t in texts if _UNSAFE.search(t)]
        exc = exc.__cause__ or exc.__context__
    return out


def configure(level: int = logging.INFO) -> None:
    """The process's logging: one stderr handler with the escaping formatter."""
    handler = logging.StreamHandler()
    handler.setFormatter(EscapingFormatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
