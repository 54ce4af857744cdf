"""One chat reply split into its parts as it streams: reasoning, content and tool calls.

    parser = ReplyParser(reasoning_fmt, inside, tool_fmt)   # either format may be None
    part = parser.feed(text_delta)      # Part(reasoning, content, calls newly complete)
    part = parser.finish()              # at the end of the reply

The reasoning split (demo.api.reasoning) comes first; the content it leaves goes through the
tool-call format (demo.api.tool_parsers): text before the format's marker is content, the
calls block after it is held back and each call is released once it is complete. A block that
turns out not to be calls (no call parses) is released as content at the end. A whole reply
is parsed by feeding it at once, so a streamed reply gets exactly the non-streamed parts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from demo.api.reasoning import ReasoningFormat, ReasoningSplit, held_back
from demo.api.tool_parsers import ToolCall, ToolFormat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IdentifiedCall:
    index: int  # position among the reply's calls
    id: str
    call: ToolCall


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call: its header (``name`` set, ``arguments`` "") or arguments text."""

    index: int
    id: str
    name: str | None
    arguments: str


@dataclass
class Part:
    reasoning: str = ""
    content: str = ""
    calls: list[IdentifiedCall] = field(default_factory=list)  # calls complete in this part
    # the same calls as stream pieces: a call's header as soon as its name is known (formats
    # with ToolFormat.partial), then its arguments as written, the rest when it completes
    call_deltas: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls or self.call_deltas)


class ReplyParser:
    """The parts of one reply (see the module doc). ``inside``: the prompt opened the
    reasoning block (demo.api.reasoning.ReasoningFormat.opens_in)."""

    def __init__(
        self,
        reasoning: ReasoningFormat | None,
        inside: bool,
        tools: ToolFormat | None,
        max_calls: int | None = None,
    ):
        self._max_calls = max_calls  # parallel_tool_calls false: 1 (later calls are dropped)
        self._split = ReasoningSplit(reasoning, inside) if reasoning is not None else None
        self._tools = tools
        self._state = "content" if tools is not None else "plain"  # "content" | "calls" | "plain"
        self._buf = ""  # content not yet released (a possible marker), or the calls block
        self._open: list | None = None  # [index, id, arguments sent] of the call being streamed
        self._seen_content = False  # content released: a start-only marker can no longer come
        self.reasoning, self.content = "", ""
        self.calls: list[IdentifiedCall] = []

    def feed(self, text: str) -> Part:
        reasoning, content = self._split.feed(text) if self._split is not None else ("", text)
        part = Part(reasoning=reasoning)
        self._tool_feed(content, part)
        return self._record(part)

    def finish(self) -> Part:
        reasoning, content = self._split.finish() if self._split is not None else ("", "")
        part = Part(reasoning=reasoning)
        self._tool_feed(content, part)
        if self._state == "content":
            part.content += self._buf
        elif self._state == "calls":
            calls = self._tools.parse(self._buf, final=True)
            if calls is None and not self.calls:
                part.content += self._buf  # not a calls block after all
            elif calls is None:
                log.info("text after the tool calls was dropped: %r", self._buf[-200:])
            else:
                self._new_calls(calls, part)
        self._buf = ""
        return self._record(part)

    @property
    def finish_reason_override(self) -> str | None:
        """ "tool_calls" once the reply made a call (OpenAI's finish_reason then)."""
        return "tool_calls" if self.calls else None

    def _record(self, part: Part) -> Part:
        self.reasoning += part.reasoning
        self.content += part.content
        self.calls += part.calls
        return part

    def _tool_feed(self, text: str, part: Part) -> None:
        if self._state == "plain":
            part.content += text
            return
        self._buf += text
        fmt = self._tools
        if self._state == "content":
            if fmt.at_start_only:
                head = self._buf.lstrip()
                starts = getattr(fmt, "starts", (fmt.start,))
                if self._seen_content or (head and not any(s.startswith(head[: len(s)]) for s in starts)):
                    self._state = "plain"  # the reply did not open with a call: all content
                    part.content += self._buf
                    self._buf = ""
                    return
                if not any(head.startswith(s) for s in starts):
                    return  # spaces, or a prefix of the marker: wait
                self._state = "calls"
            else:
                cut = self._buf.find(fmt.start)
                if cut < 0:
                    keep = held_back(self._buf, fmt.start)
                    part.content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    self._seen_content = self._seen_content or bool(part.content)
                    return
                part.content += self._buf[:cut]
                self._buf, self._state = self._buf[cut:], "calls"
        self._new_calls(fmt.parse(self._buf, final=False) or [], part)
        self._stream_open_call(part)

    def _new_calls(self, calls: list[ToolCall], part: Part) -> None:
        done = len(self.calls) + len(part.calls)
        if self._max_calls is not None:
            calls = calls[: self._max_calls]
        for call in calls[done:]:
            if self._open is not None and self._open[0] == done:  # its header is out already
                _, call_id, sent = self._open
                self._open = None
                if not call.arguments.startswith(sent):
                    log.warning("call %d: streamed arguments %r differ from the parsed ones", done, sent[:80])
                rest = call.arguments[len(sent) :] if call.arguments.startswith(sent) else ""
            else:
                call_id, rest = self._tools.call_id(), call.arguments
                part.call_deltas.append(CallDelta(done, call_id, call.name, ""))
            if rest:
                part.call_deltas.append(CallDelta(done, call_id, None, rest))
            part.calls.append(IdentifiedCall(done, call_id, call))
            done += 1

    def _stream_open_call(self, part: Part) -> None:
        """Stream the call still being written (formats that can: ToolFormat.partial)."""
        index = len(self.calls) + len(part.calls)
        if self._max_calls is not None and index >= self._max_calls:
            return
        partial = self._tools.partial(self._buf)
        if partial is None:
            return
        name, written = partial
        if self._open is None or self._open[0] != index:
            self._open = [index, self._tools.call_id(), ""]
            part.call_deltas.append(CallDelta(index, self._open[1], name, ""))
        sent = self._open[2]
        if written.startswith(sent) and len(written) > len(sent):
            part.call_deltas.append(CallDelta(index, self._open[1], None, written[len(sent) :]))
            self._open[2] = written


def parse_whole(
    reasoning: ReasoningFormat | None, inside: bool, tools: ToolFormat | None, text: str
) -> ReplyParser:
    """A finished ReplyParser over a whole reply (read .reasoning, .content, .calls)."""
    p = ReplyParser(reasoning, inside, tools)
    p.feed(text)
    p.finish()
    return p


@dataclass(frozen=True)
class ReplySpec:
    """How a request's replies are split: its reasoning format and whether the prompt opened
    the block, and its tool-call format (None when the request gave no tools)."""

    reasoning: ReasoningFormat | None = None
    inside: bool = False
    tools: ToolFormat | None = None
    max_calls: int | None = None  # 1 with parallel_tool_calls false

    def parser(self) -> ReplyParser:
        return ReplyParser(self.reasoning, self.inside, self.tools, self.max_calls)

    def __bool__(self) -> bool:
        return self.reasoning is not None or self.tools is not None
