"""python -m demo [--host H] [--port P] [--model builtin|builtin-tiny|PATH|HUB_ID] [--no-reuse] ...

Flags override RADIXKV_* environment variables; `python -m demo --help` lists both.
"""

from __future__ import annotations

import logging
import sys

from demo.config import from_args, parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = from_args(argv)
    except ValueError as e:
        parser().error(str(e))
    from demo.api import create_app
    from demo.model import BUILTIN, ModelNotFound
    from demo.server import Limits, serve_forever

    try:
        app = create_app(config)
    except ModelNotFound as e:
        parser().error(
            f"--model {config.model}: not a built-in model ({', '.join(BUILTIN)}), "
            f"a local directory or a loadable Hub id: {e}"
        )
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
    # A fixed line on stdout that scripts (benchmarks/bench_http.py) wait for.
    serve_forever(
        app,
        config.host,
        config.port,
        lambda url: print(f"radixkv demo: serving on {url}", flush=True),
        Limits.for_engine(config.max_queue, config.max_batch_size),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
