"""Flask app: the chat page, the OpenAI-compatible API, metrics and the admin flush.

    app = create_app(Config())      # builds the model and the engine
    app = create_app(config, engine) # or serve an engine you built (config's model, reuse,
                                     # block_size, cache_tokens and max_queue are then unused)

Routes: GET / (chat page), GET /health, GET /v1/models, POST /v1/chat/completions,
POST /v1/completions, POST /v1/responses and GET|DELETE /v1/responses/<id> (demo.api.responses_route), POST /v1/cache/flush (admin token), GET /metrics (Prometheus), and
POST /v1/load_lora_adapter, /v1/unload_lora_adapter (admin token; demo.model.adapters). A request's
``model`` picks the base model or a LoRA adapter; a vision-language model takes image_url
(and, with a video processor, video_url) content parts (demo.api.images, demo.api.videos,
demo.model.vision).
Every error is JSON: {"error": {"message", "type", "param", "code"}}. Request fields are
checked in demo.api.schema and demo.api.options; response shapes are built in demo.api.responses; the
generation routes' answers (JSON or an SSE stream) in demo.api.completions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time

from flask import Flask, Response, g, jsonify, render_template, request
from werkzeug.exceptions import HTTPException

from demo import cache_files
from demo.api import (
    agent_options,
    conventions,
    engine_client,
    forwarding,
    gateway,
    images,
    options,
    reasoning,
    responses_route,
    schema,
    structured,
    tool_parsers,
    videos,
)
from demo.api.auth import Auth, tenant_secret
from demo.api.auth_throttle import Throttle
from demo.api.completions import responder
from demo.api.reply_parts import ReplySpec
from demo.config import Config
from demo.engine.engine import Busy, Engine
from demo.errors import ApiError
from demo.metrics import Metrics
from demo.model import adapters, vision
from demo.model.adapters import Adapters
from demo.model.loading import BUILTIN
from demo.request_json import json_body
from demo.task_prompts import TaskPrompts
from demo.task_prompts import load as load_task_prompts
from hf_patch.attention_backend import avoid_cudnn_sdpa

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20
BUSY_RETRY_AFTER_S = 1  # a batch step frees queue slots within about a second
_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    "/v1/models": "models",
    "/v1/cache/flush": "flush",
    "/v1/cache/save": "save",  # demo.cache_files
    "/v1/cache/restore": "restore",
    "/v1/cache/files": "files",
    "/v1/load_lora_adapter": "load_lora_adapter",
    "/v1/unload_lora_adapter": "unload_lora_adapter",
}


def build_engine(config: Config) -> Engine:
    from demo.model import loading as model_lib

    device = config.resolve_device()
    options = model_lib.LoadOptions(config.revision, config.trust_remote_code, config.device_map)
    model, tokenizer, processor = model_lib.load(config.model, device, config.resolve_dtype(device), options)
    # where the weights are (a --device-map may put them on CUDA whatever --device says)
    avoid_cudnn_sdpa(next((p.device for p in model.parameters() if p.is_cuda), device))
    adapters = Adapters(
        model, config.model_id, aliases=(config.model,), download_timeout=config.lora_download_timeout
    )
    for module in config.lora_modules:  # before the engine's store: restored files find them
        adapters.load(module)
    return Engine(
        model,
        tokenizer,
        model_lib.context_length(model, tokenizer),
        reuse=config.reuse,
        block_size=config.block_size,
        cache_tokens=config.cache_tokens,
        sidecar=config.sidecar,
        max_queue=config.max_queue,
        max_batch_size=config.max_batch_size,
        max_batch_tokens=config.max_batch_tokens,
        decode_chunk=config.decode_chunk,
        prefill_chunk=config.prefill_chunk,
        max_prefill_tokens=config.max_prefill_tokens,
        adapters=adapters,
        processor=processor,
    )


def create_app(config: Config, engine: Engine | None = None) -> Flask:
    engine = engine or build_engine(config)
    auth = Auth(config.api_keys, config.admin_token, tenant_secret(config))
    # failed authentications per client address; with front ends (demo.core) each of them and
    # the engine process's app (forwarded routes authenticate there) has a share
    throttle = Throttle.shared_by(config.api_server_count + 1) if config.api_server_count else Throttle()
    proxies = config.proxies  # whose X-Forwarded-For names the client
    # request counters: with front ends, the engine process's one registry (demo.core)
    metrics = engine.request_metrics() if getattr(engine, "remote", False) else Metrics()
    tasks = TaskPrompts(load_task_prompts(config.task_prompts, config.task_prompts_json))
    if tasks and engine.store is not None:
        tasks.pin(engine)
    app = Flask(__name__, static_folder="static", template_folder="templates")
    media = config.media_policy if engine.processor is not None else None  # images taken
    # Decoding and processing images: at most this many requests at once (memory, not speed)
    image_slots = threading.BoundedSemaphore(media.processing_slots if media is not None else 1)
    # Bodies as large as the images (and videos, where the model takes them) allowed per request
    takes_videos = media is not None and vision.video_refusal(engine.processor) is None
    body_media = media if takes_videos or media is None else dataclasses.replace(media, max_videos=0)
    max_body = max(MAX_BODY_BYTES, body_media.body_bytes) if media is not None else MAX_BODY_BYTES
    # A front end's process (demo.api.engine_client.RemoteEngine): the engine is another process
    remote = getattr(engine, "remote", False)
    if remote and engine.remote_only:  # a VLM's requests (images, videos) are all forwarded
        max_body = max(MAX_BODY_BYTES, config.media_policy.body_bytes)
    # One byte over the limit: werkzeug refuses a too-long Content-Length itself, but silently
    # truncates a chunked body at the limit; reading one byte more lets body() tell (413).
    app.config["MAX_CONTENT_LENGTH"] = max_body + 1
    app.extensions["radixkv"] = {
        "engine": engine,
        "metrics": metrics,
        "config": config,
        "max_body_bytes": max_body,
    }
    conventions.install(app, config.allowed_origins)  # X-Request-Id, access log, CORS
    if remote:  # what this process does not answer goes to the engine process's app
        forwarding.install(app, engine, {config.model_id, config.model})
    model_id = config.model_id
    served_names = {model_id, config.model}  # the reported id, and the name it was started with
    # logit_bias indexes the logits: never past the output layer (rarely narrower than the input's)
    vocab_size, logits_size = engine.vocab_size, engine.logits_size

    @app.errorhandler(ApiError)
    def api_error(e: ApiError):
        resp = jsonify(e.body())
        if e.retry_after is not None:
            resp.headers["Retry-After"] = str(e.retry_after)
        return resp, e.status

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        message = f"request body larger than {max_body} bytes" if e.code == 413 else e.description
        kind = "invalid_request_error" if (e.code or 500) < 500 else "server_error"
        return api_error(ApiError(e.code or 500, message, type=kind))

    @app.errorhandler(Exception)
    def server_error(e: Exception):
        log.exception("unhandled error")
        return api_error(ApiError(500, f"internal error: {type(e).__name__}", type="server_error"))

    def body():
        data = request.get_data(cache=False)
        if len(data) > max_body:
            raise ApiError(413, f"request body larger than {max_body} bytes")
        return json_body(data)

    def authenticated(check):
        """check(headers) under the failed-attempt throttle of the client's address."""
        addr = proxies.client(request.remote_addr or "unknown", request.headers.get("X-Forwarded-For"))
        if addr is None:  # a trusted gateway's request naming no client: never throttled as one
            return check(request.headers)
        wait = throttle.retry_after(addr)
        if wait:
            raise ApiError(
                429,
                "too many failed authentication attempts from this address; retry later",
                code="too_many_failed_attempts",
                retry_after=wait,
            )
        try:
            return check(request.headers)
        except ApiError as e:
            if e.status == 401:
                throttle.failed(addr)
            raise

    def tenant():
        return authenticated(auth.namespace)

    def reserve():
        """A queue slot, taken before any tokenising: a full queue refuses at no cost."""
        try:
            return engine.reserve()
        except Busy as e:
            raise ApiError(
                503,
                f"server busy: {e}; retry later",
                type="server_error",
                code="busy",
                retry_after=BUSY_RETRY_AFTER_S,
            ) from None

    def pick_model(body) -> str | None:
        """The adapter a request's ``model`` names, None for the base model (or no name).
        vLLM answers an unknown model with a 404 and this error object."""
        name = body.get("model") if isinstance(body, dict) else None
        if not isinstance(name, str) or name in served_names:
            return None
        if engine.adapters is not None and engine.adapters.get(name) is not None:
            return name
        raise ApiError(404, f"The model '{name}' does not exist", "model", "model_not_found")

    respond = responder(engine, config, metrics, model_id)  # the chat and completions answers
    # Agents (docs/agents.md): the reply formats of this model, by flag or from its template
    template = engine.template() or getattr(engine.tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None
    reasoning_format = reasoning.choose(config.reasoning_parser, template)
    tool_format = tool_parsers.choose(config.tool_call_parser, template)
    markers = [m for f in (reasoning_format,) if f for m in (f.start, f.end)]
    markers += (
        [tool_format.start, *getattr(tool_format, "starts", ()), "</tool_call>", "[ARGS]"]
        if tool_format
        else []
    )
    engine.keep_special(markers)
    log.info(
        "agents: reasoning split %s, tool-call format %s",
        "on (<think>)" if reasoning_format else "off",
        tool_format.name if tool_format else "none",
    )
    if tool_format is not None and (template is None or "tools" not in template):
        log.warning("--tool-call-parser %s: the chat template does not render tools", tool_format.name)

    def reply_spec(agent, prompt_ids) -> ReplySpec:
        """How this request's replies split (the prompt's tail decides if reasoning is open)."""
        inside = False
        # A constrained reply (a forced call, a JSON format) is the grammar's text from its
        # first token: no reasoning block, even where the prompt opened one.
        if reasoning_format is not None and not (agent.forced_tools or agent.response_format):
            tail = engine.tokenizer.decode(prompt_ids[-32:], skip_special_tokens=False)
            inside = reasoning_format.opens_in(tail)
        tools = tool_format if agent.calls_tools else None
        return ReplySpec(reasoning_format, inside, tools, None if agent.parallel_tool_calls else 1)

    @app.get("/")
    def index():
        return render_template(
            "index.html",
            model_id=model_id,
            builtin=config.model in BUILTIN,
            reuse=engine.store is not None,
            keys_required=auth.enabled,
            adapters=engine.adapters.names() if engine.adapters is not None else [],
            images=media is not None and media.max_images > 0,
        )

    @app.get("/health")
    def health():
        if remote and not engine.client.up.is_set():
            raise engine_client.unavailable(engine.client.down_reason)
        return jsonify({"status": "ok"})

    @app.get("/v1/models")
    def models():
        tenant()
        return jsonify(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_id,
                        "object": "model",
                        "created": 0,
                        "owned_by": "radixkv",
                        "root": config.model,
                        "parent": None,
                        "max_model_len": engine.context,
                    },
                    *(engine.adapters.cards(engine.context) if engine.adapters is not None else ()),
                ],
            }
        )

    @app.post("/v1/chat/completions")
    def chat():
        started, namespace = time.perf_counter(), tenant()
        data = body()
        adapter = pick_model(data)
        req = schema.chat(data, engine.context)
        opts = options.parse(data, "chat", logits_size)
        agent = agent_options.parse(data, config.default_chat_template_kwargs, tool_format is not None)
        grammar = structured.grammar(agent, tool_format, engine.runner.grammars)
        task_prompt = tasks.lookup(data)
        messages = tasks.chat(task_prompt, req.messages) if task_prompt else req.messages
        parts, clip_parts = images.image_parts(messages), videos.video_parts(messages)
        if parts and media is None:
            raise ApiError(
                400, f"{parts[0].param}: the model {model_id} does not take images", parts[0].param
            )
        refusal = vision.video_refusal(engine.processor) if media is not None else "it takes no videos"
        if clip_parts and refusal:
            where = clip_parts[0].param
            raise ApiError(
                400,
                f"{where}: the model {model_id} cannot take videos here: {refusal}",
                where,
                "invalid_video",
            )
        # Images are fetched (maybe from a remote host, for seconds) before a queue place is
        # taken: a request still downloading is not queued, so it must not hold a place.
        processed = functools.partial(vision.processed_pixels, engine.processor)
        pictures = images.load_images(parts, media, processed, image_slots) if media is not None else []
        clips = []
        if clip_parts:
            sample = vision.frame_sampler(engine.processor, media.sampled_frames)
            per_frame = functools.partial(vision.processed_pixels, engine.processor, part="video_processor")
            clips = videos.load_videos(clip_parts, media, sample, per_frame, image_slots)
        with reserve() as slot:
            inputs = None
            if media is not None and agent.tools:
                raise ApiError(
                    400, f"the model {model_id} (vision-language) does not take tools here", "tools"
                )
            hints = None
            if media is not None:  # a vision-language model: its processor renders every chat
                with image_slots if pictures or clips else contextlib.nullcontext():
                    prompt = vision.render(engine.processor, messages, pictures, clips)
                ids, inputs = prompt.ids, prompt.inputs
            else:
                try:
                    extra = {"tools": agent.rendered_tools, "template_kwargs": agent.template_kwargs}
                    extra = {k: v for k, v in extra.items() if v}
                    ids = engine.chat_ids(messages, **extra)
                    hints = engine.message_ends(messages, ids, **extra)
                except ValueError as e:
                    raise ApiError(400, str(e), "messages") from None
            return respond(
                "chat",
                ids,
                req.sampling,
                opts,
                namespace,
                started,
                slot,
                adapter=adapter,
                inputs=inputs,
                grammar=grammar,
                reply=reply_spec(agent, ids),
                snapshot_at=hints,
            )

    # POST /v1/responses, GET|DELETE /v1/responses/<id> (stored per tenant, in memory; with
    # front ends, in the engine process's app)
    app.extensions["radixkv"]["responses"] = responses_route.install(
        app,
        responses_route.Hooks(
            engine,
            config,
            metrics,
            model_id,
            logits_size,
            tool_format,
            tenant,
            body,
            reserve,
            pick_model,
            reply_spec,
        ),
        engine.response_store() if remote else None,  # one store for every front end
    )

    @app.post("/v1/completions")
    def completions():
        started, namespace = time.perf_counter(), tenant()
        data = body()
        adapter = pick_model(data)
        req = schema.completion(data, engine.context, vocab_size)
        opts = options.parse(data, "completions", logits_size)
        task_prompt = tasks.lookup(data)
        with reserve() as slot:
            if task_prompt and isinstance(req.prompt, str):
                ids = engine.text_ids(task_prompt + req.prompt)
            elif task_prompt:
                ids = engine.text_ids(task_prompt) + list(req.prompt)
            else:
                ids = list(req.prompt) if isinstance(req.prompt, list) else engine.text_ids(req.prompt)
            return respond("completions", ids, req.sampling, opts, namespace, started, slot, adapter=adapter)

    @app.post("/v1/cache/flush")
    def flush():
        authenticated(auth.check_admin)
        engine.flush()
        # The store's flush drops task pins (made for a weight change); the weights are the
        # same here, so the operator's prompts are pinned again, as at start-up.
        if tasks and engine.store is not None:
            tasks.pin(engine)
        return jsonify({"flushed": True, "reuse": engine.store is not None})

    # /v1/cache/save|restore|files, --cache-file; admin checks under the same throttle as flush
    if not remote:  # (a front end forwards them: demo.api.forwarding)
        cache_files.install(app, engine, config, lambda: authenticated(auth.check_admin))

    def gateway_key() -> None:
        """The metadata routes: a tenant key, or the request of a trusted gateway itself (its
        worker registration and load polls; sglang_router sends them keyless unless it has an
        --api-key of its own, which it would then demand from every client too)."""
        peer = request.remote_addr
        if not (
            proxies.trusts(peer) and proxies.client(peer, request.headers.get("X-Forwarded-For")) is None
        ):
            tenant()

    if not remote:  # /server_info, /model_info, /get_load (SGLang gateway)
        gateway.install(app, engine, config, gateway_key)
    if engine.adapters is not None:  # /v1/load_lora_adapter, /v1/unload_lora_adapter
        adapters.install(app, engine, lambda: authenticated(auth.check_admin))

    @app.get("/metrics")
    def prometheus():
        # The engine's lines, then the request counters; in a front end's process both are
        # asked of the engine process, which counts every front end's requests
        text = engine.metrics_text() if remote else engine_metrics(engine) + metrics.render_requests()
        return Response(text, mimetype="text/plain; version=0.0.4")

    @app.after_request
    def count_errors(resp):
        # (a forwarded request was counted by the engine process's app, which answered it)
        if resp.status_code >= 400 and request.path.startswith("/v1/") and not g.get("forwarded"):
            metrics.request(_ROUTES.get(request.path, "other"), resp.status_code)
        return resp

    return app


def engine_metrics(engine: Engine) -> str:
    """The Prometheus lines of the engine: its store, queue and scheduler (not the requests')."""
    return Metrics.render_engine(
        engine.stats(),
        reuse=engine.store is not None,
        queued=engine.queued,
        engine_histograms=(
            (
                "radixkv_batch_size",
                "Requests per generate() call (in the step loop: per admission).",
                engine.scheduler.batch_sizes,
            ),
            (
                "radixkv_queue_wait_seconds",
                "Admission wait: submit to the request's first batch.",
                engine.scheduler.queue_waits,
            ),
            (
                "radixkv_resume_wait_seconds",
                "A paused request's wait: pause to its next batch.",
                engine.scheduler.resume_waits,
            ),
            (
                "radixkv_forward_seconds",
                "Wall time of a step-loop forward (one decode step, seated prompts included).",
                engine.scheduler.forward_seconds,
            ),
            (
                "radixkv_rows_per_step",
                "Rows making a token, per decoding step.",
                engine.scheduler.rows_per_step,
            ),
        ),
        engine_counters=(
            ("radixkv_pauses_total", "Requests paused between decode chunks.", engine.scheduler.pauses),
            (
                "radixkv_resumes_total",
                "Paused requests taken into a batch again.",
                engine.scheduler.resumes,
            ),
            (
                "radixkv_prefill_slices_total",
                "Slices of long prompts computed between decode chunks.",
                engine.scheduler.prefill_slices,
            ),
            (
                "radixkv_admissions_total",
                "Requests admitted into the running step loop between decode steps.",
                engine.scheduler.admissions,
            ),
            (
                "radixkv_aside_chunks_total",
                "Decode chunks of requests too wide to join the step loop, run between its steps.",
                engine.scheduler.asides,
            ),
        ),
    )
