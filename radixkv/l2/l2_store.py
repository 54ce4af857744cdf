"""The L2 contract (a shared block store behind the sidecar's memory) and ``open_l2``.

An L2 maps a block key (block_keys.py) to a payload: the bytes of one block's KV, opaque here.
It is a cache, never the truth: every answer may be a miss, and a store that is down, slow or
full makes calls return misses and store nothing in bounded time (``timeout_s`` per socket
operation), never raise. Values carry a header with a checksum, the identity and the key
(value_format.py); ``get_many`` refuses any value that does not match, counts it and treats
it as a miss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from radixkv.l2.url import parse_url


class L2Store(Protocol):
    """What the sidecar calls. Implementations: RedisStore (redis://, rediss://, unix://) and
    FileStore (file:). All methods are thread safe."""

    def get_many(self, keys: Sequence[bytes], *, identity: bytes | None = None) -> list[memoryview | None]:
        """One entry per key: the payload as a read-only bytes-like view (no copy; ``bytes(v)``
        for a copy), or None on a miss, a refused value (checksum, length, identity, key), a
        timeout, or the store down. A value written for another identity than the key's (the
        identity digest a block_keys key starts with, or ``identity=`` / open_l2's
        ``identity``) is refused. Raises ValueError only for malformed ``keys``, or a block key
        made for another identity than an ``identity=`` given."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, object]], *, identity: bytes | None = None) -> int:
        """Store ``(key, payload)`` pairs (payload: any C-contiguous bytes-like buffer, or a
        list of them meaning their concatenation, e.g. a block's regions: no join needed); the
        number stored. Never raises because the store is down, full or slow; raises ValueError
        only for malformed ``items``."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters since open: reads, hits, writes, errors, refused, skipped, outages,
        bytes_read, bytes_written, and down (1 during an outage)."""
        ...

    def close(self) -> None:
        """Release connections; the store must not be used afterwards."""
        ...


def open_l2(url: str, *, timeout_s: float = 0.5, **opts) -> L2Store:
    """An L2Store for ``url``: ``redis://[USER:PASSWORD@]HOST[:PORT][/DB]``, ``rediss://...``
    (TLS), ``unix:///PATH[?db=N]``, or ``file:DIR`` (docs/l2.md lists every option).

    Common options: ``identity`` (bytes; default: the one each block key carries), ``backoff_s`` / ``backoff_max_s`` (retry
    delay after an outage, 0.5 / 10 s). Redis: ``ttl_s``, ``key_prefix``, ``username``,
    ``password``, ``keys_per_mget``, ``round_trip_bytes``, ``max_value_bytes``, and redis-py's
    ``ssl_*``, ``max_connections``, ``client_name``. file: ``fsync``, ``file_mode``.
    Connects lazily: an unreachable Redis is not an error here (it is an outage at first use).
    Raises ValueError naming the part of the URL or the option that is wrong; ImportError
    (saying what to install) when redis-py is missing for a Redis URL.
    """
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not (timeout_s > 0 and math.isfinite(timeout_s))
    ):
        raise ValueError(f"L2 timeout_s must be a positive number of seconds, got {timeout_s!r}")
    parsed = parse_url(url)
    if parsed.scheme == "file":
        from radixkv.l2.file_store import FileStore

        return FileStore(parsed, timeout_s=timeout_s, **opts)
    from radixkv.l2.redis_store import RedisStore

    return RedisStore(parsed, timeout_s=float(timeout_s), **opts)
