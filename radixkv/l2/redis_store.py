"""The shared tier on Redis or Valkey (redis-py): MGET reads, pipelined SET writes (resp_sets.py).

One ``RedisStore`` is safe to share between threads: redis-py's connection pool hands each
call its own connection, the counters and the outage state sit behind one lock (health.py).
No call raises because Redis is down, slow, full or refuses us: every socket connect and read
is bounded by ``timeout_s``, redis-py's own retries are off (a retry would multiply the
bound), and a failure starts an outage during which calls return misses at once until one
probe finds Redis back (health.py). Values are checked on the way out (value_format.py).

Round trips carry about ``round_trip_bytes`` (1 MiB) each: small blocks go many to a round
trip (an MGET of up to ``keys_per_mget`` keys, a pipeline of SETs), large ones one each, so
a reply never makes redis-py grow one buffer (by copying) to hundreds of MiB. Measured once
with plain redis-py (load 10 on the 2-core machine, noisy): 8 values of 2 MiB read 88/s in one
MGET, 121/s one GET each; 512 KiB no different. Reads size their MGETs by the average value
read or written so far.

Memory: a write sends a large payload (256 KiB or more) straight from the caller's buffers
and copies small ones, framing and all, into one buffer per round trip that its thread keeps
(resp_sets.py); a read returns views into the replies redis-py allocated (no copy).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Sequence

from radixkv.l2.health import Health
from radixkv.l2.inputs import checked_items, checked_keys, identities, identity_digest
from radixkv.l2.resp_sets import SetFrames
from radixkv.l2.url import L2Url
from radixkv.l2.value_format import HEADER_BYTES, check, pack_header, parts_nbytes

logger = logging.getLogger(__name__)

# Options passed through to redis.Redis unchanged (TLS files and checks, pool size, name).
PASSTHROUGH = (
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_ca_data",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_cert_reqs",
    "ssl_check_hostname",
    "max_connections",
    "client_name",
    "socket_read_size",
)
MAX_VALUE_BYTES = 512 * 1024 * 1024  # Redis's default proto-max-bulk-len


def _redis_module():
    try:
        import redis
    except ImportError:
        raise ImportError(
            "an L2 on Redis needs redis-py: pip install 'radixkv[sidecar]' (or pip install 'redis>=5,<9')"
        ) from None
    return redis


class RedisStore:
    """L2Store on one Redis/Valkey server (see l2_store.L2Store for the contract)."""

    def __init__(
        self,
        url: L2Url,
        *,
        timeout_s: float,
        identity: bytes | None = None,
        ttl_s: float | None = None,
        key_prefix: bytes = b"radixkv:",
        username: str | None = None,
        password: str | None = None,
        backoff_s: float = 0.5,
        backoff_max_s: float = 10.0,
        keys_per_mget: int = 64,
        round_trip_bytes: int = 1024 * 1024,
        max_value_bytes: int = MAX_VALUE_BYTES,
        **redis_opts,
    ):
        redis = _redis_module()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        unknown = set(redis_opts) - set(PASSTHROUGH)
        if unknown:
            raise ValueError(
                f"L2 option(s) {sorted(unknown)} unknown for {url.scheme}:// (allowed also: {', '.join(PASSTHROUGH)})"
            )
        if url.scheme != "rediss" and any(k.startswith("ssl_") for k in redis_opts):
            raise ValueError(
                f"L2 TLS options {sorted(k for k in redis_opts if k.startswith('ssl_'))} need a rediss:// URL"
            )
        if ttl_s is not None and (
            isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0
        ):
            raise ValueError(f"L2 ttl_s must be > 0 seconds or None, got {ttl_s!r}")
        if not isinstance(key_prefix, bytes):
            raise ValueError(f"L2 key_prefix must be bytes, got {type(key_prefix).__name__}")
        for name, value in (
            ("keys_per_mget", keys_per_mget),
            ("round_trip_bytes", round_trip_bytes),
            ("max_value_bytes", max_value_bytes),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"L2 {name} must be a positive int, got {value!r}")
        for name, url_value, opt_value in (
            ("username", url.username, username),
            ("password", url.password, password),
        ):
            if url_value is not None and opt_value is not None and url_value != opt_value:
                raise ValueError(f"L2 {name} given both in the URL and as an option, differently")
        self.url = url
        self.name = url.redacted()
        self._identity = identity_digest(identity)
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._prefix = key_prefix
        self._keys_per_mget = keys_per_mget
        self._round_trip_bytes = round_trip_bytes
        self._value_bytes = 0.0  # running average size of the values read or written (0: none yet)
        self._max_value_bytes = max_value_bytes
        self.health = Health(self.name, backoff_s, backoff_max_s)
        self._local = threading.local()
        redis_opts.setdefault("socket_read_size", 1024 * 1024)  # fewer, larger reads of big replies
        kwargs = dict(
            db=url.db,
            username=username if username is not None else url.username,
            password=password if password is not None else url.password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # our own outage handling bounds the time; no hidden retries
            health_check_interval=0,
            **redis_opts,
        )
        if url.scheme == "unix":
            kwargs["unix_socket_path"] = url.path
        else:
            kwargs.update(host=url.host, port=url.port, ssl=url.scheme == "rediss")
        accepted = inspect.signature(redis.Redis.__init__).parameters
        if "socket_read_size" not in accepted:  # older redis-py (5.0) takes it through a pool only
            kwargs.pop("socket_read_size")
        self._client = redis.Redis(**kwargs)
        self._errors = (redis.RedisError, OSError)
        self._response_error = redis.ResponseError

    def _redis_key(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def get_many(self, keys: Sequence[bytes], *, identity: bytes | None = None) -> list[memoryview | None]:
        """One payload view per key (None: miss, refused, or Redis down/slow); round trips of
        about ``round_trip_bytes`` each. Never raises for Redis' sake: a failed round trip ends
        the call (what earlier ones read is returned) and starts an outage."""
        keys = checked_keys(keys, "get_many")
        fixed = self._identity if identity is None else identity_digest(identity)
        want = identities(keys, fixed, "get_many")
        out: list[memoryview | None] = [None] * len(keys)
        self.health.add(reads=len(keys))
        if not keys:
            return out
        if not self.health.may_try():
            self.health.add(skipped=len(keys))
            return out
        replies: list[bytes | None] = []
        step = self._keys_per_round_trip()
        try:
            for start in range(0, len(keys), step):
                # MGET even for one key: it answers nil for a key of another type, GET an error
                replies += self._client.mget([self._redis_key(k) for k in keys[start : start + step]])
        except self._errors as exc:
            self.health.failed("get", exc)
            self.health.add(errors=len(keys) - len(replies))
            replies += [None] * (len(keys) - len(replies))
        else:
            self.health.succeeded()
        hits = nbytes = 0
        self._note_sizes([len(v) for v in replies if v is not None])
        for i, (key, value) in enumerate(zip(keys, replies)):
            if value is None:
                continue
            payload, reason = check(value, want[i], key)
            if payload is None:
                self.health.refused(reason, key)
                continue
            out[i] = payload
            hits += 1
            nbytes += payload.nbytes
        self.health.add(hits=hits, bytes_read=nbytes)
        return out

    def _note_sizes(self, sizes: list[int]) -> None:
        """Fold the sizes of values read or written into the running average that sizes MGETs
        (a racy float update between threads only blurs an average)."""
        if sizes:
            mean = sum(sizes) / len(sizes)
            self._value_bytes = 0.5 * self._value_bytes + 0.5 * mean if self._value_bytes else mean

    def _keys_per_round_trip(self) -> int:
        if not self._value_bytes:
            return self._keys_per_mget
        return max(1, min(self._keys_per_mget, int(self._round_trip_bytes // self._value_bytes)))

    def put_many(self, items: Sequence[tuple[bytes, object]], *, identity: bytes | None = None) -> int:
        """Store each ``(key, payload)``; the number stored. Never raises for Redis' sake: a value
        over ``max_value_bytes`` or one Redis rejects (full under noeviction, read-only) is
        counted in errors and logged once; Redis down or slow ends the call (bounded time)."""
        checked = checked_items(items)
        fixed = self._identity if identity is None else identity_digest(identity)
        idents = identities([k for k, _ in checked], fixed, "put_many")
        todo = [
            (k, v, d)
            for (k, v), d in zip(checked, idents)
            if parts_nbytes(v) + HEADER_BYTES <= self._max_value_bytes
        ]
        if len(todo) < len(checked):
            self.health.write_rejected(
                len(checked) - len(todo), f"value over max_value_bytes={self._max_value_bytes}"
            )
        if not todo:
            return 0
        self._note_sizes([HEADER_BYTES + parts_nbytes(v) for _, v, _ in todo])
        if not self.health.may_try():
            self.health.add(skipped=len(todo))
            return 0
        stored = start = 0
        while start < len(todo):
            batch_start, batch_bytes = start, 0
            while start < len(todo) and (start == batch_start or batch_bytes < self._round_trip_bytes):
                batch_bytes += HEADER_BYTES + parts_nbytes(todo[start][1])
                start += 1
            frames = SetFrames(self._ttl_ms)
            for key, parts, ident in todo[batch_start:start]:
                frames.add(self._redis_key(key), pack_header(ident, key, parts), parts)
            done = self._put_batch(frames)
            if done is None:  # Redis down or slow: the rest is not tried
                self.health.add(errors=len(todo) - batch_start)
                return stored
            stored += done
        return stored

    def _scratch(self, nbytes: int) -> memoryview:
        """A buffer of at least ``nbytes`` to pack values into: this thread's reusable one (a
        fresh allocation per value cost more than the copy itself, measured on this machine),
        at most 4 x ``round_trip_bytes`` per writing thread; a one-off for a larger batch (one
        huge value), so that is not kept."""
        if nbytes == 0:
            return memoryview(b"")
        if nbytes > 4 * self._round_trip_bytes:
            return memoryview(bytearray(nbytes))
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            size = min(4 * self._round_trip_bytes, 1 << (nbytes - 1).bit_length())  # grows by doubling
            buf = self._local.buf = bytearray(max(size, nbytes))  # a new one: views of the old may live
        return memoryview(buf)

    def _connection(self):
        pool = self._client.connection_pool
        try:
            return pool.get_connection()
        except TypeError:  # redis-py before 5.3 wants a command name (later ones warn about it)
            return pool.get_connection("SET")

    def _put_batch(self, frames: SetFrames) -> int | None:
        """Send one round trip of SETs and read every reply; the number stored, or None when
        Redis is down or slow (an outage starts). Replies Redis refused (OOM, READONLY) count
        as rejected writes."""
        chunks = frames.chunks(self._scratch(frames.inline_bytes))
        try:
            conn = self._connection()
        except self._errors as exc:
            self.health.failed("put", exc)
            return None
        try:
            conn.send_packed_command(chunks)
            results = []
            for _ in frames.value_bytes:
                try:
                    results.append(conn.read_response())
                except self._response_error as exc:  # this SET refused; the others' replies follow
                    results.append(exc)
        except self._errors as exc:
            conn.disconnect()
            self.health.failed("put", exc)
            return None
        except BaseException:
            conn.disconnect()  # half-read replies: the connection cannot be reused
            raise
        finally:
            del chunks
            self._client.connection_pool.release(conn)
        self.health.succeeded()
        ok = [r in (b"OK", "OK", True) for r in results]
        rejected = [r for r, good in zip(results, ok) if not good]
        if rejected:
            self.health.write_rejected(len(rejected), f"{type(rejected[0]).__name__}: {rejected[0]}")
        else:
            self.health.writes_accepted()
        stored = sum(ok)
        if stored:
            self.health.add(
                writes=stored, bytes_written=sum(n for n, good in zip(frames.value_bytes, ok) if good)
            )
        return stored

    def stats(self) -> dict[str, int]:
        """Counters: reads/hits (keys), writes (values stored), errors, refused, skipped (keys not
        tried during an outage), outages, bytes_read, bytes_written; down (1 during an outage)."""
        return self.health.stats()

    def close(self) -> None:
        """Close every pooled connection; the store must not be used afterwards."""
        try:
            self._client.close()
        except self._errors as exc:  # closing a dead connection
            logger.debug("L2 %s close: %s", self.name, exc)
