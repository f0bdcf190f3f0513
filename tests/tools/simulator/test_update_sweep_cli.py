"""`memtide simulate --update-sweep`: the update phase alone, as the committed sim-update results
were made."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from memtide_testing import clean_env


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memtide.cli", "simulate", *args], env=clean_env(), cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_the_sweep_writes_a_row_per_phase_and_a_verdict_per_placement(tmp_path):
    out = tmp_path / "sweep.csv"
    p = cli("--update-sweep", "--model", "7B", "--csv", str(out))
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader(out.open()))
    assert {r["policy"] for r in rows} == {"cpu", "static20", "auto", "interleaved"}
    assert all(r["model"] == "7B" and r["params"] == "7e+09" for r in rows)
    cpu = next(r for r in rows if r["policy"] == "cpu")
    best = min(float(r["update_s"]) for r in rows if r["policy"] == "interleaved")
    assert best < float(cpu["update_s"])
    assert p.stderr.count("7B    grads on") == 2, p.stderr


def test_the_sweep_in_json_and_with_less_dram(tmp_path):
    full = json.loads(cli("--update-sweep", "--model", "7B", "--json").stdout)
    half = json.loads(cli("--update-sweep", "--model", "7B", "--json", "--dram", "20").stdout)
    assert len(full["verdicts"]) == 2
    assert half["verdicts"][0]["cpu_s"] > full["verdicts"][0]["cpu_s"]


@pytest.mark.parametrize("args, words", [
    (["--update-sweep", "--window", "2"], ["--window", "update phase alone"]),
    (["--update-sweep", "--host-mem", "1GiB"], ["--host-mem"]),
    (["--update-sweep", "--model", "3B"], ["3B"]),
    (["--update-sweep", "--slots", "0"], ["--slots"]),
    (["--csv", "x.csv"], ["--csv", "--update-sweep"]),
    (["--update-sweep", "--csv", "/proc/no/such/dir/x.csv"], ["--csv"]),
])
def test_bad_sweep_flags_are_named_without_a_traceback(args, words, tmp_path):
    p = cli(*args, cwd=tmp_path)
    assert p.returncode in (1, 2), (p.returncode, p.stdout[-500:])
    assert "Traceback" not in p.stderr
    for w in words:
        assert w.lower() in p.stderr.lower(), (w, p.stderr)
    assert not (tmp_path / "x.csv").exists()
