"""A new process that restores hybrid models' cache files and asks the next question.

    python -m tests.hybrid_restart FAMILY PATH [FAMILY PATH ...]

For each pair: the family's tiny model of seed 0 (tests/hybrid_models.py: the same weights the
saving process had), ``hf_patch.build_store(model, restore=PATH)``, then ``DOC + QUESTION`` with a
RadixCache on that store against stock generate() (tokens equal, logits within ``ATOL``; an
AssertionError exits non-zero). Prints one JSON line per pair: the cached tokens and the
blocks and snapshots the store held after the restore. tests/test_hf_persist_states.py runs it.
"""

from __future__ import annotations

import json
import sys

import torch

import hf_patch
from tests.hf_models import assert_outputs_equal, stock
from tests.hybrid_models import SUPPRESS, build_hybrid, tokens

BS = 4
INTERVAL = 16
ATOL = 1e-4
DOC = tokens(70, seed=1)
QUESTIONS = [tokens(9, seed=2), tokens(11, seed=3), tokens(7, seed=4)]  # the third one is asked here
GEN = dict(max_new_tokens=6, suppress_tokens=SUPPRESS, do_sample=False)


def store_for(model, restore=None):
    return hf_patch.build_store(
        model, block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL, restore=restore
    )


def ask(model, store, prompt: list[int]) -> hf_patch.RadixCache:
    """``prompt`` through a RadixCache on ``store``, checked against stock generate()."""
    input_ids = torch.tensor([prompt])
    ref = stock(model, input_ids, **GEN)
    cache = hf_patch.RadixCache(store=store)
    with torch.no_grad():
        out = model.generate(
            input_ids, past_key_values=cache, output_logits=True, return_dict_in_generate=True, **GEN
        )
    assert_outputs_equal(ref, out, atol=ATOL)
    store.check_invariants()
    return cache


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    for name, path in zip(argv[::2], argv[1::2]):
        model = build_hybrid(name)
        store = store_for(model, restore=path)
        restored = store.stats()
        cache = ask(model, store, DOC + QUESTIONS[2])
        print(
            json.dumps(
                {
                    "family": name,
                    "cached_tokens": cache.cached_tokens,
                    "restored_blocks": restored["cached_blocks"] + restored.get("host_cached_blocks", 0),
                    "restored_snapshots": restored["snapshots"] + restored.get("host_snapshots", 0),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
