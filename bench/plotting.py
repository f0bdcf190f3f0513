"""What the bench scripts share for their plots."""

from __future__ import annotations

import sys


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display), or None, said on stderr, when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return None
    return plt
