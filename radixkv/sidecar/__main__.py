"""``python -m radixkv.sidecar --socket PATH --host-bytes N [--state-bytes N] [--l2 URL] [--metrics-port P]``
and ``python -m radixkv.sidecar stats --socket PATH`` (the counters as JSON)."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys

from radixkv.sidecar.protocol import FrameBuffer, recv, send

logger = logging.getLogger("radixkv.sidecar")
STATS_TIMEOUT_S = 5.0


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or with K/M/G/T)") from None


def _mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an octal file mode: {text!r}") from None
    if mode & ~0o777:
        raise argparse.ArgumentTypeError(f"file mode {text!r} is outside 0o777")
    return mode


def stats_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixkv.sidecar stats")
    parser.add_argument("--socket", required=True)
    args = parser.parse_args(argv)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(STATS_TIMEOUT_S)
    try:
        sock.connect(args.socket)
    except OSError as e:
        print(f"no sidecar on {args.socket}: {e}", file=sys.stderr)
        return 1
    try:
        send(sock, {"op": "stats"})
        reply, _, _ = recv(sock, FrameBuffer())
    except TimeoutError:
        print(f"the sidecar on {args.socket} did not answer within {STATS_TIMEOUT_S:g} s", file=sys.stderr)
        return 1
    except (OSError, ConnectionError) as e:
        print(f"the sidecar on {args.socket} failed: {e}", file=sys.stderr)
        return 1
    print(json.dumps(reply.get("stats", reply), indent=1, sort_keys=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["stats"]:
        return stats_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m radixkv.sidecar", description=__doc__)
    parser.add_argument("--socket", required=True, help="Unix socket path clients attach to")
    parser.add_argument("--host-bytes", required=True, type=_size, help="KV memory for all models (e.g. 8G)")
    parser.add_argument(
        "--state-bytes",
        type=_size,
        default=None,
        help="of --host-bytes, the most that recurrent-state snapshots take (default a quarter)",
    )
    parser.add_argument("--l2", default=None, help="redis://HOST:PORT/DB, rediss://..., unix://..., file:DIR")
    parser.add_argument("--l2-timeout", type=float, default=0.5, help="seconds per L2 call (default 0.5)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here")
    parser.add_argument("--metrics-host", default="127.0.0.1")
    parser.add_argument("--mode", type=_mode, default=0o600, help="socket file mode (default 600)")
    parser.add_argument(
        "--kv-events-config",
        default=None,
        help="publish KV events for routers: vLLM's JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\' '
        "(docs/kv-events.md; needs pyzmq)",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s radixkv-sidecar %(message)s")

    from radixkv.sidecar.server import ServeError, Server, install_signal_handlers
    from radixkv.sidecar.state import Sidecar

    l2 = writer = None
    if args.l2:
        from radixkv.l2 import open_l2  # the L2 tier is optional: only imported with --l2
        from radixkv.sidecar.l2_writer import L2Writer

        try:
            l2 = open_l2(args.l2, timeout_s=args.l2_timeout)
        except (ValueError, ImportError) as e:
            parser.error(f"--l2: {e}")
        writer = L2Writer(l2)
    publisher = listener = None
    if args.kv_events_config:
        from radixkv.events import EventLog, KVEventsConfig, start_publisher
        from radixkv.events.recorder import sidecar_listener

        try:
            config = KVEventsConfig.from_json(args.kv_events_config)
            log = EventLog()
            publisher = start_publisher(config, log)
        except ValueError as e:
            parser.error(f"--kv-events-config: {e}")
        if publisher is not None:
            listener = sidecar_listener(log)
            logger.info("KV events on %s", config.endpoint)
    try:
        state = Sidecar(
            args.host_bytes,
            l2=l2,
            l2_writer=writer.put if writer else None,
            state_bytes=args.state_bytes,
            tree_listener=listener,
        )
    except ValueError as e:
        parser.error(str(e))
    server = Server(state, args.socket, mode=args.mode)
    try:
        try:
            server.listen()
        except ServeError as e:
            return _refuse(str(e))
        install_signal_handlers(server)
        if args.metrics_port is not None:
            from radixkv.sidecar.metrics import serve_metrics

            try:
                serve_metrics(
                    state, args.metrics_port, args.metrics_host, extra=writer.stats if writer else None
                )
            except OSError as e:
                server.close()
                where = f"{args.metrics_host}:{args.metrics_port}"
                return _refuse(
                    f"cannot serve metrics on {where} ({e.strerror or e}): give another --metrics-port"
                )
        server.serve()
    finally:
        if publisher is not None:
            publisher.close()
        if writer is not None:
            writer.close()
        if l2 is not None:
            l2.close()
    return 0


def _refuse(why: str) -> int:
    print(f"radixkv sidecar: {why}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
