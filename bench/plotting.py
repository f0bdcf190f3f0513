"""What the bench scripts share: their plots and their Markdown reports."""

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


def write_report(path: str, lines: list) -> None:
    """Writes the report's Markdown lines to `path` and shows them."""
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
