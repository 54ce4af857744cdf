"""An HTTP front end's process: the Flask app under waitress, over the engine process.

    front_end.main(config, run_dir, index, port, ready)   # a child of demo.core.supervisor

It parses, authenticates, tokenises, applies chat templates, detokenises, streams and serves
/metrics (demo.api.app over a demo.api.engine_client.RemoteEngine); it never touches the model
or the store. Every front end listens on the same port (SO_REUSEPORT: the kernel spreads new
connections over them). SIGTERM: the listener closes, this front end's requests are cut (503).
"""

from __future__ import annotations

import logging
import os
import signal
import socket

log = logging.getLogger(__name__)


def listener(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT, so that several processes share the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def main(config, run_dir: str, index: int, port: int, ready) -> None:
    """``ready`` (a Connection) gets ("ready", pid, url) once the port is bound and the engine
    has answered, or ("failed", message)."""
    from demo import log_format, startup

    log_format.configure()
    startup.exit_with_parent()
    from transformers import AutoTokenizer

    from demo.api.app import create_app
    from demo.api.engine_client import EngineClient, RemoteEngine
    from demo.api.server import Limits, serve_forever

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(run_dir, "tokenizer"))
    client = EngineClient(run_dir, index)
    try:
        engine = RemoteEngine(client, tokenizer)
    except TimeoutError as e:
        ready.send(("failed", str(e)))
        raise SystemExit(2) from None
    app = create_app(config, engine)
    sock = listener(config.host, port)
    signal.signal(signal.SIGTERM, startup.interrupt)
    url = f"http://{config.host}:{port}"
    try:
        serve_forever(
            app,
            config.host,
            port,
            lambda url: ready.send(("ready", os.getpid(), url)),
            Limits.for_engine(
                config.max_queue,
                config.max_batch_size,
                config.connections_per_address,
                app.extensions["radixkv"]["max_body_bytes"],
                config.proxies,
            ),
            lambda: engine.shutdown(0),
            sock=sock,
        )
    except KeyboardInterrupt:
        pass
    finally:
        log.info("front end %d (%s) stopped", index, url)
        client.close()
    logging.shutdown()
    os._exit(0)
