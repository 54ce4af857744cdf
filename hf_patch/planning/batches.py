"""Which prompts run together, in which order: batches that keep shared prefixes adjacent.

Used by ``generate_many`` (generation) and ``scoring`` (log-likelihoods): both sort their
prompts by token bytes, so prompts sharing a prefix run one after another (the first batch of
a group computes the prefix once, by in-batch sharing; later batches find it in the store), and
both cut batches where the uncached widths of the rows differ too much, since a left-padded
batch's first forward is as wide as its widest uncached row.
"""

from __future__ import annotations

from collections.abc import Sequence

from hf_patch.batch_share import common_prefix_tokens
from radixkv import PackedTokens


def plan_batches(
    packed: Sequence[PackedTokens],
    keys: Sequence[str],
    block_size: int,
    max_batch_tokens: int,
    max_batch_size: int,
    new_tokens: Sequence[int],
    keep: Sequence[int] | None = None,
) -> list[list[int]]:
    """Prompt indices per batch, in run order.

    Sorted by (generation key, token bytes): prompts sharing a prefix are adjacent. A batch ends
    at ``max_batch_size`` rows, at ``max_batch_tokens`` padded tokens (prompt + new tokens), at a
    change of generation arguments, and before a row whose uncached part (its tokens beyond
    what it shares with a neighbour) is more than twice (+ a block) as wide as the batch's widest
    or less than half as wide: the batch's first forward is as wide as its widest uncached part,
    for every row.

    ``keep[i]``: trailing tokens of prompt i that are computed even when cached (their outputs
    are wanted); default 1, the last prompt token generate() computes for its first logits.
    Scoring keeps the continuation: a row's reusable part is ``num_tokens - keep[i]``.
    """
    order = sorted(range(len(packed)), key=lambda i: (keys[i], packed[i]))
    lcp = [0] + [
        common_prefix_tokens(packed[a], packed[b]) // block_size * block_size if keys[a] == keys[b] else 0
        for a, b in zip(order, order[1:])
    ]
    lcp.append(0)
    keep = [1] * len(packed) if keep is None else keep
    cap = [max(0, packed[i].num_tokens - keep[i]) // block_size * block_size for i in order]
    # Uncached tokens of the k-th prompt when its predecessor ran before it or with it, and when
    # its successor also runs with it (in-batch sharing computes what they share once).
    alone = [packed[i].num_tokens - min(lcp[k], cap[k]) for k, i in enumerate(order)]
    paired = [packed[i].num_tokens - min(max(lcp[k], lcp[k + 1]), cap[k]) for k, i in enumerate(order)]
    batches: list[list[int]] = []
    batch: list[int] = []  # positions k in ``order``

    def fits(rows: list[int], k: int) -> bool:
        width = max(packed[order[j]].num_tokens + new_tokens[order[j]] for j in (*rows, k))
        widest = max((paired[j] for j in rows), default=0)
        return (
            len(rows) < max_batch_size
            and (len(rows) + 1) * width <= max_batch_tokens
            and keys[order[k]] == keys[order[rows[-1]]]
            and paired[k] <= 2 * widest + block_size
            and widest <= 2 * paired[k] + block_size
        )

    for k in range(len(order)):
        if batch and not fits(batch, k):
            # A last row that shares more with its successor than with its predecessor would
            # compute that part alone, widening the batch's first forward: it goes on with it.
            moved = []
            while len(batch) > 1 and alone[batch[-1]] > paired[batch[-1]]:
                moved.insert(0, batch.pop())
            batches.append([order[j] for j in batch])
            batch = moved
            if batch and not fits(batch, k):
                batches.append([order[j] for j in batch])
                batch = []
        batch.append(k)
    if batch:
        batches.append([order[j] for j in batch])
    return batches
