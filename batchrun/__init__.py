"""batchrun: OpenAI batch files through stock generate() with prefix reuse, data parallel.

    python -m batchrun --model DIR --input requests.jsonl --output results.jsonl
    torchrun --nproc_per_node 2 -m batchrun --model DIR --input ... --output ...
    accelerate launch -m batchrun --model DIR --input ... --output ...

An application on top of hf_patch (like demo/): it imports hf_patch and radixkv, nothing
imports it. Modules: ``openai_batch`` (the file format), ``runner`` (ranks, part files, merge,
resume); which rank serves which request is ``hf_patch.planning.routing`` (shared with evalrun).
"""

# Before anything loads torch: passive OpenMP waits unless OMP_WAIT_POLICY is set (radixkv.wait_policy)
import hf_patch  # noqa: F401
