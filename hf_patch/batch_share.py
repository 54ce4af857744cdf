"""In-batch prefix sharing: compute a prefix that several rows of one batch share once, before
generate()'s prefill, so a cold batch of 16 questions over one document costs one document
prefill plus 16 question prefills instead of 16 document prefills.

Runs inside the ``_prefill`` wrapper, after the rows are known and before they are matched:

1. ``shared_prefixes``: sort the rows (each packed, capped at its reusable length) by their
   bytes; rows sharing a prefix are then adjacent, and each adjacent pair's common prefix
   floored to whole blocks is a prefix shared by >= 2 rows. O(B log B) comparisons plus
   O(total tokens) for the common-prefix lengths.
2. ``compute_shared``: for each such prefix, shortest first (a longer one then finds the
   shorter one in the store): match it, read what the store holds into a scratch cache of one
   row, run one forward over the rest (positions continue from the cached length, exactly as
   the un-padded prefix sits in every padded row), and commit it.
3. The rows are then matched and preloaded as usual (``Request.preload``). Each row is
   acquired right after its deepest shared prefix is committed, so the pin protects those
   blocks from the commits of later groups; a store too small to hold a prefix caches what
   fits and the rows compute the rest: still the same output, just less sharing.

KV of a prefix computed alone equals, to float rounding (~1e-7 in fp32), the KV the batched
prefill would compute for it: real token j has position j in any left-padded row.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import Cache

from hf_patch.keys import RowKey
from hf_patch.layer import AppendLayer, allocate_layers, make_layers, pool_buffers, pool_tensors, row_view
from hf_patch.model_spec import ModelLayout, accepts
from hf_patch.recurrent import DEFAULT_INTERVAL, catch_up, cut_points, fill_row
from radixkv import KVStore, LayerSpec, Lease, PackedTokens, pack_tokens  # noqa: F401 (doctest)

logger = logging.getLogger(__name__)

# Model inputs generate() may hold in model_kwargs that change nothing about a row's KV given its
# ids. Anything else (token_type_ids, images, ...) would have to reach the prefix forward too:
# share nothing then, rather than compute KV that differs from the batched prefill.
PLAIN_MODEL_KWARGS = frozenset(
    {
        "attention_mask",
        "past_key_values",
        "cache_params",  # the Mamba families' name for it
        "use_cache",
        "position_ids",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "logits_to_keep",
    }
)


def can_share(model_kwargs: dict) -> bool:
    """Whether the prefill's inputs are ids + mask only (else a prefix forward could differ)."""
    return all(key in PLAIN_MODEL_KWARGS or value is None for key, value in model_kwargs.items())


def common_prefix_tokens(a: PackedTokens, b: PackedTokens) -> int:
    """Number of leading tokens ``a`` and ``b`` share. O(min length), vectorised."""
    n = min(a.num_tokens, b.num_tokens)
    if n == 0:
        return 0
    if a[: 8 * n] == b[: 8 * n]:  # memcmp: the common case of one row contained in the other
        return n
    x = np.frombuffer(a, dtype=np.int64, count=n)
    y = np.frombuffer(b, dtype=np.int64, count=n)
    return int(np.argmax(x != y))


def shared_prefixes(rows: Sequence[PackedTokens], block_size: int) -> tuple[list[PackedTokens], list[int]]:
    """Whole-block prefixes shared by at least two rows, and each row's deepest one.

    Returns ``(prefixes, deepest)``: ``prefixes`` distinct, shortest first; ``deepest[i]`` the
    index in ``prefixes`` of the longest one row ``i`` starts with, or -1. Identical rows
    (``num_return_sequences``, beams) share their whole reusable length.

    >>> p = lambda *t: pack_tokens(list(t))
    >>> prefixes, deepest = shared_prefixes([p(1, 2, 3, 4, 9), p(7, 7), p(1, 2, 3, 4, 5)], 2)
    >>> [x.num_tokens for x in prefixes], deepest
    ([4], [0, -1, 0])
    """
    order = sorted(range(len(rows)), key=rows.__getitem__)
    by_bytes: dict[bytes, int] = {}  # prefix bytes -> its length in tokens
    pair_prefix: list[bytes | None] = []
    for a, b in zip(order, order[1:]):
        n = common_prefix_tokens(rows[a], rows[b]) // block_size * block_size
        key = rows[a][: 8 * n] if n else None
        if key is not None:
            by_bytes[key] = n
        pair_prefix.append(key)
    prefixes = sorted(by_bytes, key=len)
    index = {key: i for i, key in enumerate(prefixes)}
    deepest = [-1] * len(rows)
    for k, key in enumerate(pair_prefix):
        if key is None:
            continue
        for row in (order[k], order[k + 1]):
            if deepest[row] < 0 or len(prefixes[deepest[row]]) < len(key):
                deepest[row] = index[key]
    return [PackedTokens(p) for p in prefixes], deepest


def _forward_prefix(
    model,
    store: KVStore,
    layout: ModelLayout,
    prefix: PackedTokens,
    lease: Lease,
    chunk_size: int | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict | None]:
    """KV of ``prefix`` in a one-row scratch cache: the leased part read from the store, the
    rest computed by forwards of at most ``chunk_size`` tokens (generate's ``prefill_chunk_size``).
    Returns its K and V in the pool's layer order (``hf_patch.layer.pool_tensors``), and for a
    model with recurrent layers the snapshots it took (at each snapshot interval, the junction
    and the prefix's end: ``hf_patch.recurrent``), else None."""
    length, cached = prefix.num_tokens, lease.num_tokens
    layers = make_layers(layout)
    allocate_layers(layers, layout, 1, length)
    if layout.stateful:
        views = [row_view(layer, 0, 0) for layer in layers]
        start = fill_row(store, layout, views, lease, length, count=False)
        interval = 0 if not layout.continues_in_chunks else store.snapshot_interval or DEFAULT_INTERVAL
        grain = math.lcm(store.block_size, layout.snapshot_grain)
        interval = -(-interval // grain) * grain
        cuts = cut_points(start, length, interval, lease.kv_tokens, grain)
        ids = torch.from_numpy(np.frombuffer(prefix, dtype=np.int64).copy()).to(model.device)
        snapshots, _ = catch_up(model, layout, views, ids, start, length, cuts)
        return (*pool_tensors(views, layout), snapshots)
    if cached:
        ks, vs = pool_buffers(layers, layout)
        store.read(
            [lease], cached, [k[:, :, :cached] for k in ks], [v[:, :, :cached] for v in vs], count=False
        )
        for layer in layers:
            if isinstance(layer, AppendLayer):
                layer.set_length(cached)
        if layout.index_positions is not None:  # the indexer's position history (Qwen4-Exp)
            layer = layers[layout.index_positions]
            layer.indexer_position_ids = torch.arange(cached, device=layer.keys.device).expand(3, 1, cached)
    scratch = Cache(layers=layers)
    device = model.device
    ids = torch.from_numpy(np.frombuffer(prefix, dtype=np.int64).copy()).to(device).unsqueeze(0)
    extra = {"logits_to_keep": 1} if accepts(model, "logits_to_keep") else {}  # skip the vocab matmul
    step = chunk_size or length
    for start in range(cached, length, step):
        stop = min(start + step, length)
        model(
            input_ids=ids[:, start:stop],
            attention_mask=torch.ones(1, stop, dtype=torch.long, device=device),
            position_ids=torch.arange(start, stop, device=device).unsqueeze(0),
            past_key_values=scratch,
            use_cache=True,
            **extra,
        )
    return (*pool_tensors(layers, layout), None)


@dataclass
class SharedPrefixes:
    """What ``compute_shared`` did: pinned matches of the sharing rows, and who computed what.

    ``computed[row]``: prompt tokens computed by the prefix forwards and attributed to ``row``,
    the first row (by index) that starts with each computed prefix. The others got them from
    the store; so ``cached_tokens`` reports them as cached for the others only, as a server
    reports a prefix that a concurrent request computed first.
    """

    leases: dict[int, Lease] = field(default_factory=dict)
    computed: dict[int, int] = field(default_factory=dict)


def _any_row_cached(store: KVStore, rows: Sequence[tuple[PackedTokens, Hashable]]) -> bool:
    """Whether the store holds a whole block of any row (a lookup, not a request: no counts).

    ``claim``, as the rows' own lookups: with a sidecar that has processes wait for a prefix
    another one is computing (``RADIXKV_SIDECAR_WAIT_S``), a row whose prefix is in flight is
    waited for here and counts as cached. Asked without it, a batch of rows that are all cold
    *now* was left to generate() whole, and a row the wait then served from the sidecar lost
    its hit to the batch's common column count (its cold neighbour's 0): ranks computed such
    documents twice."""
    for tokens, namespace in rows:
        if tokens.num_tokens >= store.block_size:
            with store.acquire(tokens, namespace, count=False, claim=True) as lease:
                if lease.num_tokens:
                    return True
    return False


@torch.no_grad()
def compute_shared(
    model,
    store: KVStore,
    layout: ModelLayout,
    epoch: int,
    rows: Sequence[RowKey],
    keep: Sequence[int] | None = None,
    chunk_size: int | None = None,
) -> SharedPrefixes:
    """Compute and commit the prefixes that >= 2 of ``rows`` share; return pinned row matches.

    When some prefix is shared, or some row has whole blocks cached already (a task prompt, the
    previous turn), every row that shares none gets its own whole-block prefix computed alone
    too: the batch preloads one common column count, min(pad + match), so one uncached row
    would otherwise cost every row its cached prefix and widen the batch's first forward. A
    cold batch whose rows share nothing is left to generate() as it is (one batched prefill).

    ``rows``: each row's key (hf_patch.keys.RowKey): rows share only under one namespace, by
    key tokens, and only their ``computable`` part (tokens whose KV depends on their ids alone:
    a forward over ids cannot compute an image's or an embedding table's KV). A row's last
    ``keep[i]`` tokens (default 1: a fully cached prompt would be fed again; a scored
    continuation's length for scoring) are never reused, so they take no part in the sharing.
    The leases cover every row that shares a prefix, acquired (matched and pinned) right after
    its deepest prefix was committed; the caller owns and releases them. Side
    effects: forwards of ``model`` on one-row scratch caches, commits to ``store``; the store's
    counters see the rows' lookups and commits only (a prefix lookup is not a prompt).
    """
    out = SharedPrefixes()
    groups: dict[Hashable, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(row.namespace, []).append(i)
    keep = [1] * len(rows) if keep is None else keep
    reusable = [
        row.tokens.head(max(0, min(row.tokens.num_tokens - k, row.computable))) for row, k in zip(rows, keep)
    ]
    found = {
        ns: shared_prefixes([reusable[i] for i in members], store.block_size)
        for ns, members in groups.items()
    }
    if not any(prefixes for prefixes, _ in found.values()) and not _any_row_cached(
        store, [(reusable[i], rows[i].namespace) for i in range(len(rows))]
    ):
        return out
    try:
        for ns, members in groups.items():
            prefixes, deepest = found[ns]
            _share_group(
                model, store, layout, epoch, rows, keep, reusable, members, ns, prefixes, deepest, chunk_size, out
            )  # fmt: skip
    except BaseException:
        for lease in out.leases.values():
            lease.release()
        raise
    return out


def _share_group(
    model, store, layout, epoch, rows, keep, reusable, members, namespace, prefixes, deepest_of, chunk_size, out
) -> None:  # fmt: skip
    """compute_shared for the rows ``members`` of one namespace, whose shared ``prefixes`` and
    deepest prefix per member (``shared_prefixes``) are known."""
    bs = store.block_size
    deepest = dict(zip(members, deepest_of))
    for row in members:
        if deepest[row] < 0 and reusable[row].num_tokens >= bs:
            # A row that shares nothing would, if uncached, make every row's first forward as
            # wide as its whole prompt (the batch preloads one common column count). Its own
            # prefix computed alone costs what the batch would spend on that row anyway.
            deepest[row] = len(prefixes)
            prefixes.append(reusable[row].head(reusable[row].num_tokens // bs * bs))
    waiting: dict[int, list[int]] = {}
    for row in members:
        if deepest[row] >= 0:
            waiting.setdefault(deepest[row], []).append(row)
    for p, prefix in enumerate(prefixes):
        # Not counted as a request: the rows' own lookups below are the prompts' queries and hits.
        # claim: this call computes what is missing (another process may be computing it now)
        with store.acquire(prefix, namespace, count=False, claim=True) as lease:
            if lease.num_tokens < prefix.num_tokens:
                owner = next(i for i in members if reusable[i].startswith(prefix))
                ids = rows[owner].ids.head(prefix.num_tokens)
                ks, vs, snapshots = _forward_prefix(model, store, layout, ids, lease, chunk_size)
                store.commit(prefix, ks, vs, namespace, epoch=epoch, snapshots=snapshots)
                out.computed[owner] = out.computed.get(owner, 0) + prefix.num_tokens - lease.num_tokens
        for row in waiting.get(p, ()):
            key = rows[row].tokens
            out.leases[row] = store.acquire(key, namespace, max_tokens=max(0, key.num_tokens - keep[row]))
