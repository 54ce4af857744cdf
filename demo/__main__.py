"""python -m demo [--host H] [--port P] [--model builtin|builtin-tiny|PATH|HUB_ID] [--no-reuse] ...

Flags override RADIXKV_* environment variables; `python -m demo --help` lists both.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from demo.config import from_args, parser


def quiet_threads(environ=os.environ) -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the environment says otherwise; call before torch loads
    (its OpenMP runtime reads it once). A torch thread that finishes its part of an operation
    early then sleeps instead of spinning: on a busy machine a spinning thread holds the core
    its partner needs to finish, and each of the many small operations of a decode step waits
    for a scheduler slice (measured 4-8x slower; docs/batching.md, "A busy machine")."""
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    quiet_threads()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = from_args(argv)
    except ValueError as e:
        parser().error(str(e))
    from demo.api.app import create_app
    from demo.api.auth import TenantSecretError
    from demo.api.server import Limits, serve_forever
    from demo.model.adapters import AdapterError
    from demo.model.loading import BUILTIN, ModelNotFound
    from demo.task_prompts import TaskPromptError

    try:
        app = create_app(config)
    except ModelNotFound as e:
        parser().error(
            f"--model {config.model}: not a built-in model ({', '.join(BUILTIN)}), "
            f"a local directory or a loadable Hub id: {e}"
        )
    except TaskPromptError as e:  # a malformed --task-prompts file / RADIXKV_TASK_PROMPTS, or too big
        parser().error(str(e))
    except TenantSecretError as e:  # a damaged --tenant-secret-file (or CACHE_FILE.secret)
        parser().error(str(e))
    except AdapterError as e:  # a --lora-modules entry that does not load
        parser().error(f"--lora-modules: {e.message}")
    engine = app.extensions["radixkv"]["engine"]
    log = logging.getLogger("demo")
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
        app.extensions["radixkv"]["cache_files"].save_at_exit(stopped + config.cache_save_timeout)
    return 0


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
