"""One generate() call's dealings with the store: match + preload before the first forward,
commit after generation, release always.

Left padding: real token j of every row has position j whatever its padding, and K is
stored after the position encoding, so KV of an unpadded prefix is valid in any padded row.
Row i with ``pad_i`` left pads and a match of ``m_i`` tokens; the batch preloads a common
column count ``L = min_i(pad_i + m_i)``, the most a rectangular batch allows.

A model with recurrent layers (``ModelLayout.stateful``) cannot start rows at one column: each
row's state exists only at its own snapshot. Each row is caught up alone from its snapshot to
its last prompt token but one (``hf_patch.recurrent``), straight into its row of the batch's
buffers, and generate() computes the last column; the commit attaches the snapshots taken on
the way and during the decode. A model whose padded rows depend on their padding in stock
(``ModelLayout.padding_dependent``: DeepSeek-V4) has each padded row of a generate() batch
computed as stock computes it, pads included, neither read nor committed, and generate() computes
the last two columns (docs/models.md#deepseek-v4).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import torch

from cuda_ext.stacking import chunks, interleave, stacked
from hf_patch import paged_attention
from hf_patch.cache import RadixCache
from hf_patch.keys import RowKey, SharedPrefix, row_key
from hf_patch.keys.inputs import log_once
from hf_patch.layer import (
    CompressedLayer,
    PagedLayer,
    StateLayer,
    allocate_layers,
    pool_buffers,
    pool_tensors,
    row_view,
)
from hf_patch.model_spec import ModelLayout
from hf_patch.recurrent import (
    DEFAULT_INTERVAL,
    STEPWISE_TOKENS,
    DecodeSnapshots,
    catch_up,
    cut_points,
    fill_row,
    mark_row_filled,
    state_views,
    usable_start,
)
from radixkv import KVStore, Lease

logger = logging.getLogger(__name__)


def left_pads(attention_mask: torch.Tensor | None, batch: int, length: int) -> list[int] | None:
    """Left-pad count per row, or None when the mask is not plain left padding (then no reuse)."""
    if attention_mask is None:
        return [0] * batch
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, length):
        return None
    mask = attention_mask.to("cpu", torch.bool)
    real = mask.sum(dim=1)
    # Left padding <=> every row is zeros then ones <=> the ones are a suffix.
    expected = torch.arange(length).unsqueeze(0) >= (length - real).unsqueeze(1)
    if not torch.equal(mask, expected):
        return None
    return (length - real).tolist()


# Decode headroom preallocated beyond the prompt. ``max_length`` alone is no size: callers pass
# max_new_tokens=4096 "to be safe" and stop at EOS after 100, and a buffer of max_length would
# hold ~40x the KV stock DynamicCache ever holds (an OOM on a GPU where stock fits). Past the
# headroom the layers double their buffers: O(1) amortised copies per token, at most ~2x the KV.
MIN_HEADROOM = 256


def initial_capacity(length: int, max_length: int) -> int:
    """Tokens per layer buffer: the whole generation when short, else prompt + max(256, prompt)."""
    return max(length, min(max_length, length + max(MIN_HEADROOM, length)))


@dataclass(frozen=True)
class KeyParts:
    """Per-row key parts of one call, rows as the first forward sees them (after generate()'s
    expansion by beams / num_return_sequences). See hf_patch.keys."""

    scope: int  # the model (hf_patch.keys.weights.model_scope)
    namespaces: list[Hashable]
    adapters: list[tuple]  # hf_patch.keys.adapters.row_adapters
    shared: list[SharedPrefix | None]
    extra_ids: torch.Tensor | None = None  # [B, T] int64 (uint64 bits), aligned with input_ids

    def row(self, i: int, ids: torch.Tensor, pad: int, length: int | None = None) -> RowKey:
        """Row ``i``'s key over ``ids[pad:]`` (``ids``: the row's prompt, or its whole sequence;
        tokens past the prompt's ``length`` columns carry no extra id)."""
        extra = None
        if self.extra_ids is not None:
            extra = np.zeros(len(ids) - pad, dtype=np.uint64)
            e = self.extra_ids[i, pad:length].numpy().view(np.uint64)[: len(extra)]
            extra[: len(e)] = e
        return row_key(
            ids[pad:].numpy(), extra, self.namespaces[i], self.shared[i], self.scope, self.adapters[i]
        )


class Request:
    """State of one generate() call on a RadixCache."""

    def __init__(self, cache: RadixCache, store: KVStore, layout: ModelLayout, model=None) -> None:
        self.cache = cache
        self.store = store
        self.layout = layout
        self.specs = layout.specs  # the pool's layers: the KV-bearing model layers, in order
        self.model = model  # a stateful call runs the rows' catch-up forwards itself
        self.epoch = store.epoch  # KV computed now is stale if the store is flushed meanwhile
        self.leases: list[Lease] = []
        # [B, T] int64 on the CPU, rows as seen by the first forward. Rows are packed for the
        # store straight from tensor memory (a memcpy), not from .tolist() (~10 ns a token).
        self.prompt_ids: torch.Tensor | None = None
        self.keys: KeyParts | None = None
        self.pads: list[int] | None = None
        self.eos_token_ids: list[int] = []
        self.prompt_only = False
        self.matched = False
        self.common = 0  # leading columns served from the store (the cache's length after preload)
        self.computed: dict[int, int] = {}  # in-batch sharing: tokens each row computed for others
        # The KV depends on inputs the key cannot see: no read, no commit (hf_patch.keys.inputs)
        self.uncacheable = False
        self.images = None  # hf_patch.keys.multimodal.Images of the unexpanded prompt rows
        # Items not encoded (ImageSpan.item: modality and index in its pixel input): served whole
        # by the store, or with features known from an earlier call (``known``: item -> Features).
        self.skipped: set = set()
        self.known: dict = {}
        self.features = None  # the model's hf_patch.keys.image_features.FeatureCache
        # generate() expands each prompt to max(num_beams, num_return_sequences) rows
        self.rows_per_prompt = 1
        self.weights_unchanged = None  # () -> bool, set by hf_patch.call: False skips the commit
        # Stateful models: per row, the snapshots its catch-up took (position -> states), and
        # the decode's (hf_patch.recurrent.DecodeSnapshots).
        self.snapshots: list[dict[int, list[torch.Tensor]]] = []
        self.row_logits: list[torch.Tensor | None] = []  # preload(score=True): per row [1, keep, V]
        self.decode: DecodeSnapshots | None = None
        # Snapshots only at multiples of this (the block size, or a coarser model grain: DeepSeek-V4)
        self.grain = math.lcm(store.block_size, layout.snapshot_grain)
        self.stock_rows: set[int] = set()  # rows computed with their pads (_catch_up_rows as_stock)
        # A paged call (hf_patch.paged_attention): its block table, and the model's attention
        # switched to the paged function until ``close``; the leases stay pinned until then.
        self.plan: paged_attention.PagedPlan | None = None
        self._paged_exit = contextlib.ExitStack()

    @property
    def kv_layers(self) -> list:
        """The cache layers holding KV, in the pool's layer order."""
        return [self.cache.layers[i] for i in self.layout.kv_layers]

    def mark_uncacheable(self, reason: str) -> None:
        """Run this call as stock generate() with a plain cache: nothing read, nothing committed."""
        self.uncacheable = True
        self.store.count_uncacheable()
        log_once(reason)

    # -- before the first forward --------------------------------------------------------------
    def match(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        keys: KeyParts,
        reuse: bool = True,
        share=None,
        keep: list[int] | None = None,
    ) -> None:
        """Match every row and pin what is cached; fix ``common``, the columns to preload.

        Runs once per call: from ``preload``, or earlier, before generate() encodes images, so
        that images the store serves are never encoded (hf_patch.keys.multimodal); ``preload`` then
        reads exactly what was pinned here. ``reuse=False``: prepare the commit, match nothing.
        ``share``: None, or a callable ``share(rows, keep) -> SharedPrefixes`` that computes and
        commits the prefixes rows share and returns their pinned matches
        (``batch_share.compute_shared`` bound to the model). ``keep[i]``: trailing tokens of row
        i that are never read from the store, because the caller wants their outputs: 1 (the
        default) for generate(), whose first logits come from the last prompt token (and a fully
        cached prompt would be fed again); a scored continuation's length for scoring.
        """
        if self.matched:
            return
        self.matched = True
        batch, length = input_ids.shape
        self.pads = left_pads(attention_mask, batch, length)
        if self.pads is None:
            logger.debug("attention mask is not left padding: generating without reuse")
            return
        rows = self.prompt_ids = input_ids.to("cpu", torch.int64)
        self.keys = keys
        if not reuse:
            return
        shared: dict[int, Lease] = {}
        try:
            row_keys = [keys.row(i, row, pad) for i, (row, pad) in enumerate(zip(rows, self.pads))]
            keep = [1] * batch if keep is None else keep
            if share is not None and batch > 1:
                result = share(row_keys, keep)
                shared, self.computed = result.leases, result.computed
            for i, key in enumerate(row_keys):
                lease = shared.pop(i, None)
                if lease is None:
                    lease = self.store.acquire(
                        key.tokens, key.namespace, max_tokens=max(0, key.tokens.num_tokens - keep[i])
                    )
                self.leases.append(lease)
            self.common = min(pad + lease.num_tokens for pad, lease in zip(self.pads, self.leases))
        except BaseException:
            self.release()
            raise
        finally:
            for lease in shared.values():  # left over only when an acquire above raised
                lease.release()

    def preload(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        max_length: int,
        eos_token_ids: list[int],
        prompt_only: bool,
        keys: KeyParts,
        reuse: bool = True,
        rows_per_prompt: int = 1,
        share=None,
        keep: list[int] | None = None,
        score: bool = False,
    ) -> None:
        """Match every row (unless ``match`` ran already), copy the common reusable prefix into
        fresh layer buffers, and unpin.

        ``score`` (stateful models): run every row to its end, keeping the logits of its last
        ``keep[i]`` positions in ``row_logits[i]`` (scoring); the cache then holds whole rows.

        ``keys``: each row's namespace, adapter, shared prefix and extra ids.
        ``prompt_only``: commit only the prompt afterwards (beam search: the cache rows are
        reordered running beams, not the returned sequences). ``reuse``, ``share``, ``keep``:
        see ``match``.
        """
        self.eos_token_ids = eos_token_ids
        self.prompt_only = prompt_only
        self.rows_per_prompt = rows_per_prompt
        batch, length = input_ids.shape
        capacity = initial_capacity(length, max_length)
        self.cache.cached_tokens = [0] * batch
        as_stock = self._as_stock(attention_mask, batch, length, score)
        if as_stock:
            keep = [max(2, k) for k in keep] if keep is not None else [2] * batch
        try:
            self.match(input_ids, attention_mask, keys, reuse, share, keep)
            blocks = self._paged_blocks() if self.common > 0 and not self.layout.stateful else None
            if blocks is not None:
                self._page_prefix(batch, capacity, blocks)
                return
            allocate_layers(self.cache.layers, self.layout, batch, capacity)
            if self.layout.stateful and self.pads is not None and (reuse or score):
                # (reuse=False: per-token outputs of the whole prompt are wanted, so generate()
                # computes it in one forward, as stock; nothing is committed then)
                self._catch_up_rows(input_ids, keep, score, as_stock)
            elif self.common > 0:
                self._copy_prefix(self.common, self.computed)
            if self.layout.index_positions is not None and self.pads is not None and self.common:
                self._set_index_positions(self.common)
        finally:
            if self.plan is None:
                self.release()  # the copy is done: blocks need not stay pinned through decode

    # -- paged calls (hf_patch.paged_attention) ---------------------------------------------------
    def _paged_blocks(self) -> list[list[int]] | None:
        """Each row's device-pool blocks holding its ``common - pad`` prefix tokens when this call
        reads them in place (counted as served then), else None: the copy path (the reason
        logged once, unless paged attention is off)."""
        if self.model is None or self.pads is None or not self.leases:
            return None
        reason = paged_attention.unusable_reason(self.model, self.layout, self.cache.paged)
        if reason is None:
            tokens = [max(0, self.common - pad) for pad in self.pads]
            served = [max(0, n - self.computed.get(i, 0)) for i, n in enumerate(tokens)]
            blocks = self.store.read_in_place(self.leases, tokens, served=served)
            if blocks is not None:
                self.cache.cached_tokens = served
                return blocks
            reason = "a prefix lies partly in the host or remote tier"
        if reason != paged_attention.OFF:
            paged_attention.log_copy_path(reason)
        return None

    def _page_prefix(self, batch: int, capacity: int, blocks: list[list[int]]) -> None:
        """Layers that hold only the columns from ``common`` on, the call's block table, and the
        model's attention switched to the paged function until ``close``."""
        layers = self.cache.layers
        for i in self.layout.kv_layers:
            layers[i] = PagedLayer()
        allocate_layers(layers, self.layout, batch, max(1, capacity - self.common))
        for i in self.layout.kv_layers:
            layers[i].offset = self.common
        pool = self.store.pool
        self.plan = paged_attention.build_plan(
            self.layout, self.cache, pool.k, pool.v, pool.block_size, blocks, self.pads, self.common
        )
        self.cache.paged_plan = self.plan
        self._paged_exit.enter_context(paged_attention.activate(self.model, self.plan))

    def _set_index_positions(self, common: int) -> None:
        """The indexer's position history of the preloaded columns (Qwen4-Exp keeps it on a cache
        layer and extends it each forward): real token j at position j, pads at 0, in 3 dims."""
        rows = len(self.pads)
        positions = torch.arange(common).expand(rows, common) - torch.tensor(self.pads).unsqueeze(1)
        layer = self.cache.layers[self.layout.index_positions]
        device = layer.keys.device
        layer.indexer_position_ids = positions.clamp(min=0).to(device)[None].expand(3, rows, common)

    # -- stateful models ----------------------------------------------------------------------------
    def _as_stock(self, attention_mask: torch.Tensor | None, batch: int, length: int, score: bool) -> bool:
        """Whether generate()'s padded rows are computed as stock computes them (a padding-
        dependent model, DeepSeek-V4, in a batch with padding; not scoring, whose rows are each
        scored alone). Then every row leaves generate() its last two columns: stock computes a
        padded row's last prompt token in its multi-token prefill, where the HCA layers mask
        compressed entries by position; a one-token forward shows it all of them."""
        if not self.layout.padding_dependent or score or length < 2:
            return False
        pads = self.pads if self.matched else left_pads(attention_mask, batch, length)
        return bool(pads) and any(pads)

    def _catch_up_rows(
        self, input_ids: torch.Tensor, keep: list[int] | None, score: bool = False, as_stock: bool = False
    ) -> None:
        """Bring every row's KV and states to its last prompt token but ``keep[i]`` (default 1),
        each from its own snapshot, in its own forwards (hf_patch.recurrent); rows with the
        same key are computed once and copied. Pad columns are zeroed (they are masked, but
        must be finite). ``score``: on to each row's end, its last ``keep[i]`` logits kept.
        ``as_stock`` (``_as_stock``): a padded row is computed from its first column, pads
        included, and is neither read from the store nor committed (``stock_rows``)."""
        batch, length = input_ids.shape
        keep = [1] * batch if keep is None else keep
        layers = self.cache.layers
        grain = self.grain
        interval = -(-(self.store.snapshot_interval or DEFAULT_INTERVAL) // grain) * grain
        done: dict[tuple, int] = {}
        device_ids = input_ids.to(self.model.device)
        tails = self._tail_ends(length, keep, interval, grain) if not (score or as_stock) else None
        for i, pad in enumerate(self.pads):
            stock_row = as_stock and pad > 0
            first = 0 if stock_row else pad  # the row's columns as its forwards see them
            stop = max(0, length - first - keep[i])
            lease = self.leases[i] if self.leases and not stock_row else None
            key = None
            if self.keys is not None:
                row = self.keys.row(i, self.prompt_ids[i], pad)
                key = (row.namespace, row.tokens, pad, keep[i])
            views = [row_view(layer, i, first) for layer in layers]
            end = stop + keep[i] if score else stop if tails is None else tails[i]
            if key is not None and key in done:
                self._copy_row(done[key], i, first, end)
                self.snapshots.append(self.snapshots[done[key]])
                self.row_logits.append(self.row_logits[done[key]])
                self.cache.cached_tokens[i] = self.cache.cached_tokens[done[key]]
                if stock_row:
                    self.stock_rows.add(i)
                continue
            if stock_row:
                self.stock_rows.add(i)
                mark_row_filled(views, 0)
                self.cache.cached_tokens[i] = 0
                mask = (torch.arange(length, device=device_ids.device) >= pad).long()
                catch_up(self.model, self.layout, views, device_ids[i], 0, stop, [], mask=mask)
                self.snapshots.append({})
                self.row_logits.append(None)
                if key is not None:
                    done[key] = i
                continue
            junction = lease.kv_tokens if lease is not None else 0
            stepwise = not self.layout.continues_in_chunks
            start = fill_row(self.store, self.layout, views, lease, stop)
            served = max(0, start - self.computed.get(i, 0))  # in-batch sharing computed the rest for it
            self.cache.cached_tokens[i] = served
            cuts = self._cuts(i, start, stop, 0 if stepwise else interval, junction, grain)
            if score and end % grain == 0 and end > 0:
                cuts.append(end)  # the whole row's state: the next call over it reuses all of it
            snaps, logits = catch_up(
                self.model, self.layout, views, device_ids[i, pad:], start, end, cuts, keep[i] if score else 0
            )
            self.snapshots.append(snaps)
            self.row_logits.append(logits)
            if key is not None:
                done[key] = i
        ks, vs = pool_buffers(layers, self.layout)
        for i, pad in enumerate(self.pads):
            if pad and i not in self.stock_rows:  # a stock row computed its pad columns, as stock does
                for buf in (*ks, *vs):
                    buf[i, :, :pad].zero_()
        common = length if score else max(0, length - min(keep))
        if tails is not None:  # generate()'s first forward computes every row's tail from its snapshot
            common = self.pads[0] + tails[0]
        for layer in layers:
            if hasattr(layer, "set_length"):
                layer.set_length(common)
            if isinstance(layer, StateLayer):
                layer.mark_filled()
        self.cache.consumed = common
        self.common = common

    def _cuts(self, i: int, start: int, stop: int, interval: int, junction: int, grain: int) -> list[int]:
        """Row ``i``'s snapshot positions in ``(start, stop]``: ``cut_points``' and the caller's
        ``RadixCache(snapshot_at=)`` hints (floored to the grain)."""
        if self.keys is None:
            return []
        cuts = set(cut_points(start, max(start, stop), interval, junction, grain))
        hints = self.cache.snapshot_at
        if hints and isinstance(hints[0], list):
            prompts = len(hints)
            hints = (
                hints[i // self.rows_per_prompt] if len(self.pads) == prompts * self.rows_per_prompt else []
            )
        for h in hints or ():
            h -= h % grain
            # (a model stepping a token at a time after a snapshot pays every cut past the first)
            if start < h <= stop and (self.layout.continues_in_chunks or stop - h <= STEPWISE_TOKENS):
                cuts.add(h)
        return sorted(cuts)

    def _tail_ends(self, length: int, keep: list[int], interval: int, grain: int) -> list[int] | None:
        """Where each row's catch-up may stop when generate() can compute the rest: at its deepest
        snapshot (so no catch-up forward ends past it), if that leaves every row at one column
        (one row, or rows of one prompt) and the model continues in chunks; else None (each row
        goes to its last prompt token but one, and generate() feeds the last column)."""
        if not self.layout.continues_in_chunks or self.keys is None:
            return None
        ends, columns = [], set()
        for i, pad in enumerate(self.pads):
            stop = max(0, length - pad - keep[i])
            lease = self.leases[i] if self.leases else None
            start = usable_start(self.layout, lease, stop)
            junction = lease.kv_tokens if lease is not None else 0
            cuts = self._cuts(i, start, stop, interval, junction, grain)
            ends.append(max([start, *cuts]))
            columns.add(pad + ends[-1])
        return ends if len(columns) == 1 else None

    def _copy_row(self, src: int, dst: int, first: int, stop: int) -> None:
        """Row ``dst`` becomes a copy of row ``src`` (same key and padding): KV and states of its
        columns ``first`` to ``first + stop``."""
        ks, vs = pool_buffers(self.cache.layers, self.layout)
        for buf in (*ks, *vs):
            buf[dst, :, first : first + stop] = buf[src, :, first : first + stop]
        for t in state_views(self.cache.layers, self.layout):
            t[dst] = t[src]
        for layer in self.cache.layers:
            if isinstance(layer, CompressedLayer):
                for t in layer.row_tensors():
                    t[dst] = t[src]

    def start_decode_snapshots(self, eos: list[int]) -> None:
        """Take per-row snapshots at block boundaries during generate()'s decode (stateful
        models; not for beams, whose cache rows are reordered running beams)."""
        if not self.layout.stateful or self.pads is None or self.prompt_only or self.keys is None:
            return
        lengths = [self.common - pad for pad in self.pads]
        self.decode = DecodeSnapshots(self.model, self.cache, self.layout, lengths, self.grain, eos)

    def close(self) -> None:
        """Release every pin and stop the decode's snapshots (end of the call)."""
        self._paged_exit.close()
        self.cache.paged_plan = None
        self.release()
        if self.decode is not None:
            self.decode.close()

    def _row_snapshots(self, i: int, pad: int, end: int, kv_length: int) -> dict[int, list[torch.Tensor]]:
        """Row ``i``'s snapshots at positions <= ``end`` (its committed tokens): the catch-up's,
        the decode's deepest, and the final state when it ends on a block boundary."""
        out = {p: s for p, s in self.snapshots[i].items() if p <= end} if i < len(self.snapshots) else {}
        if self.decode is not None and i in self.decode.latest:
            pos, states = self.decode.latest[i]
            if pos <= end:
                out[pos] = states
        final = kv_length - pad
        if final <= end and final % self.grain == 0 and final > 0 and not self.prompt_only:
            out[final] = [t[i] for t in state_views(self.cache.layers, self.layout)]
        return out

    def _copy_prefix(self, common: int, computed: dict[int, int]) -> None:
        """Read each row's first ``common - pad`` tokens; ``computed[i]`` of row i's were computed
        for the batch by row i (in-batch sharing): not cached for it, nor a hit in the store."""
        layers = self.kv_layers  # (indexed layers among them: set_length moves their indexer keys too)
        k_bufs, v_bufs = pool_buffers(self.cache.layers, self.layout)
        # [n, B, H, capacity, D] views: all layers at once when they are slices of one buffer
        groups = [g for g in (stacked(interleave(k_bufs, v_bufs)),) if g is not None]
        groups = groups or [buf.unsqueeze(0) for buf in (*k_bufs, *v_bufs)]
        for i, pad in enumerate(self.pads):
            if pad:  # pad columns are masked, but must be finite: NaN * 0 still poisons attn @ V
                width = min(pad, common)
                for bufs in groups:
                    for part in chunks(bufs.shape[0], width * bufs.shape[2] * bufs.shape[4]):
                        bufs[part, i, :, :width].zero_()
        # One fused read per run of consecutive rows with equal padding (views stay views).
        start = 0
        while start < len(self.pads):
            pad = self.pads[start]
            stop = start + 1
            while stop < len(self.pads) and self.pads[stop] == pad:
                stop += 1
            reuse = common - pad
            if reuse > 0:
                served = [max(0, reuse - computed.get(i, 0)) for i in range(start, stop)]
                self.store.read(
                    self.leases[start:stop],
                    reuse,
                    [k[start:stop, :, pad:common] for k in k_bufs],
                    [v[start:stop, :, pad:common] for v in v_bufs],
                    served=served,
                )
                self.cache.cached_tokens[start:stop] = served
            start = stop
        for layer in layers:
            layer.set_length(common)

    # -- after generation ----------------------------------------------------------------------
    def cached_per_returned_row(self, returned: int) -> list[int]:
        """``cached_tokens`` with one entry per returned sequence, as ``sequences`` is laid out.

        The preload counted per cache row: with beams a prompt has ``num_beams`` rows but returns
        ``num_return_sequences`` of them, so entry i would belong to another prompt than
        ``sequences[i]``. All rows of one prompt share its padding and match: take the first.
        """
        cached = self.cache.cached_tokens
        if not cached:  # no preload ran (assisted decoding, inputs_embeds)
            return [0] * returned
        prompts = len(cached) // self.rows_per_prompt
        if prompts == 0 or returned % prompts or len(cached) % self.rows_per_prompt:
            return cached  # a layout this code does not know: leave the per-row counts as they are
        per_prompt = returned // prompts
        return [cached[(j // per_prompt) * self.rows_per_prompt] for j in range(returned)]

    def commit(self, sequences: torch.Tensor) -> int:
        """Cache each row's prompt + generated tokens (cut after the first EOS; prompt only for beams)."""
        if self.prompt_ids is None or self.keys is None or not self.cache.layers:
            return 0
        if self.weights_unchanged is not None and not self.weights_unchanged():
            logger.warning("radixkv: weights changed during the call; its KV is not cached")
            return 0
        layers = self.kv_layers
        kv_length = self.cache.get_seq_length()  # the last sampled token is never fed: no KV for it
        num_rows, prompt_length = self.prompt_ids.shape
        stateful = self.layout.stateful
        if stateful:
            first = state_views(self.cache.layers, self.layout)[0]
            if first.shape[0] != num_rows or not self.snapshots:
                logger.debug("cache batch differs from the prompt batch (or no catch-up): nothing committed")
                return 0
        elif layers[0].keys is None or layers[0].keys.shape[0] != num_rows:
            logger.debug("cache batch differs from the prompt batch: nothing committed")
            return 0
        prompt_only = self.prompt_only
        rows = self.prompt_ids if prompt_only else sequences.to("cpu", torch.int64)
        generated = None if prompt_only else rows[:, prompt_length:].tolist()  # short: scanned for EOS
        eos = set(self.eos_token_ids)
        seen: set[tuple[Hashable, bytes]] = set()
        added = 0
        ks, vs = pool_tensors(self.cache.layers, self.layout)
        for i, pad in enumerate(self.pads):
            if i in self.stock_rows:  # computed with its pads (a padding-dependent model): not its prefix's
                continue
            if prompt_only:
                end = prompt_length
            else:
                new = generated[i]
                end = prompt_length + next((j + 1 for j, t in enumerate(new) if t in eos), len(new))
            end = min(end, kv_length)
            key = self.keys.row(i, rows[i, :end], pad, prompt_length)
            if key.tokens.num_tokens < self.store.block_size or (key.namespace, key.tokens) in seen:
                continue
            seen.add((key.namespace, key.tokens))
            offset, first = 0, pad
            if self.plan is not None:  # the layers hold the columns from common on, the pool the rest
                offset, first = max(0, self.common - pad), max(0, pad - self.common)
                end -= self.common
            added += self.store.commit(
                key.tokens,
                [k[i : i + 1, :, first:end] for k in ks],
                [v[i : i + 1, :, first:end] for v in vs],
                key.namespace,
                epoch=self.epoch,
                snapshots=self._row_snapshots(i, pad, end - pad, kv_length) if stateful else None,
                **({"offset": offset} if offset else {}),
            )
        return added

    def release(self) -> None:
        """Unpin everything this request pinned; idempotent, safe in ``finally``."""
        leases, self.leases = self.leases, []
        for lease in leases:
            lease.release()
