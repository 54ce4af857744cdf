"""python -m demo [--host H] [--port P] [--model builtin|builtin-tiny|PATH|HUB_ID] [--no-reuse] ...
python -m demo save-builtin DIR     (the built-in model as a checkpoint folder: demo.save_builtin)

Flags override RADIXKV_* environment variables; `python -m demo --help` lists both. With
``--api-server-count N`` (N >= 1) the engine runs in its own process and N HTTP front ends in
others (demo.core.supervisor); with 0, everything runs in this process (below).
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from demo import log_format, startup
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
        startup.fail(str(e))
    if config.api_server_count > 0:
        from demo.core.supervisor import run

        return run(config)
    return serve_in_process(config)


def serve_in_process(config) -> int:
    """The HTTP server, the engine and the model in this process (--api-server-count 0)."""
    started = startup.build(config)
    app, engine = started.app, started.engine
    from demo.api.server import Limits, serve_forever

    # SIGTERM (docker stop, systemd, Kubernetes) ends the server like Ctrl-C, so the cache file
    # is saved, within --cache-save-timeout of the signal (demo.shutdown_save).
    signal.signal(signal.SIGTERM, startup.interrupt)

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
        startup.save_at_exit(started, config, startup.signalled_at())
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is saved and logged: skip the interpreter's teardown, which takes 1-2 s with
    # torch loaded (measured on the 2-core test machine) and would eat into the grace period.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(code)
