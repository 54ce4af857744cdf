"""The demo's model runner: executes the batches the scheduler hands out as generate() calls.

`run(batch, pause)` runs the requests as rows of one left-padded call
(demo.engine.batching.run_batch), each row under its own cache namespace, PEFT adapter and
sampling options (demo.engine.sampling). It owns what every call needs: the generation config
(`config`), the RadixCache over the store (`cache`, None with reuse off or cache_prompt=false),
the model lock (adapters load and unload between calls: demo.model.adapters) and the operator's
public task-prompt prefixes.

A request's n sampled choices are n rows of the batch; with the prefix cache on their common
prompt is computed once (hf_patch.batch_share). n greedy choices are equal: one row is
generated and copied.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Sequence

import torch

from demo.engine import batching
from demo.engine.constrained import GrammarHook, Grammars
from demo.engine.generation import GREEDY_BELOW, Generation, Params
from demo.model import vision_batch

__all__ = ["PUBLIC_NAMESPACE", "Runner"]

log = logging.getLogger(__name__)

# The cache namespace of the operator's task prompts: pinned once, read by every tenant (each
# request's own text after them stays in its tenant's namespace: hf_patch.SharedPrefix).
PUBLIC_NAMESPACE = "radixkv:task-prompts"


class Runner:
    """Runs generate() for batches of requests: the model, its store (None with reuse off), its
    adapters (demo.model.adapters.Adapters, or None) and its processor (a VLM's, or None)."""

    def __init__(self, model, tokenizer, store=None, adapters=None, processor=None):
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.adapters, self.processor = adapters, processor
        # Held while a batch runs: adapters load and unload between generate() calls.
        self.lock = adapters.lock if adapters is not None else threading.RLock()
        self.eos = self._eos_ids()
        self.vocab_size = vocab = model.get_input_embeddings().num_embeddings
        logits = min(vocab, getattr(model.get_output_embeddings(), "out_features", vocab))
        self.grammars = Grammars(tokenizer, logits, self.eos)  # constrained decoding
        # How the rows' image inputs merge into one call's (None: image requests run alone)
        self.image_rule = vision_batch.rule_for(model)
        self.placeholders = (
            vision_batch.placeholder_ids(model) if self.image_rule is not None else frozenset()
        )
        self._alone_logged: set[str] = set()
        # Token prefixes pinned under PUBLIC_NAMESPACE (the operator's task prompts, longest
        # first): a request starting with one reads it there, whatever its tenant.
        self._public: list[list[int]] = []

    # -- one batch ---------------------------------------------------------------------------
    def run(
        self,
        batch: list[Generation],
        pause: Callable[[int], bool] | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> list[Generation]:
        """Run ``batch`` (holding the model lock) and give every request its ("done", cached) or
        ("error", exc) event; returns the requests ``pause`` paused (to be queued again). A
        request whose adapter was unloaded while it waited gets the API's 404. Never raises for
        a generation failure: the worker keeps serving."""
        with self.lock:
            batch = [gen for gen in batch if self._adapter_present(gen)]
            if not batch:
                return []
            if len(batch) > 1 and self.adapters is not None:
                # Batched by the adapters loaded at submit: a load since (an adapter whose PEFT
                # layers refuse adapter_names) may need the rows in calls of their own.
                calls = self.adapters.split([gen.params.adapter for gen in batch])
                if len(calls) > 1:
                    return [
                        g
                        for rows in calls
                        for g in batching.run_batch(self, [batch[i] for i in rows], pause, on_step)
                    ]
            return batching.run_batch(self, batch, pause, on_step)

    def prefill(self, gen: Generation) -> list[Generation]:
        """Compute and commit ``gen.prompt_ids[:gen.slice_to]`` (one slice of a long prompt: the
        store holds the earlier slices), so that its batch later reads the prompt instead of
        computing it while other rows wait (a one-token greedy pass: no random numbers used).
        Returns [gen] to queue again, or [] if it failed (gen got its error) or lost its adapter."""
        with self.lock:
            if not self._adapter_present(gen):
                return []
            end, gen.slice_to = gen.slice_to, 0
            ids = torch.tensor([gen.prompt_ids[:end]], device=self.model.device)
            cache = self.cache([gen], [gen])
            # what the store holds of the whole prompt before its first slice (that slice
            # reads only its own part of it)
            held = self.held(gen, gen.prompt_ids) if gen.cached is None and not self.adapters else None
            try:
                self.generate(
                    [gen],
                    ids,
                    attention_mask=torch.ones_like(ids),
                    past_key_values=cache,
                    generation_config=self.config(Params(1, temperature=0.0)),
                )
            except Exception as e:  # report to the request; the worker keeps serving
                log.exception("prefill slice failed")
                gen._events.put(("error", e))
                gen.finished.set()
                return []
            if gen.cached is None:  # the prompt's cached tokens: what the store held before
                gen.cached = max(cache.cached_tokens[0] if cache.cached_tokens else 0, held or 0)
            gen.prefilled = end
            return [gen]

    def held(self, gen: Generation, context) -> int | None:
        """Leading tokens of ``context`` the store holds for ``gen`` (its key: namespace,
        shared prefix; the base model's), up to all but the last; a lookup, nothing pinned nor
        counted, the remote tier not asked. None without a store or with cache_prompt off, or
        when the lookup fails (an adapter loading meanwhile, say: callers then estimate). Keys
        as the base model: call it while no adapter is loaded."""
        if self.store is None or not gen.params.cache_prompt or len(context) < 2:
            return None
        from hf_patch.running_batch import prefill_keys  # the store exists: hf_patch is imported

        try:
            keys = prefill_keys(self.model, self.cache([gen], [gen]), 1)
            if keys is None:
                return None
            key = keys.keys.row(0, torch.tensor(list(context)), 0)
            lease = self.store.acquire(
                key.tokens, key.namespace, max_tokens=len(context) - 1, count=False, remote=False
            )
        except Exception:
            log.debug("a store lookup failed", exc_info=True)
            return None
        try:
            return lease.num_tokens
        finally:
            lease.release()

    def _adapter_present(self, gen: Generation) -> bool:
        """Whether ``gen``'s adapter is still loaded, and for a reply paused between decode chunks
        still the one its first chunk ran under (not a re-load of other weights under its name:
        the rest of the reply would come from another model); if not, it gets the API's 404."""
        name = gen.params.adapter
        if name is None:
            return True
        adapter = self.adapters.get(name) if self.adapters is not None else None
        if adapter is not None and (gen.adapter is None or gen.adapter is adapter):  # this load
            gen.adapter = adapter
            return True
        from demo.errors import ApiError

        message = (
            f"The model '{name}' does not exist"
            if adapter is None
            else f"The model '{name}' was reloaded while this reply was generated; send the request again"
        )
        gen._events.put(("error", ApiError(404, message, "model", "model_not_found")))
        gen.finished.set()
        return False

    def generate(self, gens: Sequence[Generation], *args, **kwargs):
        """``model.generate(*args, **kwargs)`` for rows ``gens``, each under its own adapter."""
        if self.adapters is None:
            return self.model.generate(*args, **kwargs)
        return self.adapters.generate([g.params.adapter for g in gens], *args, **kwargs)

    def runs_alone(self, prompt_ids: Sequence[int], inputs: dict | None) -> bool:
        """Whether a request with model ``inputs`` must run alone and unpaused: its family has
        no batch rule, the rule does not cover one of its inputs, or it is a text request whose
        prompt holds a placeholder id (logged once per reason: demo.model.vision_batch)."""
        family = getattr(self.model.config, "model_type", None)
        reason = vision_batch.alone_reason(
            self.image_rule, family, inputs or {}, prompt_ids, self.placeholders
        )
        if reason is not None and reason not in self._alone_logged:
            self._alone_logged.add(reason)
            log.info("such requests run alone, one per generate() call, never paused: %s", reason)
        return reason is not None

    # -- what every call needs ----------------------------------------------------------------
    def config(self, p: Params):
        """The model's generation config with a request's options applied (a copy)."""
        cfg = copy.deepcopy(self.model.generation_config)
        cfg.max_new_tokens, cfg.min_new_tokens, cfg.max_length = p.max_new_tokens, None, None
        cfg.do_sample = p.temperature >= GREEDY_BELOW
        cfg.temperature, cfg.top_p, cfg.top_k = (
            (p.temperature, p.top_p, 0) if cfg.do_sample else (1.0, 1.0, None)
        )
        cfg.num_return_sequences = p.n if cfg.do_sample else 1
        # A row that ends before the others (a batch's row, one of n choices) is fed the pad
        # token until the call ends. hf_patch commits a row up to its first EOS, so an EOS as
        # the pad keeps those fillers out of the cache; any other id would be cached as if
        # generated. (Left-pad columns are masked: their id does not matter.)
        eos = cfg.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if eos:
            cfg.pad_token_id = eos[0]
        elif cfg.pad_token_id is None:
            cfg.pad_token_id = (
                self.tokenizer.pad_token_id
                if self.tokenizer.pad_token_id is not None
                else min(self.eos, default=0)
            )
        return cfg

    def cache(self, gens: Sequence[Generation], rows: Sequence[Generation] | None = None):
        """A RadixCache on the store for ``gens``, or None: reuse off, or the requests said
        cache_prompt=false (then plain generate(): the store is neither read nor written).
        ``rows``: the request of each input row (one namespace per row); None: one request
        whose input rows generate() expands (none here does)."""
        if self.store is None or not gens[0].params.cache_prompt:
            return None
        from hf_patch import RadixCache  # the store exists: hf_patch is imported

        if rows is None:  # generate() expands one input row: one namespace
            namespace, rows = gens[0].namespace, gens[:1]
        else:
            namespace = [g.namespace for g in rows]
        shared = [self.shared_prefix(g.prompt_ids) for g in rows] if self._public else None
        hints = None
        if any(g.snapshot_at for g in rows):  # a paused request resumes with its own context as prompt
            hints = [list(g.snapshot_at or ()) for g in rows] if len(rows) > 1 else list(rows[0].snapshot_at)
        return RadixCache(store=self.store, namespace=namespace, shared_prefix=shared, snapshot_at=hints)

    def grammar_hooks(self, prompt_ids: Sequence[int], params: Params) -> list[GrammarHook] | None:
        """One fresh matcher of ``params.grammar`` per row of the request (its RowHooks: each row
        advanced by its own tokens, kept on the request across pauses), or None without one.
        Raises ValueError if the grammar cannot be started."""
        if params.grammar is None:
            return None
        return [GrammarHook(self.grammars.start(params.grammar), len(prompt_ids)) for _ in range(params.rows)]

    def set_public_prefixes(self, prefixes: Sequence[Sequence[int]]) -> None:
        """Token prefixes whose KV is pinned under PUBLIC_NAMESPACE (demo.task_prompts)."""
        self._public = sorted((list(p) for p in prefixes), key=len, reverse=True)

    def shared_prefix(self, prompt_ids: Sequence[int]):
        """``hf_patch.SharedPrefix`` over the longest public prefix ``prompt_ids`` starts with,
        or None. The rest of the prompt stays keyed by the request's own namespace."""
        from hf_patch import SharedPrefix  # set only with reuse on: hf_patch is imported

        for p in self._public:
            if len(prompt_ids) >= len(p) and list(prompt_ids[: len(p)]) == p:
                return SharedPrefix(PUBLIC_NAMESPACE, len(p))
        return None

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        return set(eos)
