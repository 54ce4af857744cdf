"""What ``python -m demo`` builds around the engine, and saves when it stops: one place, used by
the in-process server (demo.__main__) and by the engine process (demo.core.engine_process).

    started = startup.build(config)       # the app and its engine; exits (status 2) on bad flags
    ...
    startup.save_at_exit(started, config, startup.signalled_at())
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("demo")


@dataclass
class Started:
    app: object  # the Flask app (demo.api.app.create_app)
    engine: object  # its demo.engine.engine.Engine
    events: object = None  # the KV events publisher (demo.kv_events), or None


def fail(message: str) -> None:
    """Stop with a one-line error (exit status 2, as argparse's): these come from the flags'
    values, not their syntax, so the usage text would only push the message out of sight."""
    print(f"python -m demo: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def build(config) -> Started:
    """The app over a new engine (the model loaded, task prompts pinned, the cache file
    restored), KV events started, the start-up line logged. Raises SystemExit(2) with a
    one-line error for a flag whose value does not work."""
    # First to load torch, so that its OpenMP threads wait passively (radixkv.wait_policy)
    import hf_patch  # noqa: F401
    from demo import kv_events
    from demo.api.app import create_app
    from demo.api.auth import TenantSecretError
    from demo.cache_files import CacheFileConflict
    from demo.model.adapters import AdapterError
    from demo.model.loading import BUILTIN, ModelNotFound
    from demo.task_prompts import TaskPromptError

    try:
        app = create_app(config)
    except ModelNotFound as e:
        fail(
            f"--model {config.model}: not a built-in model ({', '.join(BUILTIN)}), "
            f"a local directory or a loadable Hub id: {e}"
        )
    # A malformed --task-prompts file / RADIXKV_TASK_PROMPTS or prompts too big for the pool; a
    # damaged --tenant-secret-file (or CACHE_FILE.secret); a --cache-file of other flags
    except (TaskPromptError, TenantSecretError, CacheFileConflict) as e:
        fail(str(e))
    except AdapterError as e:  # a --lora-modules entry that does not load
        fail(f"--lora-modules: {e.message}")
    engine = app.extensions["radixkv"]["engine"]
    try:
        events = kv_events.start(config.kv_events_config, engine)
    except ValueError as e:  # pyzmq missing, an endpoint that does not bind
        fail(f"--kv-events-config: {e}")
    if events is not None:
        log.info("KV events on %s (replay: %s)", events.config.endpoint, events.config.replay_endpoint)
    log.info(
        "model %s on %s, context %d tokens, prefix reuse %s (block size %d), tenants: %s, flush: %s",
        config.model_id,
        engine.model.device,
        engine.context,
        "on" if config.reuse else "off",
        config.block_size,
        len(config.api_keys) or "shared",
        "enabled" if config.admin_token else "disabled",
    )
    if config.model in BUILTIN:
        log.info(
            "the built-in model has random weights: its replies are noise (it shows the cache, not language)"
        )
    return Started(app, engine, events)


def save_at_exit(started: Started, config, stopped: float) -> None:
    """The running batch has stopped (Engine.shutdown), its KV committed: what the sidecar
    writer still holds goes out first (bounded), then the cache file gets the time left of
    --cache-save-timeout from ``stopped`` (time.monotonic())."""
    from demo.shutdown_sidecar import flush_sidecar

    flush_sidecar(started.engine.store, stopped + config.cache_save_timeout)
    started.app.extensions["radixkv"]["cache_files"].save_at_exit(stopped + config.cache_save_timeout)
    if started.events is not None:
        started.events.close()


_signalled: list[float] = []  # when SIGTERM came (time.monotonic())


def interrupt(signum, frame) -> None:
    """SIGTERM's handler: end like Ctrl-C (so the cache file is saved), noting when."""
    _signalled.append(time.monotonic())
    raise KeyboardInterrupt


def signalled_at() -> float:
    """When SIGTERM came, or now (Ctrl-C, or no signal)."""
    return _signalled[0] if _signalled else time.monotonic()


def exit_with_parent() -> None:
    """A child of the supervisor ends itself (at once, no save) when the supervisor is gone
    (kill -9): nothing else would ever stop it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        log.error("the supervisor (pid %d) is gone: exiting", parent)
        os._exit(1)

    threading.Thread(target=watch, name="radixkv-parent-watch", daemon=True).start()
