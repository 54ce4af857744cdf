"""``python -m evalrun`` / ``torchrun -m evalrun`` / ``accelerate launch -m evalrun``."""

import sys

from evalrun.cli import main

sys.exit(main())
