"""Answers to POST /v1/chat/completions and /v1/completions: one JSON body, or an SSE stream.

    respond = responder(engine, config, metrics, model_id)   # demo.api.app's create_app does this
    return respond("chat", prompt_ids, sampling, opts, namespace, started, slot)

The request is checked already (demo.api.schema, demo.api.options) and holds a queue slot; ``respond``
submits it to the engine, and either collects the result or streams chunks as they come,
counting both in ``metrics``. Response shapes are built in demo.api.responses.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable

from flask import Response, jsonify, request

from demo.api import chat_shapes, options, responses, schema
from demo.api.reply_parts import ReplySpec
from demo.api.server import client_alive
from demo.config import Config
from demo.engine.engine import Disconnected, Engine, Generation, Params
from demo.engine.generation import Result
from demo.errors import ApiError
from demo.metrics import Metrics

log = logging.getLogger(__name__)
PLAIN = ReplySpec()  # no reasoning split, no tool calls


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def responder(engine: Engine, config: Config, metrics: Metrics, model_id: str) -> Callable[..., Response]:
    """``respond(endpoint, prompt_ids, sampling, opts, namespace, started, slot)`` for ``engine``.

    ``endpoint`` is "chat" or "completions"; ``started`` the request's ``time.perf_counter()``;
    ``slot`` the queue slot from ``engine.reserve()``. Returns a Flask response.
    """

    def token_text(token: int) -> str:
        return engine.tokenizer.decode([token], skip_special_tokens=False)

    def respond(
        endpoint: str,
        prompt_ids: list[int],
        s: schema.Sampling,
        opts: options.Options,
        namespace,
        started: float,
        slot,
        *,
        adapter: str | None = None,
        inputs: dict | None = None,
        grammar: str | None = None,
        reply: ReplySpec = PLAIN,
        snapshot_at: list[int] | None = None,
    ):
        """``grammar``: a checked llguidance grammar the reply must match (demo.engine.constrained);
        ``reply``: how chat replies split into reasoning, content and tool calls; ``snapshot_at``:
        where the chat's messages end (a recurrent model's snapshot hints: Engine.message_ends)."""
        name = adapter or model_id  # the model the response names: the adapter's, as vLLM does
        max_new = schema.check_length(
            len(prompt_ids),
            s.max_tokens,
            config.default_max_tokens,
            engine.context,
            "messages" if endpoint == "chat" else "prompt",
            s.max_param,
        )
        params = Params(
            max_new,
            s.temperature,
            s.top_p,
            s.stop,
            s.seed,
            n=opts.n,
            frequency_penalty=opts.frequency_penalty,
            presence_penalty=opts.presence_penalty,
            logit_bias=tuple(opts.logit_bias.items()),
            top_logprobs=opts.top_logprobs,
            cache_prompt=opts.cache_prompt,
            adapter=adapter,
            top_k=opts.top_k,
            min_p=opts.min_p,
            repetition_penalty=opts.repetition_penalty,
            grammar=grammar,
        )
        gen = engine.submit(
            prompt_ids, params, options.salted(namespace, opts.cache_salt), slot=slot, inputs=inputs,
            snapshot_at=snapshot_at,
        )  # fmt: skip
        gen.alive = client_alive(request.environ)
        rid, created = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        if not s.stream:
            try:
                r = gen.collect()
            except Disconnected:  # nobody reads this; counted as 499 by count_errors
                raise ApiError(499, "the client closed the connection", code="client_closed") from None
            finally:
                gen.cancel()
            metrics.generation(endpoint, r)
            metrics.request(endpoint, 200, time.perf_counter() - started)
            return jsonify(
                {
                    "id": rid,
                    "object": "chat.completion" if endpoint == "chat" else "text_completion",
                    "created": created,
                    "model": name,
                    "choices": [_choice(endpoint, c, reply) for c in r.choices],
                    "usage": responses.usage(r),
                }
            )
        shaper = responses.ChunkChoices(endpoint, opts.n, opts.top_logprobs is not None, token_text)
        return Response(
            _stream(endpoint, gen, shaper, s.include_usage, rid, created, started, name, reply),
            mimetype="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def _stream(
        endpoint: str,
        gen: Generation,
        shaper: responses.ChunkChoices,
        include_usage: bool,
        rid: str,
        created: int,
        started: float,
        name: str,
        reply: ReplySpec,
    ):
        obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
        parsers = [reply.parser() for _ in range(gen.params.n)] if reply else None

        def chunk(choice: dict) -> dict:
            c = {"id": rid, "object": obj, "created": created, "model": name, "choices": [choice]}
            return {**c, "usage": None} if include_usage else c

        status = 499  # until the stream ends properly: a hang-up (GeneratorExit) leaves it so
        try:
            if endpoint == "chat":
                for i in range(gen.params.n):
                    yield _sse(chunk(shaper.role(i)))
            for delta in gen:
                if parsers is None:
                    yield _sse(chunk(shaper.delta(delta)))
                    continue
                for c in _part_chunks(shaper.delta(delta), parsers[delta.index].feed(delta.text)):
                    yield _sse(chunk(c))
            r: Result = gen.result
            metrics.generation(endpoint, r)
            for c in r.choices:
                if parsers is not None:
                    for part in _part_chunks(shaper.finish(c), parsers[c.index].finish(), logprobs=False):
                        yield _sse(chunk(part))
                    yield _sse(chunk({**shaper.finish(c), "finish_reason": _reason(c, parsers[c.index])}))
                    continue
                yield _sse(chunk(shaper.finish(c)))
            if include_usage:
                yield _sse(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": name,
                        "choices": [],
                        "usage": responses.usage(r),
                    }
                )
            status = 200
        except Disconnected:  # the client is gone: nothing to say, nobody to say it to
            return
        except ApiError as e:  # refused once queued (its adapter was unloaded meanwhile): in-band
            status = e.status
            yield _sse(e.body())
        except Exception as e:  # headers are sent: report in-band, then end the stream
            log.exception("generation failed mid-stream")
            status = 500
            yield _sse(ApiError(500, f"generation failed: {type(e).__name__}", type="server_error").body())
        finally:  # also on client disconnect (GeneratorExit): stop generating for nobody
            gen.cancel()
            metrics.request(endpoint, status, time.perf_counter() - started)
        yield "data: [DONE]\n\n"

    def _choice(endpoint: str, c, reply: ReplySpec) -> dict:
        out = responses.choice(endpoint, c, token_text)
        if endpoint != "chat" or not reply:
            return out
        parser = reply.parser()
        parser.feed(c.text)
        parser.finish()
        return {
            **out,
            "message": chat_shapes.message(parser, reply.reasoning is not None),
            "finish_reason": _reason(c, parser),
        }

    return respond


def _reason(c, parser) -> str:
    """finish_reason of a parsed chat choice: "tool_calls" once it made a call (OpenAI's)."""
    return parser.finish_reason_override or c.finish_reason


def _part_chunks(template: dict, part, logprobs: bool = True) -> list[dict]:
    """The chunk choices of a parsed part, shaped like ``template`` (a plain delta's choice,
    whose logprobs go with the first of them, or an empty content delta if the part is empty)."""
    deltas = chat_shapes.deltas(part)
    if not deltas:
        if logprobs and template.get("logprobs"):
            return [{**template, "delta": {"content": ""}}]
        return []
    out = []
    for k, d in enumerate(deltas):
        out.append(
            {
                **template,
                "delta": d,
                "finish_reason": None,
                "logprobs": template.get("logprobs") if k == 0 and logprobs else None,
            }
        )
    return out
