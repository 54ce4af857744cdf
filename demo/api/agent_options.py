"""The chat request fields agents send: tools, tool_choice, parallel_tool_calls,
response_format and chat_template_kwargs (OpenAI's shapes; vLLM's chat_template_kwargs).

    agent = agent_options.parse(body, default_template_kwargs)   # ApiError 400 naming the field

Only the shapes are checked here; whether a schema can be enforced is decided when its grammar
is compiled (demo.engine.constrained), which answers a 400 naming the unsupported feature.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from demo.api.schema import _bad, _utf8_json

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# Arguments of apply_chat_template a request may not set through chat_template_kwargs.
_RESERVED = {
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
}  # fmt: skip


@dataclass(frozen=True)
class AgentOptions:
    tools: tuple[dict, ...] = ()  # OpenAI function specs {"name", "description"?, "parameters"}
    rendered_tools: tuple[dict, ...] = ()  # the client's function objects, as the template gets them
    tool_choice: str = "auto"  # "auto" | "none" | "required" | "function" (then `function`)
    function: str | None = None  # the named function tool_choice forces
    parallel_tool_calls: bool = True
    response_format: dict | None = (
        None  # None: text; {"type": "json_object"} or {"type": "json_schema", "schema"}
    )
    template_kwargs: dict = field(default_factory=dict)  # extra chat template variables

    @property
    def calls_tools(self) -> bool:
        """Whether the reply is parsed for tool calls (tools given and not tool_choice none)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tools(self) -> tuple[dict, ...]:
        """The tools a call must name when one is forced (required: any; a named function: it)."""
        if self.tool_choice == "required":
            return self.tools
        if self.tool_choice == "function":
            return tuple(t for t in self.tools if t["name"] == self.function)
        return ()


def _tools(body: dict) -> tuple[tuple[dict, ...], tuple[dict, ...]]:
    """(normalized specs with ``parameters`` always set, the client's function objects)."""
    tools = body.get("tools")
    if tools is None:
        return (), ()
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _bad(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    out, names, given = [], set(), []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict):
            raise _bad(f"{where} must be {{'type': 'function', 'function': {{'name', ...}}}}", where)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(
                f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.'",
                f"{where}.function.name",
            )
        if name in names:
            raise _bad(f"{where}: two tools are named {name!r}", f"{where}.function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(
                f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters"
            )
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise _bad(f"{where}.function.description must be a string", f"{where}.function.description")
        spec = {"name": name}
        if desc is not None:
            spec["description"] = desc
        spec["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        out.append(spec)
        given.append(dict(fn))
    _utf8_json(given, "tools")
    return tuple(out), tuple(given)


def _tool_choice(body: dict, tools: tuple[dict, ...]) -> tuple[str, str | None]:
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice != "none" and not tools:
        raise _bad("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
    if choice in ("auto", "none", "required"):
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}",
            "tool_choice",
        )
    if name not in {t["name"] for t in tools}:
        raise _bad(f"'tool_choice' names the function {name[:64]!r}, which is not in 'tools'", "tool_choice")
    return "function", name


def _response_format(body: dict) -> dict | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad(
                "'response_format' json_schema needs {'json_schema': {'name', 'schema': {...}}}",
                "response_format.json_schema.schema",
            )
        return {"type": "json_schema", "schema": schema, "name": spec.get("name")}
    raise _bad("'response_format.type' must be 'text', 'json_object' or 'json_schema'", "response_format")


def template_kwargs(value: Any, param: str) -> dict:
    """A chat_template_kwargs object (flag or request), reserved names refused."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(f"'{param}' must be an object", param)
    reserved = sorted(set(value) & _RESERVED)
    if reserved:
        raise _bad(f"'{param}' may not set {', '.join(reserved)}: apply_chat_template's own arguments", param)
    _utf8_json(value, param)
    return dict(value)


def parse(body: dict, default_kwargs: dict | None = None, tool_calls: bool = True) -> AgentOptions:
    """The agent fields of a chat body; ApiError 400 naming the bad field. ``tool_calls``: the
    model has a tool-call format (else tools and tool_choice are refused as unsupported)."""
    if not tool_calls:
        for name in ("tools", "tool_choice"):
            if body.get(name) not in (None, [], "none"):
                raise _bad(
                    f"'{name}' is not supported for this model: its chat template has no tool-call format "
                    "the server knows (start it with --tool-call-parser)",
                    name,
                    "unsupported_parameter",
                )
    tools, given = _tools(body)
    choice, function = _tool_choice(body, tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    kwargs = {
        **(default_kwargs or {}),
        **template_kwargs(body.get("chat_template_kwargs"), "chat_template_kwargs"),
    }
    return AgentOptions(
        tools=tools,
        rendered_tools=given,
        tool_choice=choice,
        function=function,
        parallel_tool_calls=parallel and choice != "function",
        response_format=_response_format(body),
        template_kwargs=kwargs,
    )
