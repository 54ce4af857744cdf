"""python -m demo [--host H] [--port P] [--model builtin|builtin-tiny|PATH|HUB_ID] [--no-reuse] ...
python -m demo save-builtin DIR     (the built-in model as a checkpoint folder: demo.save_builtin)

Flags override RADIXKV_* environment variables; `python -m demo --help` lists both.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from demo import log_format
from demo.config import from_args


def main(argv: list[str] | None = None) -> int:
    log_format.configure()  # every line escaped: a client cannot forge one (demo.log_format)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["save-builtin"]:
        from demo.save_builtin import main as save_builtin

        return save_builtin(argv[1:])
    try:
        config = from_args(argv)
    except ValueError as e:  # a flag's or variable's value (its syntax was argparse's to check)
        _fail(str(e))
    # First to load torch, so that its OpenMP threads wait passively (radixkv.wait_policy)
    import hf_patch  # noqa: F401
    from demo.api.app import create_app
    from demo.api.auth import TenantSecretError
    from demo.api.server import Limits, serve_forever
    from demo.cache_files import CacheFileConflict
    from demo.model.adapters import AdapterError
    from demo.model.loading import BUILTIN, ModelNotFound
    from demo.shutdown_sidecar import flush_sidecar
    from demo.task_prompts import TaskPromptError

    try:
        app = create_app(config)
    except ModelNotFound as e:
        _fail(
            f"--model {config.model}: not a built-in model ({', '.join(BUILTIN)}), "
            f"a local directory or a loadable Hub id: {e}"
        )
    # A malformed --task-prompts file / RADIXKV_TASK_PROMPTS or prompts too big for the pool; a
    # damaged --tenant-secret-file (or CACHE_FILE.secret); a --cache-file of other flags
    except (TaskPromptError, TenantSecretError, CacheFileConflict) as e:
        _fail(str(e))
    except AdapterError as e:  # a --lora-modules entry that does not load
        _fail(f"--lora-modules: {e.message}")
    engine = app.extensions["radixkv"]["engine"]
    log = logging.getLogger("demo")
    from demo import kv_events

    try:
        events = kv_events.start(config.kv_events_config, engine)
    except ValueError as e:  # pyzmq missing, an endpoint that does not bind
        _fail(f"--kv-events-config: {e}")
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
    # SIGTERM (docker stop, systemd, Kubernetes) ends the server like Ctrl-C, so the cache file
    # is saved, within --cache-save-timeout of the signal (demo.shutdown_save).
    signal.signal(signal.SIGTERM, _interrupt)

    def stopping() -> None:  # the save must not wait for requests: they are cut, as a stream
        # would be by the exit anyway, and the batch running stops at its next step
        engine.shutdown(wait=min(2.0, config.cache_save_timeout / 4))

    # A fixed line on stdout that scripts (benchmarks/bench_http.py) wait for.
    try:
        serve_forever(
            app,
            config.host,
            config.port,
            lambda url: print(f"radixkv demo: serving on {url}", flush=True),
            Limits.for_engine(
                config.max_queue,
                config.max_batch_size,
                config.connections_per_address,
                app.extensions["radixkv"]["max_body_bytes"],
                config.proxies,
            ),
            stopping,
        )
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM during the save kills
        stopped = _signalled[0] if _signalled else time.monotonic()  # Ctrl-C: from now
        # The running batch has stopped (stopping()), its KV committed: what the sidecar writer
        # still holds goes out first (bounded), then the cache file gets the time left.
        flush_sidecar(engine.store, stopped + config.cache_save_timeout)
        app.extensions["radixkv"]["cache_files"].save_at_exit(stopped + config.cache_save_timeout)
        if events is not None:
            events.close()
    return 0


def _fail(message: str) -> None:
    """Stop with a one-line error (exit status 2, as argparse's): these come from the flags'
    values, not their syntax, so the usage text would only push the message out of sight."""
    print(f"python -m demo: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


_signalled: list[float] = []  # when SIGTERM came (time.monotonic())


def _interrupt(signum, frame) -> None:
    _signalled.append(time.monotonic())
    raise KeyboardInterrupt


if __name__ == "__main__":
    code = main()
    # Everything is saved and logged: skip the interpreter's teardown, which takes 1-2 s with
    # torch loaded (measured on the 2-core test machine) and would eat into the grace period.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code)
