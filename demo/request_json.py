"""JSON a client sends, read in one place: a request body, and JSON text inside one (an assistant
turn's tool call arguments).

    body = json_body(request.get_data())     # ApiError 400: not JSON, or nested too deep
    args = json_text(text, param)            # ValueError if not JSON; ApiError 400 naming param

One bound on nesting for all of it (MAX_JSON_DEPTH): every later walk over a request's values
(marking the chat template's inputs against forged turns, jinja's tojson, json.dumps, schema
checks) recurses per level, and JSON nested 800 levels deep used to end in a RecursionError (a
500) inside one of them.
"""

from __future__ import annotations

import json
from typing import Any

from demo.errors import ApiError

# Objects and arrays inside one another: far past real requests (schemas, arguments, template
# variables), and well inside Python's recursion limit for the walks above.
MAX_JSON_DEPTH = 128


def bounded(value: Any, param: str | None = None) -> Any:
    """``value`` if its objects and arrays nest at most MAX_JSON_DEPTH deep, else ApiError 400
    naming ``param`` (None, for a body: the top-level field that holds the nesting). Iterative:
    it must not recurse itself."""
    stack = [(value, 0, param)]
    while stack:
        v, depth, where = stack.pop()
        if not isinstance(v, (dict, list)):
            continue
        if depth == MAX_JSON_DEPTH:
            raise _too_deep(where)
        if isinstance(v, dict):
            stack.extend((x, depth + 1, where or (k if depth == 0 else None)) for k, x in v.items())
        else:
            stack.extend((x, depth + 1, where) for x in v)
    return value


def json_text(text: str, param: str) -> Any:
    """The value of JSON text inside a request (a tool call's arguments): ValueError if it does
    not parse, ApiError 400 naming ``param`` if it nests more than MAX_JSON_DEPTH deep (so deep
    that json.loads itself runs out of recursion included)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(param) from None
    return bounded(value, param)


def json_body(data: bytes) -> Any:
    """A request body's JSON value (None for an empty body); ApiError 400 if it does not parse or
    nests more than MAX_JSON_DEPTH deep. Every route reads its body here."""
    try:
        value = json.loads(data or b"null")
    except RecursionError:
        raise _too_deep(None) from None
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON") from None
    return bounded(value)


def _too_deep(where: str | None) -> ApiError:
    named = f"'{where}'" if where else "the request body"
    return ApiError(
        400, f"{named} nests JSON objects and arrays more than {MAX_JSON_DEPTH} levels deep", where
    )
