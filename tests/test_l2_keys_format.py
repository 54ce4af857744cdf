"""radixkv.l2 without a store: chained block keys, the value header's refusals, URL and option errors."""

from __future__ import annotations

import os
import random

import pytest

from radixkv.l2 import HEADER_BYTES, KEY_BYTES, block_keys, open_l2
from radixkv.l2.url import parse_url
from radixkv.l2.value_format import as_bytes_view, check, digest16, pack

ID_A, ID_B = b"model-a weights+layout", b"model-b weights+layout"


def test_block_keys_chain_like_vllm():
    rng = random.Random(0)
    tokens = [rng.randrange(50_000) for _ in range(100)]
    keys = block_keys(ID_A, b"ns", tokens, 16)
    assert len(keys) == 6 and all(len(k) == KEY_BYTES for k in keys)  # the partial 7th block has no key
    assert {k[:16] for k in keys} == {digest16(ID_A)}  # every key starts with its identity digest
    assert len(set(keys)) == 6
    # equal prefixes give equal keys, from any call (another process computes the same)
    assert block_keys(ID_A, b"ns", tokens[:40], 16) == keys[:2]
    assert block_keys(ID_A, b"ns", tokens + [1, 2, 3], 16)[:6] == keys
    # continuing a chain from a parent gives the same keys
    assert block_keys(ID_A, b"ns", tokens[32:], 16, parent=keys[1]) == keys[2:]
    # another identity, namespace or block size: every key differs
    for other in (
        block_keys(ID_B, b"ns", tokens, 16),
        block_keys(ID_A, b"ns2", tokens, 16),
        block_keys(ID_A, b"", tokens, 16),
    ):
        assert not set(other) & set(keys)
    assert not set(block_keys(ID_A, b"ns", tokens, 8)) & set(keys)
    # one earlier token changed: keys differ from that token's block on, equal before it
    changed = list(tokens)
    changed[37] += 1
    other = block_keys(ID_A, b"ns", changed, 16)
    assert other[:2] == keys[:2] and all(a != b for a, b in zip(other[2:], keys[2:]))
    # the length-prefixed seed: moving bytes between identity and namespace changes the keys
    assert block_keys(b"ab", b"c", tokens, 16) != block_keys(b"a", b"bc", tokens, 16)


def test_block_keys_inputs():
    torch = pytest.importorskip("torch")
    tokens = list(range(-5, 59))  # key tokens may be negative (extra-id mixes)
    assert block_keys(ID_A, b"", torch.tensor(tokens), 16) == block_keys(ID_A, b"", tuple(tokens), 16)
    assert block_keys(ID_A, b"", tokens[:15], 16) == []
    assert block_keys(ID_A, b"", [], 1) == []
    assert len(block_keys(ID_A, b"", [-(2**63), 2**63 - 1], 1)) == 2
    with pytest.raises(ValueError, match="block_size"):
        block_keys(ID_A, b"", tokens, 0)
    with pytest.raises(ValueError, match="block_size"):
        block_keys(ID_A, b"", tokens, True)
    with pytest.raises(ValueError, match="64-bit"):
        block_keys(ID_A, b"", [2**63], 1)
    with pytest.raises(ValueError, match="integers"):
        block_keys(ID_A, b"", ["a"], 1)
    with pytest.raises(ValueError, match="identity"):
        block_keys("model", b"", tokens, 16)
    with pytest.raises(ValueError, match="namespace_key"):
        block_keys(ID_A, None, tokens, 16)
    with pytest.raises(ValueError, match="parent"):
        block_keys(ID_A, b"", tokens, 16, parent=b"short")
    with pytest.raises(ValueError, match="parent"):  # a parent key of another model
        block_keys(ID_A, b"", tokens, 16, parent=block_keys(ID_B, b"", tokens, 16)[0])


def test_value_header_refusals():
    key, other_key = block_keys(ID_A, b"", list(range(32)), 16)
    payload = os.urandom(5000)
    ident = digest16(ID_A)
    value = bytes(pack(ident, key, memoryview(payload)))
    assert len(value) == HEADER_BYTES + len(payload)
    got, reason = check(value, ident, key)
    assert reason is None and bytes(got) == payload
    assert check(value, digest16(ID_B), key) == (None, "identity")
    assert check(value, ident, other_key) == (None, "key")
    assert check(value[:-1], ident, key) == (None, "length")
    assert check(value + b"\0", ident, key) == (None, "length")
    assert check(value[: HEADER_BYTES - 1], ident, key) == (None, "short")
    assert check(b"", ident, key) == (None, "short")
    assert check(b"garbage" * 20, ident, key) == (None, "magic")
    # a flipped bit anywhere is refused; in the header's checked fields by what it breaks
    for pos in [0, 5, 6, 10, 20, 40, 50, 70, HEADER_BYTES, HEADER_BYTES + 2500, len(value) - 1]:
        damaged = bytearray(value)
        damaged[pos] ^= 0x04
        got, reason = check(damaged, ident, key)
        assert got is None and reason is not None, pos
    # an empty payload is a value like any other
    empty = pack(ident, key, memoryview(b""))
    got, reason = check(empty, ident, key)
    assert reason is None and got.nbytes == 0


def test_payload_buffers():
    np = pytest.importorskip("numpy")
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = as_bytes_view(arr)
    assert view.nbytes == 48 and view.format == "B"
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes_view(arr[:, ::2])


@pytest.mark.parametrize(
    "url, part",
    [
        ("redis://:badport", "port"),
        ("redis://host:70000", "port"),
        ("redis://host:0/0", "port"),
        ("redis://", "host"),
        ("redis://host:6379/x", "database"),
        ("redis://host:6379/0?ssl=1", "query"),
        ("http://host", "scheme"),
        ("host:6379", "scheme"),
        ("", "non-empty"),
        ("unix://", "socket path"),
        ("unix:///tmp/r.sock?db=x", "database"),
        ("unix:///tmp/r.sock?dbb=1", "query"),
        ("file:", "directory"),
    ],
)
def test_bad_urls_name_the_part(url, part):
    with pytest.raises(ValueError, match=part):
        open_l2(url)


def test_urls_parse():
    u = parse_url("rediss://alice:p%40ss@cache.internal:6380/3")
    assert (u.scheme, u.host, u.port, u.db, u.username, u.password) == (
        "rediss",
        "cache.internal",
        6380,
        3,
        "alice",
        "p@ss",
    )
    assert "p@ss" not in u.redacted() and "***" in u.redacted()
    assert parse_url("redis://h").port == 6379
    assert parse_url("unix:///run/r.sock?db=2").path == "/run/r.sock"
    assert parse_url("file:///mnt/x").path == parse_url("file:/mnt/x").path == "/mnt/x"


def test_bad_options(tmp_path):
    pytest.importorskip("redis")
    with pytest.raises(ValueError, match="timeout_s"):
        open_l2("redis://h", timeout_s=0)
    with pytest.raises(ValueError, match="timeout_s"):
        open_l2("redis://h", timeout_s=float("inf"))
    with pytest.raises(ValueError, match="bogus"):
        open_l2("redis://h", bogus=1)
    with pytest.raises(ValueError, match="rediss"):
        open_l2("redis://h", ssl_ca_certs="/x")
    with pytest.raises(ValueError, match="password"):
        open_l2("redis://:a@h", password="b")
    with pytest.raises(ValueError, match="ttl_s"):
        open_l2("redis://h", ttl_s=0)
    with pytest.raises(ValueError, match="identity"):
        open_l2("redis://h", identity="str")
    with pytest.raises(ValueError, match="does not exist"):
        open_l2(f"file:{tmp_path}/missing")
    with pytest.raises(ValueError, match="fsnc"):
        open_l2(f"file:{tmp_path}", fsnc=True)
    with pytest.raises(ValueError, match="ttl_s"):
        open_l2("redis://h", ttl_s="60")
    with pytest.raises(ValueError, match="backoff"):
        open_l2("redis://h", backoff_s="1")
    with pytest.raises(ValueError, match="backoff"):
        open_l2(f"file:{tmp_path}", backoff_s=2, backoff_max_s=1)
    with pytest.raises(ValueError, match="keys_per_mget"):
        open_l2("redis://h", keys_per_mget=0)
    with pytest.raises(ValueError, match="key_prefix"):
        open_l2("redis://h", key_prefix="radixkv:")
    with pytest.raises(ValueError, match="file_mode"):
        open_l2(f"file:{tmp_path}", file_mode="600")
