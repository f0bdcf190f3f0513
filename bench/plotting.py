"""What the bench scripts share: their plots, their Markdown reports and the machine they name."""

from __future__ import annotations

import platform
import sys


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for the machine line of a report."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown CPU"


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
