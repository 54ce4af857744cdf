"""What the SGLang Model Gateway asks of a worker, so that `python -m demo` replicas run behind it.

    python -m sglang_router.launch_router --worker-urls http://a:8000 http://b:8000 --policy cache_aware

GET /server_info, /model_info  the worker's metadata (and the deprecated /get_server_info,
                               /get_model_info the gateway falls back to)
GET /get_load                  running and queued requests and their tokens (``num_tokens``
                               is the load power_of_two reads)

When it registers a worker the gateway reads ``model_path`` / ``tokenizer_path`` from
/model_info and loads that tokenizer itself (cache_aware routing matches prompts as text; the
prefix_hash policy and its tokenize endpoints need token ids). A Hub id or a local directory
is given as the user named it; the built-in models, which have no files, get their tokenizer
saved to a content-addressed directory of the user's cache (``$XDG_CACHE_HOME/radixkv/tokenizers``,
default ``~/.cache``), a path only a gateway on the same machine can open (on another machine,
pass the gateway ``--tokenizer-path``). Nothing temporary is made, so nothing is left behind
however the process ends (SIGKILL, ``os._exit``). ``served_model_name`` is the id the OpenAI
routes report, so the gateway's per-model routing matches the requests' "model".

With ``--api-keys`` these routes need a key, as SGLang's own do (its gateway sends the key of
its ``--api-key`` flag as ``Authorization: Bearer`` on /model_info, /server_info and
/get_load): they name the server's files and every tenant's load.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable

from flask import Blueprint, jsonify

from demo.model.loading import BUILTIN

_saved: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its directory
_lock = threading.Lock()


def _cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "radixkv", "tokenizers")


def _save(name: str, tokenizer) -> str:
    """The tokenizer saved under the cache root, in a directory named for its content (the same
    tokenizer, the same directory, in every process); written aside and renamed into place."""
    root = _cache_root()
    os.makedirs(root, exist_ok=True)
    for stale in os.listdir(root):  # left by a process killed mid-save, an hour ago or more
        path = os.path.join(root, stale)
        if stale.startswith(".partial-") and time.time() - os.path.getmtime(path) > 3600:
            shutil.rmtree(path, ignore_errors=True)
    partial = tempfile.mkdtemp(prefix=".partial-", dir=root)
    try:
        tokenizer.save_pretrained(partial)
        digest = hashlib.sha256()
        for file in sorted(os.listdir(partial)):
            digest.update(file.encode() + b"\0")
            with open(os.path.join(partial, file), "rb") as f:
                digest.update(f.read())
        final = os.path.join(root, f"{name}-{digest.hexdigest()[:16]}")
        if not os.path.isdir(final):
            try:
                os.rename(partial, final)
            except OSError:  # another process put the same content there first
                pass
        return final
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def tokenizer_path(config, tokenizer) -> str:
    """Where a gateway can load this worker's tokenizer from: the model's own name or directory,
    or, for a built-in model, its directory in the user's cache (saved once per process)."""
    if config.model not in BUILTIN:
        return os.path.abspath(config.model) if os.path.isdir(config.model) else config.model
    with _lock:
        path = _saved.get(tokenizer)
        if path is None:
            path = _save(config.model, tokenizer)
            _saved[tokenizer] = path
        return path


def install(app, engine, config, check_key: Callable[[], object]) -> None:
    """Register the routes; ``check_key()``: the app's tenant-key check (a no-op without
    --api-keys), under its failed-authentication throttle."""
    bp = Blueprint("gateway", __name__)

    @bp.before_request
    def keyed() -> None:
        check_key()

    model_id = config.model_id
    architectures = list(getattr(engine.model.config, "architectures", None) or [type(engine.model).__name__])

    def model_info() -> dict:
        path = tokenizer_path(config, engine.tokenizer)  # saved on the first ask, not at start
        return {
            "model_path": path,
            "tokenizer_path": path,
            "served_model_name": model_id,
            "is_generation": True,
            "model_type": getattr(engine.model.config, "model_type", None),
            "architectures": architectures,
            "weight_version": "default",
        }

    def server_info() -> dict:
        return {
            **model_info(),
            "context_length": engine.context,
            "max_total_num_tokens": engine.store.pool.num_blocks * engine.store.block_size
            if engine.store is not None
            else None,
            "page_size": engine.store.block_size if engine.store is not None else None,
            "disable_radix_cache": engine.store is None,
            "max_running_requests": engine.scheduler.max_batch_size,
            "max_queued_requests": engine.scheduler.max_queue,
            "dp_size": 1,
            "tp_size": 1,
            "version": "radixkv",
        }

    for route, view in (("/model_info", model_info), ("/server_info", server_info)):
        bp.add_url_rule(route, view.__name__, lambda view=view: jsonify(view()))
        bp.add_url_rule(
            "/get" + route.replace("/", "_"), "get_" + view.__name__, lambda view=view: jsonify(view())
        )

    @bp.get("/get_load")
    def get_load():
        running = engine.running
        return jsonify(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": running + engine.queued,
                    "num_running_reqs": running,
                    "num_waiting_reqs": engine.queued,
                    "num_tokens": engine.load_tokens,
                }
            ]
        )

    app.register_blueprint(bp)
