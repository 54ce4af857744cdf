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
saved once to a temporary directory, a path only a gateway on the same machine can open (on
another machine, pass the gateway ``--tokenizer-path``). ``served_model_name`` is the id the
OpenAI routes report, so the gateway's per-model routing matches the requests' "model".
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import weakref

from flask import Blueprint, jsonify

from demo.model.loading import BUILTIN

_saved: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its directory
_lock = threading.Lock()


def tokenizer_path(config, tokenizer) -> str:
    """Where a gateway can load this worker's tokenizer from: the model's own name or directory,
    or, for a built-in model, a directory it is saved to once per process."""
    if config.model not in BUILTIN:
        return os.path.abspath(config.model) if os.path.isdir(config.model) else config.model
    with _lock:
        path = _saved.get(tokenizer)
        if path is None:
            path = tempfile.mkdtemp(prefix=f"radixkv-{config.model}-tokenizer-")
            atexit.register(shutil.rmtree, path, ignore_errors=True)
            tokenizer.save_pretrained(path)
            _saved[tokenizer] = path
        return path


def install(app, engine, config) -> None:
    bp = Blueprint("gateway", __name__)
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
