"""Redis down, slow and full: every call returns in bounded time without raising, losses are
counted, one log line per outage, and the store is used again once Redis is back."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from radixkv.l2 import block_keys, open_l2
from tests.redis_server import RedisServer, need_redis

TIMEOUT_S = 0.3
# Generous: the bound is timeout_s per socket operation; a shared 2-core machine adds noise.
BOUND_S = 5.0


@pytest.fixture
def server(tmp_path):
    need_redis()
    srv = RedisServer(tmp_path).start()
    yield srv
    srv.kill()


def keys_and_payloads(tag: bytes, n: int = 4, size: int = 8192):
    keys = block_keys(b"m", tag, list(range(16 * n)), 16)
    return keys, [bytes([i + 1]) * size for i in range(n)]


def timed(fn, *args, **kwargs):
    start = time.monotonic()
    out = fn(*args, **kwargs)
    return out, time.monotonic() - start


def wait_until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_killed_then_restarted(server, caplog):
    s = open_l2(server.url, identity=b"m", timeout_s=TIMEOUT_S, backoff_s=0.1, backoff_max_s=0.4)
    keys, payloads = keys_and_payloads(b"kill")
    assert s.put_many(list(zip(keys, payloads))) == 4
    server.kill()
    with caplog.at_level(logging.WARNING, logger="radixkv.l2.health"):
        for _ in range(5):  # during the outage: misses, nothing stored, no raise, quick
            got, took = timed(s.get_many, keys)
            assert got == [None] * 4 and took < BOUND_S
            stored, took = timed(s.put_many, list(zip(keys, payloads)))
            assert stored == 0 and took < BOUND_S
        st = s.stats()
        assert st["down"] == 1 and st["outages"] == 1 and st["errors"] >= 4 and st["skipped"] > 0
        server.start()  # back, empty (no persistence): the store finds it again by itself
        assert wait_until(lambda: s.put_many(list(zip(keys, payloads))) == 4)
    assert [bytes(v) for v in s.get_many(keys)] == payloads
    st = s.stats()
    assert st["down"] == 0 and st["outages"] == 1
    lines = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in m for m in lines) == 1, lines  # one line per outage, not per call
    assert sum("is back" in m for m in lines) == 1, lines
    s.close()


def test_down_from_the_start(tmp_path):
    need_redis()
    from tests.redis_server import free_port

    port = free_port()  # nothing listens here yet
    s = open_l2(f"redis://127.0.0.1:{port}/0", timeout_s=TIMEOUT_S, backoff_s=0.1, backoff_max_s=0.2)
    keys, payloads = keys_and_payloads(b"late")
    assert s.get_many(keys) == [None] * 4 and s.put_many(list(zip(keys, payloads))) == 0
    srv = RedisServer(tmp_path, port=port).start()
    try:
        assert wait_until(lambda: s.put_many(list(zip(keys, payloads))) == 4)
        assert [bytes(v) for v in s.get_many(keys)] == payloads
    finally:
        srv.kill()
        s.close()


def test_backoff_spares_a_dead_redis(server):
    """While Redis is down, calls skip instead of connecting each time (no reconnect storm)."""
    s = open_l2(server.url, timeout_s=TIMEOUT_S, backoff_s=5.0, backoff_max_s=5.0)
    keys, _ = keys_and_payloads(b"storm")
    server.kill()
    for _ in range(50):
        assert s.get_many(keys) == [None] * 4
    st = s.stats()
    assert st["errors"] == 4 and st["skipped"] == 49 * 4  # one try, then skips until the delay passes
    s.close()


def test_slow_redis_is_bounded(server):
    s = open_l2(server.url, identity=b"m", timeout_s=TIMEOUT_S, backoff_s=0.1, backoff_max_s=0.2)
    keys, payloads = keys_and_payloads(b"slow")
    assert s.put_many(list(zip(keys, payloads))) == 4
    server.client().execute_command("CLIENT", "PAUSE", "2000", "ALL")  # Redis answers nobody for 2 s
    got, took = timed(s.get_many, keys)
    assert got == [None] * 4 and took < 1.5  # the timeout, not Redis, ended the call
    time.sleep(0.25)  # past the 0.1 s retry delay: the next call probes Redis again
    stored, took = timed(s.put_many, list(zip(keys, payloads)))
    assert stored == 0 and took < 1.5
    assert s.stats()["errors"] == 8
    assert wait_until(lambda: s.get_many(keys)[0] is not None)
    assert [bytes(v) for v in s.get_many(keys)] == payloads
    s.close()


def test_full_redis_stores_fewer(server, caplog):
    raw = server.client()
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", raw.info("memory")["used_memory"] + 1024 * 1024)  # ~1 MiB of room
    s = open_l2(server.url, identity=b"m", timeout_s=TIMEOUT_S)
    keys, payloads = keys_and_payloads(b"full", n=12, size=256 * 1024)
    with caplog.at_level(logging.WARNING, logger="radixkv.l2.health"):
        stored = s.put_many(list(zip(keys, payloads)))
        assert 0 < stored < 12
        assert s.put_many(list(zip(keys, payloads))) < 12  # again: still full, still no raise
    got = s.get_many(keys)
    assert sum(g is not None for g in got) >= stored  # what it took is readable (SET overwrote in place)
    assert all(bytes(g) == p for g, p in zip(got, payloads) if g is not None)
    st = s.stats()
    assert st["errors"] >= 12 - stored and st["down"] == 0  # full is not an outage: reads go on
    assert sum("rejects writes" in r.getMessage() for r in caplog.records) == 1
    # room again (allkeys-lru, the recommended policy): writes succeed
    raw.config_set("maxmemory-policy", "allkeys-lru")
    assert s.put_many(list(zip(keys, payloads))) == 12
    s.close()


def test_threads_during_an_outage(server):
    """Several threads on one store while Redis dies and comes back: no raise, no wrong bytes."""
    s = open_l2(server.url, identity=b"m", timeout_s=TIMEOUT_S, backoff_s=0.05, backoff_max_s=0.2)
    keys, payloads = keys_and_payloads(b"threads")
    failures, stop = [], threading.Event()

    def worker():
        try:
            while not stop.is_set():
                s.put_many(list(zip(keys, payloads)))
                for got, want in zip(s.get_many(keys), payloads):
                    assert got is None or bytes(got) == want
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    server.kill()
    time.sleep(0.5)
    server.start()
    assert wait_until(lambda: s.stats()["down"] == 0 and s.get_many(keys)[0] is not None)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not failures, failures
    assert s.stats()["outages"] >= 1
    s.close()


def test_connections_killed_by_the_server(server):
    """Redis drops our connections (CLIENT KILL, an idle timeout, a proxy restart): the next
    call fails or reconnects, never raises, and the store is used again without a restart."""
    s = open_l2(server.url, identity=b"m", timeout_s=TIMEOUT_S, backoff_s=0.05, backoff_max_s=0.1)
    keys, payloads = keys_and_payloads(b"client-kill")
    assert s.put_many(list(zip(keys, payloads))) == 4
    server.client().execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    s.get_many(keys)  # a dead pooled connection: reconnected, or one failure
    assert wait_until(lambda: s.get_many(keys)[0] is not None)
    assert [bytes(v) for v in s.get_many(keys)] == payloads
    s.close()


def test_read_only_replica_rejects_writes_only(tmp_path, caplog):
    """A URL that points at a read-only replica: writes are rejected and counted (one log line),
    reads go on, and it is not taken for an outage."""
    need_redis()
    from tests.redis_server import free_port

    replica = RedisServer(tmp_path, "--replicaof", "127.0.0.1", str(free_port())).start()  # master never up
    try:
        s = open_l2(replica.url, timeout_s=TIMEOUT_S)
        keys, payloads = keys_and_payloads(b"replica")
        with caplog.at_level(logging.WARNING, logger="radixkv.l2.health"):
            assert s.put_many(list(zip(keys, payloads))) == 0
            assert s.put_many(list(zip(keys, payloads))) == 0
        st = s.stats()
        assert st["errors"] == 8 and st["down"] == 0 and st["outages"] == 0
        assert sum("rejects writes" in r.getMessage() for r in caplog.records) == 1
        assert s.get_many(keys) == [None] * 4 and s.stats()["down"] == 0  # reads still answered
        s.close()
    finally:
        replica.kill()
