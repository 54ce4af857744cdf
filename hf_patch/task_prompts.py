"""Task prompts pinned for good (rtp-llm's MultiTaskPrompt): compute their KV once, keep it cached.

    hf_patch.pin_prompts(model, {"summarise": ids_a, "translate": ids_b}, store=store)
    # every later generate() whose prompt starts with ids_a reuses its KV, whatever the traffic
    hf_patch.unpin_prompts(model, ["translate"], store=store)

Pinned blocks are never evicted nor demoted (``radixkv.store.task_pins``). A weight change that
flushes the store (see ``hf_patch.keys.weights``) drops the pins with the stale KV: pin again. On a
model with PEFT adapters the prompts are computed and keyed under the adapter active at the
call (``with peft_model.disable_adapter():`` for the base model's).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

import torch

from hf_patch.keys.adapters import row_adapters
from hf_patch.keys.weights import flush_if_weights_changed, model_scope
from hf_patch.layer import allocate_layers, make_layers, pool_tensors, row_view
from hf_patch.model_spec import check_store_fits, model_layout
from hf_patch.recurrent import catch_up
from hf_patch.stores import default_store
from radixkv import KeyedNamespace, KVStore

__all__ = ["pin_prompts", "unpin_prompts"]


def _token_list(task_id: Hashable, ids: object) -> list[int]:
    """``ids`` (a sequence of ints or a 1-D / [1, n] tensor) as a list, or a ValueError naming the task."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.dtype.is_floating_point:
            raise ValueError(
                f"task {task_id!r}: token ids must be a 1-D integer tensor, got {tuple(ids.shape)}"
            )
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"task {task_id!r}: token ids must be a sequence of ints, got {type(ids).__name__}")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"task {task_id!r}: token ids must be ints")
    return list(ids)


def _blocks_needed(prompts: Iterable[list[int]], block_size: int) -> int:
    """Distinct whole blocks of all prompts together (prompts sharing a prefix share its blocks)."""
    keys: set[int] = set()
    for ids in prompts:
        key = 0
        for start in range(0, len(ids) - block_size + 1, block_size):
            key = hash((key, tuple(ids[start : start + block_size])))
            keys.add(key)
    return len(keys)


@torch.no_grad()
def pin_prompts(
    model,
    prompts: Mapping[Hashable, Sequence[int] | torch.Tensor],
    *,
    store: KVStore | None = None,
    namespace: Hashable = None,
) -> dict[Hashable, int]:
    """Compute each prompt's KV with ``model`` and pin its whole blocks in ``store`` by task id.

    ``namespace``: as ``RadixCache(namespace=...)``; requests only reuse a task prompt pinned
    under their own namespace. A task id pinned already is replaced. Returns the pinned
    tokens per task (whole blocks; the tail of a prompt shorter than a block is computed per
    request as usual).

    Raises ValueError before computing anything when a prompt is malformed or shorter than
    one block, or when the prompts' blocks together with the other pinned task prompts
    exceed the device pool (naming blocks needed and blocks that exist). Raises RuntimeError,
    pinning no stale KV, when the store is flushed (weights changed) while a prompt's KV is
    computed: that flush dropped every task pin, so pin the prompts again. One forward pass
    per prompt; sliding-window layers are computed as full layers (the mask comes from
    positions), as the RadixCache does.
    """
    layout = model_layout(model)  # refuses models whose KV cannot be reused
    if store is None:
        store = default_store(model)
    else:
        check_store_fits(store, model)
    token_lists = {task_id: _token_list(task_id, ids) for task_id, ids in prompts.items()}
    bs = store.block_size
    for task_id, ids in token_lists.items():
        if len(ids) < bs:
            raise ValueError(
                f"task {task_id!r}: {len(ids)} tokens is less than one block of {bs}: nothing to pin"
            )
    need = _blocks_needed(token_lists.values(), bs)
    pinned_elsewhere = store.tasks.device_blocks(exclude=token_lists.keys())
    if need + pinned_elsewhere > store.pool.num_blocks:
        raise ValueError(
            f"task prompts need {need} blocks of {bs} tokens (plus {pinned_elsewhere} pinned by other "
            f"task prompts), but the device pool has {store.pool.num_blocks} blocks"
        )
    flush_if_weights_changed(store, model)
    # The KV is computed with the adapter active now (if any): keyed as that adapter's rows are.
    (adapter,) = row_adapters(model, 1)
    scope = (model_scope(model), KeyedNamespace(namespace, adapter) if adapter else namespace)
    pinned: dict[Hashable, int] = {}
    for task_id, ids in token_lists.items():
        epoch = store.epoch  # a flush during the forward pass (weights changed) makes its KV stale
        # RadixCache's layers (full KV even for sliding-window layers, the states of recurrent
        # ones), one forward; a recurrent model's snapshot at the prompt's whole-block end
        layers = make_layers(layout)
        allocate_layers(layers, layout, 1, len(ids))
        views = [row_view(layer, 0, 0) for layer in layers]
        cuts = [len(ids) // bs * bs] if layout.stateful else []
        snapshots, _ = catch_up(
            model, layout, views, torch.tensor(ids, device=model.device), 0, len(ids), cuts
        )
        keys, values = pool_tensors(views, layout)
        pinned[task_id] = store.tasks.pin(
            task_id, ids, keys, values, scope, epoch=epoch, snapshots=snapshots if layout.stateful else None
        )
    return pinned


def unpin_prompts(model, task_ids: Iterable[Hashable], *, store: KVStore | None = None) -> None:
    """Unpin task prompts (their KV stays cached, now evictable). Raises KeyError naming an unknown id,
    after unpinning the known ones listed before it."""
    if store is None:
        store = default_store(model)
    for task_id in task_ids:
        store.tasks.unpin(task_id)
