"""Run an OpenAI batch file over data-parallel ranks, each with its own model replica and store.

Every rank reads the whole input, drops the ``custom_id``s a previous run finished, and routes
the rest identically (``hf_patch.planning.routing.assign_ranks``). A rank appends each finished chunk to its own
part file (``<output>.parts/rank<r>.jsonl``), so a rank that fails loses only its unfinished
chunk. When every rank is done, rank 0 merges the previous output, the part files and the
error lines into ``<output>`` in input order (written to a temporary file, then renamed) and
removes the parts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import torch

import hf_patch
from batchrun.openai_batch import BatchRequest, encode, error_line, parse_line, result_line
from hf_patch.attention_backend import avoid_cudnn_sdpa
from hf_patch.planning.routing import assign_ranks, round_robin
from radixkv import pack_tokens

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m batchrun",
        description="Serve an OpenAI batch file (chat / completions) with prefix reuse, over the "
        "processes of accelerate launch or torchrun, or in one process.",
    )
    parser.add_argument(
        "--model",
        required=True,
        help="local checkpoint folder (model + tokenizer); `python -m demo save-builtin DIR` writes one",
    )
    parser.add_argument("--input", required=True, help="requests, OpenAI batch JSONL")
    parser.add_argument("--output", required=True, help="results, one line per request, in input order")
    parser.add_argument("--routing", choices=("affine", "round-robin"), default="affine")
    parser.add_argument("--dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is available")
    parser.add_argument("--cache-tokens", type=int, default=None, help="store budget per rank, in tokens")
    parser.add_argument("--max-batch-tokens", type=int, default=16384)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument(
        "--default-max-tokens", type=int, default=256, help="when a request sets no max_tokens"
    )
    parser.add_argument(
        "--chunk", type=int, default=256, help="requests generated between writes of a part file"
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.model):
        parser.exit(2, f"{parser.prog}: error: {model_dir_problem(args.model)}\n")  # no usage text first
    return args


def model_dir_problem(model: str) -> str:
    """One line saying why ``model`` is no checkpoint folder, and how to get one."""
    if model in ("builtin", "builtin-tiny"):
        return (
            f"--model {model}: batchrun loads a checkpoint folder; write the built-in model to one "
            f"with `python -m demo save-builtin DIR{'' if model == 'builtin' else ' --name ' + model}` "
            "and pass --model DIR"
        )
    return (
        f"--model {model}: no such folder (batchrun loads a local checkpoint folder, never the Hub; "
        "`python -m demo save-builtin DIR` writes a small one)"
    )


def read_requests(path: str | Path) -> list[BatchRequest]:
    """Every non-blank line, parsed; a duplicate custom_id is an error on its later lines."""
    requests, first_line = [], {}
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    for index, line in enumerate(lines):
        request = parse_line(index, line)
        if request.error is None:
            if request.custom_id in first_line:
                request.error = f"duplicate custom_id {request.custom_id!r} (first on request line {first_line[request.custom_id] + 1})"
            else:
                first_line[request.custom_id] = index
        requests.append(request)
    return requests


def parts_dir(output: Path) -> Path:
    return output.with_name(output.name + ".parts")


def finished(output: Path, served_only: bool = True) -> dict[str, dict]:
    """Result lines of earlier runs by custom_id, from the merged output and the parts: the
    served ones (status 200), plus with ``served_only=False`` failed ones that nothing served."""
    files = [output] if output.exists() else []
    if parts_dir(output).is_dir():
        files += sorted(parts_dir(output).glob("rank*.jsonl"))
    done, failed = {}, {}
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    result = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a killed rank: served again
                    continue
                if not isinstance(result, dict) or not isinstance(result.get("custom_id"), str):
                    continue
                if result.get("error") is None:
                    done[result["custom_id"]] = result
                elif not served_only and result["custom_id"] not in done:
                    failed[result["custom_id"]] = result
    return {**failed, **done}


def _load(args, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=dtype)
    return model.to(device).eval(), tokenizer


def context_length(model) -> int | None:
    n = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def serve(model, tokenizer, requests: list[BatchRequest], store, part: Path, args, model_name: str) -> dict:
    """Generate ``requests`` (already in prefix order) chunk by chunk, appending result lines to ``part``."""
    stats = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
    with open(part, "a", encoding="utf-8") as out:
        for start in range(0, len(requests), args.chunk):
            chunk = requests[start : start + args.chunk]
            try:
                results = hf_patch.generate_many(
                    model,
                    [r.prompt_ids for r in chunk],
                    tokenizer=tokenizer,
                    store=store,
                    per_prompt_kwargs=[r.generate_kwargs for r in chunk],
                    max_batch_tokens=args.max_batch_tokens,
                    max_batch_size=args.max_batch_size,
                    progress=not args.no_progress,
                )
            except Exception as exc:  # e.g. out of memory: these requests fail, the others go on
                logger.exception("generation failed for %d requests", len(chunk))
                for request in chunk:
                    failed = dataclasses.replace(
                        request, error=f"generation failed: {type(exc).__name__}: {exc}"
                    )
                    out.write(json.dumps(error_line(failed, status_code=500)) + "\n")
                out.flush()
                continue
            for request, result in zip(chunk, results):
                line = result_line(request, model_name, result.text, result.finish_reason,
                                   len(result.token_ids), result.cached_tokens)  # fmt: skip
                out.write(json.dumps(line) + "\n")
                stats["requests"] += 1
                stats["prompt_tokens"] += len(request.prompt_ids)
                stats["cached_tokens"] += result.cached_tokens
            out.flush()
            os.fsync(out.fileno())
    return stats


def merge(requests: list[BatchRequest], output: Path) -> int:
    """Write ``output`` in input order from earlier results, part files and error lines; returns
    the number of requests still without a result (a rank failed: rerun to finish them)."""
    done = finished(output, served_only=False)
    missing = 0
    tmp = output.with_name(output.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for request in requests:
            if request.error is not None:
                line = error_line(request)
            elif request.custom_id in done:  # served, or failed in generation (a rerun retries it)
                line = done[request.custom_id]
            else:
                missing += 1
                continue
            f.write(json.dumps(line) + "\n")
    os.replace(tmp, output)
    if not missing and parts_dir(output).is_dir():
        for path in parts_dir(output).glob("rank*.jsonl"):
            path.unlink()
        parts_dir(output).rmdir()
    return missing


def run(argv: list[str] | None = None) -> int:
    from accelerate import PartialState

    args = parse_args(argv)
    state = PartialState(cpu=args.cpu or not torch.cuda.is_available())
    rank, world = state.process_index, state.num_processes
    output = Path(args.output)
    started = time.perf_counter()
    avoid_cudnn_sdpa(state.device)
    model, tokenizer = _load(args, state.device)
    requests = read_requests(args.input)
    done = finished(output)  # read by every rank before any rank writes
    state.wait_for_everyone()
    for request in requests:
        if request.error is None and request.custom_id not in done:
            encode(request, tokenizer, args.default_max_tokens, context_length(model))
    todo = [r for r in requests if r.error is None and r.custom_id not in done]
    packed = [pack_tokens(r.prompt_ids) for r in todo]
    store = hf_patch.build_store(model, budget_tokens=args.cache_tokens)
    if args.routing == "affine":
        ranks = assign_ranks(packed, world, store.block_size, min_shared=store.block_size)
    else:
        ranks = round_robin(len(todo), world)
    mine = sorted((i for i, r in enumerate(ranks) if r == rank), key=packed.__getitem__)
    parts_dir(output).mkdir(parents=True, exist_ok=True)
    part = parts_dir(output) / f"rank{rank}.jsonl"
    stats = serve(model, tokenizer, [todo[i] for i in mine], store, part, args, Path(args.model).name)
    stats.update(rank=rank, seconds=round(time.perf_counter() - started, 2))
    state.wait_for_everyone()
    gathered = [stats]
    if world > 1:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, stats)
    if rank == 0:
        missing = merge(requests, output)
        _report(gathered, requests, done, args.routing, world, time.perf_counter() - started, missing)
    state.wait_for_everyone()
    return 0


def _report(gathered, requests, done, routing, world, seconds, missing) -> None:
    errors = sum(r.error is not None for r in requests)
    for s in gathered:
        print(
            f"rank {s['rank']}: {s['requests']} requests, prompt tokens {s['prompt_tokens']}, "
            f"computed {s['prompt_tokens'] - s['cached_tokens']}, "
            f"hit rate {s['cached_tokens'] / max(s['prompt_tokens'], 1):.3f}, {s['seconds']:.1f} s",
            flush=True,
        )
    prompt = sum(s["prompt_tokens"] for s in gathered)
    cached = sum(s["cached_tokens"] for s in gathered)
    print(
        f"job: {len(requests)} lines on {world} rank(s), routing {routing}: served {sum(s['requests'] for s in gathered)}, "
        f"skipped (done before) {len(done)}, errors {errors}, missing {missing}; prompt tokens {prompt}, "
        f"computed {prompt - cached}, hit rate {cached / max(prompt, 1):.3f}, wall {seconds:.1f} s",
        flush=True,
    )
