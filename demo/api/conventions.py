"""The HTTP conventions browsers and tracing expect: CORS and X-Request-Id.

    conventions.install(app, config.allowed_origins)   # demo.api.app's create_app does this

- CORS (flask-cors), off unless origins are given (``--allowed-origins``): the API routes
  (``/v1/*``, ``/health``, ``/metrics`` stay same-origin) answer a browser app on one of those
  origins, preflight included; ``*`` allows every origin. Credentials (cookies) are never
  allowed: the API authenticates by the Authorization header, which is listed as allowed.
- X-Request-Id: a client's id (1-128 characters of ``[A-Za-z0-9._:-]``, so it is safe in a log
  line) is kept, otherwise one is made (32 hex digits); it is echoed on every response and
  written in the request's access log line (``METHOD path status seconds request_id=...``), and
  ``request_id()`` gives it to the handlers. The path is logged as the client sent it, decoded:
  python -m demo's formatter (demo.log_format) escapes what could break or recolour the line.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Sequence

from flask import Flask, g, request

log = logging.getLogger(__name__)

HEADER = "X-Request-Id"
_VALID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# What a browser app may send on a cross-origin call (the rest of the "simple" headers are
# always allowed): the API key, JSON bodies, its own trace id, and the OpenAI SDK's headers.
_ALLOW_HEADERS = ["Authorization", "Content-Type", HEADER, "OpenAI-Organization", "OpenAI-Project"]
_ALLOW_SDK = re.compile(r"x-stainless-.*", re.IGNORECASE)


def request_id() -> str:
    """The current request's id (accepted or made in ``before_request``)."""
    rid = getattr(g, "request_id", None)
    if rid is None:  # outside install()'s hook (a bare test app): make one
        rid = g.request_id = uuid.uuid4().hex
    return rid


def accepted_id(value: str | None) -> str:
    """``value`` if it is a valid request id, else a new one."""
    if value is not None and _VALID.fullmatch(value):
        return value
    return uuid.uuid4().hex


def install(app: Flask, allowed_origins: Sequence[str] = ()) -> None:
    """Request ids and the access log on every route; CORS on the API when origins are given."""

    @app.before_request
    def _take_id():
        g.request_id = accepted_id(request.headers.get(HEADER))
        g.request_started = time.perf_counter()

    @app.after_request
    def _echo_id(resp):
        rid = request_id()
        resp.headers[HEADER] = rid
        started = getattr(g, "request_started", None)
        took = time.perf_counter() - started if started is not None else 0.0
        # The status is known here; a stream's body is still to come (its time is to headers).
        log.info("%s %s %d %.3fs request_id=%s", request.method, request.path, resp.status_code, took, rid)
        return resp

    if allowed_origins:
        from flask_cors import CORS

        origins = "*" if "*" in allowed_origins else list(allowed_origins)
        CORS(
            app,
            resources={r"/v1/.*": {"origins": origins}, r"/health": {"origins": origins}},
            allow_headers=[*_ALLOW_HEADERS, _ALLOW_SDK],
            expose_headers=[HEADER, "Retry-After"],
            supports_credentials=False,
            max_age=600,
        )
