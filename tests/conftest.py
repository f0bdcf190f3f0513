"""Fixtures for the Python tests of the installed memtide package."""

from __future__ import annotations

import subprocess

import pytest

from memtide_testing import clean_env, run_python


@pytest.fixture
def cli():
    """Runs the memtide CLI (as `python -m memtide.cli`, which needs no PATH entry)."""

    def invoke(*args: str, **env: str) -> subprocess.CompletedProcess:
        return run_python(["-m", "memtide.cli", *args], env=clean_env(**env))

    return invoke
