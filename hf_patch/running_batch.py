"""RunningBatch: rows that decode together one token per forward, admitted and removed between
steps, their KV kept across steps (a step loop over the model's forward, no generate() per step).

    batch = RunningBatch(model, store, pad_id, eos)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=1)
    kv, states = prefill_tensors(model, cache, mask)   # states: None unless the model is stateful
    slots = batch.admit(kv, ids, mask, first_tokens, prefill_keys(model, cache, ids.shape[0]), states=states)
    logits = batch.step()               # [slots, vocab] float32, one forward over [slots, 1]
    batch.set_next(tokens)              # the tokens sampled from those logits, one per slot
    slots, cached = batch.seat(contexts, keys)   # or: rows join with their prompts uncomputed
    logits = batch.step()               # ... and this step computes them beside the others' token
    batch.remove([i], commit=True)      # a finished row: its prompt + reply KV into the store
    moved = batch.compact()             # now and then: new slot j holds old slot moved[j]

Layout: every layer's KV is ``[B, kv_heads, W, head_dim]`` over B slots (a slot holds a row or
is free), rows left-padded to the common width W; ``mask`` ``[B, W]`` marks real columns,
``ids`` ``[B, W]`` holds the token of each column (``pad_id`` in padding), and ``pads[i]`` is
slot i's first real column. Real token j of a
row has position j (as generate() numbers a left-padded row), so KV computed for a row alone
(its prefill) is valid at any padding; padding columns hold zeros (finite: NaN * 0 still
poisons attention) and are masked. ``last[i]``: the token sampled for row i and not yet fed
(it has no KV); ``step()`` feeds it.

Prefixes read from the pool in place (``pools``: on by default where ``pool_reason`` is None;
``RADIXKV_STEP_POOL=0`` or ``RunningBatch(pooled=False)`` turns it off): a row whose cached
prefix is in the device pool keeps the lease pinning it until it leaves, and ``prefix[i]`` of
its tokens are read from the pool through its block table at every step
(``ragged_attention.PoolTables`` -> ``cuda_ext.ragged_decode.ragged_pooled``: those tokens, then
its own columns, one softmax; bit for bit the sums of the same prefix copied into its columns).
Its slot holds only its own columns: the KV layers are ``kv_width`` columns wide, ids and mask
``width`` (every token: positions, penalties and commit keys see the whole row), both
right-aligned, so slot i's own KV columns start at ``kv_start(i)``; 32 rows over one cached
document hold it once. ``commit`` then copies only the own columns (``KVStore.commit(offset=)``).
A pinned block is never evicted, demoted or rewritten; a flush frees it when the row leaves. A
prefix on the host or remote tier, a model with recurrent state, no store, or no ragged kernel:
the prefix is copied into the slot (as before); a kernel that stops applying mid-run (the model
moved or trains) copies every row's prefix in first (``unpool``), logged once.

A row's store key is fixed at admission (``prefill_keys``: the prefill call's namespace,
shared prefix and adapter key parts, hf_patch.keys); a row admitted without one (cache_prompt
off, reuse off, an unkeyable call) is never committed. ``commit`` stores a row's fed tokens
up to its first EOS after its prompt (never padding, never the unfed last token), skipped when
the model's weights changed since admission or the store was flushed meanwhile (epoch).

Joining inside a step (``seat``, where ``packs(model)``: the CPU ragged kernel applies): a
newcomer's context is placed right-aligned so that its last token is fed by the next step, its
cached prefix read from the store into its columns, and the rest of its prompt left without KV
(``pending``). The next ``step()`` is then one forward over the batch's tokens packed as one
sequence (hf_patch.ragged_attention.packed): each live row's last token, and before it each
newcomer's uncomputed prompt tokens, each attending to its own row's columns up to itself. So a
newcomer costs the step its prompt tokens' compute, not a prefill forward of its own (on a CPU
a small model's forward costs ~6 ms before its first token), and its first token comes out of
that step with everyone's next one. After that step each seated row's prompt is committed
(as the prefill generate() commits it).

Decoders with 1-D positions whose layers keep full-attention KV, recurrent / conv state, or
both (``unsupported_reason(model)`` is None): sliding windows, indexer keys, shared KV, M-RoPE
and encoder-decoder models need what this layout does not keep. A model with recurrent state
(``ModelLayout.stateful``) keeps each row's states in its slot (hf_patch.slot_states: spliced in
at ``admit``, snapshotted at block boundaries, committed with the row); its rows join through
``admit`` only (``packs`` is False: a recurrent layer cannot run over packed rows). Not
thread-safe: one worker owns a batch. Memory: one ``[B, H, W + headroom, D]`` K and V buffer
per KV layer, one ``[B, ...]`` tensor per state; steps append in place, admission and removal
write one slot (see the class for when the whole batch is re-laid out).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DummyLayer

from hf_patch import ragged_attention, step_models
from hf_patch.cache import RadixCache
from hf_patch.call import key_parts
from hf_patch.keys.adapters import unkeyable_reason
from hf_patch.keys.weights import fingerprint, flush_if_weights_changed
from hf_patch.layer import AppendLayer, StateAppendLayer, StateLayer
from hf_patch.model_spec import ModelLayout, layer_specs, model_layout
from hf_patch.request import KeyParts
from hf_patch.slot_prefixes import SlotPrefixes
from hf_patch.slot_states import SlotStates

__all__ = [
    "JoinFailed", "RowKeys", "RunningBatch", "packs", "pool_reason", "prefill_keys", "prefill_tensors",
    "unsupported_reason",
]  # fmt: skip

logger = logging.getLogger(__name__)

HEADROOM = 64  # columns allocated beyond the width at each re-layout (steps append in place)
_POOL_ENV = "RADIXKV_STEP_POOL"
POOL_OFF = "reading prefixes from the pool in place is off"  # (not logged: chosen)
NO_STORE = "no store"  # (not logged: nothing is read)
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning("radixkv: %s", message)


def pool_setting() -> bool:
    """``RADIXKV_STEP_POOL``: ``1``, unset or ``auto`` (the default): on where it applies; ``0``: off."""
    value = os.environ.get(_POOL_ENV, "").strip()
    if value not in ("", "auto", "0", "1"):
        raise ValueError(f"{_POOL_ENV} must be 0, 1 or auto, got {value!r}")
    return value != "0"


def pool_reason(model, store, choice: bool | None = None) -> str | None:
    """Why ``model``'s RunningBatch over ``store`` copies each row's cached prefix into its slot,
    or None: its rows read their prefixes from the pool in place (see the module). ``choice``:
    ``RunningBatch(pooled=)``; the setting counts when it is None. Probed once per model."""
    if not (pool_setting() if choice is None else choice):
        return POOL_OFF
    if store is None:
        return NO_STORE
    if model_layout(model).stateful:
        return "a model with recurrent state (its rows commit their whole KV with their snapshots)"
    if not ragged_attention.verify(model):
        return "the step's ragged kernel does not apply (numba, a float32 CPU sdpa model: hf_patch.ragged_attention)"
    pool = store.pool
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in (*pool.k, *pool.v)):
        return "the store's pool is not float32 on the CPU"
    ok = ragged_attention.probed_once(
        model, "_radixkv_step_pool_ok", _probe_pool, logger, "running rows copy their cached prefixes"
    )
    return None if ok else "the model did not pass the step pool probe (logged)"


@dataclass(frozen=True)
class RowKeys:
    """A prefill call's key parts (``keys``: one entry per row of that call) and the store epoch
    and weights fingerprint when its KV was computed; ``cached``: per row, its tokens that call
    read from the store (its KV of those is the pool's: ``admit`` reads no more in place)."""

    keys: KeyParts
    epoch: int
    weights: int
    cached: tuple[int, ...] = ()


def prefill_keys(model, cache, rows: int) -> RowKeys | None:
    """The key parts of the ``rows`` rows a prefill generate() just ran on ``cache``, for
    committing their replies later; None when ``cache`` is no RadixCache with a store (then
    nothing is committed) or the call was unkeyable. Call right after that generate()."""
    if not isinstance(cache, RadixCache) or cache.store is None or unkeyable_reason(model) is not None:
        return None
    keys = key_parts(model, cache, torch.Size((rows, 0)), 1)
    return RowKeys(keys, cache.store.epoch, fingerprint(model), tuple(cache.cached_tokens or ()))


def _release(held: Sequence[tuple]) -> None:
    """Release the leases of ``(lease or None, blocks)`` pairs not handed to a slot."""
    for lease, _ in held:
        if lease is not None:
            lease.release()


class JoinFailed(RuntimeError):
    """A step computing seated rows' prompts failed (its cause: ``__cause__``); those rows
    (``slots``) were removed, uncommitted, and the batch is as before the step."""

    def __init__(self, slots: list[int]) -> None:
        super().__init__(f"the step computing the prompts of slots {slots} failed")
        self.slots = slots


class _SlotLayer(AppendLayer):
    """A RunningBatch layer: appends a column per step, or for a packed step (``scatter`` set:
    slots, columns, free slots) writes each packed token's KV at its own (slot, column) and
    zeros the new column of the free slots (finite, masked)."""

    def __init__(self) -> None:
        super().__init__()
        self.scatter: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.scatter is None:
            return super().update(key_states, value_states, *args, **kwargs)
        slots, columns, free = self.scatter
        end = self.length + 1
        self._ensure_capacity(end)
        for buf, states in ((self._k_buf, key_states), (self._v_buf, value_states)):
            buf[slots, :, columns] = states[0].transpose(0, 1)  # [N, H, D] at (slot, column)
            if len(free):
                buf[free, :, self.length] = 0
        self.length = end
        self._refresh_views()
        return self.keys, self.values


class _SlotStateLayer(StateAppendLayer):
    """A RunningBatch layer keeping both KV and recurrent states (Falcon-H1, Zamba): a column
    per step, states per slot (never packed: stateful models join through ``admit``)."""

    scatter = None


def prefill_tensors(model, cache, mask: torch.Tensor) -> tuple[list, list[torch.Tensor] | None]:
    """What ``RunningBatch.admit`` takes from a prefill generate() that just ran on ``cache``
    over rows left-padded as ``mask`` ``[R, T]``: per KV layer (``ModelLayout.kv_layers``, every
    layer of an attention-only model) its ``(k, v)`` ``[R, H, T, D]``, and for a stateful model
    one ``[R, ...]`` tensor per state entry (else None).

    A row's state must be the state after its real tokens only. A RadixCache computes every row
    alone (hf_patch.request), so any padding is fine there; a plain cache (or a call run
    uncached: hf_patch.keys.adapters.unkeyable_reason) computed padded rows with their pads in
    the state, as stock's batched prefill does: ValueError then (admit such rows in groups of
    one length)."""
    layout = model_layout(model)
    layers = cache.layers
    kv = [(layers[i].keys, layers[i].values) for i in layout.kv_layers]
    if not layout.stateful:
        return kv, None
    padded = bool((mask == 0).any())
    if padded and (not isinstance(cache, RadixCache) or unkeyable_reason(model) is not None):
        raise ValueError(
            "prefill_tensors: padded rows of a recurrent model computed together (not through a "
            "RadixCache): their states include the padding; prefill rows of one length together"
        )
    return kv, SlotStates.rows_of(layers, layout)


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot decode in a RunningBatch, or None (``hf_patch.step_models``' layouts).
    A model with recurrent state is also probed, once per model and remembered on it (logged
    when it fails): rows decoding beside others in a step, from states spliced in per slot,
    must give the logits each row gets decoding alone. That catches a family whose decode
    reads its cache or mask in a way the batch does not give it."""
    reason = step_models.unsupported_reason(model)
    if reason is not None or not model_layout(model).stateful:
        return reason
    ok = ragged_attention.probed_once(
        model, "_radixkv_step_states_ok", _probe_states, logger, "rows decode in generate() calls"
    )
    return None if ok else "its decode steps over per-slot recurrent states differ from a row's own (logged)"


def _probe_states(model) -> tuple[bool, str | None]:
    """Two rows (4 and 7 tokens) prefilled alone in stock caches, admitted, decoded two steps
    together: each step's logits against the row's own stock decode."""
    from transformers import DynamicCache

    layout = model_layout(model)
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, text.vocab_size, (1, n), generator=g) for n in (4, 7)]
    fed = torch.randint(3, text.vocab_size, (2, 2), generator=g)  # the tokens the two steps feed
    device = model.device
    want, kv, states = [], [], []
    with torch.no_grad():
        for r, ids in enumerate(prompts):
            cache = DynamicCache(config=text)
            model(input_ids=ids.to(device), use_cache=True, **{layout.cache_arg: cache})
            k, s = prefill_tensors(model, cache, torch.ones_like(ids))
            kv.append([(a.clone(), b.clone()) for a, b in k])
            states.append([t.clone() for t in s])  # (the stock decode below updates them in place)
            own = []
            for step in range(2):  # the row alone, on in its stock cache
                out = model(input_ids=fed[r : r + 1, step : step + 1].to(device), use_cache=True,
                            **{layout.cache_arg: cache})  # fmt: skip
                own.append(out.logits[0, -1].float())
            want.append(own)
    batch = RunningBatch(model)
    for r, ids in enumerate(prompts):
        batch.admit(kv[r], ids, torch.ones_like(ids), [int(fed[r, 0])], states=states[r])
    for step in range(2):
        got = batch.step()
        for r in range(2):
            diff = (got[r] - want[r][step]).abs().max().item()
            scale = max(1.0, want[r][step].abs().max().item())
            tolerance = 1e-3 if got.dtype == torch.float32 and model.dtype == torch.float32 else 5e-2
            if diff > tolerance * scale:
                return False, f"row {r}'s logits at step {step} differ by {diff:.3g} from its own decode"
        if step == 0:
            batch.set_next([int(fed[0, 1]), int(fed[1, 1])])
    return True, None


def packs(model) -> bool:
    """Whether newcomers may join ``model``'s RunningBatch inside a step (``seat``): the CPU
    ragged kernel applies (hf_patch.ragged_attention.verify), and, probed once per model and
    remembered on it (logged when not), a packed step gives the logits a plain step and a
    separate prefill give (a row joining beside a decoding one)."""
    if not ragged_attention.verify(model) or model_layout(model).stateful:
        return False  # (a recurrent layer cannot run over rows packed as one sequence)
    return ragged_attention.probed_once(
        model,
        "_radixkv_packed_ok",
        _probe_packed,
        logger,
        "newcomers join through prefill calls, not inside a step",
    )


def _probe_packed(model) -> tuple[bool, str | None]:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, text.vocab_size, (2, 7), generator=g).tolist()
    with torch.no_grad():
        want_a = model(input_ids=torch.tensor([a[:6]]), logits_to_keep=1).logits[0, -1].float()
        want_a2 = model(input_ids=torch.tensor([a]), logits_to_keep=1).logits[0, -1].float()
        want_b = model(input_ids=torch.tensor([b[:5]]), logits_to_keep=1).logits[0, -1].float()
    batch = RunningBatch(model)
    batch._packed = True  # the probe itself must take the packed path
    (sa,), _ = batch.seat([a[:6]])
    got_a = batch.step()[sa]
    batch.set_next([a[6] if i == sa else 0 for i in range(batch.size)])
    (sb,), _ = batch.seat([b[:5]])
    logits = batch.step()
    got_a2, got_b = logits[sa], logits[sb]
    for name, got, want in (
        ("a prompt", got_a, want_a),
        ("a decoding row", got_a2, want_a2),
        ("a joining row", got_b, want_b),
    ):
        if not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
            return False, f"{name}'s logits differ by {(got - want).abs().max().item():.3g} in a packed step"
    return True, None


def _probe_pool(model) -> tuple[bool, str | None]:
    """A row of 12 tokens whose first 8 are in a small store, admitted into a batch that copies
    its prefix into its slot and one that reads it from the pool in place, decoded two steps:
    the logits must agree (the pool's layers reached through every attention layer's kernel)."""
    from transformers import DynamicCache

    from radixkv.store import BlockPool, KVStore

    layout = model_layout(model)
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, text.vocab_size, (1, 12), generator=g)
    fed = torch.randint(3, text.vocab_size, (2,), generator=g).tolist()
    store = KVStore(BlockPool(layer_specs(model), num_blocks=8, block_size=4))
    keys = prefill_keys(model, RadixCache(store=store), 1)
    if keys is None:
        return False, "its calls are not keyable (nothing is read from the store)"
    with torch.no_grad():
        cache = DynamicCache(config=text)
        model(input_ids=ids.to(model.device), use_cache=True, past_key_values=cache)
    kv = [(cache.layers[i].keys, cache.layers[i].values) for i in layout.kv_layers]
    key = keys.keys.row(0, ids[0, :8], 0)  # its first 8 tokens cached, as a finished row leaves them
    store.commit(key.tokens, [k[:, :, :8] for k, _ in kv], [v[:, :, :8] for _, v in kv], key.namespace)
    keys = RowKeys(keys.keys, keys.epoch, keys.weights, (8,))  # (as if its prefill had read them)
    got = []
    for pooled in (False, True):
        batch = RunningBatch(model, store, pooled=pooled)
        batch._pools = pooled  # (the probe itself decides nothing)
        try:
            batch.admit(kv, ids, torch.ones_like(ids), [fed[0]], keys)
            if batch.prefix[0] != (8 if pooled else 0):
                return False, f"the row's prefix read in place is {batch.prefix[0]} tokens, not 8"
            first = batch.step()
            batch.set_next([fed[1]])
            got.append(torch.cat([first, batch.step()]))
        finally:
            batch.clear()  # (its lease released)
    diff = (got[0] - got[1]).abs().max().item()
    if not torch.allclose(got[0], got[1], rtol=1e-3, atol=1e-3):
        return False, f"its logits reading the prefix in place differ by {diff:.3g} from a copy's"
    return True, None


class RunningBatch:
    """The rows decoding now (see the module). ``store``: where ``commit`` writes (None: never).
    ``pooled``: whether rows read their cached prefixes from the pool in place (``pool_reason``;
    None: ``RADIXKV_STEP_POOL``, on by default where it applies; False: every row copies).

    Rows live in slots (index i of every tensor): a removed row's slot is masked and reused by
    the next admission (its columns overwritten), so admitting and removing a row copies that
    row only. A full re-layout (one copy of the whole KV) happens only when a newcomer's prompt
    is wider than the batch, when every slot is taken, or in `compact` (many free slots, or
    many leading columns that are padding in every live row)."""

    def __init__(
        self, model, store=None, pad_id: int = 0, eos: Sequence[int] = (), pooled: bool | None = None
    ):
        self.model, self.store, self.pad_id, self.eos = model, store, pad_id, set(eos)
        self.cache: Cache | None = None
        self.kv_width = 0  # KV columns of every layer (``width`` counts the rows' pool tokens too)
        # per slot: the row's first tokens read from the pool in place (its KV columns hold the
        # rest), the lease pinning them until the row leaves, their blocks (hf_patch.slot_prefixes)
        self.prefixes = SlotPrefixes()
        self._choice = pooled
        self._pools: bool | None = None  # pool_reason() is None, asked once
        self.ids = torch.zeros((0, 0), dtype=torch.long)
        self.mask = torch.zeros((0, 0), dtype=torch.long)
        self.live: list[bool] = []  # per slot: a row decodes there
        self.pads: list[int] = []  # per slot: the row's first real column
        self.last: list[int] = []  # per slot: the token to feed next (pad_id in a free slot)
        self.prompt_lengths: list[int] = []  # real tokens of each row's prompt (EOS after it ends it)
        self._keys: list[tuple[RowKeys, int] | None] = []  # (prefill keys, row in that call)
        # per slot: columns before the last (width - pending .. width - 1) with no KV yet: the
        # next step computes them (a row seated by ``seat``)
        self.pending: list[int] = []
        self._seated: list[int] = []  # slots seated since the last step: committed after it
        self._packed: bool | None = None  # packs(model), asked once
        self._layout: ModelLayout | None = None
        # a stateful model's per-slot states and snapshots (hf_patch.slot_states), at the first layout
        self.states: SlotStates | None = None

    @property
    def layout(self) -> ModelLayout:
        """The model's layout (hf_patch.model_spec), read once."""
        if self._layout is None:
            self._layout = model_layout(self.model)
        return self._layout

    @property
    def size(self) -> int:
        """Slots (live or free): the batch dimension of a step."""
        return len(self.live)

    @property
    def rows(self) -> list[int]:
        """The live slots."""
        return [i for i, alive in enumerate(self.live) if alive]

    @property
    def width(self) -> int:
        """Columns of ``ids`` / ``mask``: a row's tokens, its pool tokens included."""
        return self.ids.shape[1]

    @property
    def prefix(self) -> list[int]:
        """Per slot: the row's first tokens read from the pool in place (0: none)."""
        return self.prefixes.tokens

    @property
    def pools(self) -> bool:
        """Whether newcomers read their cached prefixes from the pool in place (``pool_reason``,
        asked once per batch; logged once when it does not apply, unless switched off)."""
        if self._pools is None:
            reason = pool_reason(self.model, self.store, self._choice)
            if reason not in (None, POOL_OFF, NO_STORE):
                _log_once(f"running rows copy their cached prefixes into their slots: {reason}")
            self._pools = reason is None
        # the kernel's conditions hold per call (dtype, device, eval mode, the setting)
        return self._pools and ragged_attention.verify(self.model)

    def kv_start(self, i: int) -> int:
        """Slot i's first KV column (its own tokens: those past its ``prefix``); ``kv_width`` when free."""
        if not self.live[i]:
            return self.kv_width
        return self.kv_width - (self.width - self.pads[i] - self.prefix[i])

    def tokens(self, i: int) -> list[int]:
        """Slot i's fed tokens (prompt and reply so far, no padding; ``last[i]`` not included)."""
        return self.ids[i, self.pads[i] :].tolist()

    # -- membership -------------------------------------------------------------------------
    def admit(
        self,
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        ids: torch.Tensor,
        mask: torch.Tensor,
        first: Sequence[int],
        keys: RowKeys | None = None,
        states: Sequence[torch.Tensor] | None = None,
    ) -> list[int]:
        """Splice in R rows whose prompt KV was just computed: ``kv`` per KV layer ``(k, v)``
        each ``[R, H, T, D]`` (a prefill cache's, left-padded as ``mask`` ``[R, T]`` says:
        ``prefill_tensors``), ``ids`` ``[R, T]`` their tokens, ``first`` the token sampled for
        each (not fed yet). ``states`` (a stateful model: ``prefill_tensors``' states, one
        ``[R, ...]`` tensor per state entry, each row's after its real tokens only).
        ``keys``: the prefill's key parts (``prefill_keys``), None: never committed. Returns
        the slot of each new row (free slots first; live slots keep theirs). Copies ``kv``."""
        rows, length = ids.shape
        layout = self.layout
        if len(kv) != len(layout.kv_layers) or len(first) != rows or tuple(mask.shape) != (rows, length):
            raise ValueError(
                f"admit: {len(kv)} layers, {len(first)} first tokens and mask {list(mask.shape)} "
                f"for ids {list(ids.shape)} (the model has {len(layout.kv_layers)} KV layers)"
            )
        if kv and kv[0][0].shape[2] != length:
            raise ValueError(f"admit: KV of {kv[0][0].shape[2]} columns for {length} tokens")
        if layout.stateful and (states is None or len(states) != len(layout.state_entries)):
            raise ValueError(
                f"admit: {0 if states is None else len(states)} state tensors for a model with "
                f"{len(layout.state_entries)} (hf_patch.running_batch.prefill_tensors)"
            )
        if layout.stateful and any(t.shape[0] != rows for t in states):
            raise ValueError(f"admit: states of {[t.shape[0] for t in states]} rows for {rows} rows")
        mask = mask.to("cpu", torch.long)
        real = mask.sum(dim=1)
        expected = torch.arange(length).unsqueeze(0) >= (length - real).unsqueeze(1)
        if not torch.equal(mask.bool(), expected):
            raise ValueError("admit: the mask is not plain left padding")
        ids = torch.where(mask.bool(), ids.to("cpu", torch.long), self.pad_id)
        # a row reads in place the prefix its prefill read from the store (leased again now: its
        # KV of those tokens is the pool's; what the prefill computed stays the row's own, as a
        # copy would keep it, though another row of the call may have committed the same tokens)
        reads = (
            keys is not None
            and self.store is not None
            and keys.epoch == self.store.epoch
            and len(keys.cached) == rows
            and self.pools
        )
        held: list[tuple] = []
        try:
            for r in range(rows):
                n = int(real[r])
                most = min(n, keys.cached[r]) if reads else 0
                held.append(self._lease(keys, r, ids[r, length - n :], most) if most else (None, None))
            own = [int(real[r]) - (lease.num_tokens if lease else 0) for r, (lease, _) in enumerate(held)]
            free = [i for i, alive in enumerate(self.live) if not alive]
            need = max(own, default=0)  # (the widest real row when none reads the pool)
            if self.cache is None or length > self.width or need > self.kv_width or len(free) < rows:
                # one re-layout: wide enough for the newcomers, a slot for each
                grow = max(0, rows - len(free))
                width, kv_width = max(self.width, length), max(self.kv_width, need)
                self._relayout(list(range(self.size)), width, kv_width, self.size + grow, kv)
                free = [i for i, alive in enumerate(self.live) if not alive]
        except BaseException:
            _release(held)
            raise
        width, kv_width = self.width, self.kv_width
        slots = free[:rows]
        for r, slot in enumerate(slots):
            pad = width - int(real[r])
            start = kv_width - own[r]
            try:
                for layer, (k, v) in zip(self._kv_layers(), kv):
                    for buf, src in zip(layer.buffers(), (k, v)):
                        buf[slot, :, :start] = 0  # padding: finite zeros, masked
                        buf[slot, :, start:kv_width] = src[r, :, length - own[r] :]
            except BaseException:  # (a later layer's KV of another shape) no lease left pinned
                _release(held[r:])
                raise
            self.prefixes.hold(slot, *held[r])
            if self.states is not None:
                self.states.admit(self.cache.layers, slot, states, r)
            self.ids[slot] = self.pad_id
            self.ids[slot, width - length :] = ids[r]
            self.mask[slot] = 0
            self.mask[slot, pad:] = 1
            self.live[slot], self.pads[slot], self.last[slot] = True, pad, int(first[r])
            self.prompt_lengths[slot] = int(real[r])
            self._keys[slot] = (keys, r) if keys is not None else None
        return slots

    def _lease(self, keys: RowKeys, r: int, tokens: torch.Tensor, most: int) -> tuple:
        """``keys``' row r's longest cached prefix of ``tokens`` (at most ``most`` tokens) pinned,
        and its blocks in the device pool, for a row admitted after its prefill (which counted
        the hits): ``(lease, blocks)``, or ``(None, None)`` where it is not all in the device pool."""
        lease, blocks = SlotPrefixes.lease(self.store, keys.keys.row(r, tokens, 0), most, 0)
        if blocks is None or lease.epoch != keys.epoch:  # (a flush since the prefill: its own KV)
            lease.release()
            return None, None
        return lease, blocks

    def seat(
        self,
        contexts: Sequence[Sequence[int]],
        keys: RowKeys | None = None,
        rows: Sequence[int] | None = None,
    ) -> tuple[list[int], list[int]]:
        """Seat rows whose KV is not computed yet: ``contexts[r]`` the tokens of row r (its
        prompt, or prompt and reply so far), placed so that its last token is fed by the next
        ``step()``; its longest cached prefix (under ``keys``' row ``rows[r]``, default r; None:
        nothing read nor committed) is read from the store now, and the next step computes the
        rest beside the other rows' tokens, then commits it. Needs ``packs(model)``. Returns
        each row's slot and its tokens read from the store."""
        if not self.packed:
            raise ValueError("seat: this model's rows cannot join inside a step (running_batch.packs)")
        rows = list(range(len(contexts))) if rows is None else list(rows)
        if len(rows) != len(contexts) or any(len(c) == 0 for c in contexts):
            raise ValueError(f"seat: {len(contexts)} contexts (each non-empty) for {len(rows)} key rows")
        longest = max((len(c) for c in contexts), default=0)
        if keys is not None and self.store is not None:
            # as generate() does before reading: KV cached under other weights is dropped, and
            # these rows' KV belongs to the store's new epoch
            if flush_if_weights_changed(self.store, self.model, keys.weights):
                keys = RowKeys(keys.keys, self.store.epoch, keys.weights)
        store = self.store if keys is not None else None
        # each row's cached prefix pinned first: one read in place needs no KV columns here
        held: list[tuple] = []
        try:
            for context, r in zip(contexts, rows):
                held.append(self._seat_lease(store, keys, r, context))
            need = max(
                len(c) - 1 - (lease.num_tokens if blocks is not None else 0) for c, (lease, blocks) in zip(contexts, held)
            )  # fmt: skip
            free = [i for i, alive in enumerate(self.live) if not alive]
            if (
                self.cache is None
                or longest - 1 > self.width
                or need > self.kv_width
                or len(free) < len(contexts)
            ):
                grow = max(0, len(contexts) - len(free))
                like = None
                if self.cache is None:
                    like = [
                        (
                            torch.empty(
                                (1, spec.num_kv_heads, 0, spec.k_head_dim),
                                dtype=spec.dtype,
                                device=spec.device,
                            ),
                            torch.empty(
                                (1, spec.num_kv_heads, 0, spec.v_head_dim),
                                dtype=spec.dtype,
                                device=spec.device,
                            ),
                        )
                        for spec in layer_specs(self.model)
                    ]
                width, kv_width = max(self.width, longest - 1), max(self.kv_width, need)
                self._relayout(list(range(self.size)), width, kv_width, self.size + grow, like)
                free = [i for i, alive in enumerate(self.live) if not alive]
        except BaseException:
            _release(held)
            raise
        slots, cached = [], []
        try:
            for (context, r), (lease, blocks) in zip(zip(contexts, rows), held):
                slot = free.pop(0)
                slots.append(slot)
                cached.append(self._seat_one(slot, context, keys, r, lease, blocks))
        except BaseException:  # a store read failed: the rows seated so far leave, uncommitted
            for lease, _ in held[len(cached) + 1 :]:  # (the failing row's own: released by _seat_one)
                if lease is not None:
                    lease.release()
            self.remove(slots[: len(cached)], commit=False)
            raise
        return slots, cached

    def _seat_lease(self, store, keys: RowKeys | None, r: int, context: Sequence[int]) -> tuple:
        """A newcomer's longest cached prefix, pinned: ``(lease, blocks)``, ``blocks`` its blocks in
        the device pool when it reads them in place (``pools``), else None (copied into its slot;
        ``lease`` None without a store)."""
        if store is None:
            return None, None
        key = keys.keys.row(r, torch.tensor(context, dtype=torch.long), 0)
        if self.pools:
            return SlotPrefixes.lease(store, key, len(context) - 1, None)
        return store.acquire(key.tokens, key.namespace, max_tokens=len(context) - 1), None

    def _seat_one(
        self, slot: int, context: Sequence[int], keys: RowKeys | None, r: int, lease, blocks
    ) -> int:
        """Seat one row in free ``slot`` (see ``seat``) with its ``lease`` (``_seat_lease``: kept
        while it reads ``blocks`` in place, else released here); returns its tokens read from the store."""
        length = len(context)
        width, kv_width = self.width, self.kv_width
        pad = width + 1 - length  # its last token goes to the next step's column
        hit = lease.num_tokens if lease is not None else 0
        inplace = blocks is not None
        start = kv_width + 1 - length + (hit if inplace else 0)  # its first KV column
        ids = torch.tensor(context, dtype=torch.long)
        try:
            for layer in self.cache.layers:
                for buf in layer.buffers():
                    buf[slot, :, :start] = 0  # padding: finite zeros, masked (the rest is written below)
            if hit and not inplace:
                layers = self.cache.layers
                self.store.read(
                    [lease],
                    hit,
                    [layer.buffers()[0][slot : slot + 1, :, start : start + hit] for layer in layers],
                    [layer.buffers()[1][slot : slot + 1, :, start : start + hit] for layer in layers],
                )
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        if lease is not None and not inplace:
            lease.release()
        self.prefixes.hold(slot, lease if inplace else None, blocks)
        self.ids[slot] = self.pad_id
        self.ids[slot, pad:] = ids[:-1]
        self.mask[slot] = 0
        self.mask[slot, pad:] = 1
        self.live[slot], self.pads[slot], self.last[slot] = True, pad, int(context[-1])
        self.prompt_lengths[slot] = length
        self._keys[slot] = (keys, r) if keys is not None else None
        self.pending[slot] = length - 1 - hit
        self._seated.append(slot)
        return hit

    @property
    def packed(self) -> bool:
        """Whether rows may join inside a step (``packs(model)``, asked once per batch)."""
        if self._packed is None:
            self._packed = packs(self.model)
        # the kernel's conditions hold per call (dtype, device, eval mode, the setting)
        return self._packed and ragged_attention.verify(self.model)

    def remove(self, slots: Sequence[int], commit: bool = True) -> int:
        """Free ``slots`` (committing each row first unless ``commit`` is False; a commit that
        fails is logged, its row freed uncached); the other rows keep their slots. Returns the
        tokens the commits added to the store."""
        added = 0
        for i in sorted(set(slots)):
            if not 0 <= i < self.size or not self.live[i]:
                raise ValueError(f"remove: slot {i} holds no row")
            if commit:
                added += self._commit_or_log(i)
            self.prefixes.release(i)  # (after its commit: that extends the prefix it pins)
            self.live[i], self.last[i], self._keys[i] = False, self.pad_id, None
            self.pending[i] = 0
            if self.states is not None:
                self.states.free(i)
            self.mask[i] = 0
            self.ids[i] = self.pad_id
        gone = set(slots)
        self._seated = [i for i in self._seated if i not in gone]  # nothing left to commit there
        return added

    def compact(self) -> list[int] | None:
        """Drop free slots and the leading columns that are padding in every live row when that
        saves enough (free slots outnumber live ones, or a quarter of the columns and at least
        64 are padding everywhere, in ``ids`` or in the KV): one copy of the live rows' KV. Returns the old slot of each
        new slot, or None when nothing changed (slots stay as they are)."""
        live = self.rows
        if not live:
            if self.cache is not None:
                self.clear()
                return []
            return None
        trim = min(self.pads[i] for i in live)
        kv_trim = min(self.kv_start(i) for i in live)  # (trim where no row reads the pool)
        sparse = self.size - len(live) > max(2, len(live))
        wide = trim >= max(64, self.width // 4) or kv_trim >= max(64, self.kv_width // 4)
        if not (sparse or wide):
            return None
        self._relayout(live, self.width - trim, self.kv_width - kv_trim, len(live), None)
        return live

    # -- decoding ---------------------------------------------------------------------------
    def step(self, **model_kwargs) -> torch.Tensor:
        """Feed every slot's ``last`` token: one forward over ``[slots, 1]`` with each row's own
        position and the 2-D mask; returns the next-token logits ``[slots, vocab]`` float32 (a
        free slot's row is meaningless: it attends to its own fed token only)."""
        if not any(self.live):
            raise ValueError("step: the batch has no rows")
        pool = self._pool_tables()
        if any(self.pending):
            return self._packed_step(pool, **model_kwargs)
        kv_layers = self._kv_layers()
        device = kv_layers[0].keys.device if kv_layers else self.model.device
        tokens = torch.tensor(self.last, dtype=torch.long).unsqueeze(1)
        positions = self.mask.sum(dim=1, keepdim=True)  # real tokens before this one (pool tokens too)
        mask = torch.cat([self.mask, torch.ones_like(tokens)], dim=1)
        kv_width = self.kv_width
        starts = [self.kv_start(i) for i in range(self.size)]
        model_mask = mask
        if kv_width != self.width:  # the model's mask covers the KV columns (the kernel reads none of it)
            model_mask = (torch.arange(kv_width + 1).unsqueeze(0) >= torch.tensor(starts).unsqueeze(1)).long()
        if self.layout.cache_arg == "cache_params":
            # the Mamba families: no positions, and a one-token step has no padding to mask
            inputs = {"cache_params": self.cache}
        else:
            inputs = {
                "attention_mask": model_mask.to(device),
                "position_ids": positions.to(device),
                "past_key_values": self.cache,
            }
        with torch.no_grad(), ragged_attention.columns(self.model, starts, kv_width + 1, pool=pool) as ragged:
            out = self.model(
                input_ids=tokens.to(device),
                use_cache=True,
                logits_to_keep=1,
                **inputs,
                **model_kwargs,
                **ragged,
            )
        free = torch.tensor([not alive for alive in self.live])
        mask[free, -1] = 0  # a free slot's column stays masked (its fed token was no row's)
        self.ids, self.mask = torch.cat([self.ids, tokens], dim=1), mask
        self.kv_width += 1
        if self.states is not None:
            fed = {
                i: (self.width - self.pads[i], self.last[i])
                for i in self.rows
                if self._keys[i] is not None and self.store is not None
            }
            self.states.after_step(self.cache.layers, fed)
        self._commit_seated()
        return out.logits[:, -1, :].to(dtype=torch.float32)

    def _packed_step(self, pool, **model_kwargs) -> torch.Tensor:
        """``step()`` with seated rows: one forward over the live rows' tokens packed as one
        sequence (each row's pending prompt tokens, then its last token, all at their own
        positions), each attending to its row's columns up to itself."""
        live = self.rows
        kv_width = self.kv_width
        try:
            logits = self._packed_forward(live, pool, **model_kwargs)
        except Exception as e:
            # undo what the forward appended, and drop the rows whose prompts it computed
            # (uncommitted): the caller fails their requests and steps the others again
            for layer in self.cache.layers:
                layer.set_length(kv_width)
            joining = [i for i in live if self.pending[i]]
            self.remove(joining, commit=False)
            raise JoinFailed(joining) from e
        fed = torch.tensor(self.last, dtype=torch.long).unsqueeze(1)
        column = torch.tensor([1 if alive else 0 for alive in self.live], dtype=torch.long).unsqueeze(1)
        self.ids, self.mask = torch.cat([self.ids, fed], dim=1), torch.cat([self.mask, column], dim=1)
        self.kv_width += 1
        full = torch.zeros((self.size, logits.shape[-1]), dtype=torch.float32, device=logits.device)
        full[torch.tensor(live, dtype=torch.long, device=logits.device)] = logits
        self._commit_seated()
        return full

    def _packed_forward(self, slots: list[int], pool=None, **model_kwargs) -> torch.Tensor:
        """One forward over ``slots``' pending columns and each slot's last token at the new
        KV column ``kv_width`` (the other slots' new column is zeroed), packed as one sequence;
        returns the logits ``[len(slots), vocab]`` float32 after each slot's last token.
        Clears their pending columns. ``pool``: the rows' prefixes in the pool (``_pool_tables``)."""
        width, kv_width = self.width, self.kv_width
        device = self.cache.layers[0].keys.device
        tokens, positions, owners, columns, starts, keep = [], [], [], [], [], []
        for i in slots:
            pending = self.pending[i]
            first = width - pending
            pad = self.pads[i]
            start = self.kv_start(i)
            tokens += self.ids[i, first:width].tolist() + [self.last[i]]
            positions += range(first - pad, width + 1 - pad)  # (its pool tokens counted)
            columns += range(kv_width - pending, kv_width + 1)
            owners += [i] * (pending + 1)
            starts += [start] * (pending + 1)
            keep.append(len(tokens) - 1)
        free = [i for i, alive in enumerate(self.live) if not alive]
        plan = (
            torch.tensor(owners, dtype=torch.long, device=device),
            torch.tensor(columns, dtype=torch.long, device=device),
            torch.tensor(free, dtype=torch.long, device=device),
        )
        for layer in self.cache.layers:
            layer.scatter = plan
        ends = [c + 1 for c in columns]
        try:
            with torch.no_grad(), ragged_attention.packed(self.model, owners, starts, ends, pool) as packing:
                out = self.model(
                    input_ids=torch.tensor([tokens], dtype=torch.long, device=device),
                    position_ids=torch.tensor([positions], dtype=torch.long, device=device),
                    past_key_values=self.cache,
                    use_cache=True,
                    logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
                    **model_kwargs,
                    **packing,
                )
        finally:
            for layer in self.cache.layers:
                layer.scatter = None
        for i in slots:
            self.pending[i] = 0
        return out.logits[0].to(dtype=torch.float32)

    def _commit_seated(self) -> None:
        """Commit the prompts of the rows seated before this step (their KV is complete now). A
        commit that fails (the store's, a remote tier's) leaves that prompt uncached, logged:
        the step's tokens stand, and the row commits again when it leaves."""
        seated, self._seated = self._seated, []
        for i in seated:
            if self.live[i]:
                self._commit_or_log(i)

    def _commit_or_log(self, i: int) -> int:
        try:
            return self.commit(i)
        except Exception:
            logger.exception("radixkv: committing a row's KV to the store failed; it may not be cached")
            return 0

    def set_next(self, tokens: Sequence[int]) -> None:
        """The tokens sampled from the last ``step()``'s logits, one per slot (fed next)."""
        if len(tokens) != self.size:
            raise ValueError(f"set_next: {len(tokens)} tokens for {self.size} slots")
        self.last = [int(t) if alive else self.pad_id for t, alive in zip(tokens, self.live)]

    # -- the store --------------------------------------------------------------------------
    def commit(self, i: int) -> int:
        """Store slot i's fed tokens (prompt + reply, cut after the first EOS of its reply) under
        its key; 0 when it has none, is shorter than a block, or its KV is stale."""
        entry = self._keys[i]
        if entry is None or self.store is None or self.cache is None or not self.live[i] or self.pending[i]:
            return 0  # (a seated row before its step: some of its columns have no KV yet)
        keys, row = entry
        if fingerprint(self.model) != keys.weights:
            logger.warning("radixkv: weights changed while a row decoded; its KV is not cached")
            return 0
        pad = self.pads[i]
        ids = self.ids[i, pad:]
        prompt = self.prompt_lengths[i]
        end = len(ids)
        for j, t in enumerate(ids[prompt:].tolist()):
            if t in self.eos:
                end = prompt + j + 1
                break
        key = keys.keys.row(row, ids[:end], 0)
        if key.tokens.num_tokens < self.store.block_size:
            return 0
        layers = self._kv_layers()
        snapshots = None
        if self.states is not None:  # KV is cached up to the deepest snapshot (the prompt's: its prefill's)
            snapshots = self.states.snapshots(i, end)
            if not snapshots:
                return 0
        start, offset = self.kv_start(i), self.prefix[i]  # (its pool tokens: in the tree, pinned)
        return self.store.commit(
            key.tokens,
            [layer.keys[i : i + 1, :, start : start + end - offset] for layer in layers],
            [layer.values[i : i + 1, :, start : start + end - offset] for layer in layers],
            key.namespace,
            epoch=keys.epoch,
            snapshots=snapshots,
            **({"offset": offset} if offset else {}),
        )

    # -- prefixes read from the pool in place ---------------------------------------------------
    def _pool_tables(self) -> ragged_attention.PoolTables | None:
        """The step's block tables (rebuilt after a membership change), None when no row reads
        the pool. Where the kernel stopped applying (the model moved, trains, another dtype, the
        setting off), every row's prefix is first copied into its slot (``unpool``), logged once."""
        if not any(self.prefix):
            return None
        if not ragged_attention.verify(self.model):
            _log_once(
                "the step's ragged kernel no longer applies: running rows copy their prefixes into their slots"
            )
            self.unpool()
            return None
        return self.prefixes.tables(self.store.pool, self.layout)

    def unpool(self) -> None:
        """Copy every row's prefix from the pool into its slot and release its lease: the batch
        then holds every row's KV itself (one re-layout as wide as the longest row), as the copy
        path does. No new row reads the pool in place after this."""
        self._pools = False
        pooled = [i for i in self.rows if self.prefix[i]]
        if not pooled:
            return
        longest = max(self.width - self.pads[i] for i in self.rows)
        self._relayout(list(range(self.size)), self.width, max(self.kv_width, longest), self.size, None)
        layers = self._kv_layers()
        for i in pooled:
            lease, n = self.prefixes.leases[i], self.prefix[i]
            start = self.kv_start(i) - n  # (its pool tokens go right before its own columns)
            self.store.read(
                [lease],
                n,
                [layer.buffers()[0][i : i + 1, :, start : start + n] for layer in layers],
                [layer.buffers()[1][i : i + 1, :, start : start + n] for layer in layers],
                count=False,
            )
            self.prefixes.release(i)

    # -- layout -----------------------------------------------------------------------------
    def _kv_layers(self) -> list:
        """The batch's layers holding KV (``ModelLayout.kv_layers``: all of an attention-only model)."""
        if not self.layout.stateful:
            return self.cache.layers
        return [self.cache.layers[i] for i in self.layout.kv_layers]

    def _new_layers(self) -> list:
        """One empty layer per model layer: KV (a column per step, or scattered when packed),
        states, both, or nothing, as the layout says (attention-only: KV everywhere)."""
        layout = self.layout
        if not layout.stateful:
            return [_SlotLayer() for _ in layout.kinds]
        states: dict[int, int] = {}
        for layer_idx, _, idx in layout.state_entries:
            states[layer_idx] = max(states.get(layer_idx, 0), idx + 1)
        kinds = {"kv": _SlotLayer, "state": StateLayer, "kv+state": _SlotStateLayer}
        out = []
        for i, kind in enumerate(layout.kinds):
            if kind == "none":
                out.append(DummyLayer())
            elif kind == "kv":
                out.append(_SlotLayer())
            else:
                out.append(kinds[kind](number_of_states=states[i]))
        return out

    def clear(self) -> None:
        """Drop every row and the KV (nothing committed; the rows' leases released)."""
        self.prefixes.clear()
        self.kv_width = 0
        self.cache = None
        self.ids = torch.zeros((0, 0), dtype=torch.long)
        self.mask = torch.zeros((0, 0), dtype=torch.long)
        self.live, self.pads, self.last, self.prompt_lengths, self._keys = [], [], [], [], []
        self.pending, self._seated = [], []
        self.states = None

    def _relayout(self, keep: list[int], width: int, kv_width: int, slots: int, like) -> None:
        """New zeroed buffers of ``slots`` x ``kv_width`` (+ headroom) KV columns and ``width``
        columns of ids and mask; new slot j holds old slot ``keep[j]``'s last columns (right-aligned;
        the callers keep every live row's columns); the rest are free. ``like``: per-layer (k, v)
        to shape the buffers after when the batch has none yet."""
        old_width, old_kv = self.width, self.kv_width
        n, kv_n = min(width, old_width), min(kv_width, old_kv)  # the columns kept
        source = [(layer.keys, layer.values) for layer in self._kv_layers()] if self.cache else like
        index = torch.tensor(keep, dtype=torch.long)
        layers = self._new_layers()
        kv_layers = layers if not self.layout.stateful else [layers[i] for i in self.layout.kv_layers]
        for layer, (k0, v0) in zip(kv_layers, source):
            layer.allocate(
                slots, k0.shape[1], k0.shape[3], v0.shape[3], kv_width + HEADROOM, k0.dtype, k0.device
            )
            for buf, old in zip(layer.buffers(), (k0, v0)):
                buf.zero_()
                if keep and self.cache is not None and kv_n:
                    buf[: len(keep), :, kv_width - kv_n : kv_width] = old[
                        index.to(old.device), :, old_kv - kv_n : old_kv
                    ]
            layer.set_length(kv_width)
        if self.layout.stateful:
            if self.states is None:
                self.states = SlotStates(self.layout, self.store.block_size if self.store else 1, self.eos)
            self.states.allocate(layers, slots, self.cache.layers if self.cache else None, keep)
        self.cache = Cache(layers=layers)
        self.kv_width = kv_width
        ids = torch.full((slots, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((slots, width), dtype=torch.long)
        if keep and n:
            ids[: len(keep), width - n :] = self.ids[index, old_width - n :]
            mask[: len(keep), width - n :] = self.mask[index, old_width - n :]
        self.ids, self.mask = ids, mask
        free = slots - len(keep)
        self.live = [self.live[i] for i in keep] + [False] * free
        self.pads = [self.pads[i] + width - old_width for i in keep] + [width] * free
        self.last = [self.last[i] for i in keep] + [self.pad_id] * free
        self.prompt_lengths = [self.prompt_lengths[i] for i in keep] + [0] * free
        self._keys = [self._keys[i] for i in keep] + [None] * free
        self.pending = [self.pending[i] for i in keep] + [0] * free
        self.prefixes.relayout(keep, free)
        where = {old: new for new, old in enumerate(keep)}
        self._seated = [where[i] for i in self._seated if i in where]
