"""radixkv.l2 against a real redis-server: round trips, misses, refused values, two clients,
AUTH, a Unix socket, TLS, TTL, one store shared by threads."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import threading

import pytest

from radixkv.l2 import HEADER_BYTES, block_keys, open_l2
from radixkv.l2.value_format import digest16, pack
from tests.redis_server import RedisServer, need_redis

ID_A, ID_B = b"model-a", b"model-b"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_redis()
    srv = RedisServer(tmp_path_factory.mktemp("redis"), unix_socket=True).start()
    yield srv
    srv.kill()


@pytest.fixture
def store(server):
    s = open_l2(server.url, identity=ID_A)
    yield s
    s.close()


def blocks(n, size=4096, seed=0):
    rng = __import__("random").Random(seed)
    return [rng.randbytes(size) for _ in range(n)]


def test_round_trip_and_miss(store):
    keys = block_keys(ID_A, b"round", list(range(80)), 16)
    payloads = blocks(5)
    assert store.put_many(list(zip(keys, payloads))) == 5
    missing = block_keys(ID_A, b"round-missing", list(range(16)), 16)
    got = store.get_many(keys + missing)
    assert [bytes(g) for g in got[:5]] == payloads and got[5] is None
    assert store.get_many([]) == [] and store.put_many([]) == 0
    s = store.stats()
    assert (s["reads"], s["hits"], s["writes"], s["errors"], s["refused"], s["down"]) == (6, 5, 5, 0, 0, 0)


def test_payload_in_pieces(store):
    """A payload given as a list of buffers (a block's regions) is stored as their concatenation."""
    np = pytest.importorskip("numpy")
    key = block_keys(ID_A, b"pieces", list(range(16)), 16)[0]
    regions = [np.full(1000, i, dtype=np.uint16) for i in range(5)] + [b"", bytearray(b"tail")]
    assert store.put_many([(key, regions)]) == 1
    assert bytes(store.get_many([key])[0]) == b"".join(bytes(r) for r in regions)
    with pytest.raises(ValueError, match="list of them"):
        store.put_many([(key, [b"ok", 5])])


@pytest.mark.parametrize("ttl_s", [None, 60])
def test_small_and_large_values_in_one_call(server, ttl_s):
    """Small values are framed into one buffer, large ones sent from the caller's memory (and
    in pieces): one call mixing them, with and without PX, stores each whole."""
    s = open_l2(server.url, ttl_s=ttl_s, round_trip_bytes=4 << 20)
    keys = block_keys(ID_A, b"mixed%d" % (ttl_s or 0), list(range(16 * 6)), 16)
    big = os.urandom(300_000)
    payloads = [b"s0", big, b"s2" * 1000, [big[:1000], big[1000:]], bytes(256 * 1024), b""]
    assert s.put_many(list(zip(keys, payloads))) == 6
    want = [bytes(p) if not isinstance(p, list) else b"".join(p) for p in payloads]
    assert [bytes(v) for v in s.get_many(keys)] == want
    ttls = [server.client().pttl(b"radixkv:" + k.hex().encode()) for k in keys]
    assert all(t == -1 for t in ttls) if ttl_s is None else all(0 < t <= 60_000 for t in ttls)
    s.close()


def test_round_trips_of_bounded_size(server, store):
    """A call's keys are spread over several round trips (MGETs of keys_per_mget keys, then
    sized by the values seen; SET pipelines of about round_trip_bytes): same answers."""
    keys = block_keys(ID_A, b"round-trips", list(range(16 * 7)), 16)
    payloads = blocks(7, size=4096, seed=9)
    small = open_l2(server.url, keys_per_mget=3, round_trip_bytes=9000)
    assert small.put_many(list(zip(keys, payloads))) == 7
    for _ in range(2):  # 2 keys an MGET (9000 // 4176, the size the writes showed), not 3
        assert [bytes(v) for v in small.get_many(keys)] == payloads
    assert small.stats()["hits"] == 14 and small._keys_per_round_trip() == 2
    reader = open_l2(server.url, keys_per_mget=3, round_trip_bytes=9000)  # reads only: learns from them
    assert reader._keys_per_round_trip() == 3
    assert [bytes(v) for v in reader.get_many(keys)] == payloads
    assert reader._keys_per_round_trip() == 2 and [bytes(v) for v in reader.get_many(keys)] == payloads
    small.close()
    reader.close()


def test_a_real_block_size_and_buffers(store):
    np = pytest.importorskip("numpy")
    # 16 tokens x 32 layers x 2 (K, V) x 8 heads x 128 x 2 bytes = 2 MiB
    block = np.random.default_rng(0).integers(0, 2**16, size=(32, 2, 8, 16, 128), dtype=np.uint16)
    key = block_keys(ID_A, b"big", list(range(16)), 16)[0]
    assert store.put_many([(key, block)]) == 1
    (got,) = store.get_many([key])
    assert got.nbytes == 2 * 1024 * 1024
    assert (np.frombuffer(got, dtype=np.uint16).reshape(block.shape) == block).all()


def test_two_machines_share_blocks(server):
    a = open_l2(server.url, identity=ID_A)
    b = open_l2(server.url, identity=ID_A)
    tokens = list(range(1000, 1064))
    keys_a = block_keys(ID_A, b"doc", tokens, 16)
    payloads = blocks(4, seed=1)
    assert a.put_many(list(zip(keys_a, payloads))) == 4
    keys_b = block_keys(ID_A, b"doc", tokens + [7, 7], 16)  # B computes the same chain itself
    assert [bytes(v) for v in b.get_many(keys_b)] == payloads
    # another model or namespace reads nothing of it
    assert b.get_many(block_keys(ID_B, b"doc", tokens, 16), identity=ID_B) == [None] * 4
    assert b.get_many(block_keys(ID_A, b"other-tenant", tokens, 16)) == [None] * 4
    a.close()
    b.close()


MACHINE_B = """
import sys
from radixkv.l2 import block_keys, open_l2
l2 = open_l2(sys.argv[1])
keys = block_keys(b"model-a", b"doc", list(range(5000, 5000 + 16 * 3 + 5)), 16)  # computed here
got = l2.get_many(keys)
print([None if v is None else bytes(v).hex() for v in got], l2.stats()["hits"])
"""


def test_another_process_reads_what_one_wrote(server):
    """Machine B is another process: it computes the keys from the tokens itself."""
    a = open_l2(server.url)
    keys = block_keys(ID_A, b"doc", list(range(5000, 5048)), 16)
    payloads = blocks(3, size=1000, seed=3)
    assert a.put_many(list(zip(keys, payloads))) == 3
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", MACHINE_B, server.url], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{[p.hex() for p in payloads]} 3"
    a.close()


def test_damaged_and_foreign_values_are_refused(server, store, caplog):
    raw = server.client()
    keys = block_keys(ID_A, b"damage", list(range(16 * 6)), 16)
    payloads = blocks(6, seed=2)
    assert store.put_many(list(zip(keys, payloads))) == 6
    rkey = [b"radixkv:" + k.hex().encode() for k in keys]
    raw.set(rkey[0], b"garbage")  # someone else's string
    value = bytearray(raw.get(rkey[1]))
    value[HEADER_BYTES + 100] ^= 1  # one flipped bit in the payload
    raw.set(rkey[1], bytes(value))
    raw.set(rkey[2], raw.get(rkey[2])[:-10])  # truncated
    raw.set(rkey[3], raw.get(rkey[4]))  # a sound value copied under the wrong key
    raw.set(rkey[5], bytes(pack(digest16(ID_B), keys[5], memoryview(b"model b's block"))))  # foreign identity
    raw.rpush(b"radixkv:" + b"ff" * 32, b"a list")  # another type under a key
    with caplog.at_level(logging.WARNING, logger="radixkv.l2.health"):
        got = store.get_many(keys + [b"\xff" * 32])
        again = store.get_many(keys)
    assert got == [None, None, None, None, payloads[4], None, None]
    assert again == got[:6]
    s = store.stats()
    assert s["refused"] == 10 and s["hits"] == 2 and s["errors"] == 0
    kinds = sorted(
        re.search(r"kind=(\w+)", r.getMessage())[1] for r in caplog.records if "refused" in r.getMessage()
    )
    assert kinds == ["checksum", "identity", "key", "length", "short"]  # once per kind, not per value


def test_identity_comes_with_the_key(server):
    """A store opened without identity= checks each value against the identity its block key
    carries; an identity= that contradicts a block key is a caller's bug (ValueError)."""
    plain = open_l2(server.url)
    keys = block_keys(ID_A, b"id", list(range(32)), 16)
    assert plain.put_many([(keys[0], b"a0"), (keys[1], b"a1")]) == 2
    assert [bytes(v) for v in open_l2(server.url, identity=ID_A).get_many(keys)] == [b"a0", b"a1"]
    with pytest.raises(ValueError, match="another identity"):
        plain.put_many([(keys[0], b"b0")], identity=ID_B)
    with pytest.raises(ValueError, match="another identity"):
        plain.get_many(keys, identity=ID_B)
    # a key of another shape: the identity given, or none
    assert plain.put_many([(b"custom-key", b"v")], identity=ID_B) == 1
    assert bytes(plain.get_many([b"custom-key"], identity=ID_B)[0]) == b"v"
    assert plain.get_many([b"custom-key"]) == [None] and plain.stats()["refused"] == 1
    plain.close()


def test_ttl(server):
    s = open_l2(server.url, ttl_s=30)
    key = block_keys(b"", b"ttl", list(range(16)), 16)[0]
    assert s.put_many([(key, b"v")]) == 1
    assert 0 < server.client().pttl(b"radixkv:" + key.hex().encode()) <= 30_000
    s.close()


def test_unix_socket_and_db(server):
    s = open_l2(f"unix://{server.unix_path}?db=2", identity=ID_A)
    key = block_keys(ID_A, b"unix", list(range(16)), 16)[0]
    assert s.put_many([(key, b"over the socket")]) == 1
    assert bytes(s.get_many([key])[0]) == b"over the socket"
    assert server.client().exists(b"radixkv:" + key.hex().encode()) == 0  # db 2, not db 0
    s.close()


def test_bad_items_raise_value_error(store):
    with pytest.raises(ValueError, match="key 0"):
        store.get_many(["text"])
    with pytest.raises(ValueError, match="list of bytes"):
        store.get_many(b"one key")
    with pytest.raises(ValueError, match="tuple"):
        store.put_many([b"k"])
    with pytest.raises(ValueError, match="payload"):
        store.put_many([(b"k", 5)])
    with pytest.raises(ValueError, match="bytes"):
        store.put_many([(b"", b"v")])


def test_value_too_big_is_counted_not_sent(server):
    s = open_l2(server.url, max_value_bytes=1000)
    assert s.put_many([(b"k1", bytes(2000)), (b"k2", bytes(10))]) == 1
    assert s.stats()["errors"] == 1 and s.get_many([b"k1"]) == [None]
    s.close()


def test_auth(tmp_path):
    need_redis()
    # alice: the least an ACL user needs (docs/l2.md): these keys, GET/MGET/SET, SELECT for db != 0
    alice_acl = ["--user", "alice", "on", ">pw", "~radixkv:*", "+get", "+mget", "+set", "+select"]
    srv = RedisServer(tmp_path, "--requirepass", "s3cret:@x", *alice_acl).start()
    try:
        key = block_keys(b"", b"auth", list(range(16)), 16)[0]
        good = open_l2(f"redis://:{'s3cret%3A%40x'}@127.0.0.1:{srv.port}/1")
        assert good.put_many([(key, b"secret block")]) == 1
        alice = open_l2(f"redis://127.0.0.1:{srv.port}/1", username="alice", password="pw")
        assert bytes(alice.get_many([key])[0]) == b"secret block"
        assert alice.put_many([(key, b"alice's block")]) == 1
        for bad in (open_l2(srv.url), open_l2(srv.url, password="wrong")):
            assert bad.get_many([key]) == [None] and bad.put_many([(key, b"x")]) == 0  # no raise
            s = bad.stats()
            assert s["errors"] == 1 and s["skipped"] == 1 and s["down"] == 1
            bad.close()
        assert bytes(good.get_many([key])[0]) == b"alice's block"
        good.close()
        alice.close()
    finally:
        srv.kill()


def test_tls(tmp_path):
    need_redis()
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make a test certificate)")
    ca, crt, pkey = (str(tmp_path / n) for n in ("ca.pem", "server.pem", "server.key"))
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", pkey, "-out", crt, "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    shutil.copy(crt, ca)
    from tests.redis_server import free_port

    tls_port = free_port()
    args = ["--tls-port", str(tls_port), "--tls-cert-file", crt, "--tls-key-file", pkey]
    args += ["--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]
    try:
        srv = RedisServer(tmp_path, *args).start()
    except RuntimeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server has no TLS: {exc}")
        raise
    try:
        key = block_keys(b"", b"tls", list(range(16)), 16)[0]
        s = open_l2(f"rediss://127.0.0.1:{tls_port}/0", ssl_ca_certs=ca)
        assert s.put_many([(key, b"over TLS")]) == 1
        assert bytes(s.get_many([key])[0]) == b"over TLS"
        s.close()
        untrusted = open_l2(f"rediss://127.0.0.1:{tls_port}/0")  # the system CAs do not know ours
        assert untrusted.get_many([key]) == [None] and untrusted.stats()["errors"] == 1
        untrusted.close()
    finally:
        srv.kill()


def test_one_store_many_threads(server):
    s = open_l2(server.url, identity=ID_A)
    failures = []

    def worker(t):
        try:
            for i in range(20):
                keys = block_keys(ID_A, f"thread{t}".encode(), list(range(i, i + 48)), 16)
                size = 3000 + t if i % 5 else 300_000 + t  # small values framed inline, large sent as is
                payloads = [os.urandom(size) for _ in keys]
                assert s.put_many(list(zip(keys, payloads))) == 3
                assert [bytes(v) for v in s.get_many(keys)] == payloads
        except BaseException as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    st = s.stats()
    assert (st["writes"], st["hits"], st["reads"], st["errors"], st["refused"]) == (360, 360, 360, 0, 0)
    s.close()


def test_hostile_values(server, store):
    """Values nobody should find under a key: a big blob, a header claiming a huge length, an
    empty string, a sound header over a missing payload. Each is refused, none raises."""
    raw = server.client()
    keys = block_keys(ID_A, b"hostile", list(range(16 * 5)), 16)
    rkey = [b"radixkv:" + k.hex().encode() for k in keys]
    sound = bytes(pack(digest16(ID_A), keys[2], memoryview(b"payload")))
    raw.set(rkey[0], os.urandom(16 << 20))
    raw.set(rkey[1], sound[:8] + (2**64 - 1).to_bytes(8, "little") + sound[16:])
    raw.set(rkey[2], sound[:HEADER_BYTES])
    raw.set(rkey[3], b"")
    raw.set(rkey[4], sound + sound)  # two values glued together
    assert store.get_many(keys) == [None] * 5
    assert store.stats()["refused"] == 5 and store.stats()["errors"] == 0
