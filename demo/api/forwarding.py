"""A front end's forwarding of the requests it does not answer itself to the engine process.

    forwarding.install(app, engine, served_names)   # create_app does this for a RemoteEngine

Answered in the front end's process: /health, /metrics, and text generation (POST
/v1/chat/completions, /v1/completions, /v1/responses; GET|DELETE /v1/responses/<id>) for the
base model. Everything else (the chat page, /v1/models, admin and cache-file endpoints,
adapters' loading, the gateway's metadata, a request naming an adapter, every generation
request of a vision-language model) is sent whole (demo.core.wire.HttpRequest) to the engine
process, whose own app answers it exactly as in-process mode does, and its answer streams back.
"""

from __future__ import annotations

import json

from flask import Flask, Response, g, request

from demo.api.server import client_alive

_LOCAL = {"/health", "/metrics", "/v1/chat/completions", "/v1/completions", "/v1/responses"}
_GENERATION = {"/v1/chat/completions", "/v1/completions", "/v1/responses"}
# The engine app's own: this process sets them (X-Request-Id, CORS) or the server does
_DROPPED = {"content-length", "transfer-encoding", "connection", "keep-alive", "x-request-id", "vary"}


def answered_here(path: str, method: str, body: bytes | None, served: set[str], remote_only: bool) -> bool:
    """Whether the front end answers this request itself (else the engine process's app does)."""
    if path.startswith("/v1/responses/"):
        return True  # the stored responses: read here from the engine's store (RemoteResponseStore)
    if path not in _LOCAL:
        return False
    if path not in _GENERATION or method != "POST":
        return True
    if remote_only:
        return False
    try:
        name = json.loads(body).get("model") if body else None
    except (ValueError, AttributeError, UnicodeDecodeError):
        return True  # the route itself answers the malformed body
    return not isinstance(name, str) or name in served  # an adapter's name: the engine's app


def install(app: Flask, engine, served: set[str]) -> None:
    @app.before_request
    def _forward():
        if request.method == "OPTIONS":  # a CORS preflight: answered here
            return None
        body = request.get_data(cache=True) if request.path in _GENERATION else None
        if answered_here(request.path, request.method, body, served, engine.remote_only):
            return None
        g.forwarded = True  # counted by the engine process's app (demo.api.app count_errors)
        data = body if body is not None else request.get_data(cache=True)
        environ = {k: v for k, v in request.environ.items() if isinstance(v, str) and k.isupper()}
        environ["wsgi.url_scheme"] = request.environ.get("wsgi.url_scheme", "http")
        environ["HTTP_X_REQUEST_ID"] = g.request_id  # one id in both processes' logs
        status, headers, chunks = engine.client.forward(environ, data, client_alive(request.environ))
        kept = [
            (k, v)
            for k, v in headers
            if k.lower() not in _DROPPED and not k.lower().startswith("access-control-")
        ]
        return Response(chunks, status=status, headers=kept)
