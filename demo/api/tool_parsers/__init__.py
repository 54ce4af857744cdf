"""Tool-call formats (``--tool-call-parser``, vLLM's names), one module each, and the choice
of one for a model: by flag, or from the chat template's own markers.

    fmt = tool_parsers.choose("auto", template)     # None: this template writes no tool calls
"""

from __future__ import annotations

from demo.api.tool_parsers.base import ToolCall, ToolFormat
from demo.api.tool_parsers.hermes import Hermes
from demo.api.tool_parsers.llama3_json import Llama3Json
from demo.api.tool_parsers.mistral import Mistral

__all__ = ["FORMATS", "PARSERS", "Hermes", "Llama3Json", "Mistral", "ToolCall", "ToolFormat", "choose"]

FORMATS: dict[str, type[ToolFormat]] = {"hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral}
PARSERS = ("auto", "none", *FORMATS)


def choose(parser: str, template: str | None) -> ToolFormat | None:
    """The format ``--tool-call-parser parser`` names; "auto": the one whose markers the chat
    ``template`` writes (None when it writes none of them, or has no tools at all)."""
    if parser not in PARSERS:
        raise ValueError(f"tool call parser must be one of {', '.join(PARSERS)}, got {parser!r}")
    if parser == "none":
        return None
    if parser != "auto":
        return FORMATS[parser]()
    if not isinstance(template, str) or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return Hermes()
    if "[TOOL_CALLS]" in template:
        return Mistral()
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|eot_id|>" in template):
        return Llama3Json()
    return None
