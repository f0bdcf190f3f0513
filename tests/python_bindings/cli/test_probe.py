"""`memtide probe` and `memtide.topology()` on the hand-written hwloc XML fixtures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import memtide
from memtide_testing import clean_env

DATA = Path(__file__).resolve().parents[2] / "data" / "topology"
FOUR = str(DATA / "two_socket_4gpu.xml")
EIGHT = str(DATA / "two_socket_8gpu_switches.xml")
UNKNOWN = str(DATA / "unknown_locality.xml")

needs_hwloc = pytest.mark.skipif(not memtide.topology()["hwloc"],
                                 reason="memtide was built without hwloc: XML topologies cannot be loaded")


@needs_hwloc
def test_topology_returns_plain_data():
    topo = memtide.topology(FOUR)
    assert topo["source"] == f"hwloc-xml:{FOUR}"
    assert [n["os_index"] for n in topo["numa_nodes"]] == [0, 1]
    assert [n["memory_bytes"] for n in topo["numa_nodes"]] == [64 << 30, 32 << 30]
    assert [g["pci_bus_id"] for g in topo["gpus"]] == ["0000:18:00.0", "0000:4b:00.0", "0000:99:00.0", "0000:b1:00.0"]
    assert [g["numa_nodes"] for g in topo["gpus"]] == [[0], [0], [1], [1]]
    assert topo["gpus"][2]["cpus"] == [4, 5, 6, 7]
    assert topo["links"][0] == ["X", "NODE", "SYS", "SYS"]
    json.dumps(topo)  # nothing but dicts, lists, strings, numbers and booleans


@needs_hwloc
def test_probe_json(cli):
    out = cli("probe", "--json", "--topology", EIGHT)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["source"] == f"hwloc-xml:{EIGHT}"
    assert len(doc["numa_nodes"]) == 2
    gpus = doc["gpus"]
    assert [g["index"] for g in gpus] == list(range(8))
    for g in gpus:
        assert {"index", "pci_bus_id", "numa_nodes", "cpus", "locality_known", "name"} <= set(g)
        assert g["locality_known"]
        assert g["name"] == "NVIDIA H100 80GB HBM3"
    assert gpus[0]["cpus"] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert gpus[7]["numa_nodes"] == [1]
    # Every class appears on this machine, and the matrix is symmetric.
    links = doc["links"]
    assert {c for row in links for c in row} == {"X", "PIX", "PXB", "PHB", "NODE", "SYS"}
    assert all(links[a][b] == links[b][a] for a in range(8) for b in range(8))
    assert links[4][5:] == ["PIX", "PHB", "NODE"]


@needs_hwloc
def test_probe_text_matrix(cli):
    out = cli("probe", "--topology", EIGHT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(line for line in lines if "CPU Affinity" in line)
    assert header.split()[:8] == [f"GPU{i}" for i in range(8)]
    assert header.rstrip().endswith("NUMA Affinity")
    row0 = next(line for line in lines if line.startswith("GPU0 "))
    assert row0.split() == ["GPU0", "X", "PIX", "PXB", "PXB", "SYS", "SYS", "SYS", "SYS", "0-3,8-11", "0"]
    row7 = next(line for line in lines if line.startswith("GPU7 "))
    assert row7.split()[-2:] == ["4-7,12-15", "1"]
    assert f"source    hwloc-xml:{EIGHT}" in out.stdout
    assert "node 1     64.00 GiB  cpus 4-7,12-15" in out.stdout


@needs_hwloc
def test_probe_unknown_locality(cli):
    out = cli("probe", "--topology", UNKNOWN)
    assert out.returncode == 0, out.stderr
    row1 = next(line for line in out.stdout.splitlines() if line.startswith("GPU1 "))
    assert row1.split()[-1] == "N/A"
    assert "GPU1: NUMA locality unknown; memtide uses node 1" in out.stdout
    doc = json.loads(cli("probe", "--json", "--topology", UNKNOWN).stdout)
    assert doc["gpus"][1]["locality_known"] is False
    assert doc["gpus"][1]["preferred_node"] == 1
    assert doc["gpus"][1]["local_cpus"] == [4, 5, 6, 7]


@needs_hwloc
def test_probe_reads_memtide_topology(cli):
    out = cli("probe", "--json", MEMTIDE_TOPOLOGY=FOUR)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["source"] == f"hwloc-xml:{FOUR}"


def test_probe_missing_file_exits_2(cli, tmp_path):
    missing = str(tmp_path / "nowhere.xml")
    out = cli("probe", "--topology", missing)
    assert out.returncode == 2
    assert missing in out.stderr
    out = cli("probe", "--json", MEMTIDE_TOPOLOGY=missing)
    assert out.returncode == 2
    assert "MEMTIDE_TOPOLOGY" in out.stderr and missing in out.stderr


def test_probe_invalid_file_exits_2(cli, tmp_path):
    junk = tmp_path / "junk.xml"
    junk.write_text("this is not XML\n")
    out = cli("probe", "--topology", str(junk))
    assert out.returncode == 2
    assert str(junk) in out.stderr


def test_probe_this_machine(cli):
    out = cli("probe", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["source"] in ("hwloc", "sysfs", "none")
    assert doc["numa_nodes"]
    cpus = [c for node in doc["numa_nodes"] for c in node["cpus"]]
    assert set(os.sched_getaffinity(0)) <= set(cpus)
    text = cli("probe")
    assert text.returncode == 0, text.stderr
    assert "NUMA nodes:" in text.stdout
    if not doc["gpus"]:
        assert "no NVIDIA GPU found" in text.stdout


def test_a_topology_file_that_crashes_hwloc_is_an_error_not_a_crash(cli):
    if not memtide.topology()["hwloc"]:
        pytest.skip("memtide was built without hwloc")
    path = str(DATA / "corrupt_crashes_hwloc.xml")
    r = cli("probe", "--topology", path)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert path in r.stderr and "Traceback" not in r.stderr


def test_probe_nvme_measures_the_directory_and_names_a_bad_one(tmp_path):
    import memtide

    if not getattr(memtide._memtide, "HAVE_NVME", False):
        pytest.skip("built without the NVMe tier")
    stale = tmp_path / "memtide-spill-999999999-zzzzzz"
    stale.mkdir()
    (stale / "state.spill").write_bytes(b"x" * 5000)
    p = subprocess.run([sys.executable, "-m", "memtide.cli", "probe", "--nvme", str(tmp_path), "--nvme-bytes", "64MiB",
                        "--json"], env=clean_env(), capture_output=True, text=True, timeout=300)
    if p.returncode != 0 and "does not support direct I/O" in p.stderr:
        pytest.skip(f"{tmp_path} does not support O_DIRECT (tmpfs?)")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["bytes"] == 64 << 20 and r["write_bytes_per_s"] > 0 and r["read_bytes_per_s"] > 0
    assert [s["bytes"] for s in r["stale_spills"]] == [5000]
    assert sorted(os.listdir(tmp_path)) == [stale.name]  # its own spill directory is gone
    q = subprocess.run([sys.executable, "-m", "memtide.cli", "probe", "--nvme", str(tmp_path / "nope")],
                       env=clean_env(), capture_output=True, text=True, timeout=60)
    assert q.returncode == 2 and "nope" in q.stderr and "Traceback" not in q.stderr
