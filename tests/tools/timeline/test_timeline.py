"""The trace format and the timeline report: round trip, the HTML's charts (drawn, offline), the
Chrome trace, bad traces and targets, and memtide simulate --timeline."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

from memtide import _timeline as timeline
from memtide_testing import clean_env


def make_trace(path, ops=200, phases=("forward", "backward", "update")):
    with timeline.TraceWriter(str(path), source="test", clock="virtual", capacity_bytes=8 << 30) as w:
        t = 0.0
        for phase in phases:
            w.phase(t, phase)
            for i in range(ops):
                engine = ("compute", "h2d", "d2h", "link")[i % 4]
                w.op(engine, t + i * 1e-3, t + i * 1e-3 + 5e-4, 1 << 20)
                w.memory(t + i * 1e-3, (1 << 30) + i * 4096, 2 << 30)
            t += ops * 1e-3
    return path


def test_the_trace_round_trips_event_for_event(tmp_path):
    path = make_trace(tmp_path / "t.jsonl", ops=10)
    header, events = timeline.read_trace(str(path))
    events = list(events)
    assert header["memtide_trace"] == timeline.VERSION and header["source"] == "test"
    assert sum(e["type"] == "op" for e in events) == 30 and sum(e["type"] == "phase" for e in events) == 3
    first_op = next(e for e in events if e["type"] == "op")
    assert first_op == {"type": "op", "engine": "compute", "start": 0.0, "end": 5e-4, "bytes": 1 << 20}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_the_report_draws_every_chart_and_opens_offline(tmp_path):
    path = make_trace(tmp_path / "t.jsonl")
    out = timeline.render(str(path), str(tmp_path / "r.html"), chrome=str(tmp_path / "r.json"))
    doc = (tmp_path / "r.html").read_text()
    assert "<script" not in doc and "src=" not in doc and "href=" not in doc  # nothing to fetch
    charts = {m: doc.split(f'<svg id="{m}"')[1].split("</svg>")[0] for m in ("memory", "pcie", "gantt")}
    assert len(re.findall(r"<polyline", charts["memory"])) == 2
    assert charts["memory"].count(",") > 300  # the allocated series has its 600 samples drawn
    assert len(re.findall(r'class="phase"', charts["pcie"])) == 3
    assert len(re.findall(r'class="busy"', charts["pcie"])) >= 2  # both directions drawn
    assert len(re.findall(r'class="busy"', charts["gantt"])) >= 4
    assert doc.count("<tr>") == 1 + 3  # header and one row per phase
    assert out["events"] == 3 * (1 + 2 * 200)
    chrome = json.loads((tmp_path / "r.json").read_text())
    spans = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 600 and all(e["dur"] == pytest.approx(500.0) for e in spans)
    assert sum(e["ph"] == "C" for e in chrome["traceEvents"]) == 600


def test_bad_traces_are_named(tmp_path):
    (tmp_path / "junk").write_text("hello\n")
    with pytest.raises(timeline.TraceError, match="junk.*not a memtide trace"):
        timeline.read_trace(str(tmp_path / "junk"))
    (tmp_path / "new").write_text(json.dumps({"memtide_trace": 99}) + "\n")
    with pytest.raises(timeline.TraceError, match="format 99"):
        timeline.read_trace(str(tmp_path / "new"))
    cut = make_trace(tmp_path / "cut.jsonl", ops=5)
    cut.write_text(cut.read_text()[:-20])
    header, events = timeline.read_trace(str(cut))
    with pytest.raises(timeline.TraceError, match=r"line \d+ is not JSON"):
        list(events)
    with pytest.raises(timeline.TraceError, match="cannot read"):
        timeline.read_trace(str(tmp_path / "missing"))
    (tmp_path / "binary").write_bytes(bytes(range(256)) * 8)
    with pytest.raises(timeline.TraceError, match="binary is not a memtide trace"):
        timeline.read_trace(str(tmp_path / "binary"))
    for name, line, words in (("nostart", {"type": "op", "engine": "h2d"}, "'start' as a number"),
                              ("badt", {"type": "memory", "t": "abc", "allocated": 1, "reserved": 2}, "'t'")):
        (tmp_path / name).write_text(json.dumps({"memtide_trace": 1}) + "\n" + json.dumps(line) + "\n")
        header, events = timeline.read_trace(str(tmp_path / name))
        with pytest.raises(timeline.TraceError, match=rf"{name}: line 2: .*{re.escape(words)}"):
            list(events)


def test_targets_that_are_not_regular_files_are_refused(tmp_path):
    path = make_trace(tmp_path / "t.jsonl", ops=5)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    os.symlink(victim, tmp_path / "link.html")
    with pytest.raises(timeline.TraceError, match="symbolic link"):
        timeline.render(str(path), str(tmp_path / "link.html"))
    assert victim.read_text() == "keep me"
    with pytest.raises(timeline.TraceError, match="folder"):
        timeline.render(str(path), str(tmp_path))
    with pytest.raises(timeline.TraceError, match="does not exist"):
        timeline.check_report_target(str(tmp_path / "no" / "r.html"))
    os.symlink(victim, tmp_path / "r.trace.jsonl")
    with pytest.raises(timeline.TraceError, match="symbolic link"):
        timeline.check_report_target(str(tmp_path / "r.html"))  # a companion file is a link
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".memtide-")]  # no temp file left


def test_memtide_simulate_writes_the_trace_and_its_report(tmp_path):
    p = subprocess.run([sys.executable, "-m", "memtide.cli", "simulate", "--model", "custom", "--layers", "4",
                        "--hidden", "1024", "--heads", "8", "--timeline", str(tmp_path / "sim.html")],
                       env=clean_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    for name in ("sim.html", "sim.trace.jsonl", "sim.chrome.json"):
        assert (tmp_path / name).stat().st_size > 1000, name
    header, events = timeline.read_trace(str(tmp_path / "sim.trace.jsonl"))
    kinds = {e["type"] for e in events}
    assert header["source"] == "memtide simulate" and {"phase", "memory", "op"} <= kinds
    q = subprocess.run([sys.executable, "-m", "memtide.cli", "timeline", str(tmp_path / "nope.jsonl")],
                       env=clean_env(), capture_output=True, text=True, timeout=300)
    assert q.returncode in (1, 2) and "nope.jsonl" in q.stderr and "Traceback" not in q.stderr


def test_memtide_run_timeline_records_the_phases_and_a_memory_viz_pickle(tmp_path):
    torch = pytest.importorskip("torch")
    p = subprocess.run([sys.executable, "-m", "memtide.cli", "run", "--iterations", "3", "--layers", "2", "--hidden",
                        "64", "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "128", "--subgroup-size",
                        "4096", "--timeline", str(tmp_path / "run.html")],
                       env=clean_env(MEMTIDE_DEVICE="sim"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    header, events = timeline.read_trace(str(tmp_path / "run.trace.jsonl"))
    events = list(events)
    phases = [e["phase"] for e in events if e["type"] == "phase"]
    assert header["source"] == "memtide run"
    assert phases.count("forward") >= 3 and phases.count("backward") >= 3 and phases.count("update") >= 3
    assert sum(e["type"] == "alloc" for e in events) > 0 and sum(e["type"] == "memory" for e in events) > 0
    # torch's own memory_viz reads the pickle written beside the report (its text views: its
    # HTML views fetch their viewer from a CDN, which is why memtide draws its own report).
    from torch.cuda import _memory_viz

    with open(tmp_path / "run.pickle", "rb") as f:
        snap = __import__("pickle").load(f)
    assert "segments:" in _memory_viz.segsum(snap)
    assert "alloc" in _memory_viz.trace(snap)
    del torch


def test_cupti_tracing_reports_a_status_instead_of_failing():
    import memtide

    status = memtide._memtide.device_trace_start()
    assert status["status"] in ("active", "partial", "no_gpu", "no_cupti", "busy")
    if status["status"] != "active":
        assert status["detail"]  # says why
    if memtide.cuda_status()["device_count"] == 0:
        assert status["status"] == "no_gpu"
    assert isinstance(memtide._memtide.device_trace_stop(), list)


def _png_colors(path) -> int:
    """Distinct pixel values of an 8-bit RGB(A) PNG (decoded with zlib: no imaging library)."""
    import struct
    import zlib

    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6)
            channels = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = width * channels
    prev = bytearray(stride)
    colors = set()
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        prev = line
        if y % 8 == 0:
            colors.update(bytes(line[i:i + 3]) for i in range(0, stride, channels * 8))
    return len(colors)


def test_a_headless_browser_draws_the_report_with_the_network_off(tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium (scripts/test.sh installs it from Debian)")
    path = make_trace(tmp_path / "t.jsonl")
    timeline.render(str(path), str(tmp_path / "r.html"))
    offline = ["--headless=new", "--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND",
               "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>", "--window-size=1200,1000"]
    url = (tmp_path / "r.html").as_uri()
    dom = subprocess.run([chromium, *offline, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    drawn = {m: dom.stdout.split(f'<svg id="{m}"')[1].split("</svg>")[0] for m in ("memory", "pcie", "gantt")}
    assert drawn["memory"].count("<polyline") == 2
    assert drawn["pcie"].count('class="busy"') >= 2 and drawn["gantt"].count('class="busy"') >= 4
    shot = tmp_path / "shot.png"
    p = subprocess.run([chromium, *offline, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and shot.stat().st_size > 10_000, p.stderr[-2000:]
    assert _png_colors(shot) >= 8  # phase bands, series, lanes: a drawn page, not a blank one


def test_the_engine_plans_around_pcie_traffic_others_cause():
    torch = pytest.importorskip("torch")
    from memtide.optim import TieredAdamW

    opt = TieredAdamW(torch.nn.Linear(64, 64).parameters(), subgroup_size=1024)
    engine = opt.engine
    assert engine.foreign_pcie_share() == (0.0, 0.0)
    engine.observe_pcie(1e6, 5e5, 1e5, own_h2d_busy_ns=1e5, own_d2h_busy_ns=1e5)
    assert engine.foreign_pcie_share() == pytest.approx((0.4, 0.0))
    with pytest.raises(ValueError, match="window_ns"):
        engine.observe_pcie(0.0, 1.0, 1.0)


def test_memtide_timeline_writes_four_outputs_and_torchs_memory_viz_reads_the_pickle(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.cuda import _memory_viz
    import pickle

    with timeline.TraceWriter(str(tmp_path / "a.trace.jsonl"), source="test") as w:
        w.phase(0.0, "forward")
        w.event(type="alloc", t=0.001, addr="0x7f0000000000", bytes=4096, stream="0x0")
        w.event(type="alloc", t=0.002, addr=0x7f0000100000, bytes=1 << 20, stream=0)
        w.event(type="free", t=0.003, addr="0x7f0000000000", bytes=4096, stream="0x0")
    p = subprocess.run([sys.executable, "-m", "memtide.cli", "timeline", str(tmp_path / "a.trace.jsonl"), "-o",
                        str(tmp_path / "a.html")], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for name in ("a.html", "a.chrome.json", "a.pickle"):
        assert (tmp_path / name).stat().st_size > 0, name
    snap = pickle.loads((tmp_path / "a.pickle").read_bytes())
    assert [e["action"] for e in snap["device_traces"][0]] == ["alloc", "alloc", "free_completed"]
    assert snap["device_traces"][0][0]["addr"] == 0x7f0000000000
    text = _memory_viz.trace(snap)
    assert "3 entries" in text and "MEM[139637976727552:4.0KiB]" in text and "free completed" in text
    del torch


def test_progress_on_a_trace_of_more_than_200000_lines(tmp_path, capsys):
    """The progress line is printed every 200,000 events; it used to call tell() on a file being
    iterated, which Python forbids, so every trace that long failed."""
    path = tmp_path / "long.jsonl"
    with timeline.TraceWriter(str(path), source="test") as w:
        for i in range(210_000):
            w.memory(i * 1e-6, i, i)
    header, events = timeline.read_trace(str(path), progress=True)
    assert sum(1 for _ in events) == 210_000
    assert re.search(r"timeline: read 200,0\d\d events \(9\d%\)", capsys.readouterr().err)


def _one_event_trace(path, event, header=None):
    lines = [header if header is not None else json.dumps({"memtide_trace": 1}), event]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("event, field", [
    ('{"type":"phase","t":NaN,"phase":"forward"}', "t"),
    ('{"type":"phase","t":1e308,"phase":"forward"}', "t"),
    ('{"type":"phase","t":1e999,"phase":"forward"}', "t"),
    ('{"type":"phase","t":-1,"phase":"forward"}', "t"),
    ('{"type":"phase","t":true,"phase":"forward"}', "t"),
    ('{"type":"memory","t":0,"allocated":"lots","reserved":1}', "allocated"),
    ('{"type":"memory","t":0,"allocated":-5,"reserved":1}', "allocated"),
    ('{"type":"memory","t":0,"allocated":1.5,"reserved":1}', "allocated"),
    ('{"type":"memory","t":0,"allocated":1,"reserved":1e30}', "reserved"),
    ('{"type":"op","engine":"h2d","start":0,"end":1,"bytes":"lots"}', "bytes"),
    ('{"type":"op","engine":"h2d","start":0,"end":1,"bytes":-1}', "bytes"),
    ('{"type":"op","engine":"h2d","start":0,"end":1,"bytes":Infinity}', "bytes"),
    ('{"type":"op","engine":"h2d","start":2,"end":1}', "end"),
    ('{"type":"tiering","what":"prefetch","subgroup":-1,"start":0,"end":1}', "subgroup"),
    ('{"type":"tiering","what":"prefetch","subgroup":2.5,"start":0,"end":1}', "subgroup"),
    ('{"type":"alloc","t":0,"addr":"nowhere","bytes":4096}', "addr"),
    ('{"type":"alloc","t":0,"addr":-4096,"bytes":4096}', "addr"),
    ('{"type":"free","t":0,"addr":4096,"bytes":4096,"stream":"0x1g"}', "stream"),
    ('{"type":"oom","t":0,"bytes":-1}', "bytes"),
    ('{"type":"op","engine":"h2d","start":0,"end":1,"note":NaN}', "note"),
])
def test_every_number_in_an_event_is_range_checked_naming_field_file_and_line(tmp_path, event, field):
    path = _one_event_trace(tmp_path / "bad.jsonl", event)
    header, events = timeline.read_trace(str(path))
    with pytest.raises(timeline.TraceError, match=rf"bad\.jsonl: line 2: .*'{field}'"):
        list(events)


@pytest.mark.parametrize("header, words", [
    ('{"memtide_trace":1,"capacity_bytes":-1}', "'capacity_bytes'"),
    ('{"memtide_trace":1,"capacity_bytes":NaN}', "'capacity_bytes'"),
    ('{"memtide_trace":1,"capacity_bytes":1e999}', "'capacity_bytes'"),
    ('{"memtide_trace":true}', "format"),
    ('{"memtide_trace":-1}', "format"),
])
def test_the_header_is_range_checked_too(tmp_path, header, words):
    path = _one_event_trace(tmp_path / "bad.jsonl", '{"type":"phase","t":0,"phase":"forward"}', header)
    with pytest.raises(timeline.TraceError, match=rf"bad\.jsonl.*{re.escape(words)}"):
        timeline.read_trace(str(path))


def _strict_json(text):
    def refuse(token):
        raise AssertionError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_memtide_timeline_json_is_strict_json_and_the_report_has_no_nan(tmp_path):
    path = make_trace(tmp_path / "t.jsonl", ops=20)
    p = subprocess.run([sys.executable, "-m", "memtide.cli", "timeline", str(path), "-o", str(tmp_path / "r.html"),
                        "--json"], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert _strict_json(p.stdout)["events"] == 3 * (1 + 2 * 20)
    _strict_json((tmp_path / "r.chrome.json").read_text())
    assert "nan" not in (tmp_path / "r.html").read_text().lower()
    with pytest.raises(ValueError):  # the writer never writes what the reader refuses
        with timeline.TraceWriter(str(tmp_path / "w.jsonl")) as w:
            w.phase(float("nan"), "forward")
    assert not (tmp_path / "w.jsonl").exists()


def test_memtide_timeline_names_the_bad_line_without_a_traceback(tmp_path):
    path = _one_event_trace(tmp_path / "bad.jsonl", '{"type":"phase","t":1e999,"phase":"forward"}')
    p = subprocess.run([sys.executable, "-m", "memtide.cli", "timeline", str(path), "-o", str(tmp_path / "r.html")],
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "bad.jsonl: line 2" in p.stderr and "'t'" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("flag", ["-o", "--chrome", "--png", "--memory-viz"])
@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_memtide_timeline_refuses_to_write_over_the_trace_it_reads(tmp_path, flag, how):
    trace = make_trace(tmp_path / "t.jsonl", ops=5)
    before = trace.read_bytes()
    target = {"same": trace, "symlink": tmp_path / "link.html", "hardlink": tmp_path / "hard.html"}[how]
    if how == "symlink":
        os.mkdir(tmp_path / "d")
        os.symlink(tmp_path, tmp_path / "d" / "up")  # a folder link: the target itself is a regular file
        target = tmp_path / "d" / "up" / "t.jsonl"
    elif how == "hardlink":
        os.link(trace, target)
    args = [str(trace), "-o", str(tmp_path / "r.html")] if flag != "-o" else [str(trace)]
    p = subprocess.run([sys.executable, "-m", "memtide.cli", "timeline", *args, flag, str(target)],
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert flag in p.stderr and "t.jsonl" in p.stderr and "Traceback" not in p.stderr
    assert trace.read_bytes() == before
    assert not (tmp_path / "r.html").exists()  # refused before any work


def test_render_refuses_an_output_that_is_its_input(tmp_path):
    trace = make_trace(tmp_path / "t.jsonl", ops=5)
    before = trace.read_bytes()
    with pytest.raises(timeline.TraceError, match="the Chrome trace .* is the same file as the trace"):
        timeline.render(str(trace), str(tmp_path / "r.html"), chrome=str(trace))
    with pytest.raises(timeline.TraceError, match="same file"):
        timeline.render(str(trace), str(tmp_path / "r.html"), chrome=str(tmp_path / "x"), png=str(tmp_path / "x"))
    assert trace.read_bytes() == before and not (tmp_path / "r.html").exists()


def test_a_png_skipped_for_want_of_matplotlib_is_said_with_how_to_install_it(tmp_path):
    """The README's `simulate --timeline` promises a PNG; without matplotlib it used to be skipped
    without a word. A stand-in matplotlib that fails to import makes the test the same everywhere."""
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = clean_env(PYTHONPATH=str(fake) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "memtide.cli", "simulate", "--model", "custom", "--layers", "2",
                        "--hidden", "256", "--heads", "4", "--iterations", "1", "--timeline", str(tmp_path / "s.html")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "no PNG" in p.stderr and "pip install matplotlib" in p.stderr
    assert not (tmp_path / "s.png").exists()
    q = subprocess.run([sys.executable, "-m", "memtide.cli", "timeline", str(tmp_path / "s.trace.jsonl"), "-o",
                        str(tmp_path / "t.html"), "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert q.returncode == 0 and "pip install matplotlib" in q.stderr, q.stderr
    assert json.loads(q.stdout)["png"] is None


# ---- hostile inputs: special files, deep nesting, links at the outputs ---------------------------

# Every reader of the package, each given a FIFO (named like a trace; for trace_inputs, the only
# trace in a folder): each must refuse it naming it, never open it and wait for a writer.
READ_A_FIFO_EVERY_WAY = r"""
import os, sys
from memtide import _timeline as timeline
fifo, folder, real, out = sys.argv[1:5]
calls = {
    "read_trace": lambda: timeline.read_trace(fifo),
    "read_snapshot": lambda: timeline.read_snapshot(fifo),
    "looks_like_pickle": lambda: timeline.looks_like_pickle(fifo),
    "trace_inputs": lambda: timeline.trace_inputs([folder]),
    "render": lambda: timeline.render(fifo, os.path.join(out, "r.html")),
    "render_ranks": lambda: timeline.render_ranks([real, fifo], os.path.join(out, "k.html")),
    "trace_from_observer": lambda: timeline.trace_from_observer(fifo, os.path.join(out, "o.trace.jsonl")),
}
for name, call in calls.items():
    try:
        call()
        print(name, "read it")
    except timeline.TraceError as e:
        print(name, "refused:", e)
"""


def test_every_reader_refuses_a_fifo_naming_it_without_waiting_on_it(tmp_path):
    fifo, folder = tmp_path / "t.trace.jsonl", tmp_path / "runs"
    os.mkfifo(fifo)
    folder.mkdir()
    os.mkfifo(folder / "r.trace.jsonl")
    real = make_trace(tmp_path / "a.trace.jsonl", ops=2)
    (tmp_path / "out").mkdir()
    p = subprocess.run([sys.executable, "-c", READ_A_FIFO_EVERY_WAY, str(fifo), str(folder), str(real),
                        str(tmp_path / "out")], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 7, p.stdout
    for line in lines:
        named = folder / "r.trace.jsonl" if line.startswith("trace_inputs") else fifo
        assert "refused:" in line and f"{named} is a FIFO, not a regular file" in line, line
    assert os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize("line", [1, 2])
def test_a_trace_nested_100000_deep_is_refused_naming_the_file_and_the_line(tmp_path, line):
    deep = "[" * 100_000 + "]" * 100_000
    path = tmp_path / "deep.jsonl"
    if line == 1:
        path.write_text('{"memtide_trace": 1, "x": ' + deep + "}\n")
    else:
        _one_event_trace(path, '{"type": "phase", "t": 0, "phase": "forward", "x": ' + deep + "}")
    p = subprocess.run([sys.executable, "-m", "memtide.cli", "timeline", str(path), "-o", str(tmp_path / "r.html")],
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"{path}: line {line} is nested 100,001 levels deep" in p.stderr, p.stderr[-2000:]
    assert "recursion" not in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "r.html").exists()


def test_an_observer_log_line_nested_too_deeply_is_skipped_like_a_line_cut_short(tmp_path):
    log = tmp_path / "o.jsonl"
    event = {"type": "event", "t_ns": 1000, "op": "cudaMalloc", "ptr": "0x10", "size": 4096, "current": 4096, "pid": 7}
    log.write_text(json.dumps({"type": "header", "pid": 7}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n"
                   + json.dumps(event) + "\n")
    assert timeline.trace_from_observer(str(log), str(tmp_path / "o.trace.jsonl")) == 2  # the alloc and its memory


# A stand-in matplotlib whose savefig writes where it is told, as the real one does (a path or a
# file): render() must hand it the one writer's file, never the PNG's path.
FAKE_MATPLOTLIB = '''
class _Any:
    def __getattr__(self, name):
        return lambda *a, **k: None

class _Figure(_Any):
    def savefig(self, fname, **kwargs):
        if hasattr(fname, "write"):
            fname.write(b"PNG")
        else:
            with open(fname, "wb") as f:
                f.write(b"PNG")

def subplots(nrows=1, ncols=1, **k):
    return _Figure(), [[_Any() for _ in range(ncols)] for _ in range(nrows)]

def close(fig):
    pass
'''


RENDER_PNG = "from memtide import _timeline as t; import sys; t.render(*sys.argv[1:3], png=sys.argv[3])"


def test_a_png_target_that_is_a_link_is_refused_and_its_target_untouched(tmp_path):
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("def use(name):\n    pass\n")
    (fake / "pyplot.py").write_text(FAKE_MATPLOTLIB)
    trace = make_trace(tmp_path / "t.jsonl", ops=5)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "p.png").symlink_to(victim)
    env = clean_env(PYTHONPATH=str(tmp_path / "fake") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "memtide.cli", "timeline", str(trace), "-o", str(tmp_path / "r.html"),
                        "--png", str(tmp_path / "p.png")], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"{tmp_path / 'p.png'} is a symbolic link" in p.stderr, p.stderr[-2000:]
    assert victim.read_text() == "precious" and (tmp_path / "p.png").is_symlink()
    q = subprocess.run([sys.executable, "-c", RENDER_PNG,
                        str(trace), str(tmp_path / "r.html"), str(tmp_path / "p.png")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert q.returncode == 1 and "is a symbolic link" in q.stderr, q.stderr[-2000:]
    assert victim.read_text() == "precious"
    q = subprocess.run([sys.executable, "-c", RENDER_PNG,
                        str(trace), str(tmp_path / "r.html"), str(tmp_path / "real.png")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert q.returncode == 0, q.stderr[-2000:]
    assert (tmp_path / "real.png").read_bytes() == b"PNG"
    assert stat.S_IMODE(os.stat(tmp_path / "real.png").st_mode) == 0o600


def test_a_trace_writer_refused_at_its_header_leaves_no_file(tmp_path):
    with pytest.raises(ValueError, match="JSON compliant"):
        timeline.TraceWriter(str(tmp_path / "t.jsonl"), capacity_bytes=float("nan"))
    assert os.listdir(tmp_path) == []  # neither the trace nor its temporary file
