"""Every tier in one timeline: the host tier (HostArena, staging, resident memory) and the NVMe tier
(reads, write-backs, waits, queues, the spill file) recorded by memtide.timeline.record in a
user's loop, by memtide run --timeline and by memtide simulate --timeline, and drawn in the report."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from memtide import _timeline as timeline
from memtide_testing import clean_env, direct_io_dir


def charts(doc: str, *ids: str) -> dict:
    return {i: doc.split(f'<svg id="{i}"')[1].split("</svg>")[0] for i in ids}


# A user's loop under memtide.timeline.record with about half the subgroups on NVMe, in its own
# process: the host arena's peak is the process's, which other tests in this one would have set.
USER_LOOP = r"""
import json, sys
import torch
import memtide, memtide.host, memtide.timeline
from memtide.cli.gpt import TinyGPT, arithmetic_batch, lm_loss
from memtide.optim import TieredAdamW

torch.manual_seed(0)
torch.set_num_threads(1)
model = TinyGPT(128, 64, 4, 2, 32).to(torch.bfloat16)
n = sum(p.numel() for p in model.parameters())
SUBGROUP = 10_000
# 16 B/param in host memory, less 12 B for each spilled param, plus two subgroups of staging:
# about half of the 12 subgroups go to NVMe.
opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, policy="cpu", host_budget=10 * n + 2 * 12 * SUBGROUP,
                  nvme_dir=sys.argv[2])
data = [arithmetic_batch(torch.Generator().manual_seed(1 + i), 4, 32, 128) for i in range(4)]
steps = []
with memtide.timeline.record(sys.argv[1], opt) as rec:
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        opt.step()
        last = opt.nvme_info()["last"]
        steps.append({"read": last["read_bytes"], "write": last["write_bytes"], "reads": last["reads"]})
stats = memtide.host.stats()
info = opt.nvme_info()
print(json.dumps({"steps": steps, "spilled": opt.spilled_subgroups, "subgroups": len(opt.plan.subgroups),
                  "arena": stats, "budget": opt.nvme.host_budget, "file_bytes": info["file_bytes"],
                  "staging_bytes": info["staging_bytes"], "on_nvme": list(info["on_nvme"]),
                  "sizes": [int(e - s) for s, e in opt.plan.subgroups], "result": rec.result}))
"""


@pytest.fixture(scope="module")
def user_loop(tmp_path_factory):
    """USER_LOOP run once: its folder and what it printed."""
    pytest.importorskip("torch")
    tmp_path = tmp_path_factory.mktemp("loop")
    spill = direct_io_dir(tmp_path)
    p = subprocess.run([sys.executable, "-c", USER_LOOP, str(tmp_path / "loop.html"), str(spill)],
                       env=clean_env(MEMTIDE_DEVICE="sim"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp_path, json.loads(p.stdout.splitlines()[-1])


def test_a_users_loop_records_nvme_bytes_equal_to_nvme_info_and_the_arena_peak(user_loop):
    tmp_path, out = user_loop
    report = tmp_path / "loop.html"
    # Spilling really happened, to about half the subgroups, and every step moved spilled state.
    assert 0.3 <= out["spilled"] / out["subgroups"] <= 0.7, out
    assert all(s["read"] > 0 and s["write"] > 0 for s in out["steps"])
    header, events = timeline.read_trace(str(tmp_path / "loop.trace.jsonl"))
    events = list(events)
    nvme = [e for e in events if e["type"] == "nvme"]
    # The trace's transfers add up to what the engine counted for the same steps.
    assert sum(e["bytes"] for e in nvme if e["what"] == "read") == sum(s["read"] for s in out["steps"])
    assert sum(e["bytes"] for e in nvme if e["what"] == "write") == sum(s["write"] for s in out["steps"])
    assert sum(e["what"] == "read" for e in nvme) == sum(s["reads"] for s in out["steps"])
    assert sum(e["what"] == "wait" for e in nvme) > 0
    assert all(e["queued"] <= e["start"] <= e["end"] for e in nvme)
    # The host lane's peaks are the arena's.
    host = [e for e in events if e["type"] == "host"]
    assert max(e["allocated"] for e in host) == out["arena"]["peak_allocated_bytes"] > 0
    assert max(e["reserved"] for e in host) == out["arena"]["reserved_bytes"]
    assert max(e["rss"] for e in host) > 0 and max(e["staging"] for e in host) > 0
    assert header["host_capacity_bytes"] == out["budget"] and header["nvme_capacity_bytes"] == out["file_bytes"]
    # The report draws each tier; the summary table's NVMe totals are the trace's.
    doc = report.read_text()
    drawn = charts(doc, "memory", "host", "nvme", "nvme-queues", "nvme-memory")
    assert drawn["host"].count("<polyline") == 4  # reserved, allocated, staging, resident
    assert drawn["host"].count('class="capacity"') == 1  # the host budget
    assert drawn["nvme"].count('class="busy"') >= 3 and drawn["nvme-queues"].count("<polyline") == 2
    assert drawn["nvme-memory"].count("<polyline") == 1
    reads = sum(r.get("nvme_read_bytes", 0) for r in out["result"]["summary"])
    assert reads == sum(s["read"] for s in out["steps"])


def test_the_nvme_charts_values_are_the_bytes_the_tier_moves_and_its_file_holds(user_loop):
    # What the NVMe charts are drawn from, against what the tier really moves (tiering/nvme:
    # each spilled subgroup's fp32 params and both moments, 12 B/param, read and written back
    # each step) and the file it holds them in (each subgroup's extent rounded up to 4 KiB for
    # direct I/O), computed here from the subgroups' sizes, not from what the tier reports.
    tmp_path, out = user_loop
    spilled = [i for i, on in enumerate(out["on_nvme"]) if on]
    assert len(spilled) == out["spilled"] > 0
    file_bytes = sum(-(-12 * out["sizes"][i] // 4096) * 4096 for i in spilled)
    step_bytes = 12 * sum(out["sizes"][i] for i in spilled)
    steps = len(out["steps"])
    assert file_bytes == out["file_bytes"]
    assert out["staging_bytes"] not in (file_bytes, step_bytes)  # so that reporting staging would fail below
    header, events = timeline.read_trace(str(tmp_path / "loop.trace.jsonl"))
    events = list(events)
    # The state on NVMe: the spill file's bytes after every step, against the space reserved.
    spill = [e["bytes"] for e in events if e["type"] == "spill"]
    assert spill == [file_bytes] * steps and header["nvme_capacity_bytes"] == file_bytes
    # Every read and write-back moves one spilled subgroup's 12 B/param; each step all of them.
    for what in ("read", "write"):
        moved = [e for e in events if e["type"] == "nvme" and e["what"] == what]
        assert all(e["subgroup"] in spilled and e["bytes"] == 12 * out["sizes"][e["subgroup"]] for e in moved), what
        assert sum(e["bytes"] for e in moved) == steps * step_bytes, what
    assert [s["read"] for s in out["steps"]] == [step_bytes] * steps
    assert [s["write"] for s in out["steps"]] == [step_bytes] * steps
    # The Timeline the charts draw, and the charts' own numbers.
    tl = timeline.Timeline(header, events)
    assert [b for _, b in tl.spill] == [file_bytes] * steps
    assert tl.nvme_totals["read_bytes"] == tl.nvme_totals["write_bytes"] == steps * step_bytes
    rows = tl.summary()  # the table per phase (this loop marks none: one row, "other")
    assert sum(r["nvme_read_bytes"] for r in rows) == sum(r["nvme_write_bytes"] for r in rows) == steps * step_bytes
    from memtide._timeline.html_report import _fmt_bytes

    doc = (tmp_path / "loop.html").read_text()
    assert (f"reads ({_fmt_bytes(steps * step_bytes)}), {tl.nvme_totals['writes']:,} write-backs "
            f"({_fmt_bytes(steps * step_bytes)})") in doc
    chart = charts(doc, "nvme-memory")["nvme-memory"]
    # The scale's top is 1.1 times the highest state drawn; the dashed line the file's reservation.
    assert f">{_fmt_bytes(1.1 * file_bytes)}</text>" in chart
    assert f"<title>reserved {_fmt_bytes(file_bytes)}</title>" in chart


def test_memtide_run_timeline_records_the_host_and_nvme_tiers(tmp_path):
    pytest.importorskip("torch")
    spill = direct_io_dir(tmp_path)
    p = subprocess.run([sys.executable, "-m", "memtide.cli", "run", "--iterations", "3", "--layers", "2", "--hidden",
                        "64", "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "128", "--subgroup-size", "4096",
                        "--policy", "cpu", "--host-budget", "1MiB", "--nvme-dir", str(spill), "--json",
                        "--timeline", str(tmp_path / "run.html")],
                       env=clean_env(MEMTIDE_DEVICE="sim"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout)
    header, events = timeline.read_trace(str(tmp_path / "run.trace.jsonl"))
    events = list(events)
    reads = [e for e in events if e["type"] == "nvme" and e["what"] == "read"]
    # Every step reads every spilled subgroup once (policy cpu): the last step's bytes, three times.
    assert result["nvme"]["spilled"] > 0
    assert len(reads) == 3 * result["nvme"]["spilled"]
    assert sum(e["bytes"] for e in reads) == 3 * result["nvme"]["last"]["read_bytes"]
    assert header["host_capacity_bytes"] == 1 << 20
    assert sum(e["type"] == "host" for e in events) >= 4 and sum(e["type"] == "phase" for e in events) >= 9
    doc = (tmp_path / "run.html").read_text()
    drawn = charts(doc, "host", "nvme")
    assert drawn["host"].count("<polyline") >= 3 and drawn["nvme"].count('class="busy"') >= 2


def test_memtide_simulate_timeline_with_host_mem_draws_every_tier(tmp_path):
    p = subprocess.run([sys.executable, "-m", "memtide.cli", "simulate", "--model", "20B", "--host-mem", "40GiB",
                        "--json", "--timeline", str(tmp_path / "sim.html")],
                       env=clean_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout)
    nv = result["contenders"]["memtide"]["nvme"]
    assert nv["subgroups"] > 0 and nv["bytes"] > 0
    header, events = timeline.read_trace(str(tmp_path / "sim.trace.jsonl"))
    events = list(events)
    moved = sum(e["bytes"] for e in events if e["type"] == "nvme" and e["what"] in ("read", "write"))
    assert moved == nv["bytes"]  # the simulator's own count of the update's NVMe bytes
    update = [e["t"] for e in events if e["type"] == "phase" and e["phase"] == "update"][0]
    assert all(e["start"] >= update for e in events if e["type"] == "nvme")  # transfers in the update phase
    host = [e for e in events if e["type"] == "host"]
    assert host and all(0 < e["allocated"] <= header["host_capacity_bytes"] for e in host)
    assert header["host_capacity_bytes"] == 40 << 30
    doc = (tmp_path / "sim.html").read_text()
    drawn = charts(doc, "memory", "host", "nvme", "nvme-queues")
    assert drawn["host"].count("<polyline") == 2 and drawn["host"].count('class="capacity"') == 1
    assert all(drawn["nvme"].count(f"<title>{lane} ") >= 1 for lane in ("read", "write", "wait"))
    table = doc.split("<table id='summary'>")[1]
    assert "NVMe read" in table and "host allocated peak" in table


def test_record_refuses_bad_arguments_naming_them(tmp_path):
    import memtide.timeline

    with pytest.raises(TypeError, match="optimizer must be a memtide.optim.TieredAdamW, got list"):
        memtide.timeline.record(str(tmp_path / "r.html"), [])
    with pytest.raises(ValueError, match="interval must be seconds"):
        memtide.timeline.record(str(tmp_path / "r.html"), interval=0)
    with pytest.raises(timeline.TraceError, match="does not exist"):
        memtide.timeline.record(str(tmp_path / "no" / "r.html"))
    with pytest.raises(TypeError, match="report must be a path"):
        memtide.timeline.record(42)


def test_bad_tier_events_are_named(tmp_path):
    for event, words in ((dict(type="host", t=1.0, reserved=-4), "'reserved'"),
                         (dict(type="nvme", what="read", start=2.0, end=1.0), "before 'start'"),
                         (dict(type="nvme", what="read", start=1.0, end=2.0, bytes="many"), "'bytes'"),
                         (dict(type="spill", t=1.0), "'bytes'"),
                         (dict(type="checkpoint", t=1.0, written=5), "'total'")):
        path = tmp_path / "t.jsonl"
        path.write_text(json.dumps({"memtide_trace": 1}) + "\n" + json.dumps(event) + "\n")
        with pytest.raises(timeline.TraceError, match=re.escape(str(path)) + ".*line 2.*" + re.escape(words)):
            list(timeline.read_trace(str(path))[1])


def tiered_trace(path, steps=20):
    """A trace with every tier: phases, device memory, PCIe ops, host samples, NVMe transfers."""
    with timeline.TraceWriter(str(path), source="test", clock="virtual", capacity_bytes=8 << 30,
                              host_capacity_bytes=4 << 30, nvme_capacity_bytes=16 << 30) as w:
        t = 0.0
        w.event(type="spill", t=0.0, bytes=12 << 30)
        for s in range(steps):
            for phase in ("forward", "backward", "update"):
                w.phase(t, phase)
                for i in range(10):
                    w.memory(t + i * 1e-3, (1 << 30) + i * (16 << 20), 2 << 30)
                    w.event(type="host", t=t + i * 1e-3, reserved=3 << 30, allocated=(2 << 30) + i * (8 << 20),
                            staging=256 << 20, rss=(3 << 30) + i * (4 << 20))
                    w.op(("h2d", "d2h")[i % 2], t + i * 1e-3, t + i * 1e-3 + 5e-4, 1 << 20)
                    if phase == "update":
                        a = t + i * 1e-3
                        w.event(type="nvme", what="read", subgroup=i, queued=a, start=a, end=a + 4e-4, bytes=64 << 20)
                        w.event(type="nvme", what="wait", subgroup=i, queued=a, start=a, end=a + 2e-4, bytes=64 << 20)
                        w.event(type="nvme", what="write", subgroup=i, queued=a + 5e-4, start=a + 5e-4, end=a + 9e-4,
                                bytes=64 << 20)
                t += 10e-3
    return path


OFFLINE = ["--headless=new", "--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND",
           "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>", "--window-size=1200,1000"]


def _chromium():
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium (scripts/test.sh installs it from Debian)")
    return chromium


def test_a_headless_browser_draws_every_tier_with_the_network_off(tmp_path):
    chromium = _chromium()
    timeline.render(str(tiered_trace(tmp_path / "t.jsonl")), str(tmp_path / "r.html"))
    dom = subprocess.run([chromium, *OFFLINE, "--dump-dom", (tmp_path / "r.html").as_uri()], capture_output=True,
                         text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    drawn = charts(dom.stdout, "memory", "host", "nvme", "nvme-queues", "nvme-memory", "pcie")
    assert drawn["memory"].count("<polyline") == 2  # device: allocated, reserved
    assert drawn["host"].count("<polyline") == 4 and drawn["host"].count('class="capacity"') == 1
    for lane in ("read", "write", "wait"):
        assert drawn["nvme"].count(f"<title>{lane} ") >= 1, lane
    assert drawn["nvme-queues"].count("<polyline") == 2 and drawn["nvme-memory"].count("<polyline") == 1
    for chart in drawn.values():  # the phase bands run across every chart
        assert chart.count('class="phase"') == 60


def test_a_headless_browser_draws_a_torch_snapshot_with_the_network_off(tmp_path):
    import os

    chromium = _chromium()
    snap = os.path.join(os.path.dirname(__file__), "..", "..", "data", "snapshots", "torch_2_1_snapshot.pickle")
    timeline.render(snap, str(tmp_path / "s.html"))
    dom = subprocess.run([chromium, *OFFLINE, "--dump-dom", (tmp_path / "s.html").as_uri()], capture_output=True,
                         text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    drawn = charts(dom.stdout, "memory", "segments")
    assert drawn["memory"].count("<polyline") == 2
    assert drawn["segments"].count('class="segment"') == 3 and drawn["segments"].count('class="block"') == 3
    assert dom.stdout.count("(train.py:") >= 4 * 3  # the frames of the blocks at the peak


class _RecordedAxes:
    """A stand-in matplotlib Axes that keeps every call made on it: (method, args, kwargs)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append((name, a, k))

    def title(self):
        return next((a[0] for name, a, _ in self.calls if name == "set_title"), None)

    def made(self, method):
        return [(a, k) for name, a, k in self.calls if name == method]


def _recording_matplotlib(monkeypatch):
    """A stand-in matplotlib (matplotlib may not be installed) in sys.modules whose figure keeps its
    axes, for the test to read what write_png drew on each."""
    import types

    figures = []

    class Figure:
        def __init__(self, rows):
            self.axes = [_RecordedAxes() for _ in range(rows)]

        def tight_layout(self):
            pass

        def savefig(self, f, **kwargs):
            f.write(b"PNG")

    def subplots(nrows=1, ncols=1, squeeze=True, **kwargs):
        figures.append(Figure(nrows * ncols))
        axes = figures[-1].axes
        return figures[-1], (axes if squeeze else [axes[r * ncols:(r + 1) * ncols] for r in range(nrows)])

    mpl = types.ModuleType("matplotlib")
    mpl.use = lambda name: None
    pyplot = types.ModuleType("matplotlib.pyplot")
    pyplot.subplots, pyplot.close = subplots, lambda fig: None
    mpl.pyplot = pyplot
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    return figures


def test_the_png_draws_the_host_and_nvme_tiers_from_the_reports_series(tmp_path, monkeypatch):
    # The HTML report draws the host tier and the NVMe tier; the PNG used to draw device memory
    # and the engines only. Its axes are read here, not its pixels: one per chart, with the
    # values of the trace's samples (GiB) and the NVMe lanes' busy time.
    figures = _recording_matplotlib(monkeypatch)
    trace = tiered_trace(tmp_path / "t.jsonl", steps=3)
    out = timeline.render(str(trace), str(tmp_path / "r.html"), png=str(tmp_path / "r.png"))
    assert out["png"] == str(tmp_path / "r.png") and (tmp_path / "r.png").read_bytes() == b"PNG"
    axes = {ax.title(): ax for ax in figures[-1].axes}
    assert list(axes) == ["device memory", "host memory", "NVMe lanes", "NVMe queues", "state on NVMe", "engines"]
    header, events = timeline.read_trace(str(trace))
    events = list(events)
    host = [e for e in events if e["type"] == "host"]
    tl = timeline.Timeline(header, events)  # what the HTML report draws from
    lines = {k["label"]: a for a, k in axes["host memory"].made("plot")}
    assert sorted(lines) == ["allocated", "reserved", "rss", "staging"]
    for name in ("reserved", "allocated", "staging", "rss"):
        xs, ys = lines[name]
        assert list(ys) == [e[name] / 2**30 for e in host], name
        assert xs == pytest.approx([e["t"] - tl.t0 for e in host]), name
    # The host budget (4 GiB) is within 1.5 times the peak drawn (about 3 GiB): a dashed line.
    assert [a for a, _ in axes["host memory"].made("axhline")] == [(4.0,)]
    # The NVMe lanes: read, write, wait, each busy where the trace's transfers were.
    fills = axes["NVMe lanes"].made("fill_between")
    assert len(fills) == 3
    assert list(axes["NVMe lanes"].made("set_yticks")[0][0][1]) == ["read", "write", "wait"]
    span = (tl.t1 - tl.t0) / tl.bins
    for r, (lane, (a, _)) in enumerate(zip(("read", "write", "wait"), fills)):
        busy = [v - r for v in a[2]]
        assert any(b > 0 for b in busy), lane
        assert busy == pytest.approx([min(v / span, 1) * 0.8 for v in tl.nvme_busy[lane]]), lane
    spilled = [e["bytes"] for e in events if e["type"] == "spill"]
    (xs, ys), = [a for a, _ in axes["state on NVMe"].made("plot")]
    assert ys[:len(spilled)] == [b / 2**30 for b in spilled]
    assert {k["label"] for _, k in axes["NVMe queues"].made("step")} == {"read-ahead", "write-back queue"}
    assert list(axes["engines"].made("set_yticks")[0][0][1]) == ["h2d", "d2h"]


# A CPU run (a SimDevice: the engine's copies and GPU updates on its virtual clock) of a few steps
# under memtide.timeline.record, each step's wall time taken around opt.step() on the steady clock.
CPU_STEPS = r"""
import json, sys, time
import torch
import memtide.timeline
from memtide.cli.gpt import TinyGPT, arithmetic_batch, lm_loss
from memtide.optim import TieredAdamW

torch.manual_seed(0)
torch.set_num_threads(1)
model = TinyGPT(128, 64, 4, 2, 32)
opt = TieredAdamW(model.parameters(), subgroup_size=10_000, policy="cpu")
data = [arithmetic_batch(torch.Generator().manual_seed(1 + i), 4, 32, 128) for i in range(3)]
steps = []
with memtide.timeline.record(sys.argv[1], opt):
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        a = time.monotonic()
        opt.step()
        b = time.monotonic()
        steps.append({"start": a, "end": b, "engine_s": opt.stats.last_engine_seconds,
                      "virtual_cpu_s": opt.last_report.cpu.busy_ns / 1e9})
print(json.dumps({"simulated": opt.engine.simulated, "steps": steps}))
"""


def test_a_cpu_run_draws_its_cpu_updates_on_the_wall_clock(tmp_path):
    # The engine's CPU-update lane ("host") of a CPU run used to be empty: the SimDevice's times
    # are on a virtual clock, and only a GPU's activities (CUPTI) filled the engines' lanes.
    pytest.importorskip("torch")
    p = subprocess.run([sys.executable, "-c", CPU_STEPS, str(tmp_path / "cpu.html")],
                       env=clean_env(MEMTIDE_DEVICE="sim"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["simulated"]
    header, events = timeline.read_trace(str(tmp_path / "cpu.trace.jsonl"))
    host = sorted((e for e in json_ops(events) if e["engine"] == "host"), key=lambda e: e["start"])
    assert len(host) == len(out["steps"]) == 3
    assert header["clock"] == "steady" and "wall clock" in header["host_lane"]
    for op, step in zip(host, out["steps"]):
        # Each lies within its step's wall time, and holds the engine's measured (wall) time:
        # neither of which the virtual clock's microseconds would.
        assert step["start"] <= op["start"] < op["end"] <= step["end"], (op, step)
        assert op["end"] - op["start"] >= step["engine_s"] > 0
        assert op["end"] - op["start"] > step["virtual_cpu_s"]
        assert op["bytes"] > 0
    doc = (tmp_path / "cpu.html").read_text()
    gantt = charts(doc, "gantt")["gantt"]
    assert ">host</text>" in gantt and 'class="busy"' in gantt
    assert "<p class='clock'" in doc.split("<h2>Engines</h2>")[1].split("<svg")[0]
    chrome = json.loads((tmp_path / "cpu.chrome.json").read_text())
    assert sum(e.get("ph") == "X" and e.get("name") == "host" for e in chrome["traceEvents"]) == 3


def json_ops(events):
    return [e for e in events if e["type"] == "op"]


def _trained_mlp(torch, optimizer_class):
    """A small MLP, its optimizer (CPU updates in many subgroups) and its step, stepped once."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512))
    opt = optimizer_class(model.parameters(), policy="cpu", subgroup_size=1 << 14)

    def step():
        model(torch.randn(4, 512)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    return model, opt, step


def test_a_checkpoint_save_beside_training_has_a_chart_of_its_own(tmp_path):
    torch = pytest.importorskip("torch")
    import memtide.timeline
    from memtide.optim import TieredAdamW

    model, opt, step = _trained_mlp(torch, TieredAdamW)
    report = tmp_path / "r.html"
    with memtide.timeline.record(str(report), opt, interval=0.001):
        save = opt.save_checkpoint(tmp_path / "ckpt")
        for _ in range(3):
            step()
        save.wait()
    _, events = timeline.read_trace(timeline.companions(str(report))["trace"])
    saves = [e for e in events if e["type"] == "checkpoint"]
    assert saves, "the save was not sampled"
    written = [e["written"] for e in saves]
    assert written == sorted(written) and written[-1] == saves[-1]["total"] == 12 * opt.layout.numel
    assert saves[-1]["target"].endswith("ckpt")
    doc = report.read_text()
    assert 'id="checkpoint"' in doc and "Checkpoint saves beside training" in doc


def test_a_dcp_async_save_through_memtide_has_the_same_chart(tmp_path):
    torch = pytest.importorskip("torch")
    import warnings

    import time

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    import memtide.timeline
    from memtide.optim import StateWriter, TieredAdamW

    class Unhurried(DefaultSavePlanner):  # the save still runs when the first step begins
        def create_local_plan(self):
            time.sleep(0.3)
            return super().create_local_plan()

    model, opt, step = _trained_mlp(torch, TieredAdamW)
    report = tmp_path / "r.html"
    with memtide.timeline.record(str(report), opt, interval=0.001), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming ... a single process"
        future = dcp.async_save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=tmp_path / "dcp",
                                storage_writer=StateWriter(tmp_path / "dcp", opt, buffer_bytes=1), planner=Unhurried())
        for _ in range(3):
            step()
        future.result()
        step()  # sampled once more after the end
    _, events = timeline.read_trace(timeline.companions(str(report))["trace"])
    saves = [e for e in events if e["type"] == "checkpoint"]
    assert saves, "the save was not sampled"
    assert saves[-1]["total"] == 8 * opt.layout.numel  # the moments: fp32 params are not in the state dict
    assert saves[-1]["target"].endswith("dcp")
    assert 'id="checkpoint"' in report.read_text()
