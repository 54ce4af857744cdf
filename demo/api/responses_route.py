"""POST /v1/responses, GET and DELETE /v1/responses/<id>: OpenAI's Responses API.

    responses_route.install(app, hooks)     # demo.api.app's create_app does this

A response is generated as a chat completion is (the same template, tools, reasoning split,
constrained decoding and prefix cache), then shaped as a Responses ``response`` object whose
``output`` holds a ``reasoning`` item, a ``message`` item and ``function_call`` items. With
``store`` (the default) it is kept per tenant (demo.api.conversations) with its whole
conversation, and ``previous_response_id`` continues it: the new prompt is the stored
conversation plus the new input, rendered again, so its prefix (everything up to the stored
response's own prompt, and usually its reply) is read from the prefix cache.

Streaming (``stream: true``) sends Responses events in OpenAI's order: response.created,
response.in_progress, then per output item output_item.added, its deltas
(reasoning_text.delta, output_text.delta inside content_part.added/done,
function_call_arguments.delta), output_item.done, and response.completed (response.incomplete
when max_output_tokens cut the reply); each with a ``sequence_number``. No ``[DONE]`` line (the Responses API has none).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from flask import Flask, Response, jsonify, request

from demo.api import agent_options, options, responses_input, schema, structured
from demo.api.conversations import ResponseStore, StoredResponse
from demo.api.reply_parts import ReplyParser, ReplySpec
from demo.api.server import client_alive
from demo.engine.engine import Disconnected, Params
from demo.errors import ApiError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hooks:
    """What the routes take from demo.api.app: the engine and config, and the app's request
    helpers (tenant namespace, JSON body, queue slot, adapter pick, reply split)."""

    engine: object
    config: object
    metrics: object
    model_id: str
    logits_size: int
    tool_format: object
    tenant: Callable
    body: Callable
    reserve: Callable
    pick_model: Callable
    reply_spec: Callable[..., ReplySpec]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """The output items of one reply as it streams: events out, the final items kept."""

    def __init__(self, parser: ReplyParser, reasoning: bool):
        self.parser, self.reasoning = parser, reasoning
        self.items: list[dict] = []
        self._open: dict | None = None  # the reasoning or message item being written
        self._texts: dict[str, str] = {}
        self._calls: dict[int, dict] = {}  # function_call items by call index

    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        i = self.items.index(item)
        text = self._texts[item["id"]]
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            return [
                {
                    "type": "response.reasoning_text.done",
                    "item_id": item["id"],
                    "output_index": i,
                    "content_index": 0,
                    "text": text,
                },
                {"type": "response.output_item.done", "output_index": i, "item": item},
            ]
        part = {"type": "output_text", "text": text, "annotations": []}
        item["content"], item["status"] = [part], "completed"
        return [
            {
                "type": "response.output_text.done",
                "item_id": item["id"],
                "output_index": i,
                "content_index": 0,
                "text": text,
            },
            {
                "type": "response.content_part.done",
                "item_id": item["id"],
                "output_index": i,
                "content_index": 0,
                "part": part,
            },
            {"type": "response.output_item.done", "output_index": i, "item": item},
        ]

    def _text(self, kind: str, delta: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": []}
            else:
                item = {
                    "type": "message",
                    "id": _new_id("msg"),
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
            self.items.append(item)
            self._open, self._texts[item["id"]] = item, ""
            i = len(self.items) - 1
            events.append({"type": "response.output_item.added", "output_index": i, "item": dict(item)})
            if kind == "message":
                events.append(
                    {
                        "type": "response.content_part.added", "item_id": item["id"], "output_index": i,
                        "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []},
                    }
                )  # fmt: skip
        item = self._open
        self._texts[item["id"]] += delta
        kind_event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        i = len(self.items) - 1
        events.append(
            {"type": kind_event, "item_id": item["id"], "output_index": i, "content_index": 0, "delta": delta}
        )
        return events

    def feed(self, part) -> list[dict]:
        events = []
        if part.reasoning:
            events += self._text("reasoning", part.reasoning)
        if part.content:
            events += self._text("message", part.content)
        done = {c.index: c for c in part.calls}  # calls completed in this part
        for d in part.call_deltas:
            if d.name is not None:  # a new call: the calls before it are complete
                events += self._close()
                events += self._complete([done.pop(k) for k in sorted(done) if k < d.index])
                item = {"type": "function_call", "id": _new_id("fc"), "call_id": d.id, "name": d.name,
                        "arguments": "", "status": "in_progress"}  # fmt: skip
                self.items.append(item)
                self._calls[d.index] = item
                events.append(
                    {
                        "type": "response.output_item.added",
                        "output_index": len(self.items) - 1,
                        "item": dict(item),
                    }
                )
            else:
                item = self._calls[d.index]
                item["arguments"] += d.arguments
                i = self.items.index(item)
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": item["id"],
                        "output_index": i,
                        "delta": d.arguments,
                    }
                )
        return events + self._complete([done[k] for k in sorted(done)])

    def _complete(self, calls) -> list[dict]:
        events = []
        for c in calls:
            item = self._calls[c.index]
            item["arguments"], item["status"] = c.call.arguments, "completed"
            i = self.items.index(item)
            events += [
                {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": i, "arguments": item["arguments"]},
                {"type": "response.output_item.done", "output_index": i, "item": dict(item)},
            ]  # fmt: skip
        return events

    def finish(self) -> list[dict]:
        events = self.feed(self.parser.finish()) + self._close()
        # a call announced while written that never parsed: not part of the response (its text
        # came out as content)
        self.items = [i for i in self.items if i["type"] != "function_call" or i["status"] == "completed"]
        return events


def install(app: Flask, hooks: Hooks, store=None) -> ResponseStore:
    """``store``: where responses are kept (a front end passes the engine process's,
    demo.api.engine_client.RemoteResponseStore); None: a ResponseStore of this app's own."""
    engine, config = hooks.engine, hooks.config
    if store is None:
        store = ResponseStore(config.responses_max_stored, config.responses_max_age)

    def shape(rid, created, req, agent, status, items, result, previous) -> dict:
        def reasoning_tokens() -> int:
            text = "".join(c["text"] for i in items if i["type"] == "reasoning" for c in i["content"])
            return (
                min(
                    len(engine.tokenizer(text, add_special_tokens=False)["input_ids"]),
                    result.completion_tokens,
                )
                if text
                else 0
            )

        usage = None
        if result is not None:
            usage = {
                "input_tokens": result.prompt_tokens,
                "input_tokens_details": {"cached_tokens": result.cached_tokens},
                "output_tokens": result.completion_tokens,
                # the reasoning text's tokens, re-encoded (the reply's own split is not tracked)
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens()},
                "total_tokens": result.prompt_tokens + result.completion_tokens,
            }
        incomplete = result is not None and result.finish_reason == "length"
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "status": "incomplete" if incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None,
            "model": req.chat_body.get("model") or hooks.model_id,
            "instructions": req.instructions,
            "output": items,
            "previous_response_id": previous,
            "tools": [{"type": "function", **t} for t in agent.tools],
            "tool_choice": agent.tool_choice
            if agent.tool_choice != "function"
            else {"type": "function", "name": agent.function},
            "parallel_tool_calls": agent.parallel_tool_calls,
            "store": req.store,
            "temperature": req.chat_body.get("temperature", 1.0),
            "top_p": req.chat_body.get("top_p", 1.0),
            "max_output_tokens": req.chat_body.get("max_tokens"),
            "text": {"format": agent.response_format or {"type": "text"}},
            "usage": usage,
            "metadata": {},
        }

    def history_turn(parser: ReplyParser) -> dict:
        """This reply as the assistant message a continuation renders."""
        turn = {"role": "assistant", "content": parser.content or (None if parser.calls else "")}
        if parser.calls:
            turn["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.call.name, "arguments": c.call.arguments},
                }
                for c in parser.calls
            ]
        if parser.reasoning:
            turn["reasoning_content"] = parser.reasoning
        return turn

    @app.post("/v1/responses")
    def create_response():
        started, namespace = time.perf_counter(), hooks.tenant()
        data = hooks.body()
        adapter = hooks.pick_model(data)
        req = responses_input.parse(data)
        history: list[dict] = []
        if req.previous_id is not None:
            prev = store.get(namespace, req.previous_id)
            if prev is None:
                raise ApiError(
                    404, f"Previous response with id '{req.previous_id}' not found.", "previous_response_id"
                )
            history = list(prev.messages)
        with req.named():  # the chat parsers' errors name the fields this request sent
            sampling = schema.sampling(req.chat_body, engine.context, schema.CHAT_ONLY)
            opts = options.parse(req.chat_body, "chat", hooks.logits_size)
            agent = agent_options.parse(
                req.chat_body, config.default_chat_template_kwargs, hooks.tool_format is not None
            )
            grammar = structured.grammar(agent, hooks.tool_format, engine.runner.grammars)
            schema.chat({"messages": req.messages}, engine.context)  # the new input, checked
        conversation = history + req.messages
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        # (the stored history was checked when it came, the instructions by responses_input)
        rendered = schema.chat({"messages": system + conversation}, engine.context).messages
        with hooks.reserve() as slot:
            try:
                ids = engine.chat_ids(rendered, agent.rendered_tools, agent.template_kwargs)
            except ValueError as e:
                raise ApiError(400, str(e), "input") from None
            max_new = schema.check_length(
                len(ids),
                sampling.max_tokens,
                config.default_max_tokens,
                engine.context,
                "input",
                "max_output_tokens",
            )
            params = Params(
                max_new, sampling.temperature, sampling.top_p, (), sampling.seed,
                cache_prompt=opts.cache_prompt, adapter=adapter, grammar=grammar,
            )  # fmt: skip
            gen = engine.submit(ids, params, options.salted(namespace, opts.cache_salt), slot=slot)
        gen.alive = client_alive(request.environ)
        spec = hooks.reply_spec(agent, ids)
        rid, created = _new_id("resp"), int(time.time())
        out = _Output(spec.parser(), spec.reasoning is not None)

        def finished(result) -> dict:
            body = shape(rid, created, req, agent, "completed", out.items, result, req.previous_id)
            if req.store:
                turn = history_turn(out.parser)
                try:
                    store.put(namespace, StoredResponse(rid, time.time(), tuple(conversation + [turn]), body))
                except ApiError as e:  # (the engine process's store, down) the answer is not lost
                    log.warning("response %s was not stored: %s", rid, e.message)
            hooks.metrics.generation("responses", result)
            hooks.metrics.request("responses", 200, time.perf_counter() - started)
            return body

        if not sampling.stream:
            try:
                for delta in gen:
                    out.feed(out.parser.feed(delta.text))
                out.finish()
            except Disconnected:
                raise ApiError(499, "the client closed the connection", code="client_closed") from None
            finally:
                gen.cancel()
            return jsonify(finished(gen.result))

        def events():
            seq = 0

            def sse(event: dict) -> str:
                nonlocal seq
                event = {**event, "sequence_number": seq}
                seq += 1
                return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"

            status = 499
            try:
                head = shape(rid, created, req, agent, "in_progress", [], None, req.previous_id)
                yield sse({"type": "response.created", "response": head})
                yield sse({"type": "response.in_progress", "response": head})
                for delta in gen:
                    for e in out.feed(out.parser.feed(delta.text)):
                        yield sse(e)
                for e in out.finish():
                    yield sse(e)
                status, body = 200, finished(gen.result)
                # OpenAI's last event says how it ended: a reply cut by max_output_tokens is
                # response.incomplete (a client switching on the type must not read it as done)
                done = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
                yield sse({"type": done, "response": body})
            except Disconnected:
                return
            except ApiError as e:  # refused once running (its grammar had no way on): in-band
                status = e.status
                yield sse({"type": "error", "code": e.code, "message": e.message, "param": e.param})
            except Exception as e:  # headers are sent: report in-band (Responses' error event)
                log.exception("generation failed mid-stream")
                status = getattr(e, "status", 500)
                yield sse(
                    {
                        "type": "error",
                        "code": "server_error",
                        "message": f"generation failed: {type(e).__name__}",
                        "param": None,
                    }
                )
            finally:
                gen.cancel()
                if status != 200:
                    hooks.metrics.request("responses", status, time.perf_counter() - started)

        return Response(
            events(),
            mimetype="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.get("/v1/responses/<response_id>")
    def retrieve_response(response_id: str):
        item = store.get(hooks.tenant(), response_id)
        if item is None:
            raise ApiError(404, f"Response with id '{response_id[:128]}' not found.", "response_id")
        return jsonify(item.body)

    @app.delete("/v1/responses/<response_id>")
    def delete_response(response_id: str):
        if not store.delete(hooks.tenant(), response_id):
            raise ApiError(404, f"Response with id '{response_id[:128]}' not found.", "response_id")
        return jsonify({"id": response_id, "object": "response.deleted", "deleted": True})

    return store
