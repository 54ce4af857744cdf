"""How torch's OpenMP threads wait between operations: passive unless the user chose.

torch's CPU operations run on an OpenMP thread pool (GNU libgomp in the CPU wheels). Its
default wait policy spins a finished thread for a while before it sleeps, so the next
operation starts without a wake-up. On a machine whose cores other processes also want, a
spinning thread holds the core its partner needs to finish its share, and every one of the
many small operations of a decode step (and of radixkv's KV copies) waits for a scheduler
slice: measured 3-10x slower (docs/performance.md). ``OMP_WAIT_POLICY=PASSIVE`` makes a
finished thread sleep at once.

The runtime reads the variable once, when torch loads it, and offers no call to change it
afterwards. So this module imports nothing heavy, and ``radixkv/__init__.py`` runs
:func:`quiet_threads` before its first torch import: radixkv is the lowest layer that loads
torch, so every process that imports it first gets the policy: ``python -m radixkv.sidecar``,
``import hf_patch`` (whose ``__init__`` imports radixkv before anything else) and through it
the entry points ``python -m demo``, ``batchrun`` and ``evalrun``, which import hf_patch before
anything else loads torch. In a process that loaded torch before radixkv, the policy is
whatever the environment said then. (``hf_patch.wait_policy`` re-exports this module: the
import rule keeps radixkv from importing hf_patch, so the function lives down here.)
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

VARIABLE = "OMP_WAIT_POLICY"


def quiet_threads(environ: MutableMapping[str, str] = os.environ, modules=sys.modules) -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` when it is unset and torch is not loaded yet.

    Side effect: one environment variable of this process (inherited by its children). A
    value the user set (``ACTIVE``, ``PASSIVE``, anything) is left as it is. With torch
    already in ``modules`` nothing changes (too late for this process's runtime, and its
    children are not ours to decide for): a line at INFO says how to choose instead.
    Returns True when it set the variable.
    """
    if VARIABLE in environ:
        return False
    if "torch" in modules:
        logger.info(
            "torch was loaded before radixkv (or hf_patch) without %s: its threads spin between operations, "
            "slow on a busy machine; set %s=PASSIVE in the environment (docs/performance.md)",
            VARIABLE,
            VARIABLE,
        )
        return False
    environ[VARIABLE] = "PASSIVE"
    return True
