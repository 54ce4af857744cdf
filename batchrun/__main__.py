"""``python -m batchrun`` / ``torchrun -m batchrun`` / ``accelerate launch -m batchrun``."""

import sys

from batchrun.runner import run

sys.exit(run())
