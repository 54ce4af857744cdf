"""Prometheus text exposition (format 0.0.4) for GET /metrics, with no client library.

Request counters and latency histograms are kept here; prefix-cache and pool numbers are
read from `KVStore.stats()` at scrape time.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# A step-loop forward (a decode step: ~5-50 ms on a CPU): fine around a step's usual length
FORWARD_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)

# stats() key -> (metric name, type, help)
_STORE = [
    (
        "query_tokens",
        "radixkv_prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
    ),
    (
        "hit_tokens",
        "radixkv_prefix_cache_hits_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
    ),
    ("hit_rate", "radixkv_prefix_cache_hit_rate", "gauge", "hits / queries since start (tokens)."),
    (
        "inserted_tokens",
        "radixkv_prefix_cache_inserted_tokens_total",
        "counter",
        "Tokens committed to the cache.",
    ),
    ("evicted_blocks", "radixkv_prefix_cache_evictions_total", "counter", "Blocks evicted (LRU leaves)."),
    # Not *_total: that suffix marks counters, and would read as a sample of radixkv_pool_blocks.
    ("num_blocks", "radixkv_pool_capacity_blocks", "gauge", "Blocks in the KV pool."),
    ("block_size", "radixkv_pool_block_size", "gauge", "Tokens per block."),
    ("pool_bytes", "radixkv_pool_bytes", "gauge", "Bytes of KV pool storage."),
]
# Host tier and task prompts (radixkv stats keys present only with a host tier are read as 0).
_TIERS = [
    ("demoted_blocks", "radixkv_host_demotions_total", "counter", "Device blocks demoted to the host tier."),
    ("host_hit_tokens", "radixkv_host_hits_total", "counter", "Prompt tokens served from host-tier blocks."),
    (
        "remote_hit_tokens",
        "radixkv_sidecar_hits_total",
        "counter",
        "Prompt tokens served from the machine's sidecar (radixkv.sidecar), not from this process's pools.",
    ),
    (
        "sidecar_connected",
        "radixkv_sidecar_connected",
        "gauge",
        "1 while a sidecar answers (0: none or gone).",
    ),
    (
        "sidecar_timeouts",
        "radixkv_sidecar_timeouts_total",
        "counter",
        "Calls to the sidecar that waited out RADIXKV_SIDECAR_TIMEOUT_S: each a miss or a write not made.",
    ),
    ("host_num_blocks", "radixkv_host_pool_capacity_blocks", "gauge", "Blocks in the host tier (0: none)."),
    ("host_pool_bytes", "radixkv_host_pool_bytes", "gauge", "Bytes of host-tier storage."),
    (
        "task_prompts",
        "radixkv_task_prompts",
        "gauge",
        "Task prompts pinned (per form, once for all tenants).",
    ),
]
_HOST_POOL_STATES = (
    ("host_free_blocks", "free"),
    ("host_cached_blocks", "cached"),
    ("host_pinned_blocks", "pinned"),
    ("host_retired_blocks", "retired"),
)
# pinned is a subset of cached; retired = flushed blocks that running requests still read.
_POOL_STATES = (
    ("free_blocks", "free"),
    ("cached_blocks", "cached"),
    ("pinned_blocks", "pinned"),
    ("retired_blocks", "retired"),
)


def number(v) -> str:
    """A sample value, exact: integers as integers, floats round-trip (repr).

    `:g` kept 6 digits, so 1073741824 pool bytes read 1.07374e+09 and counters past a
    million moved in steps: rate() over them was wrong."""
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    v = float(v)
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)


def _tier_lines(stats: dict) -> list[str]:
    """Host-tier and task-prompt samples: gauges per tier, demotions, host hits, bytes each way."""
    out = []
    for key, name, kind, help_ in _TIERS:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {number(stats.get(key, 0))}"]
    out += [
        "# HELP radixkv_host_pool_blocks Host-tier blocks by state.",
        "# TYPE radixkv_host_pool_blocks gauge",
    ]
    out += [f'radixkv_host_pool_blocks{{state="{s}"}} {int(stats.get(k, 0))}' for k, s in _HOST_POOL_STATES]
    out += [
        "# HELP radixkv_tier_copy_bytes_total KV bytes copied between the device pool and the host tier.",
        "# TYPE radixkv_tier_copy_bytes_total counter",
        f'radixkv_tier_copy_bytes_total{{direction="to_host"}} {int(stats.get("bytes_to_host", 0))}',
        f'radixkv_tier_copy_bytes_total{{direction="from_host"}} {int(stats.get("bytes_from_host", 0))}',
        "# HELP radixkv_task_pinned_blocks Blocks pinned by task prompts, by tier.",
        "# TYPE radixkv_task_pinned_blocks gauge",
        f'radixkv_task_pinned_blocks{{tier="device"}} {int(stats.get("task_pinned_blocks", 0))}',
        f'radixkv_task_pinned_blocks{{tier="host"}} {int(stats.get("task_pinned_host_blocks", 0))}',
    ]
    return out


def _le(bound) -> str:
    return repr(bound) if isinstance(bound, float) else str(bound)


class Histogram:
    """A Prometheus histogram: cumulative `_bucket{le=...}` counts, `_sum`, `_count`.
    observe() is thread-safe (the engine's worker observes while /metrics renders)."""

    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value

    def lines(self, name: str, labels: str = "") -> list[str]:
        with self._lock:
            counts, total_sum = list(self.counts), self.sum
        out, total, sep = [], 0, "," if labels else ""
        for le, n in zip([*map(_le, self.buckets), "+Inf"], counts):
            total += n
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {total}')
        braces = f"{{{labels}}}" if labels else ""
        return out + [f"{name}_sum{braces} {number(total_sum)}", f"{name}_count{braces} {total}"]


class Metrics:
    """Thread-safe request metrics. `endpoint` is a short route name: chat, completions, ..."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, int], int] = defaultdict(int)
        self._seconds: dict[str, Histogram] = defaultdict(Histogram)
        self._ttft: dict[str, Histogram] = defaultdict(Histogram)
        self._tokens = {"prompt": 0, "completion": 0, "cached": 0}

    def request(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        with self._lock:
            self._requests[endpoint, status] += 1
            if seconds is not None:
                self._seconds[endpoint].observe(seconds)

    def generation(self, endpoint: str, result) -> None:
        """Record a finished demo.engine.engine.Result."""
        self.record(
            endpoint, result.ttft_s, result.prompt_tokens, result.completion_tokens, result.cached_tokens
        )

    def record(self, endpoint: str, ttft_s: float, prompt: int, completion: int, cached: int) -> None:
        """A finished generation's time to first token and token counts."""
        with self._lock:
            self._ttft[endpoint].observe(ttft_s)
            self._tokens["prompt"] += prompt
            self._tokens["completion"] += completion
            self._tokens["cached"] += cached

    def render(
        self, stats: dict, *, reuse: bool, queued: int, engine_histograms=(), engine_counters=()
    ) -> str:
        """The engine's lines (`render_engine`), then the requests' (`render_requests`)."""
        engine = self.render_engine(
            stats,
            reuse=reuse,
            queued=queued,
            engine_histograms=engine_histograms,
            engine_counters=engine_counters,
        )
        return engine + self.render_requests()

    @staticmethod
    def render_engine(
        stats: dict, *, reuse: bool, queued: int, engine_histograms=(), engine_counters=()
    ) -> str:
        """`engine_histograms`: (name, help, Histogram) of the engine (batch size, queue wait);
        `engine_counters`: (name, help, value) of the engine (pauses, resumes). Rendered where
        the engine runs (with --api-server-count, in the engine process)."""
        out = [
            "# HELP radixkv_prefix_reuse_enabled 1 if prefix reuse is on.",
            "# TYPE radixkv_prefix_reuse_enabled gauge",
            f"radixkv_prefix_reuse_enabled {int(reuse)}",
            "# HELP radixkv_queue_waiting Requests waiting for the generation worker.",
            "# TYPE radixkv_queue_waiting gauge",
            f"radixkv_queue_waiting {queued}",
        ]
        for key, name, kind, help_ in _STORE:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {number(stats.get(key, 0))}"]
        out += ["# HELP radixkv_pool_blocks KV pool blocks by state.", "# TYPE radixkv_pool_blocks gauge"]
        out += [f'radixkv_pool_blocks{{state="{s}"}} {int(stats.get(k, 0))}' for k, s in _POOL_STATES]
        out += _tier_lines(stats)
        for name, help_, h in engine_histograms:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *h.lines(name)]
        for name, help_, value in engine_counters:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {number(value)}"]
        return "\n".join(out) + "\n"

    def render_requests(self) -> str:
        """This process's request counters, latencies and token totals."""
        out: list[str] = []
        with self._lock:
            out += [
                "# HELP radixkv_requests_total Requests by endpoint and HTTP status.",
                "# TYPE radixkv_requests_total counter",
            ]
            out += [
                f'radixkv_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                for (e, s), n in sorted(self._requests.items())
            ]
            out += [
                "# HELP radixkv_tokens_total Tokens of finished generations, by kind.",
                "# TYPE radixkv_tokens_total counter",
            ]
            out += [f'radixkv_tokens_total{{kind="{k}"}} {n}' for k, n in self._tokens.items()]
            for name, help_, hists in (
                ("radixkv_request_seconds", "Request latency (to the last byte).", self._seconds),
                ("radixkv_ttft_seconds", "Time to first token, queueing included.", self._ttft),
            ):
                out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
                for endpoint, h in sorted(hists.items()):
                    out += h.lines(name, f'endpoint="{endpoint}"')
        return "\n".join(out) + "\n"
