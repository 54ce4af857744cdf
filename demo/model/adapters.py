"""LoRA adapters served as extra model names (vLLM's ``--lora-modules``), loaded and unloaded at run time.

    python -m demo --model DIR --lora-modules sql=/adapters/sql '{"name": "chat", "path": "/adapters/chat"}'
    GET  /v1/models                                        the base model, then one entry per adapter
                                                           (``root``: its path, ``parent``: the base)
    POST /v1/load_lora_adapter   {"lora_name", "lora_path"}   admin token (vLLM's runtime loading)
    POST /v1/unload_lora_adapter {"lora_name"}                admin token; the adapter's KV is dropped

A request's ``model`` picks an adapter by name (the base model's names pick the base). PEFT holds
every adapter in one ``PeftModelForCausalLM`` over the served model and loads it its own way
(adapter_config.json + weights, a local directory or a Hub id). Rows of different adapters share a
generate() call through PEFT's ``adapter_names=`` where PEFT allows it (plain LoRA on modules: no
DoRA, aLoRA, LoRA on parameters or attention modules, no other tuner types; those get batches of
their own, ``batch_group``). hf_patch keys each row's KV
by its adapter's name and weights digest: adapters never share KV with each other nor with the
base, and a re-load of other weights under the same name never reads the old KV, which is
dropped anyway (``hf_patch.drop_stale_adapters`` after every load and unload).

The model changes only between generate() calls: the engine's worker holds ``engine.exclusive()``
while it generates, and loading / unloading take it too, but only to attach or detach: an
adapter's files are found (a local directory, or a bounded Hub download: demo.model.adapter_files)
and read (config and weights) before the lock is taken, so a slow disk, a slow Hub or a Hub id
that does not exist never holds generation up. PEFT's adapter names are derived from
the API's (``peft_name``): a name PEFT accepts as a module key, the same in every process, so a
cache file's adapter prefixes find their adapter again after a restart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import re
import threading
import time
import warnings
from collections.abc import Callable, Collection, Hashable, Sequence

from flask import Blueprint, Response, request

from demo.errors import ApiError
from demo.model.adapter_files import AdapterError, local_files
from demo.request_json import json_body

log = logging.getLogger(__name__)
BASE = "__base__"  # PEFT's adapter_names entry for "no adapter"
# PEFT LoRA layers that refuse ``adapter_names`` (mixed batches) whatever the config says: a LoRA
# on parameters (``target_parameters``, MoE experts) and on nn.MultiheadAttention.
_UNMIXABLE_LAYERS = ("ParamWrapper", "MultiheadAttention")


@dataclasses.dataclass(frozen=True)
class LoraModule:
    """One ``--lora-modules`` entry: ``name=path`` or ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(items: Sequence[str]) -> tuple[LoraModule, ...]:
    """``name=path`` items, or JSON objects (vLLM's two forms); raises ValueError naming the item."""
    out = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        if "=" in item and not item.startswith("{"):
            name, _, path = item.partition("=")
            module = LoraModule(name.strip(), path.strip())
        else:
            try:
                fields = json.loads(item)
                module = LoraModule(**fields)
            except (ValueError, TypeError) as e:
                raise ValueError(
                    f"--lora-modules entry {item!r}: expected name=path or a JSON object with "
                    f'"name", "path" and optionally "base_model_name" ({e})'
                ) from None
        if (
            not isinstance(module.name, str)
            or not isinstance(module.path, str)
            or not module.name
            or not module.path
        ):
            raise ValueError(f"--lora-modules entry {item!r}: name and path must be non-empty strings")
        out.append(module)
    names = [m.name for m in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names must be distinct, got {names}")
    return tuple(out)


def peft_name(name: str) -> str:
    """PEFT's name for the adapter the API calls ``name``: no '.', never '__base__', stable."""
    readable = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:40]
    return f"{readable}-{hashlib.sha256(name.encode('utf-8')).hexdigest()[:8]}"


@dataclasses.dataclass(frozen=True)
class Adapter:
    name: str  # the model name the API lists and requests use
    path: str  # what it was loaded from (``root`` in /v1/models)
    parent: str  # the base model's name
    peft_name: str
    mixable: bool  # PEFT can run it in a mixed adapter_names batch
    created: int
    blocks_mixing: bool = False  # while it is loaded PEFT runs no adapter_names batch at all


class Adapters:
    """The adapters loaded over ``model`` (the transformers model hf_patch sees).

    ``lock``: the model lock; the engine's worker holds it while it generates, ``load`` and
    ``unload`` take it, so the model changes only between generate() calls. ``store``: the KV
    store (set by the engine; None before it exists or with reuse off) from which ``load`` and
    ``unload`` drop the KV of adapters no longer held with the same weights. ``aliases``: other
    names requests pick the base by (the name it was started with); no adapter may take one."""

    def __init__(self, model, base_name: str, aliases: Collection[str] = (), download_timeout: float = 120.0):
        self.model, self.base_name = model, base_name
        self.base_names = {base_name, *aliases}
        self.download_timeout = download_timeout  # seconds for a Hub id's files
        self._pending: set[str] = set()  # names being read off the lock, not attached yet
        self._names_lock = threading.Lock()
        self.peft = None  # PeftModelForCausalLM over ``model`` while any adapter is loaded
        self._loaded: dict[str, Adapter] = {}
        self.lock = threading.RLock()
        self.store = None

    def __len__(self) -> int:
        return len(self._loaded)

    def names(self) -> list[str]:
        return list(self._loaded)

    def get(self, name: str) -> Adapter | None:
        return self._loaded.get(name)

    def batch_group(self, name: str | None) -> Hashable:
        """Requests of equal groups may be rows of one generate(): the base and mixable adapters
        share one (None), any other adapter has its own; while an adapter whose layers refuse
        ``adapter_names`` is loaded, every adapter and the base have their own."""
        adapter = self._loaded.get(name) if name else None
        mixing = not any(a.blocks_mixing for a in list(self._loaded.values()))
        return None if mixing and (adapter is None or adapter.mixable) else ("adapter", name)

    def split(self, names: Sequence[str | None]) -> list[list[int]]:
        """The rows (indices into ``names``) of each generate() call that rows of adapters
        ``names`` need now: one call unless a load since they were batched says otherwise."""
        calls: dict[Hashable, list[int]] = {}
        for i, name in enumerate(names):
            calls.setdefault(self.batch_group(name), []).append(i)
        return list(calls.values())

    def load(self, module: LoraModule) -> Adapter:
        """Load ``module`` under its name: its files found and read first, without the model
        lock (generation goes on), then attached between generate() calls; AdapterError
        (nothing changed) when it cannot be."""
        name = module.name
        if name in self.base_names:  # requests naming it get the base: the adapter would never serve
            raise AdapterError(400, f"'{name}' is the base model's name", "lora_name")
        with self._names_lock:
            if name in self._loaded or name in self._pending:
                raise AdapterError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
            self._pending.add(name)
        try:
            config, weights = self._read(name, module.path)
            with self.lock:
                adapter = self._attach(module, config, weights)
                self._drop_stale()
        finally:
            with self._names_lock:
                self._pending.discard(name)
        return adapter

    def _read(self, name: str, path: str):
        """(PeftConfig, state dict) of the adapter at ``path`` (a directory or a Hub id), read
        without the model lock."""
        try:
            from peft import PeftConfig
            from peft.utils import load_peft_weights
        except ImportError:  # pragma: no cover - peft is in the demo extra
            raise AdapterError(400, "serving adapters needs peft (pip install peft)") from None
        directory = local_files(path, self.download_timeout)
        try:
            config = PeftConfig.from_pretrained(directory)
        except (OSError, ValueError) as e:
            raise AdapterError(
                404, f"No adapter found at {path!r}: {e}", "lora_path", "adapter_not_found"
            ) from None
        if config.is_prompt_learning or config.task_type not in (None, "CAUSAL_LM"):
            raise AdapterError(
                400,
                f"{path!r} is a {config.peft_type} adapter for {config.task_type}: only weight adapters "
                "(LoRA and other tuners) of a causal language model can be served",
                "lora_path",
            )
        try:
            weights = load_peft_weights(directory, device=str(self.model.device))
        except Exception as e:
            raise AdapterError(400, f"cannot load adapter '{name}' from {path!r}: {e}", "lora_path") from None
        return config, weights

    def _attach(self, module: LoraModule, config, weights) -> Adapter:
        """Inject the adapter's layers and set their weights; holding the model lock."""
        from peft import PeftModelForCausalLM, PeftType
        from peft.utils import set_peft_model_state_dict

        name, path = module.name, module.path
        internal = peft_name(name)
        config.inference_mode = True
        fresh = self.peft is None
        peft = None if fresh else self.peft
        try:
            # The wrapper injects the first adapter's layers as it is built: an adapter that does
            # not fit the model (target modules it lacks, a module type LoRA cannot wrap) fails
            # here, possibly after some layers went in.
            with _peft_notices():
                if fresh:
                    peft = PeftModelForCausalLM(self.model, config, adapter_name=internal)
                else:
                    if hasattr(peft, "_check_new_adapter_config"):
                        peft._check_new_adapter_config(config, is_trainable=False)
                    peft.add_adapter(internal, config)
                result = set_peft_model_state_dict(peft, weights, adapter_name=internal)
            missing = [k for k in getattr(result, "missing_keys", ()) if f".{internal}." in k]
            if missing:
                raise ValueError(f"the adapter's file lacks {len(missing)} of its weights, e.g. {missing[0]}")
        except Exception as e:
            self._undo(peft, internal, fresh)
            raise AdapterError(400, f"cannot load adapter '{name}' from {path!r}: {e}", "lora_path") from None
        self.peft = peft.eval()
        # PEFT's layers for these refuse adapter_names outright, whichever adapters the rows name
        blocks_mixing = any(
            type(layer).__name__ in _UNMIXABLE_LAYERS and internal in (getattr(layer, "lora_A", None) or {})
            for layer in self.model.modules()
        )
        mixable = (
            config.peft_type == PeftType.LORA
            and not getattr(config, "use_dora", False)
            and not getattr(config, "alora_invocation_tokens", None)  # offsets per call, not per row
            and not blocks_mixing
        )
        parent = module.base_model_name or self.base_name
        adapter = Adapter(name, path, parent, internal, mixable, int(time.time()), blocks_mixing)
        self._loaded[name] = adapter
        log.info(
            "loaded adapter %s from %s (%s%s)",
            name,
            path,
            config.peft_type,
            "" if mixable else ", own batches",
        )
        return adapter

    def _undo(self, peft, internal: str, fresh: bool) -> None:
        """Take a half-loaded adapter out again (PEFT injects its layers before reading weights)."""
        if not fresh:
            if internal in peft.peft_config:
                with _peft_notices():
                    peft.delete_adapter(internal)
            from peft.tuners.tuners_utils import BaseTunerLayer

            for layer in self.model.modules():  # injected before the failure, not in peft_config
                held = (getattr(layer, attr, {}) for attr in getattr(layer, "adapter_layer_names", ()))
                if isinstance(layer, BaseTunerLayer) and any(internal in (d or {}) for d in held):
                    layer.delete_adapter(internal)
        else:  # the first adapter (the wrapper built or failed part-way): the plain model again
            _plain_modules(self.model)

    def unload(self, name: str) -> Adapter:
        """Remove adapter ``name`` between generate() calls and drop its KV from the store;
        AdapterError 404 when none is loaded under it."""
        with self.lock:
            adapter = self._unload(name)
            self._drop_stale()
        return adapter

    def _drop_stale(self) -> None:
        if self.store is not None:
            import hf_patch

            freed = hf_patch.drop_stale_adapters(self.model, self.store)
            if freed:
                log.info("dropped %d KV blocks of adapters no longer loaded", freed)

    @contextlib.contextmanager
    def base(self):
        """The model lock held and every adapter disabled: yields the model computing as the base."""
        with self.lock:
            with self.peft.disable_adapter() if self.peft is not None else contextlib.nullcontext():
                yield self.model

    def _unload(self, name: str) -> Adapter:
        adapter = self._loaded.pop(name, None)
        if adapter is None:
            raise AdapterError(
                404, f"The lora adapter '{name}' cannot be found.", "lora_name", "adapter_not_found"
            )
        if self._loaded:
            with _peft_notices():
                self.peft.delete_adapter(adapter.peft_name)
        else:  # the last one: the plain model again, no tuner layers left
            _plain_modules(self.model)
            self.peft = None
        log.info("unloaded adapter %s", name)
        return adapter

    def generate(self, names: Sequence[str | None], *args, **kwargs):
        """``generate(*args, **kwargs)`` with row i computed by adapter ``names[i]`` (None: the
        base model): one adapter for every row is set active, several go in ``adapter_names``."""
        if self.peft is None:
            return self.model.generate(*args, **kwargs)
        rows = [self._loaded[n].peft_name if n else BASE for n in names]
        if len(set(rows)) > 1:
            return self.peft.generate(*args, adapter_names=rows, **kwargs)
        if rows[0] == BASE:
            with self.peft.disable_adapter():
                return self.peft.generate(*args, **kwargs)
        self.peft.set_adapter(rows[0])
        return self.peft.generate(*args, **kwargs)

    def cards(self, max_model_len: int) -> list[dict]:
        """/v1/models entries, vLLM's shape."""
        return [
            {
                "id": a.name,
                "object": "model",
                "created": a.created,
                "owned_by": "radixkv",
                "root": a.path,
                "parent": a.parent,
                "max_model_len": max_model_len,
            }
            for a in list(self._loaded.values())  # a copy: a load may add one meanwhile
        ]


def _plain_modules(model) -> None:
    """Every PEFT tuner layer and auxiliary wrapper in ``model`` replaced by the model's own module
    it wraps. Not PEFT's ``unload()``: that puts an active ``modules_to_save`` copy (the adapter's
    fine-tuned module) where the model's module was, which would then serve as the base."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import _get_submodules
    from peft.utils.other import AuxiliaryTrainingWrapper

    from hf_patch.keys.adapters import adapter_holders

    while True:  # a wrapper may hold another (a LoRA inside a modules_to_save original): again
        found = [k for k, _ in adapter_holders(model)]
        if not found:
            return
        for key in found:
            try:
                parent, layer, attr = _get_submodules(model, key)
            except AttributeError:  # inside a wrapper replaced above: the next pass finds it
                continue
            if isinstance(layer, AuxiliaryTrainingWrapper):
                setattr(parent, attr, layer.original_module)
            elif isinstance(layer, BaseTunerLayer):
                setattr(parent, attr, layer.get_base_layer())


def _body() -> dict:
    body = json_body(request.get_data(cache=False))
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _string(body: dict, name: str, message: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise ApiError(400, message, name)
    return value


def install(app, engine, check_admin: Callable[[], None]) -> None:
    """Register the load / unload endpoints (``check_admin()``: the app's admin check, under
    its failed-authentication throttle)."""
    bp = Blueprint("radixkv_adapters", __name__)

    @bp.post("/v1/load_lora_adapter")
    def load():
        check_admin()
        body = _body()
        both = "Both 'lora_name' and 'lora_path' must be provided (non-empty strings)."
        name, path = _string(body, "lora_name", both), _string(body, "lora_path", both)
        engine.adapters.load(LoraModule(name, path))
        return Response(f"Success: LoRA adapter '{name}' added successfully.", mimetype="text/plain")

    @bp.post("/v1/unload_lora_adapter")
    def unload():
        check_admin()
        name = _string(_body(), "lora_name", "'lora_name' must be provided (a non-empty string).")
        engine.adapters.unload(name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", mimetype="text/plain")

    app.register_blueprint(bp)


@contextlib.contextmanager
def _peft_notices():
    """Silence two warnings of our dependencies that say nothing to a demo operator: peft 0.21
    reads transformers 5's deprecated ``is_gradient_checkpointing`` when it wraps a model (a
    FutureWarning each adapter load), and announces which adapter it made active after a delete
    (the demo sets the active adapter, or passes ``adapter_names``, for every generate() call:
    the one peft picks after a delete is never used)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        warnings.filterwarnings(
            "ignore", message="Adapter .* was active which is now deleted", category=UserWarning
        )
        yield
