"""Image requests as rows of the engine's batches against running alone (the engine before this
change), on a Gemma 3-style model built from a config (random weights, no download).

A burst of `--images` image requests (each its own random image, `--image-tokens` placeholders)
and `--texts` text requests, all submitted at once to the demo engine (prefix cache on, empty
store: every image is new), `--max-tokens` greedy tokens each. Two modes, interleaved over
`--repeats` rounds with fresh images each time:

- batched: this engine (demo.model.vision_batch merges the image rows' inputs);
- alone:   every image request runs alone and unpaused (the runner's `runs_alone` answers yes
           for every request with inputs), as the engine did before: one call per image request.

Prints the median wall time of the burst, requests per second, the median time to first token of
the image requests and of the text requests, and generate() calls per burst.

    python benchmarks/bench_vlm_batching.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB = 1024
IMAGE, START, END = VOCAB - 1, VOCAB - 3, VOCAB - 4


def model(args):
    from transformers import AutoConfig, AutoModelForImageTextToText

    side = int(args.image_tokens**0.5)
    heads = args.hidden // 64
    text = dict(model_type="gemma3_text", vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                head_dim=64, max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                sliding_window=512)  # fmt: skip
    vision = dict(model_type="siglip_vision_model", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=2, image_size=14 * side * 2, patch_size=14)  # fmt: skip
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, image_token_id=IMAGE,
                                  mm_tokens_per_image=side * side, boi_token_id=START, eoi_token_id=END)  # fmt: skip
    torch.manual_seed(0)
    m = AutoModelForImageTextToText.from_config(config).float().eval()
    m.generation_config.suppress_tokens = [2, IMAGE, START, END]  # every row makes max_tokens
    m.generation_config.eos_token_id, m.generation_config.pad_token_id = 2, 0
    return m, 14 * side * 2


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {("<pad>" if i == 0 else "</s>" if i == 2 else f"w{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def burst(engine, args, size: int, seed: int, alone: bool) -> dict:
    from demo.engine.engine import Params

    g = torch.Generator().manual_seed(seed)
    words = lambda n: torch.randint(3, VOCAB - 8, (n,), generator=g).tolist()  # noqa: E731
    requests = []
    for _ in range(args.images):
        ids = words(20) + [START] + [IMAGE] * args.image_tokens + [END] + words(10)
        types = torch.tensor([[int(t == IMAGE) for t in ids]])
        requests.append(
            (ids, {"pixel_values": torch.rand(1, 3, size, size, generator=g), "token_type_ids": types})
        )
    requests += [(words(40 + 8 * i), None) for i in range(args.texts)]
    calls, generate = [0], engine.model.generate

    def counted(*a, **kw):
        calls[0] += 1
        return generate(*a, **kw)

    engine.model.generate = counted
    if alone:  # as before: every request with images runs alone, unpaused
        engine.runner.runs_alone = lambda prompt_ids, inputs: bool(inputs)
    start = time.perf_counter()
    gens = [
        engine.submit(ids, Params(args.max_tokens, temperature=0.0), inputs=inputs)
        for ids, inputs in requests
    ]
    results = [None] * len(gens)
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, gens[i].collect()))
        for i in range(len(gens))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    del engine.model.generate
    engine.runner.__dict__.pop("runs_alone", None)
    return {
        "wall": wall,
        "image_ttft": statistics.median(r.ttft_s for r in results[: args.images]),
        "text_ttft": statistics.median(r.ttft_s for r in results[args.images :]),
        "calls": calls[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--texts", type=int, default=4)
    p.add_argument("--image-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from demo.engine.engine import Engine

    m, size = model(args)
    engine = Engine(m, tokenizer(), 8192, block_size=16, cache_tokens=1 << 16, max_batch_size=16)
    burst(engine, args, size, 0, False)  # warm-up (the store's KV-shape probe)
    out: dict[str, list[dict]] = {"batched": [], "alone": []}
    for r in range(args.repeats):
        for mode in ("batched", "alone") if r % 2 == 0 else ("alone", "batched"):
            out[mode].append(burst(engine, args, size, 1000 + 17 * r + (mode == "alone"), mode == "alone"))
    print(f"load average at the end: {os.getloadavg()}")
    n = args.images + args.texts
    for mode, runs in out.items():
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        print(
            f"{mode:8s} wall {med['wall']:.2f} s  {n / med['wall']:.2f} req/s  image TTFT {med['image_ttft']:.2f} s"
            f"  text TTFT {med['text_ttft']:.2f} s  generate() calls {med['calls']:.0f}"
        )


if __name__ == "__main__":
    main()
