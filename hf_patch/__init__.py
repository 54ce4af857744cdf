"""Automatic prefix reuse inside stock ``model.generate()``.

    import hf_patch
    out = model.generate(ids, past_key_values=hf_patch.RadixCache(), max_new_tokens=64)
    scores = hf_patch.score(model, [(context_ids, continuation_ids), ...])   # log-likelihoods

Importing installs the generate() integration once; for any other cache it changes nothing.
Imported before torch, it also asks for passive OpenMP waits unless ``OMP_WAIT_POLICY`` is set
(radixkv.wait_policy, run by radixkv's import: spinning threads are slow on a busy machine).
"""

# First, before anything loads torch (its OpenMP runtime reads the wait policy once, when it
# loads): importing radixkv sets the policy (radixkv.wait_policy); isort keeps it first.
import radixkv  # noqa: F401
from hf_patch.cache import RadixCache
from hf_patch.generate_many import Generated, generate_many
from hf_patch.identity import model_identity
from hf_patch.keys import SharedPrefix
from hf_patch.keys.weights import drop_stale_adapters
from hf_patch.model_spec import UnsupportedModelError
from hf_patch.patch import install
from hf_patch.persistence import restore_cache, save_cache
from hf_patch.scoring import Score, rolling_windows, score, score_rolling
from hf_patch.stores import build_store, default_store
from hf_patch.task_prompts import pin_prompts, unpin_prompts

install()

__all__ = [
    "Generated",
    "RadixCache",
    "Score",
    "SharedPrefix",
    "UnsupportedModelError",
    "build_store",
    "default_store",
    "drop_stale_adapters",
    "generate_many",
    "install",
    "model_identity",
    "restore_cache",
    "rolling_windows",
    "save_cache",
    "score",
    "score_rolling",
    "pin_prompts",
    "unpin_prompts",
]
