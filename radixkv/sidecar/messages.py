"""The sidecar's requests as a typed schema (msgspec): every op's fields, types and ranges, here only.

``protocol`` cuts the stream into frames and parses each header as a bounded JSON object;
``parse_request`` turns that object into one of the request types below, or raises
``BadRequest`` naming the op and the field that is wrong. The server then dispatches on the
type (``radixkv.sidecar.server``): no handler reads a raw header. To add an op, add a
``Request`` subclass with its ``tag`` and fields here (and ``REPLIES = False`` if it gets no
reply) and a handler in the server; to add a field, add it with a default, so that clients
that do not send it keep working. Unknown ops and unknown fields are refused by name (a
misspelt field is an error, never silently its default).

What a request may hold (checked before any state is touched):

- integers: ``int`` JSON numbers in their range (no bools, no floats such as ``1.0``, no
  ``1e400``, ``Infinity`` or ``NaN``); ids (``lease``, ``txn``) and counts (``have``) in
  ``[0, 2**63)``; seconds (``claim``) a finite number in ``[0, 3600]``;
- ``ident``: 1..64 bytes as hex; ``ns``: a string of at most ``MAX_NAMESPACE`` characters,
  valid UTF-8;
- a layout: block size, 0..``MAX_LAYERS`` layers of heads, head dims and a dtype name, and
  0..``MAX_STATES`` recurrent-state tensors (a shape of 1..``MAX_STATE_DIMS`` dims, a dtype
  name), each bounded (``radixkv.sidecar.layout`` checks what the sizes add up to, and that a
  layout has layers or states);
- snapshot positions (``alloc``'s ``snaps``): at most ``MAX_SNAPS`` counts, strictly increasing
  and positive (the state checks they are block multiples within the tokens);
- the body: packed int64 tokens for ``match`` and ``alloc``; no body for the other ops.
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

import msgspec
from msgspec import Meta

MAX_LAYERS = 1024
MAX_NAMESPACE = 1 << 16  # characters of an encoded namespace (a tenant key's digest, adapters, salt)
MAX_DIM = 1 << 16  # heads, head dims
MAX_BLOCK_SIZE = 1 << 16  # tokens a block
DTYPES = ("bfloat16", "float16", "float32", "float64")
MAX_STATES = 2 * MAX_LAYERS  # state tensors of a snapshot (a conv and a recurrent state a layer)
MAX_STATE_DIMS = 8  # dims of one state tensor (without the batch dim)
MAX_SNAPS = 4096  # snapshot positions one alloc names (a 1 M-token prompt, one every 256 tokens)

Id = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Count = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Seconds = Annotated[float, Meta(ge=0, le=3600)]
Dim = Annotated[int, Meta(ge=1, le=MAX_DIM)]
Hex = Annotated[str, Meta(min_length=2, max_length=128)]  # and hex: Keyed.__post_init__
Namespace = Annotated[str, Meta(max_length=MAX_NAMESPACE)]


_HEX = re.compile("[0-9a-fA-F]*")
SURROGATE = "a string holds a lone surrogate (a \\ud800-\\udfff escape alone): not UTF-8"


class BadRequest(ValueError):
    """A header that is a JSON object but not a request: unknown op, a field missing, unknown,
    of the wrong type or out of range. ``op``: the op it named (None when that was not one);
    ``replies``: whether that op gets a reply (the error goes there; else it is only logged)."""

    def __init__(self, message: str, op: str | None, replies: bool) -> None:
        super().__init__(message)
        self.op, self.replies = op, replies


class _Object(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class Layer(_Object):
    num_kv_heads: Dim
    k_head_dim: Dim
    v_head_dim: Dim
    dtype: Literal[DTYPES]


class State(_Object):
    """One tensor of a recurrent-state snapshot: its shape (without the batch dim) and dtype."""

    shape: Annotated[list[Dim], Meta(min_length=1, max_length=MAX_STATE_DIMS)]
    dtype: Literal[DTYPES]


class Layout(_Object):
    """A pool's KV layout, as ``radixkv.persist.manifest.layout_of`` writes it; ``states``: the
    snapshot tensors of a model with recurrent layers (none: a plain model; no ``layers``: a
    model without attention KV, such as Mamba)."""

    block_size: Annotated[int, Meta(ge=1, le=MAX_BLOCK_SIZE)]
    layers: Annotated[list[Layer], Meta(max_length=MAX_LAYERS)]
    states: Annotated[list[State], Meta(max_length=MAX_STATES)] = []


class Request(_Object, tag_field="op"):
    REPLIES: ClassVar[bool] = True  # False: no reply, not even an error (release, abort)
    TOKENS: ClassVar[bool] = False  # the body is packed int64 tokens; else it must be empty

    @property
    def op_name(self) -> str:
        return self.__struct_config__.tag


class Keyed(Request):
    """A request about one key root: ``ident`` (a model identity digest, hex) and ``ns`` (the
    encoded namespace)."""

    ident: Hex
    ns: Namespace

    def __post_init__(self) -> None:
        if len(self.ident) % 2 or not _HEX.fullmatch(self.ident):
            raise ValueError(f"ident must be 1..64 bytes as hex, got {self.ident[:20]!r}")
        try:
            self.ns.encode()
        except UnicodeEncodeError:
            raise ValueError(f"ns: {SURROGATE}") from None

    @property
    def namespace(self) -> tuple[bytes, bytes]:
        """The tree root: ``(identity digest, namespace key)``."""
        return bytes.fromhex(self.ident), self.ns.encode()


class Hello(Request, tag="hello"):
    """-> ``{num_blocks, pool_bytes}`` and the pool's fd (SCM_RIGHTS)."""

    layout: Layout


class Match(Keyed, tag="match"):
    """-> ``{lease, num_tokens, slots, wait}`` (a pool with states: and ``snap``, ``kv_tokens``)."""

    TOKENS: ClassVar[bool] = True
    have: Count = 0
    claim: Seconds = 0.0


class Release(Request, tag="release"):
    REPLIES: ClassVar[bool] = False
    lease: Id


class Alloc(Keyed, tag="alloc"):
    """-> ``{txn, start, slots}`` (a pool with states: and ``snaps``, one state slot or -1 per
    position of ``snaps``: the snapshots after that many tokens the client will write)."""

    TOKENS: ClassVar[bool] = True
    snaps: Annotated[list[Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]], Meta(max_length=MAX_SNAPS)] = []

    def __post_init__(self) -> None:
        super().__post_init__()
        if any(a >= b for a, b in zip(self.snaps, self.snaps[1:])):
            raise ValueError("snaps must be strictly increasing positions")


class Commit(Request, tag="commit"):
    """-> ``{inserted}`` (a pool with states: and ``snapshots``, those attached)."""

    txn: Id


class Abort(Request, tag="abort"):
    REPLIES: ClassVar[bool] = False
    txn: Id


class Stats(Request, tag="stats"):
    """-> ``{stats}``."""


REQUESTS: tuple[type[Request], ...] = (Hello, Match, Release, Alloc, Commit, Abort, Stats)
OPS = {r.__struct_config__.tag: r for r in REQUESTS}
_ANY = Hello | Match | Release | Alloc | Commit | Abort | Stats


def explain(error: msgspec.ValidationError, root: str) -> str:
    """msgspec's ``Expected `int` >= 1 - at `$.layers[0].num_kv_heads``` as
    ``root.layers[0].num_kv_heads: expected `int` >= 1`` (the field first; with no ``root``:
    ``lease: ...``, or the message alone for the object itself)."""
    text = str(error)
    what, sep, where = text.rpartition(" - at `")
    if not sep:
        what, where = text, ""
    path = where.rstrip("`").removeprefix("$")
    field = root + path if root else path.lstrip(".")
    what = what[:1].lower() + what[1:]
    return f"{field}: {what}" if field else what


def parse_request(header: dict, body: bytes) -> Request:
    """The request ``header`` (a parsed JSON object) and ``body`` make; ``BadRequest`` if none."""
    op = header.get("op")
    kind = OPS.get(op) if isinstance(op, str) else None
    replies = kind is None or kind.REPLIES
    if kind is None:
        raise BadRequest(f"unknown op {op!r}; ops: {', '.join(OPS)}", None, replies)
    try:
        request = msgspec.convert(header, _ANY)
    except msgspec.ValidationError as e:
        raise BadRequest(f"{op}: {explain(e, '')}", op, replies) from None
    except UnicodeEncodeError:  # msgspec reads strings as UTF-8: "\ud800" (JSON allows it) is not
        raise BadRequest(f"{op}: {SURROGATE}", op, replies) from None
    if kind.TOKENS and len(body) % 8:
        raise BadRequest(f"{op}: a token body of {len(body)} bytes is not packed int64", op, replies)
    if not kind.TOKENS and body:
        raise BadRequest(f"{op}: takes no body, got {len(body)} bytes", op, replies)
    return request


def layout_from(obj: object) -> Layout:
    """``obj`` (a JSON layout, or a ``Layout``) checked against the schema; ValueError naming the
    field (``layout.layers[0].dtype: ...``)."""
    if isinstance(obj, Layout):
        return obj
    try:
        return msgspec.convert(obj, Layout)
    except UnicodeEncodeError:
        raise ValueError(f"layout: {SURROGATE}") from None
    except msgspec.ValidationError as e:
        text = explain(e, "layout")
        if "enum value" in text:
            text += f" (dtypes: {', '.join(DTYPES)})"
        raise ValueError(text) from None
