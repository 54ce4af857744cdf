"""The engine process's messages (demo.core.wire) and the front end's routing (demo.api.forwarding)."""

from __future__ import annotations

import pytest

from demo.api.forwarding import answered_here
from demo.core import wire
from demo.engine.generation import Params
from demo.engine.processors import TokenLogprobs

pytest.importorskip("msgspec")


def test_every_message_round_trips_and_a_namespace_comes_back_hashable():
    codec = wire.Codec()
    params = Params(7, 0.5, 0.9, ("stop",), 3, n=2, logit_bias=((5, -1.5),), top_logprobs=2, grammar="g")
    submit = wire.Submit("0.ab.1", [1, 2, 3], params, ("tenant:x", "salt", "s"), [2])
    back = codec.to_engine(codec.encode(submit))
    assert back.params == params and back.prompt_ids == [1, 2, 3] and back.snapshot_at == [2]
    assert wire.hashable(back.namespace) == ("tenant:x", "salt", "s")
    hash(wire.hashable(back.namespace))
    lps = [TokenLogprobs(4, -0.25, ((4, -0.25), (9, -2.0))), None]
    tokens = wire.Tokens("0.ab.1", [[4], []], lps)
    assert codec.to_front_end(codec.encode(tokens)) == tokens
    for m in (
        wire.Done("r", 3, 1.5),
        wire.Failed("r", 503, "busy", code="busy", retry_after=1),
        wire.Accepted("r"),
    ):
        assert codec.to_front_end(codec.encode(m)) == m
    for m in (
        wire.Cancel("r"),
        wire.StopChoice("r", 1),
        wire.Hello(0, "i"),
        wire.HttpRequest("r", {"PATH_INFO": "/"}, b"{}"),
    ):
        assert codec.to_engine(codec.encode(m)) == m


def test_a_bad_params_value_is_refused_by_name_on_decoding():
    codec = wire.Codec()
    data = codec.encode(wire.Submit("r", [1], Params(1)))
    bad = data.replace(b"\xaemax_new_tokens\x01", b"\xaemax_new_tokens\x00")
    with pytest.raises(ValueError, match="max_new_tokens"):
        codec.to_engine(bad)


@pytest.mark.parametrize(
    "path, method, body, remote_only, here",
    [
        ("/v1/chat/completions", "POST", b'{"model": "m"}', False, True),
        ("/v1/chat/completions", "POST", b'{"model": "an-adapter"}', False, False),
        ("/v1/chat/completions", "POST", b"not json", False, True),  # the route says what is wrong
        ("/v1/chat/completions", "POST", b"{}", True, False),  # a VLM: its processor is the engine's
        ("/v1/responses/resp_1", "GET", None, False, True),
        ("/metrics", "GET", None, False, True),
        ("/v1/cache/flush", "POST", None, False, False),
        ("/v1/models", "GET", None, False, False),
        ("/get_load", "GET", None, False, False),
    ],
)
def test_what_a_front_end_answers_and_what_it_forwards(path, method, body, remote_only, here):
    assert answered_here(path, method, body, {"m"}, remote_only) is here
