"""Pieces of the demo without a server: config precedence, text streaming, metrics, model."""

from __future__ import annotations

import random

import pytest

from demo.config import Config, from_args
from demo.engine.textstream import TextStream
from demo.metrics import Histogram


def test_config_defaults_env_and_flags():
    c = from_args([], env={})
    assert (c.host, c.port, c.model, c.reuse, c.block_size, c.api_keys, c.admin_token) == (
        "127.0.0.1",
        8000,
        "builtin",
        True,
        16,
        (),
        None,
    )
    env = {
        "RADIXKV_REUSE": "0",
        "RADIXKV_BLOCK_SIZE": "32",
        "RADIXKV_PORT": "9000",
        "RADIXKV_API_KEYS": "a, b,",
        "RADIXKV_ADMIN_TOKEN": "t",
        "RADIXKV_CACHE_TOKENS": "4096",
    }
    c = from_args([], env=env)
    assert (c.reuse, c.block_size, c.port, c.api_keys, c.admin_token, c.cache_tokens) == (
        False,
        32,
        9000,
        ("a", "b"),
        "t",
        4096,
    )
    c = from_args(["--port", "9100", "--block-size", "8", "--api-keys", "z"], env=env)
    assert (c.port, c.block_size, c.api_keys, c.reuse) == (9100, 8, ("z",), False)  # flags win
    assert from_args(["--no-reuse"], env={}).reuse is False


@pytest.mark.parametrize(
    "env,match",
    [
        ({"RADIXKV_BLOCK_SIZE": "12"}, "power of two"),
        ({"RADIXKV_REUSE": "maybe"}, "RADIXKV_REUSE"),
        ({"RADIXKV_PORT": "x"}, "RADIXKV_PORT"),
        ({"RADIXKV_CACHE_TOKENS": "3"}, "cache_tokens"),
    ],
)
def test_config_rejects_bad_values(env, match):
    with pytest.raises(ValueError, match=match):
        from_args([], env=env)


def test_config_validates_dtype_and_device():
    with pytest.raises(ValueError, match="dtype"):
        Config(dtype="int8")
    with pytest.raises(ValueError, match="device"):
        Config(device="tpu")
    assert Config(device="cpu").resolve_device() == "cpu"


def _chars(ids):
    return "".join(map(chr, ids))


def test_textstream_holds_back_partial_stop_and_cuts():
    s = TextStream(_chars, stop=["STOP", "xy"])
    out = [s.push([ord(c)]) for c in "abST"]
    assert "".join(out) == "ab"  # "ST" may start a stop string
    assert s.push([ord("O")]) == "" and s.push([ord("P")]) == "" and s.stopped and s.text == "ab"
    s = TextStream(_chars, stop=["STOP"])
    for c in "abST":
        s.push([ord(c)])
    assert s.finish() == "ST" and s.text == "abST"  # a partial stop at the end is text


def test_textstream_random_chunks_never_leak_a_stop():
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 30)))
        stops = [
            "".join(rng.choice("abc") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(0, 3))
        ]
        s = TextStream(_chars, stop=stops)
        streamed, i = "", 0
        while i < len(text) and not s.stopped:
            n = rng.randrange(1, 4)
            streamed += s.push([ord(c) for c in text[i : i + n]])
            i += n
        streamed += s.finish()
        assert text.startswith(streamed) and not any(x in streamed for x in stops)
        if streamed != text:  # cut exactly where a stop string starts
            assert s.stopped and any(text[len(streamed) :].startswith(x) for x in stops)
        else:
            assert not any(x in text for x in stops)


def test_textstream_random_bytes_never_leak_a_stop():
    """Byte-level tokens split characters, as byte-level BPE does: a stop string may be
    completed by the second half of a character (it leaked when that was not checked)."""

    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    rng = random.Random(1)
    alphabet = "abé✓"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 20)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4)))
            for _ in range(rng.randrange(1, 3))
        ]
        data, s, streamed, i = text.encode(), TextStream(decode, stop=stops), "", 0
        while i < len(data) and not s.stopped:
            n = rng.randrange(1, 4)
            streamed += s.push(list(data[i : i + n]))
            i += n
        streamed += s.finish()
        assert streamed == s.text and text.startswith(streamed), (text, stops, streamed)
        assert not any(x in streamed for x in stops), (text, stops, streamed)  # no leak
        # Cut where a stop starts: no earlier than the first one in the text, no later than
        # the first one completed when reading the text a character at a time.
        first = min((text.find(x) for x in stops if x in text), default=len(text))
        done = next((e for e in range(len(text) + 1) if any(x in text[:e] for x in stops)), None)
        latest = len(text) if done is None else min(text[:done].find(x) for x in stops if x in text[:done])
        assert first <= len(streamed) <= latest, (text, stops, streamed)
        assert streamed == text or any(text[len(streamed) :].startswith(x) for x in stops)


def test_textstream_long_stop_strings_stay_cheap():
    import time

    s = TextStream(_chars, stop=["q" * 200_000] * 4)
    start = time.perf_counter()
    for i in range(2000):
        s.push([ord("a") + i % 7] * 3)
    assert time.perf_counter() - start < 5  # was ~12 s: every token scanned every stop prefix
    assert s.finish() == "" and len(s.text) == 6000


def test_textstream_holds_back_incomplete_utf8():
    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    s = TextStream(decode)
    e_acute = "é".encode()
    assert s.push([ord("a"), e_acute[0]]) == "a"
    assert s.push([e_acute[1]]) == "é"


def test_histogram_buckets_are_cumulative():
    h = Histogram()
    for v in (0.001, 0.01, 0.3, 100.0):
        h.observe(v)
    lines = h.lines("x", 'endpoint="e"')
    assert 'x_bucket{endpoint="e",le="0.005"} 1' in lines and 'x_bucket{endpoint="e",le="0.01"} 2' in lines
    assert 'x_bucket{endpoint="e",le="+Inf"} 4' in lines and 'x_count{endpoint="e"} 4' in lines


def test_builtin_model_is_deterministic_and_has_a_chat_template():
    from demo.model.loading import build_builtin

    (m1, t1), (m2, t2) = build_builtin("builtin-tiny"), build_builtin("builtin-tiny")
    assert t1.get_vocab() == t2.get_vocab()
    assert all((a == b).all() for a, b in zip(m1.parameters(), m2.parameters()))
    text = t1.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|user|>hi<|end|><|assistant|>"
    assert t1.decode(t1("café ünïcode ✓")["input_ids"]) == "café ünïcode ✓"  # any text encodes


def test_sidecar_flag_env_and_metrics():
    assert from_args([], env={}).sidecar is None
    assert from_args([], env={"RADIXKV_SIDECAR": "/run/kv.sock"}).sidecar == "/run/kv.sock"
    assert from_args(["--sidecar", "/tmp/a.sock"], env={"RADIXKV_SIDECAR": "/b"}).sidecar == "/tmp/a.sock"
    from demo.metrics import Metrics

    text = Metrics().render(
        {"remote_hit_tokens": 48, "sidecar_connected": 1, "sidecar_timeouts": 2}, reuse=True, queued=0
    )
    assert "radixkv_sidecar_hits_total 48" in text and "radixkv_sidecar_connected 1" in text
    assert "radixkv_sidecar_timeouts_total 2" in text
