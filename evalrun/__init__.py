"""evalrun: EleutherAI's lm-evaluation-harness with prefix reuse, the same numbers as ``--model hf``.

    python -m evalrun --model radixkv --model_args pretrained=DIR,dtype=float32 \\
        --tasks TASKS --include_path DIR --batch_size 8
    torchrun --nproc_per_node 2 -m evalrun ...       # data parallel, one store per rank
    accelerate launch -m evalrun ...

    lm = evalrun.RadixLM(pretrained="DIR", dtype="float32", batch_size=8)
    results = lm_eval.simple_evaluate(model=lm, tasks=[...])

An application above hf_patch (like batchrun/): modules ``model`` (RadixLM, registered as
lm-eval model type ``radixkv``), ``ranks`` (how requests are split over data-parallel ranks),
``figures`` (the cache's figures printed beside lm-eval's table), ``cli`` (``python -m
evalrun``: lm-eval's own command line). lm-eval is an optional extra: ``pip install -e .[eval]``.
"""

# Before anything loads torch: passive OpenMP waits unless OMP_WAIT_POLICY is set (radixkv.wait_policy)
import hf_patch  # noqa: F401

try:
    import lm_eval  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only where the extra is missing
    raise ImportError(
        "evalrun needs lm-eval: pip install -e '.[eval]' (or pip install lm_eval==0.4.13)"
    ) from exc

from evalrun.figures import CacheFigures
from evalrun.model import RadixLM

__all__ = ["CacheFigures", "RadixLM"]
