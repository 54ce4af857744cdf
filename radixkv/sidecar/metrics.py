"""The sidecar's counters as Prometheus text, served on ``--metrics-port`` (a daemon thread).

Names are ``radixkv_sidecar_<stat>``: counters (``*_total`` once exported) for monotone numbers,
gauges for occupancy. Hit tokens per tier: ``hit_tokens`` (served from sidecar memory) of which
``l2_hit_tokens`` came from the L2 tier for that request; ``l2_*`` are the L2 store's own counts.
"""

from __future__ import annotations

import http.server
import threading

from radixkv.sidecar.state import Counters, Sidecar

GAUGES = {
    "clients",
    "pools",
    "budget_bytes",
    "used_bytes",
    "cached_blocks",
    "pinned_blocks",
    "open_leases",
    "open_txns",
    "private_blocks",
    "claims",
    "state_budget_bytes",
    "used_state_bytes",
    "cached_snapshots",
    "private_snapshots",
    "l2_queued_bytes",
    "l2_down",  # 1 while the L2 is in an outage: a state, not a count
}
COUNTERS = set(Counters.__dataclass_fields__) | {"l2_dropped_blocks"}


def prometheus_text(stats: dict[str, int]) -> str:
    lines = []
    for name, value in sorted(stats.items()):
        if name in GAUGES:
            kind, metric = "gauge", f"radixkv_sidecar_{name}"
        else:  # sidecar and L2 counters: monotone
            base = name.removesuffix("_total")  # clients_total -> ..._clients_total, not _total_total
            kind, metric = "counter", f"radixkv_sidecar_{base}_total"
        lines += [f"# TYPE {metric} {kind}", f"{metric} {int(value)}"]
    return "\n".join(lines) + "\n"


def serve_metrics(state: Sidecar, port: int, host: str = "127.0.0.1", extra=None) -> http.server.HTTPServer:
    """Serve ``GET /metrics`` on ``host:port`` from a daemon thread; returns the server."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics")
                return
            with state.lock:
                stats = state.stats()
            if extra is not None:
                stats.update(extra())
            body = prometheus_text(stats).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="sidecar-metrics", daemon=True).start()
    return server
