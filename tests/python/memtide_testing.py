"""Helpers shared by the Python tests of the installed memtide package."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, Optional, Sequence


def clean_env(**overrides: str) -> Dict[str, str]:
    """The environment without MEMTIDE_* settings, plus `overrides`.

    The runtime reads its options once per process, so scenarios that need their own settings run
    in a subprocess with an environment of their own.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTIDE_")}
    env.update(overrides)
    return env


def run_python(args: Sequence[str], env: Optional[Dict[str, str]] = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `python <args>` and captures text output."""
    return subprocess.run(
        [sys.executable, *args],
        env=env if env is not None else clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
