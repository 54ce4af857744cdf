"""Server configuration: command-line flags over RADIXKV_* environment variables over defaults.

python -m demo --port 8080 --no-reuse        # flags win over the environment
RADIXKV_REUSE=0 RADIXKV_PORT=8080 python -m demo
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from demo.api.agent_options import template_kwargs
from demo.api.images import MediaPolicy, parse_limit_mm
from demo.api.proxies import TrustedProxies
from demo.errors import ApiError
from demo.model.adapters import LoraModule, parse_lora_modules

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("cpu", "cuda", "mps", "xpu")
_REASONING = ("auto", "none", "deepseek_r1", "qwen3")  # demo.api.reasoning.PARSERS
_TOOL_PARSERS = ("auto", "none", "hermes", "llama3_json", "mistral")  # demo.api.tool_parsers.PARSERS
_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's strategies


@dataclass(frozen=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "builtin"  # a demo.model.loading.BUILTIN name, a local checkpoint directory or a Hub id
    revision: str | None = None  # Hub branch, tag or commit of `model`
    trust_remote_code: bool = False  # run a Hub repository's own modelling code
    device_map: str | None = None  # from_pretrained's device_map (accelerate), e.g. "auto"
    device: str = "auto"  # auto = cuda if available else cpu
    dtype: str = "auto"  # auto = bfloat16 on cuda, float32 on cpu
    reuse: bool = True  # False: plain generate(), no RadixCache (A/B baseline)
    block_size: int = 16
    cache_tokens: int | None = None  # KV pool budget in tokens; None = hf_patch's default
    sidecar: str | None = None  # Unix socket of a radixkv sidecar shared by this machine's processes
    kv_events_config: str | None = None  # vLLM's KVEventsConfig JSON: KV events for routers
    api_keys: tuple[str, ...] = ()  # non-empty: Bearer key required, one cache namespace each
    admin_token: str | None = None  # required by POST /v1/cache/flush; None = flush refused
    default_max_tokens: int = 256  # when a request gives no max_tokens (clamped to the context)
    max_queue: int = 32  # requests waiting for the generation worker before 503
    # HTTP front-end processes beside one engine process (demo.core); 0: all in this process
    api_server_count: int = 0
    max_batch_size: int = 32  # rows decoding together (step loop) or in one generate() call
    max_batch_tokens: int = 16384  # cap on rows x padded prompt length of one batch
    # decode steps after which a running batch pauses for a waiting request that can join it
    # (continuous batching in chunks); 0: a batch runs to its end
    decode_chunk: int = 16
    # prompt tokens a long prompt computes per turn while other requests decode (prefilled in
    # slices between decode chunks, docs/batching.md); 0: a long prompt is prefilled at once
    prefill_chunk: int = 256
    # step loop: prompt tokens newcomers may compute per decode step (the first one in line
    # always joins); 0: no budget, every newcomer that fits joins at once; None: twice
    # max_batch_size (at least 64) where newcomers join inside steps (the CPU kernel), else none
    # (docs/batching.md#the-admission-budget)
    max_prefill_tokens: int | None = None
    # open connections one client address may hold; None: half of the server's connection
    # limit, 0: no cap (behind a trusted proxy or gateway, which is one address for everyone)
    connections_per_address: int | None = None
    # peers (addresses or networks) whose X-Forwarded-For names the client (demo.api.proxies)
    trusted_proxies: tuple[str, ...] = ()
    served_name: str | None = None  # model id in responses; default: basename of `model`
    tenant_secret: bytes = field(default_factory=lambda: os.urandom(32), repr=False)
    cache_file: str | None = None  # restored at start, saved at shutdown (and every cache_save_every s)
    cache_dir: str | None = None  # where POST /v1/cache/save|restore {"name"} files live
    cache_save_every: float | None = None  # seconds between periodic saves to cache_file
    # seconds from SIGTERM to exit, the shutdown save included (Kubernetes' default grace
    # period is 30 s: 25 leaves room for the rest of the pod's shutdown)
    cache_save_timeout: float = 25.0
    # Where the tenant HMAC secret persists (owner-only); default with a cache_file: beside it.
    tenant_secret_file: str | None = None
    task_prompts: str | None = None  # a JSON file of [{"task_id", "prompt"}] (demo.task_prompts)
    task_prompts_json: str | None = field(default=None, repr=False)  # the same JSON, from the env
    # PEFT adapters served as extra model names (demo.model.adapters), vLLM's --lora-modules
    lora_modules: tuple[LoraModule, ...] = ()
    lora_download_timeout: float = 120.0  # seconds for a Hub id's adapter files (demo.model.adapter_files)
    # Images (a vision-language --model, demo.api.images): per request, encoded bytes per image, the
    # hosts http(s) images may be fetched from (none: data: URLs only) and the fetch's time limit
    limit_images: int = 4
    max_image_bytes: int = 8 << 20
    # Videos (demo.api.videos): per request, encoded bytes per video, frames handed to the model
    limit_videos: int = 1
    max_video_bytes: int = 32 << 20
    max_video_frames: int = 64
    video_frames: int | None = None  # sampled evenly where the processor samples none (MediaPolicy)
    video_decode_timeout: float = 30.0  # seconds for decoding one request's videos
    allowed_media_domains: tuple[str, ...] = ()
    media_fetch_timeout: float = 5.0
    # Origins a browser app may call the API from (CORS, demo.api.conventions); () = none, "*" = any
    allowed_origins: tuple[str, ...] = ()
    # Agents (docs/agents.md): how replies split into reasoning and tool calls ("auto": from the
    # chat template; demo.api.reasoning.PARSERS, demo.api.tool_parsers.PARSERS), and chat
    # template variables every request gets unless it sets them (``{"enable_thinking": false}``)
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    default_chat_template_kwargs: dict = field(default_factory=dict)
    # /v1/responses with store: responses kept (per tenant, in memory) and for how many seconds
    responses_max_stored: int = 1000
    responses_max_age: float = 3600.0

    def __post_init__(self) -> None:
        if self.kv_events_config is not None:
            from radixkv.events.config import KVEventsConfig

            try:
                events = KVEventsConfig.from_json(self.kv_events_config)
            except ValueError as e:
                raise ValueError(f"kv_events_config: {e}") from None
            if events.enabled and not self.reuse:
                raise ValueError("kv_events_config: KV events need the prefix cache (no --no-reuse)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.cache_tokens is not None and self.cache_tokens < self.block_size:
            raise ValueError(
                f"cache_tokens must be >= block_size ({self.block_size}), got {self.cache_tokens}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.device != "auto" and self.device.split(":")[0] not in _DEVICES:
            raise ValueError(f"device must be auto, cpu, cuda[:N], mps or xpu, got {self.device!r}")
        if not 0 <= self.api_server_count <= 64:
            raise ValueError(
                f"api_server_count must be in 0..64 (0: the engine in the HTTP server's process), "
                f"got {self.api_server_count}"
            )
        if self.default_max_tokens < 1 or self.max_queue < 1:
            raise ValueError("default_max_tokens and max_queue must be >= 1")
        if self.max_batch_size < 1 or self.max_batch_tokens < 1:
            raise ValueError(
                f"max_batch_size and max_batch_tokens must be >= 1, got {self.max_batch_size} "
                f"and {self.max_batch_tokens}"
            )
        if self.decode_chunk < 0:
            raise ValueError(f"decode_chunk must be >= 0, got {self.decode_chunk}")
        if self.prefill_chunk < 0 or self.prefill_chunk % self.block_size:
            raise ValueError(
                f"prefill_chunk must be 0 (off) or a multiple of block_size {self.block_size}, got {self.prefill_chunk}"
            )
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 0:
            raise ValueError(f"max_prefill_tokens must be >= 0 (0: no budget), got {self.max_prefill_tokens}")
        if self.connections_per_address is not None and self.connections_per_address < 0:
            raise ValueError(f"connections_per_address must be >= 0, got {self.connections_per_address}")
        if any(not k for k in self.api_keys):
            raise ValueError("api_keys must be non-empty strings")
        if self.device_map is not None and self.model in ("builtin", "builtin-tiny"):
            raise ValueError("device_map applies to checkpoints, not to the built-in models")
        if self.device_map not in (None, *_DEVICE_MAPS) and self.device_map.split(":")[0] not in _DEVICES:
            raise ValueError(
                f"device_map must be one of {', '.join(_DEVICE_MAPS)} or a device, got {self.device_map!r}"
            )
        if self.cache_save_every is not None and (self.cache_save_every <= 0 or not self.cache_file):
            raise ValueError("cache_save_every must be > 0 seconds and needs a cache_file")
        if not self.lora_download_timeout > 0:
            raise ValueError(f"lora_download_timeout must be > 0 seconds, got {self.lora_download_timeout}")
        if not self.cache_save_timeout > 0:  # also refuses NaN
            raise ValueError(f"cache_save_timeout must be > 0 seconds, got {self.cache_save_timeout}")
        for origin in self.allowed_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(
                    f"allowed_origins must be '*' or scheme://host[:port] origins, got {origin!r}"
                )
        if self.reasoning_parser not in _REASONING:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(_REASONING)}, got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser not in _TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(_TOOL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.responses_max_stored < 0 or not self.responses_max_age > 0:
            raise ValueError(
                f"responses_max_stored must be >= 0 and responses_max_age > 0 seconds, got "
                f"{self.responses_max_stored} and {self.responses_max_age}"
            )
        try:  # the request's own rule: reserved names (messages, add_generation_prompt, ...) refused
            template_kwargs(self.default_chat_template_kwargs, "default_chat_template_kwargs")
        except ApiError as e:
            raise ValueError(e.message) from None
        self.media_policy  # noqa: B018  (raises ValueError for bad image limits)
        self.proxies  # noqa: B018  (raises ValueError for a bad --trusted-proxies entry)

    @property
    def proxies(self) -> TrustedProxies:
        """The peers whose X-Forwarded-For is believed (demo.api.proxies)."""
        return TrustedProxies.parse(self.trusted_proxies)

    @property
    def media_policy(self) -> MediaPolicy:
        """The image and video limits and URL policy of demo.api.images and demo.api.videos."""
        return MediaPolicy(
            self.limit_images,
            self.max_image_bytes,
            self.allowed_media_domains,
            self.media_fetch_timeout,
            max_videos=self.limit_videos,
            max_video_bytes=self.max_video_bytes,
            max_video_frames=self.max_video_frames,
            video_frames=self.video_frames,
            video_decode_timeout=self.video_decode_timeout,
        )

    @property
    def model_id(self) -> str:
        """The id the API reports: a local directory's name, else the name as given (a Hub id
        keeps its owner, "Qwen/Qwen2.5-0.5B-Instruct", as vLLM reports it)."""
        if self.served_name:
            return self.served_name
        if os.path.isdir(self.model):
            return os.path.basename(os.path.normpath(self.model)) or self.model
        return self.model

    def resolve_device(self) -> str:
        import torch

        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolve_dtype(self, device: str):
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {text!r}")


def _keys(text: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in text.split(",") if k.strip())


def _domains(text: str) -> tuple[str, ...]:
    return tuple(d.strip().lower() for d in text.replace(",", " ").split() if d.strip())


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text[:80]!r}")
    return value


def _lora_env(text: str) -> tuple[LoraModule, ...]:
    """RADIXKV_LORA_MODULES: a JSON list (of name=path strings or objects), or name=path items
    separated by whitespace."""
    text = text.strip()
    if text.startswith("["):
        items = json.loads(text)
        if not isinstance(items, list):
            raise ValueError("expected a JSON list")
        return parse_lora_modules([i if isinstance(i, str) else json.dumps(i) for i in items])
    return parse_lora_modules(text.split())


# field -> (environment variable, parser of its text)
_ENV = {
    "host": ("RADIXKV_HOST", str),
    "port": ("RADIXKV_PORT", int),
    "model": ("RADIXKV_MODEL", str),
    "revision": ("RADIXKV_REVISION", str),
    "trust_remote_code": ("RADIXKV_TRUST_REMOTE_CODE", _bool),
    "device_map": ("RADIXKV_DEVICE_MAP", str),
    "device": ("RADIXKV_DEVICE", str),
    "dtype": ("RADIXKV_DTYPE", str),
    "reuse": ("RADIXKV_REUSE", _bool),
    "block_size": ("RADIXKV_BLOCK_SIZE", int),
    "cache_tokens": ("RADIXKV_CACHE_TOKENS", int),
    "sidecar": ("RADIXKV_SIDECAR", str),
    "kv_events_config": ("RADIXKV_KV_EVENTS_CONFIG", str),
    "api_keys": ("RADIXKV_API_KEYS", _keys),
    "admin_token": ("RADIXKV_ADMIN_TOKEN", str),
    "default_max_tokens": ("RADIXKV_MAX_TOKENS", int),
    "max_queue": ("RADIXKV_MAX_QUEUE", int),
    "api_server_count": ("RADIXKV_API_SERVER_COUNT", int),
    "cache_file": ("RADIXKV_CACHE_FILE", str),
    "cache_dir": ("RADIXKV_CACHE_DIR", str),
    "cache_save_every": ("RADIXKV_CACHE_SAVE_EVERY", float),
    "cache_save_timeout": ("RADIXKV_CACHE_SAVE_TIMEOUT", float),
    "tenant_secret_file": ("RADIXKV_TENANT_SECRET_FILE", str),
    "task_prompts_json": ("RADIXKV_TASK_PROMPTS", str),
    "max_batch_size": ("RADIXKV_MAX_BATCH_SIZE", int),
    "max_batch_tokens": ("RADIXKV_MAX_BATCH_TOKENS", int),
    "connections_per_address": ("RADIXKV_CONNECTIONS_PER_ADDRESS", int),
    "trusted_proxies": ("RADIXKV_TRUSTED_PROXIES", _keys),
    "decode_chunk": ("RADIXKV_DECODE_CHUNK", int),
    "prefill_chunk": ("RADIXKV_PREFILL_CHUNK", int),
    "max_prefill_tokens": ("RADIXKV_MAX_PREFILL_TOKENS", int),
    "lora_modules": ("RADIXKV_LORA_MODULES", _lora_env),
    "lora_download_timeout": ("RADIXKV_LORA_DOWNLOAD_TIMEOUT", float),
    "limit_mm": ("RADIXKV_LIMIT_MM_PER_PROMPT", parse_limit_mm),  # -> limit_images, limit_videos
    "max_image_bytes": ("RADIXKV_MAX_IMAGE_BYTES", int),
    "max_video_bytes": ("RADIXKV_MAX_VIDEO_BYTES", int),
    "max_video_frames": ("RADIXKV_MAX_VIDEO_FRAMES", int),
    "video_frames": ("RADIXKV_VIDEO_FRAMES", int),
    "video_decode_timeout": ("RADIXKV_VIDEO_DECODE_TIMEOUT", float),
    "allowed_media_domains": ("RADIXKV_ALLOWED_MEDIA_DOMAINS", _domains),
    "media_fetch_timeout": ("RADIXKV_MEDIA_FETCH_TIMEOUT", float),
    "allowed_origins": ("RADIXKV_ALLOWED_ORIGINS", _keys),
    "reasoning_parser": ("RADIXKV_REASONING_PARSER", str),
    "tool_call_parser": ("RADIXKV_TOOL_CALL_PARSER", str),
    "default_chat_template_kwargs": ("RADIXKV_DEFAULT_CHAT_TEMPLATE_KWARGS", _json_object),
    "responses_max_stored": ("RADIXKV_RESPONSES_MAX_STORED", int),
    "responses_max_age": ("RADIXKV_RESPONSES_MAX_AGE", float),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m demo",
        description="radixkv chat page + OpenAI-compatible API",
        epilog="python -m demo save-builtin DIR writes the built-in model as a checkpoint folder "
        "(python -m demo save-builtin --help).",
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1; env RADIXKV_HOST)")
    p.add_argument("--port", type=int, help="port (default 8000; env RADIXKV_PORT)")
    p.add_argument(
        "--model",
        help="builtin, builtin-tiny, a local HF checkpoint dir or a Hub id such as "
        "Qwen/Qwen2.5-0.5B-Instruct (env RADIXKV_MODEL)",
    )
    p.add_argument("--revision", help="Hub branch, tag or commit of --model (env RADIXKV_REVISION)")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        default=None,
        help="run the model repository's own Python code (off by default; env RADIXKV_TRUST_REMOTE_CODE)",
    )
    p.add_argument(
        "--device-map",
        help="spread the model over devices with accelerate: auto, balanced, sequential "
        "(env RADIXKV_DEVICE_MAP); --device is then unused",
    )
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N (env RADIXKV_DEVICE)")
    p.add_argument("--dtype", choices=_DTYPES, help="default auto: bfloat16 on cuda, float32 on cpu")
    p.add_argument(
        "--no-reuse",
        dest="reuse",
        action="store_false",
        default=None,
        help="plain generate() without prefix reuse (env RADIXKV_REUSE=0)",
    )
    p.add_argument(
        "--block-size", type=int, help="tokens per KV block, power of two (env RADIXKV_BLOCK_SIZE)"
    )
    p.add_argument("--cache-tokens", type=int, help="KV pool budget in tokens (env RADIXKV_CACHE_TOKENS)")
    p.add_argument(
        "--sidecar",
        help="Unix socket of a python -m radixkv.sidecar: prefixes shared with the other processes "
        "and replicas of this machine (env RADIXKV_SIDECAR; docs/sidecar.md)",
    )
    p.add_argument(
        "--kv-events-config",
        help="publish KV cache events for routers, vLLM's JSON: "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\' '
        "(env RADIXKV_KV_EVENTS_CONFIG; docs/kv-events.md; needs pyzmq)",
    )
    p.add_argument("--api-keys", type=_keys, help="comma-separated tenant keys (env RADIXKV_API_KEYS)")
    p.add_argument("--admin-token", help="token for POST /v1/cache/flush (env RADIXKV_ADMIN_TOKEN)")
    p.add_argument(
        "--max-tokens",
        dest="default_max_tokens",
        type=int,
        help="completion length when a request sets none (default 256; env RADIXKV_MAX_TOKENS)",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        metavar="N",
        help="HTTP front-end processes; N >= 1 runs the engine core (scheduler, model, store) in "
        "a process of its own, the HTTP work in N others (default 0: one process; "
        "docs/design.md#processes; env RADIXKV_API_SERVER_COUNT)",
    )
    p.add_argument(
        "--max-queue", type=int, help="waiting requests before 503 (default 32; env RADIXKV_MAX_QUEUE)"
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        help="rows decoding together (default 32; 1 = one at a time; env RADIXKV_MAX_BATCH_SIZE)",
    )
    p.add_argument(
        "--decode-chunk",
        type=int,
        help="generate() path (adapters, images, models the step loop refuses): decode steps after "
        "which a running batch lets waiting requests join (default 16; 0 = never; env RADIXKV_DECODE_CHUNK)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        help="prompt tokens a long prompt computes per turn while others decode (default 256, a "
        "multiple of the block size; 0 = all at once; env RADIXKV_PREFILL_CHUNK)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        help="step loop: prompt tokens newcomers compute per decode step (the first in line always "
        "joins; the rest join at the next steps, in order; 0 = no budget; default twice "
        "--max-batch-size, at least 64, where newcomers join inside steps (the CPU kernel), else none; env "
        "RADIXKV_MAX_PREFILL_TOKENS)",
    )
    p.add_argument(
        "--connections-per-address",
        type=int,
        help="open connections one client address may hold (default: half of the server's limit; "
        "0 = no cap, e.g. behind a gateway; env RADIXKV_CONNECTIONS_PER_ADDRESS)",
    )
    p.add_argument(
        "--trusted-proxies",
        type=_keys,
        metavar="ADDR[,ADDR...]",
        help="comma-separated addresses or networks of gateways / proxies whose X-Forwarded-For names "
        "the client (failed-auth throttle); their connections are not capped per address "
        "(env RADIXKV_TRUSTED_PROXIES)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        help="cap on rows x padded prompt tokens of one batch (default 16384; env RADIXKV_MAX_BATCH_TOKENS)",
    )
    p.add_argument("--served-name", help="model id reported by the API")
    p.add_argument(
        "--cache-file",
        help="restore the KV cache from this file at start, save it at shutdown (env RADIXKV_CACHE_FILE)",
    )
    p.add_argument(
        "--cache-dir", help="directory of named cache files for the admin endpoints (env RADIXKV_CACHE_DIR)"
    )
    p.add_argument(
        "--cache-save-every",
        type=float,
        help="also save the cache file every SECONDS (env RADIXKV_CACHE_SAVE_EVERY)",
    )
    p.add_argument(
        "--cache-save-timeout",
        type=float,
        metavar="SECONDS",
        help="on SIGTERM, exit within SECONDS, saving the most recently used prefixes that fit "
        "(default 25, inside Kubernetes' 30 s grace period; env RADIXKV_CACHE_SAVE_TIMEOUT)",
    )
    p.add_argument(
        "--tenant-secret-file",
        help="owner-only file holding the tenant HMAC secret, created if missing; default with "
        "--cache-file: CACHE_FILE.secret, else a new secret per start (env RADIXKV_TENANT_SECRET_FILE)",
    )
    p.add_argument(
        "--task-prompts",
        metavar="FILE",
        help='JSON list of {"task_id", "prompt"}: pinned prompts a request selects with "task_id" '
        "(env RADIXKV_TASK_PROMPTS: the JSON itself)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        metavar="NAME=PATH",
        help="PEFT adapters served as extra model names: name=path or a JSON object "
        '{"name", "path", "base_model_name"} (vLLM\'s flag; env RADIXKV_LORA_MODULES)',
    )
    p.add_argument(
        "--lora-download-timeout",
        type=float,
        metavar="SECONDS",
        help="time for downloading an adapter named by Hub id, retries included (default 120; "
        "env RADIXKV_LORA_DOWNLOAD_TIMEOUT)",
    )
    p.add_argument(
        "--limit-mm-per-prompt",
        dest="limit_mm",
        type=parse_limit_mm,
        metavar="image=N,video=M",
        help="images and videos per request for a vision-language model: image=N,video=M or "
        '{"image": N, "video": M}, either alone (default image=4,video=1; env RADIXKV_LIMIT_MM_PER_PROMPT)',
    )
    p.add_argument(
        "--max-image-bytes",
        type=int,
        help="encoded bytes of one image (default 8 MiB; env RADIXKV_MAX_IMAGE_BYTES)",
    )
    p.add_argument(
        "--max-video-bytes",
        type=int,
        help="encoded bytes of one video (default 32 MiB; env RADIXKV_MAX_VIDEO_BYTES)",
    )
    p.add_argument(
        "--max-video-frames",
        type=int,
        help="frames of one video handed to the model, after the processor's frame sampling "
        "(default 64; env RADIXKV_MAX_VIDEO_FRAMES)",
    )
    p.add_argument(
        "--video-frames",
        type=int,
        metavar="N",
        help="frames sampled evenly from a video where the model's processor samples none "
        "(default 32, as vLLM, or --max-video-frames where lower; at most --max-video-frames; "
        "env RADIXKV_VIDEO_FRAMES)",
    )
    p.add_argument(
        "--video-decode-timeout",
        type=float,
        help="seconds for decoding one request's videos; longer is a 400 (default 30; "
        "env RADIXKV_VIDEO_DECODE_TIMEOUT)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        metavar="HOST",
        help="hosts http(s) image and video URLs may be fetched from; default none: data: URLs only "
        "(env RADIXKV_ALLOWED_MEDIA_DOMAINS, comma-separated)",
    )
    p.add_argument(
        "--media-fetch-timeout",
        type=float,
        help="seconds for fetching one image or video URL, name lookup to last byte (default 5; "
        "env RADIXKV_MEDIA_FETCH_TIMEOUT)",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        metavar="ORIGIN",
        help="origins (https://app.example:8443, or *) whose browser apps may call the API (CORS); "
        "default none (env RADIXKV_ALLOWED_ORIGINS, comma-separated)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=_REASONING,
        help="split <think> reasoning into reasoning_content: auto (when the chat template has "
        "<think>), none, deepseek_r1, qwen3 (env RADIXKV_REASONING_PARSER)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=_TOOL_PARSERS,
        help="tool-call format of the model's replies: auto (from the chat template), none, hermes, "
        "llama3_json, mistral (env RADIXKV_TOOL_CALL_PARSER)",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        metavar="JSON",
        help="chat template variables for every request, e.g. '{\"enable_thinking\": false}'; a "
        "request's chat_template_kwargs override them (env RADIXKV_DEFAULT_CHAT_TEMPLATE_KWARGS)",
    )
    p.add_argument(
        "--responses-max-stored",
        type=int,
        help="responses /v1/responses keeps for previous_response_id (default 1000, oldest dropped "
        "first; in memory, lost on restart; env RADIXKV_RESPONSES_MAX_STORED)",
    )
    p.add_argument(
        "--responses-max-age",
        type=float,
        metavar="SECONDS",
        help="how long a stored response is kept (default 3600; env RADIXKV_RESPONSES_MAX_AGE)",
    )
    return p


def from_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Build a Config: defaults, then environment variables, then flags. Raises ValueError."""
    env = os.environ if env is None else env
    values = {}
    for name, (var, parse) in _ENV.items():
        if env.get(var, "") != "":
            try:
                values[name] = parse(env[var])
            except ValueError as e:
                raise ValueError(f"{var}: {e}") from None
    args = parser().parse_args(argv)
    limits = {**values.pop("limit_mm", {}), **(args.limit_mm or {})}
    values.update({f"limit_{medium}s": n for medium, n in limits.items()})
    if args.lora_modules is not None:
        args.lora_modules = parse_lora_modules(args.lora_modules)
    if args.allowed_media_domains is not None:
        args.allowed_media_domains = _domains(" ".join(args.allowed_media_domains))
    if args.allowed_origins is not None:
        args.allowed_origins = _keys(",".join(args.allowed_origins))
    values.update(
        {f.name: getattr(args, f.name) for f in fields(Config) if getattr(args, f.name, None) is not None}
    )
    return Config(**values)
