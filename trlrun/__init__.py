"""Prefix reuse for RL rollouts that a trainer generates with its model's own ``generate()``
(TRL's GRPOTrainer and RLOOTrainer without vLLM): one callback, nothing else in the script.

    from trlrun import RadixRollouts
    trainer = GRPOTrainer(model, reward_funcs=reward, args=config, train_dataset=data,
                          callbacks=[RadixRollouts()])       # or trainer.add_callback(RadixRollouts())

An application of hf_patch beside evalrun (lm-eval) and batchrun: it imports hf_patch and
transformers' ``TrainerCallback``, and needs nothing of trl itself (``pip install -e '.[trl]'``
installs the TRL release it is tested with). See docs/rl.md.
"""

# First, before anything loads torch: hf_patch's import sets the OpenMP wait policy.
import hf_patch  # noqa: F401, I001
from trlrun.budget import free_bytes, pool_bytes
from trlrun.rollouts import RadixRollouts

__all__ = ["RadixRollouts", "free_bytes", "pool_bytes"]
