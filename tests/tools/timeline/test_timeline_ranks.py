"""The timelines of a job's ranks: traces named by rank (memtide.timeline.record under RANK), one
report of all ranks with lanes per rank on one time axis (memtide timeline A B ..., a folder, a
pattern), a real 2-rank run under torchrun drawn in headless Chromium, and the inputs that are not
one job's ranks refused naming the files."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memtide import _timeline as timeline
from memtide_testing import clean_env

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_gpt_distributed.py"
OFFLINE = ["--headless=new", "--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND",
           "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>", "--window-size=1200,1400"]


def rank_trace(path, rank, start=100.0, world=2, ops=50, **header):
    """A rank's trace on the steady clock: three phases of `ops` ops and memory samples each,
    beginning at `start`; device memory (rank + 1) GiB, host samples, NVMe reads on rank 1."""
    fields = dict(source="test", clock="steady", host="node0", rank=rank, world_size=world, capacity_bytes=8 << 30)
    fields.update(header)
    with timeline.TraceWriter(str(path), **{k: v for k, v in fields.items() if v is not None}) as w:
        t = start
        for phase in ("forward", "backward", "update"):
            w.phase(t, phase)
            for i in range(ops):
                w.op(("compute", "h2d", "d2h")[i % 3], t + i * 1e-3, t + i * 1e-3 + 5e-4, 1 << 20)
                w.memory(t + i * 1e-3, ((rank or 0) + 1) * (1 << 30) + i * 4096, 3 << 30)
                w.event(type="host", t=t + i * 1e-3, reserved=1 << 28, allocated=(1 << 27) + i, rss=1 << 29)
                if rank == 1 and phase == "update":
                    w.event(type="nvme", what="read", subgroup=i, queued=t + i * 1e-3, start=t + i * 1e-3,
                            end=t + i * 1e-3 + 2e-4, bytes=1 << 16)
            t += ops * 1e-3
    return path


def svg(doc: str, svg_id: str) -> str:
    return doc.split(f'<svg id="{svg_id}"')[1].split("</svg>")[0]


def rank_groups(chart: str) -> dict:
    """Per rank: the markup of its group in a chart of lanes per rank."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r'<g class="rank" data-rank="(\d+)">(.*?)</g>', chart,
                                                             re.S)}


def first_band_x(chart: str) -> float:
    return float(re.search(r'class="phase" x="([\d.]+)"', chart).group(1))


def memtide_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "memtide.cli", *args], env=clean_env(), capture_output=True,
                          text=True, timeout=timeout)


# -- traces named by rank ---------------------------------------------------------------------------

RECORD = r"""
import json, sys
import torch
import memtide.timeline
with memtide.timeline.record(sys.argv[1]) as rec:
    torch.zeros(8)
print(json.dumps({"html": rec.result["html"], "trace": rec.result["trace"]}))
"""


@pytest.mark.parametrize("env, suffix", [({"RANK": "1", "WORLD_SIZE": "2"}, ".rank1"), ({}, "")])
def test_record_names_its_files_by_rank_and_the_header_holds_rank_and_world_size(tmp_path, env, suffix):
    pytest.importorskip("torch")
    p = subprocess.run([sys.executable, "-c", RECORD, str(tmp_path / "r.html")], env=clean_env(**env),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.splitlines()[-1])
    assert out == {"html": str(tmp_path / f"r{suffix}.html"), "trace": str(tmp_path / f"r{suffix}.trace.jsonl")}
    assert sorted(f.name for f in tmp_path.iterdir() if f.name.startswith("r.")) == sorted(
        f"r{suffix}{ext}" for ext in (".html", ".trace.jsonl", ".chrome.json", ".pickle", ".png")
        if ext != ".png" or (tmp_path / f"r{suffix}.png").exists())
    header, _ = timeline.read_trace(out["trace"])
    assert header.get("rank") == (1 if env else None) and header.get("world_size") == (2 if env else None)
    # Not under torchrun: the process's own identity, said so in the header.
    assert header["job"]["launcher"] == "none" and "not launched by torchrun" in header["job"]["note"]
    assert header["job"]["process"].rsplit(":", 1)[1].isdigit() and header["job"]["started"] > 0
    assert header["host"] and header["epoch_offset_s"] > 0  # how ranks on several machines are aligned


def test_rank_report_names_a_ranks_files():
    assert timeline.rank_report("run.html", 3) == "run.rank3.html"
    assert timeline.companions(timeline.rank_report("out/run.html", 0))["trace"] == "out/run.rank0.trace.jsonl"
    assert timeline.rank_report("run", 12) == "run.rank12"


# -- one report of several ranks --------------------------------------------------------------------

def test_the_ranks_report_has_lanes_per_rank_on_one_time_axis(tmp_path):
    a = rank_trace(tmp_path / "a.trace.jsonl", 0, start=100.0)
    b = rank_trace(tmp_path / "b.trace.jsonl", 1, start=100.075)  # began half a phase later
    out = timeline.render_ranks([str(b), str(a)], str(tmp_path / "m.html"), chrome=str(tmp_path / "m.json"))
    doc = (tmp_path / "m.html").read_text()
    assert "<script" not in doc and "src=" not in doc and "href=" not in doc  # opens offline
    assert [r["rank"] for r in out["ranks"]] == [0, 1] and out["world_size"] == 2
    assert out["events"] == 2 * (3 + 3 * 50 * 3) + 50
    # Device and host memory: a chart per rank on one scale, the rank's phase bands behind it.
    for chart in ("memory", "host"):
        drawn = {r: svg(doc, f"{chart}-rank{r}") for r in (0, 1)}
        assert all(d.count("<polyline") >= 2 and d.count('class="phase"') == 3 for d in drawn.values()), chart
        assert [re.search(r'<text x="4" y="[\d.]+" font-size="11">([^<]+)</text>', drawn[r]).group(1)
                for r in (0, 1)] == ["0 B"] * 2
        assert re.findall(r'font-size="11">([^<]+)</text>', drawn[0]) == re.findall(r'font-size="11">([^<]+)</text>',
                                                                                    drawn[1])  # one scale
    # PCIe, NVMe and engine lanes: a group per rank, its lanes named by rank, its bands behind them.
    pcie, gantt = rank_groups(svg(doc, "pcie")), rank_groups(svg(doc, "gantt"))
    assert sorted(pcie) == sorted(gantt) == [0, 1]
    for r in (0, 1):
        assert pcie[r].count(f">rank {r} h2d<") == 1 and pcie[r].count(f">rank {r} d2h<") == 1
        assert pcie[r].count('class="busy"') >= 2 and pcie[r].count('class="phase"') == 3
        assert gantt[r].count('class="lane"') == 3  # compute, h2d, d2h
    assert sorted(rank_groups(svg(doc, "nvme"))) == [1]  # only rank 1 read from NVMe
    # One time axis: rank 1's first band begins 75 ms after rank 0's, which begins the window; the
    # window ends with rank 1's last op (149.5 ms after its start). The charts are 1000 px wide.
    x0, x1 = first_band_x(pcie[0]), first_band_x(pcie[1])
    assert x0 == pytest.approx(90.0) and x1 - x0 == pytest.approx(0.075 / (0.075 + 0.1495) * 1000, abs=1.0)
    # A table row per rank and phase.
    rows = re.findall(r'<tr data-rank="(\d)"><td>\d</td><td>(\w+)</td>', doc)
    assert rows == [(r, p) for r in "01" for p in ("forward", "backward", "update")]
    # The Chrome trace: a process per rank, on the same axis (rank 1's first op 75 ms in).
    chrome = json.loads((tmp_path / "m.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in chrome["traceEvents"] if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    first = {pid: min(e["ts"] for e in chrome["traceEvents"] if e["ph"] == "X" and e["pid"] == pid) for pid in (0, 1)}
    assert first[0] == pytest.approx(0.0, abs=1e-3) and first[1] == pytest.approx(75_000, abs=1e-3)


def test_ranks_on_several_machines_are_aligned_on_the_wall_clock(tmp_path):
    # Two machines' steady clocks, far apart, began the job at the same wall-clock second plus 50 ms.
    a = rank_trace(tmp_path / "a.trace.jsonl", 0, start=100.0, host="node0", epoch_offset_s=1.7e9)
    b = rank_trace(tmp_path / "b.trace.jsonl", 1, start=5000.0, host="node1", epoch_offset_s=1.7e9 - 4900.0 + 0.05)
    out = timeline.render_ranks([str(a), str(b)], str(tmp_path / "m.html"))
    assert "wall clock (2 machines" in out["clock_note"]
    pcie = rank_groups(svg((tmp_path / "m.html").read_text(), "pcie"))
    drawn = 0.05 + 0.1495  # the 50 ms between the ranks' starts, and rank 1's 149.5 ms
    assert first_band_x(pcie[1]) - first_band_x(pcie[0]) == pytest.approx(0.05 / drawn * 1000, abs=1.0)
    # Without the offset, two machines' steady clocks cannot be put on one axis.
    c = rank_trace(tmp_path / "c.trace.jsonl", 1, start=5000.0, host="node1")
    with pytest.raises(timeline.TraceError, match=r"cannot be aligned.*c\.trace\.jsonl has no 'epoch_offset_s'"):
        timeline.render_ranks([str(a), str(c)], str(tmp_path / "m.html"))


def test_a_rank_that_recorded_nothing_keeps_its_lanes_and_leaves_the_axis_alone(tmp_path):
    a = rank_trace(tmp_path / "a.trace.jsonl", 0, start=100.0)
    b = tmp_path / "b.trace.jsonl"
    with timeline.TraceWriter(str(b), source="test", clock="steady", host="node0", rank=1, world_size=2):
        pass
    ranks, _ = timeline.read_ranks([str(a), str(b)])
    # Both ranks drawn over rank 0's window (not from the empty trace's 0 to 1).
    assert [(tl.t0, tl.t1) for _, tl in ranks] == [(100.0, pytest.approx(100.1495))] * 2
    timeline.render_ranks([str(a), str(b)], str(tmp_path / "m.html"))
    assert sorted(rank_groups(svg((tmp_path / "m.html").read_text(), "pcie"))) == [0, 1]


def test_memtide_timeline_takes_files_a_folder_or_a_pattern(tmp_path):
    for r in (0, 1, 2):
        rank_trace(tmp_path / f"run.rank{r}.trace.jsonl", r, world=3)
    for args in ([str(tmp_path / f"run.rank{r}.trace.jsonl") for r in (2, 0, 1)], [str(tmp_path)],
                 [str(tmp_path / "run.rank*.trace.jsonl")]):
        p = memtide_cli("timeline", *args, "-o", str(tmp_path / "all.html"), "--json")
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        assert [r["rank"] for r in out["ranks"]] == [0, 1, 2] and out["world_size"] == 3, args
        assert out["chrome"] == str(tmp_path / "all.chrome.json") and out["chrome_events"] > 0
        (tmp_path / "all.html").unlink()  # the folder's traces only, next time
        (tmp_path / "all.chrome.json").unlink()
    p = memtide_cli("timeline", str(tmp_path), "-o", str(tmp_path / "all.html"))
    assert p.returncode == 0 and "3 ranks of 3" in p.stdout and "rank 2   update" in p.stdout, p.stdout


# -- what is not one job's ranks ------------------------------------------------------------------

def test_traces_that_are_not_one_jobs_ranks_are_refused_naming_the_files(tmp_path):
    a = str(rank_trace(tmp_path / "a.trace.jsonl", 0, ops=3))
    b = str(rank_trace(tmp_path / "b.trace.jsonl", 1, ops=3))
    cases = {
        "same rank": (rank_trace(tmp_path / "dup.trace.jsonl", 0, ops=3), r"a\.trace\.jsonl and .*dup\.trace\.jsonl "
                      r"both claim rank 0"),
        "no rank": (rank_trace(tmp_path / "single.trace.jsonl", None, world=None, ops=3),
                    r"single\.trace\.jsonl: no rank in the trace's header"),
        "clocks": (rank_trace(tmp_path / "virtual.trace.jsonl", 1, clock="virtual", ops=3),
                   r"different clocks.*a\.trace\.jsonl: steady; .*virtual\.trace\.jsonl: virtual"),
        "sources": (rank_trace(tmp_path / "sim.trace.jsonl", 1, source="memtide simulate", ops=3),
                    r"different sources.*a\.trace\.jsonl: test; .*sim\.trace\.jsonl: memtide simulate"),
        "world sizes": (rank_trace(tmp_path / "four.trace.jsonl", 1, world=4, ops=3),
                        r"disagree on the job's number of ranks.*a\.trace\.jsonl: 2; .*four\.trace\.jsonl: 4"),
    }
    for name, (other, words) in cases.items():
        with pytest.raises(timeline.TraceError, match=words):
            timeline.render_ranks([a, str(other)], str(tmp_path / "m.html"))
        assert not (tmp_path / "m.html").exists(), name
    with pytest.raises(timeline.TraceError, match=r"a\.trace\.jsonl and .*a\.trace\.jsonl are the same file"):
        timeline.render_ranks([a, b, a], str(tmp_path / "m.html"))
    snapshot = Path(__file__).resolve().parents[2] / "data" / "snapshots" / "torch_2_1_snapshot.pickle"
    with pytest.raises(timeline.TraceError, match=r"torch_2_1_snapshot\.pickle is a torch memory snapshot.*"
                                                  r"a\.trace\.jsonl"):
        timeline.render_ranks([a, str(snapshot)], str(tmp_path / "m.html"))
    with pytest.raises(timeline.TraceError, match=r"b\.trace\.jsonl is the same file as the trace"):
        timeline.render_ranks([a, b], b)
    assert timeline.read_trace(b)[0]["rank"] == 1  # not written over


def test_job_identity_is_torchruns_run_id_endpoint_and_start_or_the_process(monkeypatch):
    env = {"TORCHELASTIC_RUN_ID": "abc", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
           "TORCHELASTIC_RESTART_COUNT": "1", "RANK": "0"}
    assert timeline.job_identity(env) == {"launcher": "torchrun", "run_id": "abc", "endpoint": "node0:29500",
                                          "restart": 1}  # no process group here: no shared start
    job = timeline.job_identity({"MASTER_ADDR": "node0", "MASTER_PORT": "29500"})
    assert job["launcher"] == "none" and job["endpoint"] == "node0:29500" and job["started"] > 0
    assert job["process"].endswith(f":{__import__('os').getpid()}") and "this process's own identity" in job["note"]


def test_traces_of_different_jobs_are_refused_naming_the_files_and_both_jobs(tmp_path):
    one = dict(launcher="torchrun", run_id="run-one", endpoint="node0:29500", started=1.7e9)
    a = str(rank_trace(tmp_path / "a.trace.jsonl", 0, ops=3, job=one))
    cases = {
        "run id": (dict(one, run_id="run-two"), "torchrun run run-two at node0:29500"),
        "endpoint": (dict(one, endpoint="node1:29500"), "torchrun run run-one at node1:29500"),
        "start": (dict(one, started=1.7e9 + 60), "torchrun run run-one at node0:29500 started 2023-11-14 22:14:20"),
        "launcher": (dict(launcher="none", process="node0:42", started=1.7e9), r"process node0:42 \(not torchrun\)"),
    }
    for name, (job, words) in cases.items():
        b = str(rank_trace(tmp_path / f"{name}.trace.jsonl", 1, ops=3, job=job))
        with pytest.raises(timeline.TraceError, match=r"different jobs.*a\.trace\.jsonl: torchrun run run-one at "
                                                      rf"node0:29500 started .*; .*{name}\.trace\.jsonl: {words}"):
            timeline.render_ranks([a, b], str(tmp_path / "m.html"))
        assert not (tmp_path / "m.html").exists(), name
    # One job's ranks: one of them recorded before the process group was up (no shared start).
    b = str(rank_trace(tmp_path / "b.trace.jsonl", 1, ops=3, job=dict(one, started=None, restart=2)))
    assert timeline.render_ranks([a, b], str(tmp_path / "m.html"))["job_note"] is None
    (tmp_path / "bad.jsonl").write_text(json.dumps({"memtide_trace": 1, "job": "run-one"}) + "\n")
    with pytest.raises(timeline.TraceError, match=r"bad\.jsonl: line 1: 'job' must be a job's identity"):
        timeline.read_trace(str(tmp_path / "bad.jsonl"))


@pytest.mark.parametrize("header, words", [
    ({"rank": 2, "world_size": 2}, r"'rank' 2 is not a rank of a job of 2 ranks"),
    ({"rank": 0, "world_size": 0}, r"'world_size' must be a number of ranks from 1"),
    ({"rank": -1}, r"'rank' must be a whole number"),
    ({"rank": "one"}, r"'rank' must be a whole number"),
    ({"epoch_offset_s": -5.0}, r"'epoch_offset_s' must be a number of seconds"),
])
def test_a_headers_rank_world_size_and_clock_offset_are_range_checked(tmp_path, header, words):
    (tmp_path / "t.jsonl").write_text(json.dumps({"memtide_trace": 1, **header}) + "\n")
    with pytest.raises(timeline.TraceError, match=rf"t\.jsonl: line 1: {words}"):
        timeline.read_trace(str(tmp_path / "t.jsonl"))


def test_memtide_timeline_names_bad_rank_inputs_without_a_traceback(tmp_path):
    a = str(rank_trace(tmp_path / "a.trace.jsonl", 0, ops=3))
    b = str(rank_trace(tmp_path / "b.trace.jsonl", 0, ops=3))
    (tmp_path / "empty").mkdir()
    for args, words in (([a, b], "both claim rank 0"), ([str(tmp_path / "empty")], "holds no traces"),
                        ([str(tmp_path / "nothing*.jsonl")], "no trace matches"),
                        ([a, b, "--png", str(tmp_path / "x.png")], "--png: a report of several ranks"),
                        ([a, b, "--memory-viz", str(tmp_path / "x.pickle")], "--memory-viz: a report of several")):
        p = memtide_cli("timeline", *args, "-o", str(tmp_path / "m.html"))
        assert p.returncode in (1, 2) and words in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
    assert not (tmp_path / "m.html").exists()


# -- a real job: 2 ranks under torchrun, its traces in one report, opened in headless Chromium ------

def torchrun_job(out, steps=3):
    """A real 2-rank job (torchrun --standalone, gloo) recording its timeline into `out`."""
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    env = clean_env(OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(EXAMPLE), "--wrap", "fsdp2", "--steps", str(steps), "--layers", "2", "--d-model", "64",
                        "--timeline", str(out / "run.html")], env=env, cwd=out, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    torchrun_job(out)
    q = memtide_cli("timeline", *(str(out / f"run.rank{r}.trace.jsonl") for r in (0, 1)), "-o",
                    str(out / "merged.html"), "--json")
    assert q.returncode == 0, q.stderr[-3000:]
    return out, json.loads(q.stdout)


def test_a_two_rank_torchrun_job_writes_a_trace_per_rank_and_one_report_of_both(two_rank_run):
    out, report = two_rank_run
    for r in (0, 1):
        header, events = timeline.read_trace(str(out / f"run.rank{r}.trace.jsonl"))
        kinds = [e["type"] for e in events]
        assert (header["rank"], header["world_size"], header["wrap"]) == (r, 2, "fsdp2")
        assert kinds.count("phase") >= 3 * 3 and kinds.count("host") >= 2
    assert not (out / "run.html").exists() and not (out / "run.trace.jsonl").exists()  # no rank wrote over another
    assert [r["rank"] for r in report["ranks"]] == [0, 1] and report["world_size"] == 2
    assert "steady clock" in report["clock_note"]  # one machine: its clock as it is
    for r in report["ranks"]:
        assert [row["phase"] for row in r["summary"]] == ["forward", "backward", "update"]
    doc = (out / "merged.html").read_text()
    assert all(f'<svg id="{chart}-rank{r}"' in doc for chart in ("memory", "host") for r in (0, 1))


def test_a_headless_browser_draws_the_ranks_report_with_the_network_off(two_rank_run):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium (scripts/test.sh installs it from Debian)")
    out, _ = two_rank_run
    url = (out / "merged.html").as_uri()
    dom = subprocess.run([chromium, *OFFLINE, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    drawn = dom.stdout
    for r in (0, 1):
        memory, host = svg(drawn, f"memory-rank{r}"), svg(drawn, f"host-rank{r}")
        assert memory.count("<polyline") == 2 and f">rank {r}<" in memory  # allocated, reserved
        assert host.count("<polyline") >= 3 and f">rank {r}<" in host  # arena reserved, allocated, resident...
        assert memory.count('class="phase"') >= 9 and host.count('class="phase"') >= 9  # the rank's own bands
    pcie = rank_groups(svg(drawn, "pcie"))
    assert sorted(pcie) == [0, 1]
    assert all(pcie[r].count('class="lane"') == 2 and pcie[r].count('class="phase"') >= 9 for r in (0, 1))
    assert drawn.count('<tr data-rank="0">') == 3 and drawn.count('<tr data-rank="1">') == 3  # its table rows
    shot = out / "shot.png"
    p = subprocess.run([chromium, *OFFLINE, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and shot.stat().st_size > 10_000, p.stderr[-2000:]


# -- two real jobs: the ranks of one are not drawn with the ranks of another ------------------------

@pytest.fixture(scope="module")
def another_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("another")
    torchrun_job(out, steps=1)
    return out


def test_the_ranks_of_one_torchrun_job_name_it_and_draw_together(two_rank_run):
    out, report = two_rank_run
    jobs = [timeline.read_trace(str(out / f"run.rank{r}.trace.jsonl"))[0]["job"] for r in (0, 1)]
    assert jobs[0]["launcher"] == "torchrun" and jobs[0]["run_id"] and jobs[0]["endpoint"].count(":") == 1
    assert jobs[0]["started"] > 0  # shared through the job's process group: the same on every rank
    assert jobs[0] == jobs[1]
    assert report["job_note"] is None


def test_rank_0_of_one_torchrun_job_and_rank_1_of_another_are_refused_naming_both(two_rank_run, another_job,
                                                                                  tmp_path):
    out, _ = two_rank_run
    a, b = out / "run.rank0.trace.jsonl", another_job / "run.rank1.trace.jsonl"
    ja, jb = (timeline.read_trace(str(t))[0]["job"] for t in (a, b))
    assert ja["run_id"] != jb["run_id"]  # --standalone: a fresh run id per job
    p = memtide_cli("timeline", str(a), str(b), "-o", str(tmp_path / "m.html"))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "different jobs" in p.stderr and str(a) in p.stderr and str(b) in p.stderr, p.stderr
    assert ja["run_id"] in p.stderr and jb["run_id"] in p.stderr, p.stderr
    assert not (tmp_path / "m.html").exists()


def test_traces_without_a_job_identity_draw_with_a_note_not_a_guess(two_rank_run, tmp_path):
    out, _ = two_rank_run
    paths = []
    for r in (0, 1):  # as an older memtide wrote them: the same traces without "job" (rank 1's only)
        lines = (out / f"run.rank{r}.trace.jsonl").read_text().splitlines(keepends=True)
        if r == 1:
            header = json.loads(lines[0])
            del header["job"]
            lines[0] = json.dumps(header) + "\n"
        paths.append(tmp_path / f"old.rank{r}.trace.jsonl")
        paths[-1].write_text("".join(lines))
    p = memtide_cli("timeline", *map(str, paths), "-o", str(tmp_path / "m.html"), "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    note = f"{paths[1]}: no job identity in the header (recorded by an older memtide): not checked"
    assert note in p.stderr and str(paths[0]) not in p.stderr  # rank 0's names its job
    assert json.loads(p.stdout)["job_note"].startswith(note)
    assert note in (tmp_path / "m.html").read_text()
