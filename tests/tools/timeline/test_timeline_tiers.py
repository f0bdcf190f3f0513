"""Every tier in one timeline: the host tier (HostArena, staging, resident memory) and the NVMe tier
(reads, write-backs, waits, queues, the spill file) recorded by memtide.timeline.record in a
user's loop, by memtide run --timeline and by memtide simulate --timeline, and drawn in the report."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import memtide_timeline as timeline
from memtide_testing import clean_env, direct_io_dir


def charts(doc: str, *ids: str) -> dict:
    return {i: doc.split(f'<svg id="{i}"')[1].split("</svg>")[0] for i in ids}


# A user's loop under memtide.timeline.record with about half the subgroups on NVMe, in its own
# process: the host arena's peak is the process's, which other tests in this one would have set.
USER_LOOP = r"""
import json, sys
import torch
import memtide, memtide.host, memtide.timeline
from memtide.gpt import TinyGPT, arithmetic_batch, lm_loss
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
    from memtide_timeline.html_report import _fmt_bytes

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
                         (dict(type="spill", t=1.0), "'bytes'")):
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
