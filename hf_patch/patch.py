"""The generate() integration: two thin wrappers that do nothing unless the cache is a RadixCache.

- ``GenerationMixin._prefill`` is the last stop before the first forward and the first place
  that sees the final ``input_ids`` (after beam / num_return_sequences expansion) and the
  full 2-D attention mask: compute once the prefixes rows of the batch share
  (``batch_share``), then match and preload there.
- ``GenerationMixin.generate``: bind the store, then after generation commit the finished
  sequences, and in ``finally`` release every pin (exceptions, KeyboardInterrupt, a streamer
  consumer that raises).

What a row's KV is keyed by (namespace, PEFT adapter, shared prefix, extra ids, images) is
gathered per row in ``call.key_parts`` (hf_patch.keys, adapters, multimodal). A call whose KV
depends on something the key cannot see (a model input outside hf_patch.keys.inputs.KEYED_INPUTS, a
replaced ``prepare_inputs_for_generation``) runs with the RadixCache as a plain cache: nothing
read, nothing committed, counted as ``uncacheable_requests``. A third wrapper,
``_maybe_prepare_encoder_kwargs_for_generation``, keys a VLM call's images before generate()
encodes them, and matches there so that served images are never encoded. Assisted / prompt-lookup
decoding never calls ``_prefill``, and ``inputs_embeds`` prompts are reused only with
``RadixCache(extra_ids=...)`` and their ids: otherwise they too run as with a plain cache.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import threading

import torch
import transformers
from packaging.version import Version
from transformers.generation.utils import GenerationMixin

from hf_patch.cache import RadixCache
from hf_patch.call import key_parts, open_request, sharing
from hf_patch.keys import image_features
from hf_patch.keys.encoder_outputs import feed_features, remember_features
from hf_patch.keys.inputs import unkeyed_inputs
from hf_patch.keys.model_walk import watch_structure
from hf_patch.keys.multimodal import UnkeyableImages, drop_pixels, has_images, image_keys, keyed_inputs
from hf_patch.keys.weights import watch_fused_optimizers
from hf_patch.model_spec import cache_arg

logger = logging.getLogger(__name__)

_install_lock = threading.Lock()
_MARK = "_radixkv_wrapped"


def _eos_ids(generation_config) -> list[int]:
    eos = generation_config.eos_token_id
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        return eos.flatten().tolist()
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def _reject_unsupported_kwargs(model, kwargs: dict) -> None:
    """``use_cache=False`` from a kwarg, an explicit generation config, or the model's own config."""
    config = kwargs.get("generation_config") or model.generation_config
    use_cache = kwargs.get("use_cache", getattr(config, "use_cache", None))
    if use_cache is False:
        raise ValueError(
            "RadixCache needs use_cache=True: with use_cache=False generate feeds the whole sequence every step "
            "while the model still writes the cache, which is silently wrong"
        )


def _clear_cache_implementation(model, kwargs: dict) -> None:
    """A generation config's ``cache_implementation`` makes generate refuse any cache object."""
    config = kwargs.get("generation_config")
    if config is not None and getattr(config, "cache_implementation", None) is not None:
        config = copy.deepcopy(config)
        config.cache_implementation = None
        kwargs["generation_config"] = config
    elif "cache_implementation" not in kwargs and getattr(
        model.generation_config, "cache_implementation", None
    ):
        kwargs["cache_implementation"] = None


def _positional_names(function) -> list[str] | None:
    """Names of generate()'s positional parameters after ``self``; None if it takes ``*args``
    (another library's wrapper without ``functools.wraps``): then positions cannot be named."""
    params = list(inspect.signature(function).parameters.values())[1:]
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    return [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]


def _positional_to_keywords(names: list[str] | None, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``generate(ids, generation_config, ...)``: name the positional arguments, so the checks
    below see a positional generation config too (else its ``cache_implementation`` makes
    generate refuse the cache, and its ``use_cache=False`` escapes the early refusal).
    Anything it cannot name stays positional, for generate() itself to accept or refuse."""
    if names is None or len(args) > len(names) or any(name in kwargs for name in names[: len(args)]):
        return args, kwargs
    kwargs.update(zip(names, args))
    return (), kwargs


def _wrap_generate(original):
    names = _positional_names(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        cache = _radix_cache(kwargs)
        if cache is None:
            return original(self, *args, **kwargs)
        if cache_arg(self) == "cache_params" and kwargs.get("past_key_values") is cache:
            # The Mamba families take their cache as cache_params: as past_key_values their
            # forward would ignore it (and compute every token with no state at all).
            kwargs["cache_params"] = kwargs.pop("past_key_values")
        args, kwargs = _positional_to_keywords(names, args, kwargs)
        _reject_unsupported_kwargs(self, kwargs)
        _clear_cache_implementation(self, kwargs)
        unkeyed = unkeyed_inputs(kwargs, keyed_inputs(self))
        # With a reason, stock generate() runs with the RadixCache as a plain cache.
        reason = (
            f"generate() got {', '.join(unkeyed)}, which the cache key does not cover" if unkeyed else None
        )
        with open_request(self, cache, reason) as request:
            output = original(self, *args, **kwargs)
            sequences = output if isinstance(output, torch.Tensor) else output.sequences
            cache.cached_tokens = request.cached_per_returned_row(sequences.shape[0])
            with torch.no_grad():
                request.commit(sequences)
            return output

    setattr(generate, _MARK, True)
    return generate


def _radix_cache(kwargs: dict) -> RadixCache | None:
    """The RadixCache of a call, under either cache argument name (``cache_params``: Mamba)."""
    for name in ("past_key_values", "cache_params"):
        cache = kwargs.get(name)
        if isinstance(cache, RadixCache):
            return cache
    return None


def _rows_per_prompt(generation_config) -> int:
    return max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)


def _reuse_allowed(generation_config) -> bool:
    """Per-token outputs of the prompt (hidden states, attentions) must cover every prompt
    token, as in stock generate(): then nothing is read from the store (nor images skipped)."""
    return not (generation_config.output_hidden_states or generation_config.output_attentions)


def _wrap_encode(original):
    """``_maybe_prepare_encoder_kwargs_for_generation``: key the call's images (hf_patch.keys.multimodal)
    while their pixels are still there, and where the rows are final (one row per prompt), match
    now and drop the pixels of images the store serves, so they are never encoded."""

    @functools.wraps(original)
    def encode(self, inputs_tensor, model_kwargs, model_input_name, generation_config, *args, **kwargs):
        cache = _radix_cache(model_kwargs)
        request = getattr(cache, "_request", None) if cache is not None else None
        if (
            request is not None
            and not request.uncacheable
            and (has_images(model_kwargs) or keyed_inputs(self))
        ):
            try:
                if model_input_name != "input_ids":
                    if has_images(model_kwargs):
                        raise UnkeyableImages(f"images with {model_input_name} instead of input_ids")
                else:
                    request.images = image_keys(self, inputs_tensor, model_kwargs)
            except UnkeyableImages as e:
                request.mark_uncacheable(str(e))
            reuse = _reuse_allowed(generation_config)
            images = request.images
            features = request.features = image_features.for_model(self) if images is not None else None
            if (
                images is not None
                and reuse
                and model_input_name == "input_ids"
                and _rows_per_prompt(generation_config) == 1
                and model_kwargs.get("inputs_embeds") is None
            ):
                keys = key_parts(self, cache, inputs_tensor.shape, 1, images)
                request.match(inputs_tensor, model_kwargs.get("attention_mask"), keys)
                # Not encoded: items the store serves whole, and items whose features are known.
                served = {s.item for s in images.spans if s.end <= request.common}
                known = {}
                if features is not None:
                    for span in images.spans:
                        rows = None if span.item in served else features.get(span.content)
                        if rows is not None:
                            known[span.item] = rows
                request.skipped = drop_pixels(images, served | set(known), model_kwargs)
                request.known = {item: rows for item, rows in known.items() if item in request.skipped}
            model_kwargs = original(
                self, inputs_tensor, model_kwargs, model_input_name, generation_config, *args, **kwargs
            )
            if images is not None:
                remember_features(images, request.skipped, model_kwargs, features)
            return model_kwargs
        return original(
            self, inputs_tensor, model_kwargs, model_input_name, generation_config, *args, **kwargs
        )

    setattr(encode, _MARK, True)
    return encode


def _wrap_prefill(original):
    @functools.wraps(original)
    def _prefill(self, input_ids, generation_config, model_kwargs, is_first_iteration=True, *args, **kwargs):
        cache = _radix_cache(model_kwargs)
        request = getattr(cache, "_request", None) if cache is not None else None
        embeds = model_kwargs.get("inputs_embeds")
        if (
            request is not None
            and not request.uncacheable
            and is_first_iteration
            # inputs_embeds: keyed only by the ids and extra ids given with them (TensorRT-LLM)
            and (embeds is None or (cache.extra_ids is not None and embeds.shape[:2] == input_ids.shape))
            and input_ids.shape[1] > 0
            and cache.get_seq_length() == 0
        ):
            if generation_config.use_cache is False:  # merged config: the last word on use_cache
                raise ValueError(
                    "RadixCache needs use_cache=True (the generation config sets use_cache=False)"
                )
            reuse = _reuse_allowed(generation_config)
            rows_per_prompt = _rows_per_prompt(generation_config)
            images = None if request.images is None else request.images.expand(rows_per_prompt)
            share = (
                sharing(self, request, model_kwargs, generation_config.prefill_chunk_size) if reuse else None
            )
            request.preload(
                input_ids,
                model_kwargs.get("attention_mask"),
                max_length=generation_config.max_length or 0,
                eos_token_ids=_eos_ids(generation_config),
                prompt_only=(generation_config.num_beams or 1) > 1,
                keys=key_parts(self, cache, input_ids.shape, rows_per_prompt, images),
                # Per-token outputs of the prompt must cover every prompt token, as in stock
                # generate(): compute the whole prompt then (and still commit it).
                reuse=reuse,
                rows_per_prompt=rows_per_prompt,
                share=share,
            )
            if images is not None:  # features for exactly the placeholders the model is fed
                containers = request.features.containers if request.features is not None else {}
                feed_features(
                    images, request.common, request.skipped, request.known, model_kwargs, containers
                )
            if request.layout.stateful:
                request.start_decode_snapshots(_eos_ids(generation_config))
                if request.common and model_kwargs.get("cache_params") is cache:
                    # generate() slices the prompt by the cache's length only for past_key_values
                    sliced = dict(model_kwargs)
                    if sliced.get("attention_mask") is not None:
                        sliced["attention_mask"] = sliced["attention_mask"][:, request.common :]
                    return original(
                        self, input_ids[:, request.common :], generation_config, sliced, is_first_iteration,
                        *args, **kwargs,
                    )  # fmt: skip
        return original(self, input_ids, generation_config, model_kwargs, is_first_iteration, *args, **kwargs)

    setattr(_prefill, _MARK, True)
    return _prefill


# The transformers releases the suite passes on (setup.cfg's range): generate()'s internals that
# the wrappers hook move between releases. 5.17 lacks _maybe_prepare_encoder_kwargs_for_generation;
# 5.18-5.22 import but give other logits for Gemma 3 image prompts and other prefill_chunk_size splits.
TESTED_TRANSFORMERS = ("5.23", "5.24")  # [from, to)
_HOOKED = ("generate", "_prefill", "_maybe_prepare_encoder_kwargs_for_generation")


def check_transformers(version: str, generation_mixin=GenerationMixin) -> None:
    """Raise ImportError naming ``version`` and the tested range when generate()'s internals that
    the wrappers hook are missing; log a warning when ``version`` is outside the tested range."""
    missing = [name for name in _HOOKED if not hasattr(generation_mixin, name)]
    low, high = TESTED_TRANSFORMERS
    if missing:
        raise ImportError(
            f"radixkv needs transformers >={low},<{high} (tested); transformers {version} has no "
            f"GenerationMixin.{', '.join(missing)}: pip install 'transformers>={low},<{high}'"
        )
    if not _in_range(version, low, high):
        logger.warning(
            "transformers %s is outside the range radixkv is tested with (>=%s,<%s): outputs may "
            "differ from stock generate(); pip install 'transformers>=%s,<%s'",
            version, low, high, low, high,
        )  # fmt: skip


def _in_range(version: str, low: str, high: str) -> bool:
    """Major.minor of ``version`` in [low, high) (a dev or patch release counts as its minor)."""
    return Version(low).release[:2] <= Version(version).release[:2] < Version(high).release[:2]


def install() -> None:
    """Install the wrappers on GenerationMixin once; calling again is a no-op. Raises
    ImportError when this transformers lacks what they hook (``check_transformers``)."""
    check_transformers(transformers.__version__)
    watch_fused_optimizers()
    watch_structure()
    with _install_lock:
        if not getattr(GenerationMixin.generate, _MARK, False):
            GenerationMixin.generate = _wrap_generate(GenerationMixin.generate)
        if not getattr(GenerationMixin._prefill, _MARK, False):
            GenerationMixin._prefill = _wrap_prefill(GenerationMixin._prefill)
        encode = GenerationMixin._maybe_prepare_encoder_kwargs_for_generation
        if not getattr(encode, _MARK, False):
            GenerationMixin._maybe_prepare_encoder_kwargs_for_generation = _wrap_encode(encode)
