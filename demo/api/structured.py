"""The grammar a chat request's reply must match: a forced tool call or a response_format.

    grammar = structured.grammar(agent, tool_format, engine.runner.grammars)   # None: free text

- ``tool_choice: "required"`` or a named function: the calls block of the model's tool-call
  format (demo.api.tool_parsers), each call naming a forced tool with arguments matching its
  ``parameters`` schema; several calls only with ``parallel_tool_calls`` and ``required``.
- ``response_format`` ``json_object`` (any JSON object) or ``json_schema`` (that schema; OpenAI's
  ``strict`` is what constrained decoding gives anyway).

A forced call wins over response_format (the reply is the call). Anything the grammar library
cannot enforce (an unsupported keyword, a bad pattern, a dangling $ref) is a 400 naming it, and
so is, before the library sees it, a schema whose $refs nest it deeper than MAX_REF_DEPTH (the
library's compiler overflowed its stack: the process died) or whose $ref cycles allow no finite
value (demo.api.schema_refs; the matcher dead-ended after ``{"x": ``, answered as a finished 200).
"""

from __future__ import annotations

from demo.api import schema_refs
from demo.api.agent_options import AgentOptions
from demo.api.tool_parsers import ToolFormat
from demo.engine.constrained import JSON_OPTIONS, Grammars, json_lark
from demo.errors import ApiError

# Objects on a path through a schema once its $refs are followed (schema_refs.ref_depth): four
# times under the shortest chain that crashed llguidance 1.9 in a thread (about 2,000), and far
# past real schemas (a request's JSON itself nests at most 128 levels).
MAX_REF_DEPTH = 512


def _lark(
    agent: AgentOptions, fmt: ToolFormat | None, grammars: Grammars
) -> tuple[str, str, dict | None] | None:
    """(Lark grammar, the request field it comes from, the JSON schema in it), or None."""
    forced = agent.forced_tools
    if forced:
        if fmt is None:
            raise ApiError(
                400,
                "tool_choice 'required' or a named function needs a tool-call format: this model's chat "
                "template writes none the server knows; start it with --tool-call-parser",
                "tool_choice",
            )
        schema = {**fmt.call_schema(list(forced)), "x-guidance": JSON_OPTIONS}
        parallel = agent.parallel_tool_calls and agent.tool_choice == "required"
        return fmt.grammar(schema, parallel, grammars.literal), "tool_choice", schema
    rf = agent.response_format
    if rf is None:
        return None
    if rf["type"] == "json_object":
        return json_lark(None), "response_format", None
    return json_lark(rf["schema"]), "response_format.json_schema.schema", rf["schema"]


def grammar(agent: AgentOptions, fmt: ToolFormat | None, grammars: Grammars) -> str | None:
    """The checked grammar of the request, or None; ApiError 400 naming what cannot be enforced."""
    lark = _lark(agent, fmt, grammars)
    if lark is None:
        return None
    text, param, schema = lark
    try:
        if schema is not None:
            _check_refs(schema)
        return grammars.check(text)
    except ValueError as e:
        where = "tools[].function.parameters" if param == "tool_choice" else param
        raise ApiError(
            400, f"{where}: this schema cannot be enforced: {str(e)[:500]}", param, "unsupported_schema"
        ) from None


def _check_refs(schema: dict) -> None:
    """ValueError if the schema's $refs nest it too deep, or trap it in cycles with no way out."""
    depth = schema_refs.ref_depth(schema)
    if depth > MAX_REF_DEPTH:
        raise ValueError(f"its $refs nest it {depth} levels deep (at most {MAX_REF_DEPTH})")
    endless = schema_refs.endless_refs(schema)
    if endless:
        shown = ", ".join(endless[:8]) + (", ..." if len(endless) > 8 else "")
        raise ValueError(f"no finite JSON value matches it: its $ref cycle has no way out ({shown})")
