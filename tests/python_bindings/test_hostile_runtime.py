"""The optimizer, its spill tier, the layer window and `memtide run` under the ways a real user
ends or misuses them: a script that exits with its optimizer still referenced, Ctrl-C, a host
budget on a machine whose "device" memory is host memory, a forward that skips blocks, and
checkpoints with the wrong shapes or numbers (issue 27)."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")

import memtide  # noqa: E402
from memtide.optim import TieredAdamW  # noqa: E402
from memtide.window import LayerWindow  # noqa: E402
from memtide_testing import clean_env, default_signals, direct_io_dir, one_torch_thread, run_python  # noqa: E402,F401

SUBGROUP = 8192


@pytest.fixture
def spill_dir(tmp_path):
    if not memtide._memtide.HAVE_NVME:
        pytest.skip("memtide was built without the NVMe tier")
    return direct_io_dir(tmp_path)


def spills(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("memtide-spill-"))


# ---- spill folders go at exit -------------------------------------------------------------------

def test_a_script_that_ends_with_its_optimizer_referenced_leaves_no_spill_folder(spill_dir):
    script = textwrap.dedent(f"""
        import sys, torch
        from memtide.optim import TieredAdamW
        model = torch.nn.Linear(256, 256).to(torch.bfloat16)
        opt = TieredAdamW(model.parameters(), subgroup_size={SUBGROUP}, host_budget=600_000,
                          nvme_dir=sys.argv[1], policy="cpu")
        model(torch.randn(4, 256, dtype=torch.bfloat16)).sum().backward()
        opt.step()
        assert opt.spilled_subgroups > 0
        print(opt.nvme_info()["file"])
    """)
    p = run_python(["-c", script, str(spill_dir)])
    assert p.returncode == 0, p.stderr
    assert "memtide-spill-" in p.stdout
    assert spills(spill_dir) == [], f"left behind by a clean exit: {spills(spill_dir)}"


def test_remove_spill_dirs_leaves_the_open_file_usable(spill_dir):
    """Removal at exit takes the folder's name away; an engine still stepping keeps its file."""
    model = torch.nn.Linear(256, 256).to(torch.bfloat16)
    opt = TieredAdamW(model.parameters(), subgroup_size=SUBGROUP, host_budget=600_000, nvme_dir=spill_dir,
                      policy="cpu")
    assert spills(spill_dir)
    assert memtide._memtide.remove_spill_dirs() >= 1
    assert spills(spill_dir) == []
    for _ in range(2):
        model(torch.randn(4, 256, dtype=torch.bfloat16)).sum().backward()
        opt.step()
    assert opt.nvme_info()["last"]["read_bytes"] > 0
    opt.sync_state()
    assert torch.isfinite(opt.buffers.exp_avg).all()


# ---- memtide run: Ctrl-C, the policy digest ----------------------------------------------------

SMALL_RUN = ["--layers", "1", "--hidden", "64", "--heads", "2", "--seq", "32", "--batch", "2", "--vocab", "512",
             "--subgroup-size", "10000", "--device", "sim"]


def test_ctrl_c_in_memtide_run_reports_what_ran_exits_130_and_removes_the_spill_folder(spill_dir, tmp_path):
    report = tmp_path / "t.html"
    p = subprocess.Popen([sys.executable, "-m", "memtide.cli", "run", *SMALL_RUN, "--iterations", "100000",
                          "--host-budget", "1MiB", "--nvme-dir", str(spill_dir), "--timeline", str(report)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                         preexec_fn=default_signals)
    seen = ""
    deadline = time.monotonic() + 240
    while "step   2/" not in seen:
        line = p.stdout.readline()
        assert line or p.poll() is None, f"memtide run ended early: {p.stderr.read()}"
        seen += line
        assert time.monotonic() < deadline, seen
    assert spills(spill_dir), "the run spills nothing: the test would prove nothing"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=240)
    out = seen + out
    assert p.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    assert "interrupted (Ctrl-C)" in out + err
    assert "loss " in out and "plan " in out, out  # the summary of the steps done
    assert report.exists() and report.stat().st_size > 0
    assert spills(spill_dir) == [], spills(spill_dir)


def test_memtide_run_policy_digest_reads_the_synced_state(cli, spill_dir):
    # A budget the state fits: auto keeps subgroups on the device, whose state the host buffers
    # hold only after sync_state().
    p = cli("run", *SMALL_RUN, "--iterations", "1", "--host-budget", "1GiB", "--nvme-dir", str(spill_dir))
    assert p.returncode == 0, p.stderr
    assert "identical results under every policy: yes" in p.stdout, p.stdout
    assert spills(spill_dir) == []


# ---- a host budget on a device whose memory is host memory -------------------------------------

def test_host_budget_holds_on_a_simulated_device_with_every_policy(spill_dir):
    """On a SimDevice the device's memory is host memory: its slots and residents count against
    the host budget, so the spilled subgroups are read from NVMe every step."""
    if memtide.backend() != "sim":
        pytest.skip("the device's memory is host memory only on the SimDevice")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)]).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    budget = 10 * n + 2 * 12 * SUBGROUP  # about half of the 16 B/param
    # The arena's slabs round the kept arrays up: a page per run of kept subgroups per array.
    slack = 4 * 3 * (len(range(0, n, SUBGROUP)) + 1) * 4096
    for policy in ("auto", "cpu"):
        opt = TieredAdamW(model.parameters(), policy=policy, subgroup_size=SUBGROUP, host_budget=budget,
                          nvme_dir=spill_dir)
        assert opt.spilled_subgroups > 0
        opt.attach(model)
        for _ in range(3):
            model(torch.randn(4, 128, dtype=torch.bfloat16)).float().sum().backward()
            opt.step()
            held = opt.engine.host_bytes + opt.engine.resident_bytes
            assert held <= budget + slack, (policy, held, budget, opt.plan.summary())
        last = opt.nvme_info()["last"]
        assert last["read_bytes"] > 0 and last["write_bytes"] > 0, (policy, last, opt.plan.summary())
        del opt


# ---- the layer window ---------------------------------------------------------------------------

def test_layer_window_of_one_with_a_forward_that_skips_blocks():
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(6)])
    reference = [torch.nn.Linear(8, 8) for _ in range(6)]
    for r, b in zip(reference, blocks):
        r.load_state_dict(b.state_dict())
    window = LayerWindow(blocks, size=1)
    x = torch.randn(2, 8)
    for _ in range(2):
        h, g = x, x
        for i in (0, 2, 4):
            h = torch.tanh(blocks[i](h))
            g = torch.tanh(reference[i](g))
        h.sum().backward()
        g.sum().backward()
        for i in range(6):
            if i % 2:
                assert blocks[i].weight.grad is None
            else:
                assert torch.equal(blocks[i].weight.grad, reference[i].weight.grad)
    window.remove()


# ---- checkpoints: shapes and numbers ------------------------------------------------------------

def _opt_with_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4, bias=False)  # weight (4, 3)
    opt = TieredAdamW(model.parameters(), lr=1e-2, policy="cpu")
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_load_state_dict_refuses_a_moment_of_another_shape_with_the_same_size(key):
    model, opt = _opt_with_state()
    sd = opt.state_dict()
    before = [t.clone() for t in (opt.buffers.exp_avg, opt.buffers.exp_avg_sq, opt.buffers.params)]
    bad = {**sd, "state": {0: {**sd["state"][0], key: sd["state"][0][key].clone().reshape(3, 4)}}}
    with pytest.raises(ValueError) as e:
        opt.load_state_dict(bad)
    msg = str(e.value)
    assert key in msg and "param 0" in msg and "group 0" in msg, msg
    assert "(3, 4)" in msg and "(4, 3)" in msg, msg
    assert all(torch.equal(a, b) for a, b in
               zip(before, (opt.buffers.exp_avg, opt.buffers.exp_avg_sq, opt.buffers.params)))


@pytest.mark.parametrize("step", [1.5, -1, -1.0, math.nan, math.inf, 2.0 ** 40, 10 ** 30, "3", True,
                                  torch.tensor([1.0, 2.0])])
def test_load_state_dict_refuses_a_step_that_is_not_a_count(step):
    model, opt = _opt_with_state()
    sd = opt.state_dict()
    bad = {**sd, "state": {0: {**sd["state"][0], "step": step}}}
    with pytest.raises(ValueError, match="step of param 0"):
        opt.load_state_dict(bad)
    assert float(opt.state[model.weight]["step"]) == 1.0


@pytest.mark.parametrize("step", [3, 3.0, torch.tensor(3.0), torch.tensor(3, dtype=torch.int64), 2 ** 24])
def test_load_state_dict_takes_a_whole_step_count(step):
    model, opt = _opt_with_state()
    sd = opt.state_dict()
    opt.load_state_dict({**sd, "state": {0: {**sd["state"][0], "step": step}}})
    assert float(opt.state[model.weight]["step"]) == float(step)


@pytest.mark.parametrize("index", [-1, 1.0, "", True, None])
def test_load_state_dict_refuses_a_param_index_that_is_not_a_count(index):
    model, opt = _opt_with_state()
    sd = opt.state_dict()
    groups = [{**sd["param_groups"][0], "params": [index]}]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]"):
        opt.load_state_dict({**sd, "param_groups": groups, "state": {index: sd["state"][0]}})


def test_load_state_dict_takes_params_keyed_by_name():
    # torch.distributed.checkpoint's set_optimizer_state_dict keys the state by the params' names.
    model, opt = _opt_with_state()
    sd = opt.state_dict()
    moment = sd["state"][0]["exp_avg"].clone()
    names = [n for n, _ in model.named_parameters()]
    groups = [{**sd["param_groups"][0], "params": names}]
    opt.load_state_dict({**sd, "param_groups": groups, "state": {names[i]: e for i, e in sd["state"].items()}})
    assert torch.equal(opt.state[model.weight]["exp_avg"], moment)


def test_load_state_dict_refuses_a_repeated_param_index():
    model = torch.nn.Linear(3, 4)
    opt = TieredAdamW(model.parameters(), policy="cpu")
    sd = opt.state_dict()
    groups = [{**sd["param_groups"][0], "params": [0, 0]}]
    with pytest.raises(ValueError, match="index 0 twice"):
        opt.load_state_dict({**sd, "param_groups": groups})


# ---- signals a scheduler sends (issue 37, item 2) ----------------------------------------------

# A process that spills, says where, then waits to be ended. PRELUDE runs before memtide is imported
# (a handler the program installs first).
_SPILLING_CHILD = """
import os, sys, time
{prelude}
import torch
from memtide.optim import TieredAdamW
model = torch.nn.Linear(256, 256).to(torch.bfloat16)
opt = TieredAdamW(model.parameters(), subgroup_size={subgroup}, host_budget=600_000, nvme_dir=sys.argv[1],
                  policy="cpu")
model(torch.randn(4, 256, dtype=torch.bfloat16)).sum().backward()
opt.step()
assert opt.spilled_subgroups > 0
try:
    print("ready", opt.nvme_info()["file"], flush=True)
    while True:
        time.sleep(0.01)
finally:
    print("finally ran", flush=True)  # the signal unwinds the program: finally and with blocks run
"""


def _spilling_child(spill_dir, prelude=""):
    """A started child that spills into `spill_dir`, once its folder is there."""
    p = subprocess.Popen([sys.executable, "-c", _SPILLING_CHILD.format(prelude=prelude, subgroup=SUBGROUP),
                          str(spill_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                         preexec_fn=default_signals)
    line = p.stdout.readline()
    assert line.startswith("ready "), (line, p.communicate(timeout=60))
    assert spills(spill_dir), "the child spills nothing: the test would prove nothing"
    return p


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigterm_and_sighup_remove_the_spill_folder_and_exit_128_plus_the_signal(spill_dir, sig, code):
    p = _spilling_child(spill_dir)
    sent = time.monotonic()
    p.send_signal(sig)
    out, err = p.communicate(timeout=30)
    took = time.monotonic() - sent
    assert p.returncode == code, (p.returncode, out, err)
    assert took < 5, f"{took:.1f} s to end: beyond a scheduler's grace period"
    assert "finally ran" in out, "the program was not unwound: its traces and outputs are not closed"
    assert "Traceback" not in err, err
    assert f"{signal.Signals(sig).name}: exiting with {code}" in err, err
    assert spills(spill_dir) == [], spills(spill_dir)


def test_a_handler_the_program_installed_before_memtide_is_chained_to(spill_dir):
    prelude = ("import signal\n"
               "def mine(signum, frame):\n"
               "    print('my handler', signum, flush=True)\n"
               "    sys.exit(7)\n"
               "signal.signal(signal.SIGTERM, mine)")
    p = _spilling_child(spill_dir, prelude)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert f"my handler {int(signal.SIGTERM)}" in out, (out, err)
    assert p.returncode == 7, (p.returncode, err)  # the program's handler decided how to end
    assert spills(spill_dir) == [], spills(spill_dir)


def test_an_ignored_signal_stays_ignored():
    p = run_python(["-c", "import signal; signal.signal(signal.SIGHUP, signal.SIG_IGN); import memtide, os, sys; "
                          "os.kill(os.getpid(), signal.SIGHUP); "
                          "print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, "
                          "signal.getsignal(signal.SIGTERM) is memtide._cleanup._on_signal)"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True", "True"]


def test_after_sigkill_the_next_run_removes_the_dead_process_spill_folder_naming_it(spill_dir):
    p = _spilling_child(spill_dir)
    left = spills(spill_dir)
    p.kill()
    p.communicate(timeout=30)
    assert spills(spill_dir) == left, "SIGKILL runs nothing: the folder must still be there"
    script = textwrap.dedent(f"""
        import sys, torch
        from memtide.optim import TieredAdamW
        model = torch.nn.Linear(256, 256).to(torch.bfloat16)
        opt = TieredAdamW(model.parameters(), subgroup_size={SUBGROUP}, host_budget=600_000,
                          nvme_dir=sys.argv[1], policy="cpu")
        print(opt.nvme_info()["file"])
    """)
    q = run_python(["-c", script, str(spill_dir)])
    assert q.returncode == 0, q.stderr
    for name in left:
        assert not (spill_dir / name).exists(), f"{name} of the killed process is still there: {q.stderr}"
        assert f"removed {spill_dir / name}" in q.stderr, q.stderr


def test_only_memtide_folders_of_ended_processes_of_this_user_are_removed(spill_dir, monkeypatch):
    from memtide import _cleanup

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def folder(name, size=8192):
            f = spill_dir / name
            f.mkdir(mode=0o700)
            (f / "state.spill").write_bytes(b"x" * size)
            return f

        gone = folder(f"memtide-spill-{dead_pid}-abcdef")
        gone_rank = folder(f"memtide-spill-{dead_pid}-rank3-Zz09Ab")
        running = folder(f"memtide-spill-{live.pid}-abcdef")
        mine = folder(f"memtide-spill-{__import__('os').getpid()}-abcdef")
        not_ours = folder(f"memtide-spill-{dead_pid}-abc")  # not mkdtemp's six characters
        other = folder(f"my-spill-{dead_pid}-abcdef")
        (spill_dir / f"memtide-spill-{dead_pid}-linked").symlink_to(gone_rank)
        # A process of another pid namespace (a container sharing the folder) looks dead by its
        # pid; it still has its file open, which the kernel tells.
        held = folder(f"memtide-spill-{dead_pid}-HELDop")
        with open(held / "state.spill", "r+b"):
            removed = _cleanup.remove_stale_spills(spill_dir, log=lambda text: None)
            assert sorted(removed) == sorted([str(gone), str(gone_rank)])
            for kept in (running, mine, not_ours, other, held):
                assert kept.exists(), kept
            assert (spill_dir / f"memtide-spill-{dead_pid}-linked").is_symlink()
            # The live pid now belongs to a process that started after the folder last changed: a
            # reused pid, not the folder's owner.
            real = _cleanup._start_time
            monkeypatch.setattr(_cleanup, "_start_time",
                                lambda pid: (real(pid) or 0) + 1e6 if pid == live.pid else real(pid))
            logged = []
            assert _cleanup.remove_stale_spills(spill_dir, log=logged.append) == [str(running)]
            assert str(running) in logged[0] and f"process {live.pid}" in logged[0], logged
        assert _cleanup.remove_stale_spills(spill_dir, log=lambda text: None) == [str(held)]  # closed: gone
    finally:
        live.kill()
        live.wait()
