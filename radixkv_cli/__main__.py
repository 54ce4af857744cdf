"""``python -m radixkv_cli``: the ``radixkv`` command where its script is not installed."""

import sys

from radixkv_cli import main

sys.exit(main())
