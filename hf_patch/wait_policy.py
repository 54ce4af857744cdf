"""The OpenMP wait policy (re-exported): it lives in ``radixkv.wait_policy``, run by radixkv's
own import, since radixkv is the lowest layer that loads torch and must not import hf_patch."""

from radixkv.wait_policy import VARIABLE, quiet_threads

__all__ = ["VARIABLE", "quiet_threads"]
