"""Data-parallel prefix reuse with `accelerate launch`: one model replica and one store per device.

    accelerate launch --num_processes 2 examples/multi_gpu.py            # 2 GPUs
    torchrun --nproc_per_node 2 examples/multi_gpu.py --check            # 2 CPU processes (what the test runs)
    python examples/multi_gpu.py --model /path/to/local/checkpoint       # one process

(``accelerate launch --cpu`` starts one process whatever ``--num_processes`` says unless
MPI is set up; PartialState reads torchrun's environment just as well.) ``--check``
compares every output with stock generate() and fails on a difference.

Each rank serves the prompts routed to it. Routing is cache-aware, as the SGLang and vLLM
routers do it: prompts are grouped by their shared document, and a whole group goes to one
rank, so the rank holding a document's KV gets every question about it. A model too large
for one GPU is split over a rank's GPUs with `device_map`; the store then puts each layer's
blocks on that layer's device.
"""

from __future__ import annotations

import argparse
import random

import torch
from accelerate import PartialState
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_patch
from hf_patch import RadixCache


def load_model(path: str | None, device: torch.device):
    if path:
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(device).eval()
    torch.manual_seed(0)  # same random weights on every rank
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=1024,
    )
    return LlamaForCausalLM(config).to(device).eval()


def workload(num_docs: int, questions: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(0)
    docs = [[rng.randrange(10, 1000) for _ in range(300)] for _ in range(num_docs)]
    return [
        (d, docs[d] + [rng.randrange(10, 1000) for _ in range(12)])
        for d in range(num_docs)
        for _ in range(questions)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="local checkpoint directory (default: a tiny random Llama)")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="compare every output with stock generate()")
    args = parser.parse_args()
    state = PartialState(cpu=not torch.cuda.is_available())
    model = load_model(args.model, state.device)
    store = hf_patch.build_store(model, budget_tokens=16384)
    requests = workload(args.docs, args.questions)
    mine = [prompt for doc, prompt in requests if doc % state.num_processes == state.process_index]
    cached = []
    with torch.no_grad():
        for prompt in mine:
            input_ids = torch.tensor([prompt], device=state.device)
            cache = RadixCache(store=store)
            out = model.generate(input_ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
            cached.append(cache.cached_tokens[0])
            if args.check:
                stock = model.generate(input_ids, max_new_tokens=4, do_sample=False)
                if not torch.equal(out, stock):
                    raise SystemExit(f"rank {state.process_index}: output differs from stock generate()")
    store.check_invariants()
    stats = store.stats()
    print(
        f"rank {state.process_index}/{state.num_processes} on {state.device}: {len(mine)} requests, "
        f"cached tokens per request {cached}, hit rate {stats['hit_rate']:.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
