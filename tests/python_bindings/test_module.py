"""The memtide module and CLI as installed by `pip install .`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import memtide

SMALL = dict(layers=2, hidden=256, heads=4, seq=128, batch=2, vocab=1000, iterations=3)
SMALL_FLAGS = ["--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "128", "--batch", "2", "--vocab", "1000"]


def cmake_project_version() -> str:
    text = (Path(__file__).resolve().parents[2] / "CMakeLists.txt").read_text()
    match = re.search(r"project\(memtide\s+VERSION\s+([0-9.]+)", text)
    assert match, "project(memtide VERSION ...) not found in CMakeLists.txt"
    return match.group(1)


# ---- module -------------------------------------------------------------------------------------


def test_version_matches_cmake_project():
    assert memtide.version() == cmake_project_version()
    assert memtide.__version__ == memtide.version()


def test_backend_follows_cuda_status():
    status = memtide.cuda_status()
    assert set(status) == {"compiled", "usable", "device_count", "runtime_version", "driver_version", "reason"}
    requested = os.environ.get("MEMTIDE_DEVICE", "auto")
    if requested == "auto":
        assert memtide.backend() == ("cuda" if status["usable"] else "sim")
    else:
        assert memtide.backend() == requested
    if not status["usable"]:
        assert status["reason"]
    assert memtide.device_count() >= 1 or memtide.backend() == "cuda"


def test_library_path_is_the_loaded_libmemtide():
    path = Path(memtide.library_path())
    assert path.is_absolute() and path.exists()
    assert path.name.startswith("libmemtide.so")
    assert path.parent == Path(memtide._memtide.__file__).parent


def test_options_and_table_agree():
    values = memtide.options()
    table = memtide.option_table()
    assert {row["key"] for row in table} == set(values)
    for row in table:
        assert row["env"] == "MEMTIDE_" + row["key"].upper()
        assert row["accepted"] and row["help"]
    assert values["device"] in ("auto", "cuda", "sim")


def test_stats_have_torch_names():
    s = memtide.stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
                "reserved_bytes.large_pool.peak", "num_ooms", "num_alloc_retries"):
        assert key in s, key
    assert all(isinstance(v, int) for v in s.values())
    memtide.reset_peak_stats()
    memtide.empty_cache()


def test_mark_phase_and_headroom():
    with memtide.phase("forward"):
        pass
    assert memtide.phase_report()["current"] == "forward"
    memtide.mark_phase("backward")
    memtide.mark_phase("update")
    memtide.mark_phase("forward")  # closes one iteration
    report = memtide.phase_report()
    assert report["iterations"] >= 1
    assert set(report["running"]["phases"]) == {"forward", "backward", "update", "other"}
    last = report["history"][-1]["phases"]
    for name in ("forward", "backward", "update"):
        assert last[name]["seen"]
        assert set(last[name]) == {"seen", "peak_allocated", "peak_reserved", "min_free", "duration_ns"}
    h = memtide.headroom(0, "update", margin=0)
    assert set(h) == {"bytes", "limiting_phase", "iterations_used", "from_history"}
    assert h["from_history"] and h["bytes"] > 0
    assert memtide.headroom(until="update", margin=h["bytes"] + 1)["bytes"] == 0
    memtide.mark_phase("other")


def test_mark_phase_rejects_unknown_name():
    with pytest.raises(ValueError, match="sideways"):
        memtide.mark_phase("sideways")
    with pytest.raises(ValueError, match="sideways"):
        memtide.headroom(until="sideways")


def test_replay_small_transformer():
    r = memtide.replay_transformer(**SMALL)
    assert r["ops"] > 0 and r["seconds"] >= 0
    assert 1.0 <= r["reserved_over_allocated"] <= 1.5
    assert r["peak_reserved"] >= r["peak_allocated"] > 0
    for name in ("forward", "backward", "update"):
        assert r["phases"][name]["seen"]
        assert r["phases"][name]["peak_allocated"] > 0
        assert r["phases"][name]["peak_reserved"] >= r["phases"][name]["peak_allocated"]
    assert r["update_headroom"]["bytes"] > 0
    assert r["update_headroom"]["from_history"]
    assert r["iterations_finished"] == SMALL["iterations"]
    assert r["params"] > 0 and "2 layers" in r["shape"]
    assert r["backend"] in ("sim", "cuda") and r["device"]


def test_replay_on_phantom_sim_holds_no_memory():
    # 80 GiB of phantom device is fine on any machine; only addresses are handed out.
    r = memtide.replay_transformer(**dict(SMALL, layers=4), backend="sim", sim_capacity=80 << 30)
    assert r["backend"] == "sim" and "phantom" in r["device"]
    assert r["device_memory"] == 80 << 30


@pytest.mark.parametrize("field", ["layers", "hidden", "heads", "seq", "batch", "vocab", "iterations"])
def test_replay_rejects_bad_shape(field):
    with pytest.raises(ValueError, match=field):
        memtide.replay_transformer(**dict(SMALL, **{field: 0}))
    with pytest.raises(ValueError, match=field):
        memtide.replay_transformer(**dict(SMALL, **{field: 2**40}))


def test_replay_error_mapping():
    with pytest.raises(MemoryError, match="out of memory"):
        memtide.replay_transformer(**SMALL, backend="sim", sim_capacity=1 << 20)
    with pytest.raises(ValueError, match="gpu"):
        memtide.replay_transformer(**SMALL, backend="gpu")
    with pytest.raises(memtide.ConfigError):
        memtide.replay_transformer(**SMALL, backend="gpu")


def test_dump_snapshot_bad_path_raises(tmp_path):
    with pytest.raises(OSError, match="cannot create a file in"):
        memtide.dump_snapshot(tmp_path / "missing-dir" / "snap.pickle")


# ---- CLI ----------------------------------------------------------------------------------------


def test_cli_version(cli):
    p = cli("--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"memtide {cmake_project_version()}"


def test_cli_info_json(cli):
    p = cli("info", "--json")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["memtide"] == memtide.__version__
    assert info["backend"] in ("sim", "cuda")
    assert {"usable", "device_count", "reason"} <= set(info["cuda"])
    assert any(row["env"] == "MEMTIDE_MEMORY_FRACTION" and row["value"] for row in info["options"])


def test_cli_info_text(cli):
    p = cli("info", MEMTIDE_DEVICE="sim")
    assert p.returncode == 0, p.stderr
    assert "backend   sim" in p.stdout
    assert "MEMTIDE_SIM_CAPACITY" in p.stdout


def test_cli_run_trace_json(cli):
    p = cli("run", "--trace", *SMALL_FLAGS, "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert "replaying 3 iterations" in p.stderr
    assert r["model"] == SMALL
    assert 1.0 <= r["reserved_over_allocated"] <= 1.5
    assert r["update_headroom"]["bytes"] > 0
    assert r["ops"] > 0 and r["ops_per_second"] > 0
    assert all(r["phases"][name]["peak_allocated"] > 0 for name in ("forward", "backward", "update"))


def test_cli_run_trace_text(cli):
    p = cli("run", "--trace", *SMALL_FLAGS, "--device", "sim")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert out.startswith("replaying 3 iterations")
    for needle in ("forward", "backward", "update", "peak reserved / peak allocated", "update headroom", "ops/s"):
        assert needle in out, needle


@pytest.mark.parametrize("flag", ["--layers", "--hidden", "--iterations"])
def test_cli_run_rejects_bad_flag(cli, flag):
    p = cli("run", flag, "0")
    assert p.returncode == 2
    assert flag in p.stderr
    assert "Traceback" not in p.stderr


def test_cli_bad_env_value(cli):
    p = cli("info", MEMTIDE_MEMORY_FRACTION="2")
    assert p.returncode == 2
    assert "MEMTIDE_MEMORY_FRACTION" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("mode", [["--trace"], []])
def test_cli_run_bad_env_value(cli, mode):
    p = cli("run", *mode, *SMALL_FLAGS, MEMTIDE_DEVICE="gpu")
    assert p.returncode == 2
    assert "MEMTIDE_DEVICE" in p.stderr
    assert "Traceback" not in p.stderr


# The training job at a size that runs in seconds on 2 cores.
TRAIN_FLAGS = ["--layers", "1", "--hidden", "64", "--heads", "2", "--seq", "32", "--batch", "2", "--vocab", "256",
               "--iterations", "4", "--subgroup-size", "20000"]


def test_cli_run_trains_by_default_json(cli):
    pytest.importorskip("torch")
    p = cli("run", *TRAIN_FLAGS, "--json")
    assert p.returncode == 0, p.stderr
    assert "memtide.optim.TieredAdamW(policy=auto)" in p.stderr  # progress goes to stderr under --json
    assert "step   4/4" in p.stderr
    r = json.loads(p.stdout)
    params = r["model"]["params"]
    assert r["model"]["layers"] == 1 and params > 0
    assert len(r["steps"]) == 4 and r["steps"][-1]["loss"] < r["steps"][0]["loss"]
    assert r["optimizer"]["numel"] == params
    assert r["optimizer"]["subgroups"] == -(-params // 20000)
    assert r["optimizer"]["state_bytes"] >= 16 * params
    assert r["update"]["params_per_step"] == params
    assert r["update"]["engine_params_per_second"] > 0 and r["update"]["steps_measured"] == 3
    assert [p["policy"] for p in r["policies"]] == ["cpu", "static", "interleaved", "auto"]
    assert r["policies_identical"] is True
    for name in ("forward", "backward", "update"):
        assert r["phases"][name]["seen"] and r["phases"][name]["duration_ns"] > 0
    if r["optimizer"]["engine"] == "scheduler":
        # The UpdateScheduler ran the PerfModel's plan (on a data-mode SimDevice without a GPU).
        ep = r["plan"]["engine_plan"]
        assert len(ep["placement"]) == r["optimizer"]["subgroups"]
        cpu = ep["placement"].count("c")
        assert r["plan"]["placement"] == {"cpu": cpu, "gpu": len(ep["placement"]) - cpu}
        assert r["update"]["predicted_seconds"] > 0 and r["update"]["measured_seconds"] > 0
        assert r["update"]["measured_clock"] == ("simulated" if r["device"]["memtide_backend"] == "sim" else "wall")
    elif r["device"]["kind"] == "cpu":
        assert r["plan"]["placement"] == {"cpu": r["optimizer"]["subgroups"], "gpu": 0}
        assert "no GPU" in r["plan"]["summary"] or r["plan"]["reason"] == ""


def test_cli_run_trains_by_default_text(cli):
    pytest.importorskip("torch")
    p = cli("run", *TRAIN_FLAGS, "--policy", "interleaved", "--k", "2", "--device", "sim")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert out.startswith("training a 1-layer GPT-style model")
    for needle in ("step   1/4", "per phase", "plan      policy interleaved (k=2):", "params/s",
                   "identical results under every policy: yes", "on CPU (fp32"):
        assert needle in out, needle
    if "engine scheduler" in out:
        # The scheduler runs the GPU placements on the SimDevice; its clock is virtual, and the
        # output says so next to the PerfModel's prediction.
        assert "PerfModel plan: placement cgcg" in out
        assert "update phase predicted" in out and "simulated" in out
    else:
        assert "the policy asked for" in out  # the CPU engine runs nothing on a GPU, and the plan says so


def test_cli_run_train_flag_errors(cli):
    p = cli("run", "--hidden", "65", "--heads", "2")
    assert p.returncode == 2 and "--hidden (65) must be a multiple of --heads (2)" in p.stderr
    p = cli("run", "--policy", "gpu")
    assert p.returncode == 2 and "'interleaved'" in p.stderr
    p = cli("run", "--gpu-static-fraction", "2")
    assert p.returncode == 2 and "--gpu-static-fraction" in p.stderr
    assert "Traceback" not in p.stderr


def test_console_script():
    # Where pip put it for the interpreter running the tests (a venv's bin need not be on PATH):
    # its scripts folder, the folder of the interpreter itself, or the user scheme's.
    folders = [sysconfig.get_path("scripts"), str(Path(sys.executable).parent),
               sysconfig.get_path("scripts", f"{os.name}_user")]
    found = [shutil.which("memtide", path=folder) for folder in folders]
    exe = next((f for f in found if f is not None), None)
    assert exe is not None, f"no memtide console script in {folders}"
    p = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == f"memtide {memtide.__version__}"


def _omp_policy_after(script, env_policy):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    out = subprocess.run([sys.executable, "-c", script + "; import os; print(os.environ.get('OMP_WAIT_POLICY'))"],
                         env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


# Passive waiting slows torch's own CPU ops; it is asked for only where memtide's CPU step cannot
# run on torch's threads (no torch bridge), and only while torch has not started OpenMP.
_BRIDGE = os.path.exists(os.path.join(os.path.dirname(memtide.__file__), "libmemtide_torch.so"))


@pytest.mark.parametrize(
    "script, env_policy, expected",
    [
        ("import memtide", None, "None" if _BRIDGE else "PASSIVE"),
        ("import memtide", "ACTIVE", "ACTIVE"),  # the user's choice stands
        ("import torch, memtide", None, "None"),  # too late to matter: left alone
    ],
)
def test_import_sets_passive_omp_wait_only_where_the_step_runs_on_its_own_pool(script, env_policy, expected):
    assert _omp_policy_after(script, env_policy) == expected


def test_cli_reader_leaving_early_is_not_a_traceback():
    # `memtide info --json | head -c 0`: the reader is gone before the CLI (still importing) writes.
    p = subprocess.Popen([sys.executable, "-m", "memtide.cli", "info", "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env={k: v for k, v in os.environ.items() if not k.startswith("MEMTIDE_")})
    p.stdout.close()
    stderr = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
    assert rc == 141


def test_phase_report_has_no_low_water_before_anything_was_observed():
    # A fresh process: the runtime starts in "other" and nothing has been allocated yet.
    script = "import json, memtide; print(json.dumps(memtide.phase_report()['running']['phases']['other']))"
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                       env={k: v for k, v in os.environ.items() if not k.startswith("MEMTIDE_")})
    other = json.loads(p.stdout)
    assert other["seen"] is True
    assert other["min_free"] is None  # not 2**64 - 1
