"""memtide simulate --timeline and --window with the node flags (issue 37, "Left from earlier issues"):
a node's timeline as a trace per rank, named by rank as a job's ranks name theirs, drawn in one
report with a lane per rank; the layer window chosen and simulated per rank."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from memtide import _timeline as timeline
from memtide_testing import clean_env

# A tiny model on a small GPU: every node run here takes well under a second.
TINY = ("--model", "custom", "--layers", "4", "--hidden", "1024", "--heads", "8", "--seq", "512", "--vocab", "8192",
        "--subgroup-size", "2000000", "--gpu-mem", "1GiB")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memtide.cli", "simulate", *args], env=clean_env(),
                          capture_output=True, text=True, timeout=300)


def rank_groups(doc: str, svg_id: str) -> list:
    """The ranks with a group of lanes in one chart of the report (html_report.write_ranks_html)."""
    chart = doc.split(f'<svg id="{svg_id}"')[1].split("</svg>")[0]
    return sorted(int(r) for r in re.findall(r'<g class="rank" data-rank="(\d+)">', chart))


def test_a_node_timeline_writes_a_trace_per_rank_and_a_report_with_a_lane_per_rank(tmp_path):
    html = tmp_path / "node.html"
    p = cli(*TINY, "--host", "4xh100-2s", "--timeline", str(html), "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    traces = [tmp_path / f"node.rank{rank}.trace.jsonl" for rank in range(4)]
    assert r["timeline"]["traces"] == [str(t) for t in traces]
    mine = next(run for run in r["runs"] if run["placement"] == "memtide" and run["contender"] == "memtide")
    jobs = []
    for rank, path in enumerate(traces):
        header, events = timeline.read_trace(str(path))
        events = list(events)
        assert (header["rank"], header["world_size"], header["clock"], header["source"]) == \
            (rank, 4, "virtual", "memtide simulate")
        assert header["gpu"] == mine["ranks"][rank]["share"]["gpu"]
        jobs.append(header["job"])
        # The rank's simulated iteration: its phases and the engines' operations.
        assert {e["phase"] for e in events if e["type"] == "phase"} >= {"forward", "backward", "update"}
        assert sum(e["type"] == "op" for e in events) > 0
    assert all(job == jobs[0] for job in jobs)  # one job's ranks
    doc = html.read_text()
    for chart in ("pcie", "gantt"):
        assert rank_groups(doc, chart) == [0, 1, 2, 3], chart
    assert (tmp_path / "node.chrome.json").exists()
    # `memtide timeline` draws the same traces as one job's ranks.
    again = subprocess.run([sys.executable, "-m", "memtide.cli", "timeline", *map(str, traces), "-o",
                            str(tmp_path / "again.html")], env=clean_env(), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr
    assert rank_groups((tmp_path / "again.html").read_text(), "gantt") == [0, 1, 2, 3]


def test_a_timeline_of_many_nodes_draws_the_first_nodes_ranks_of_the_whole_job(tmp_path):
    p = cli(*TINY, "--nodes", "2", "--gpus-per-node", "2", "--timeline", str(tmp_path / "job.html"))
    assert p.returncode == 0, p.stderr
    assert "a lane per rank" in p.stderr
    headers = [timeline.read_trace(str(tmp_path / f"job.rank{rank}.trace.jsonl"))[0] for rank in (0, 1)]
    assert [(h["rank"], h["world_size"]) for h in headers] == [(0, 4), (1, 4)]
    assert rank_groups((tmp_path / "job.html").read_text(), "gantt") == [0, 1]


def test_a_node_window_is_simulated_and_reported_per_rank():
    p = cli(*TINY, "--host", "4xh100-2s", "--placement", "node0", "--window", "1", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["window"]["requested"] == 1
    assert set(r["window"]["placements"]) == {"memtide", "node0"}
    for placement, ranks in r["window"]["placements"].items():
        assert [x["rank"] for x in ranks] == [0, 1, 2, 3], placement
        assert all(x["window"] == 1 and x["window_h2d_bytes"] > 0 for x in ranks), placement
    for run in r["runs"]:  # the window is memtide's alone
        assert all(rank["window"] == (1 if run["contender"] == "memtide" else 0) for rank in run["ranks"]), run
    text = cli(*TINY, "--host", "4xh100-2s", "--placement", "node0", "--window", "1")
    assert text.returncode == 0, text.stderr
    assert len(re.findall(r"GPU \d \(socket \d\): .*; window 1 block\(s\), ", text.stdout)) == 8, text.stdout


def test_a_node_window_auto_chooses_per_rank_and_the_baselines_that_do_not_fit_are_a_result():
    big = ("--model", "custom", "--layers", "8", "--hidden", "3072", "--heads", "16", "--seq", "512", "--vocab",
           "8192", "--gpu-mem", "1GiB", "--host", "4xh100-2s")
    p = cli(*big, "--placement", "node0", "--window", "auto", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    for placement, row in r["placements"].items():
        assert not row["zero3_offload"]["fits"] and "out of memory" in row["zero3_offload"]["error"], placement
        assert row["memtide"]["fits"] and row["memtide"]["iteration_s"] > 0, placement
        assert row["speedup_memtide_over_zero3"] is None
    for ranks in r["window"]["placements"].values():
        assert all(x["window"] >= 1 and "whole iterations" in x["window_why"] for x in ranks)
    text = cli(*big, "--window", "auto", "--placement", "node0")
    assert text.returncode == 0, text.stderr
    assert "zero3_offload does not fit without the layer window" in text.stdout
    assert "window node0 ranks " in text.stdout
