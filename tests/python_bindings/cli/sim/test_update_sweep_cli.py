"""`memtide simulate --update-sweep`: the update phase alone, as the committed sim-update results
were made."""

from __future__ import annotations

import csv
import json
import os
import stat
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


# The CLI in a process that first plants what an attacker sharing the folder would: a link at the
# name the CSV's temporary file used to have (the CSV's name, ".tmp-", the process id).
PLANT_THEN_SWEEP = r"""
import os, sys
csv, victim = sys.argv[1], sys.argv[2]
os.symlink(victim, f"{csv}.tmp-{os.getpid()}")
from memtide.cli import main
sys.exit(main(["simulate", "--update-sweep", "--model", "7B", "--csv", csv]))
"""


def test_links_planted_beside_the_csv_or_at_it_never_reach_their_target(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "sweep.csv"
    p = subprocess.run([sys.executable, "-c", PLANT_THEN_SWEEP, str(out), str(victim)], env=clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert victim.read_text() == "precious\n"  # not written through the planted link
    assert out.is_file() and not out.is_symlink() and out.read_text().startswith("model,params,")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o644 & ~mask  # a result to share, as open() made it
    link = tmp_path / "link.csv"
    link.symlink_to(victim)
    p = cli("--update-sweep", "--model", "7B", "--csv", str(link))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"{link} is a symbolic link, not a regular file" in p.stderr and "--csv" in p.stderr, p.stderr
    assert link.is_symlink() and victim.read_text() == "precious\n"
    assert sorted(os.listdir(tmp_path)) == sorted(["victim", "sweep.csv", "link.csv", next(
        n for n in os.listdir(tmp_path) if n.startswith("sweep.csv.tmp-"))])  # nothing else left behind
