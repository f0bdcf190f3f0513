"""scripts/gpu_check.sh on a machine without a GPU (the dry run): it runs through to the summary,
marks every GPU step skipped with the reason, and exits 0 (the GPU run itself needs a GPU
machine). And its tiers: the quick one fits 300 s by its steps' caps."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def no_gpu_path(tmp_path: Path) -> str:
    """PATH without nvidia-smi, even where the test machine has one."""
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not (Path(d) / "nvidia-smi").exists()]
    return os.pathsep.join(dirs)


def run_check(tmp_path: Path, *args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMTIDE_", "OUT"))}
    env["PATH"] = path if path is not None else no_gpu_path(tmp_path)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def summary_rows(text: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] not in ("step", "---"):
            rows[cells[0]] = (cells[1], cells[3])
    return rows


QUICK = ["machine", "install", "cuda-kernels", "cuda-suites", "torch-bridge", "update-phase", "layer-window",
         "timeline"]
FULL = ["machine", "install", "sanitizer", "pytest", "probe", "observe", "nvme-probe", "nvme-train",
        "bench-checkpoint", "bench-adamw-gpu", "bench-torch-allocator", "bench-allocator", "bench-host", "gtest-all"]


def plan(*args: str) -> tuple[int, list[tuple[str, int, str, str]]]:
    """The steps `gpu_check.sh --plan` prints: (budget, [(step, cap, how, needs), ...])."""
    p = subprocess.run(["bash", str(SCRIPT), "--plan", *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    head, *rows = p.stdout.splitlines()
    budget = int(head.split("(budget ")[1].split()[0])
    steps = []
    for row in rows:
        name, cap, how, needs = row.split()
        steps.append((name, int(cap), how, needs))
    return budget, steps


def test_quick_tier_caps_add_up_to_at_most_300_s():
    """The quick tier's wall time is bounded by its caps: the serial steps one after the other, the
    background install, and the steps that overlap it (each ends by the install's cap)."""
    budget, steps = plan("--quick")
    assert [s[0] for s in steps] == QUICK
    assert budget <= 300
    serial = sum(cap for _, cap, how, _ in steps if how in ("serial", "bg"))
    assert serial <= 300, steps
    bg = [cap for _, cap, how, _ in steps if how == "bg"]
    assert len(bg) == 1
    for name, cap, how, _ in steps:
        assert how in ("serial", "bg", "overlap"), name
        if how == "overlap":
            assert cap <= bg[0], (name, cap)
    # Ordered by what they prove: the kernels and the bridge before the timings.
    assert QUICK.index("cuda-kernels") < QUICK.index("update-phase")
    assert QUICK.index("torch-bridge") < QUICK.index("update-phase")


def test_full_tier_keeps_the_rest_and_fits_one_call():
    budget, steps = plan("--full")
    assert [s[0] for s in steps] == FULL
    assert budget <= 600 - 30  # one call's limit, with room for the start and the transfers
    _, every = plan("--all")
    assert [s[0] for s in every] == QUICK + FULL[2:]


def test_only_adds_machine_and_the_install_a_step_needs():
    _, steps = plan("--only", "cuda-kernels")
    assert [s[0] for s in steps] == ["machine", "cuda-kernels"]
    _, steps = plan("--only", "pytest,torch-bridge")
    assert [s[0] for s in steps] == ["machine", "install", "torch-bridge", "pytest"]


@pytest.mark.parametrize("tier, expected", [([], QUICK), (["--full"], FULL), (["--only", "update-phase,timeline"],
                                                                              ["machine", "install", "update-phase",
                                                                               "timeline"])])
def test_without_a_gpu_every_gpu_step_is_skipped_with_the_reason(tmp_path, tier, expected):
    out = tmp_path / "results"
    p = run_check(tmp_path, *tier, str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rows = summary_rows((out / "summary.md").read_text())
    assert list(rows) == expected
    assert rows["machine"][0] == "passed"
    for step, (result, why) in rows.items():
        if step != "machine":
            assert result == "skipped", (step, result, why)
            assert why.startswith("no GPU: nvidia-smi"), (step, why)
    # The table is printed at the end too, one row per step.
    tail = p.stdout.splitlines()[-(len(expected) + 2):]
    assert tail[0].split()[:3] == ["step", "result", "seconds"]
    assert [line.split()[0] for line in tail[1:-1]] == expected
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "./machine.log" in tar.getnames()
    # Only the summary and the logs: no empty results folders.
    assert sorted(x.name for x in out.iterdir()) == ["logs.tar.gz", "summary.md"]


def test_a_gpu_that_nvidia_smi_does_not_list_is_no_gpu(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    (fake / "nvidia-smi").chmod(0o755)
    p = run_check(tmp_path, str(tmp_path / "r"), path=f"{fake}{os.pathsep}{no_gpu_path(tmp_path)}")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = summary_rows((tmp_path / "r" / "summary.md").read_text())
    assert rows["install"][0] == "skipped"
    assert "nvidia-smi lists none" in rows["install"][1]


def test_output_folder_defaults_to_out(tmp_path):
    env_out = tmp_path / "from-env"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTIDE_")}
    env.update(PATH=no_gpu_path(tmp_path), OUT=str(env_out))
    p = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (env_out / "summary.md").is_file()


@pytest.mark.parametrize("args, message", [(["--bogus"], "unknown option --bogus"),
                                           (["a", "b"], "one output folder only"),
                                           (["--only"], "--only needs a list of steps"),
                                           (["--only", "nope,pytest"], "--only: no step 'nope'")])
def test_bad_arguments_are_named(tmp_path, args, message):
    p = run_check(tmp_path, *args)
    assert p.returncode == 2
    assert message in p.stderr


def test_an_unwritable_output_folder_is_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    p = run_check(tmp_path, str(blocker / "sub"))
    assert p.returncode == 2
    assert "cannot create" in p.stderr


def test_a_relative_output_folder_is_taken_from_the_callers_directory(tmp_path):
    p = run_check(tmp_path, "relative")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "relative" / "summary.md").is_file()
