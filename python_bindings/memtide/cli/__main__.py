"""``python -m memtide.cli``: the ``memtide`` command without a PATH entry."""

import sys

from memtide.cli import main

sys.exit(main())
