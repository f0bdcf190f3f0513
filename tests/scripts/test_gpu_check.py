"""scripts/gpu_check.sh on a machine without a GPU: it runs through to the summary, marks every
GPU step skipped with the reason, and exits 0 (the GPU run itself needs a GPU machine)."""

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


def test_without_a_gpu_every_gpu_step_is_skipped_with_the_reason(tmp_path):
    out = tmp_path / "results"
    p = run_check(tmp_path, str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    rows = summary_rows((out / "summary.md").read_text())
    expected = {"machine", "build", "ctest", "cuda-suites", "install", "probe", "backend-memtide", "observe",
                "timeline", "nvme-probe", "nvme-train", "torch-bridge", "bench-window-gpu",
                "bench-update-phase", "pytest", "bench-adamw-gpu", "bench-torch-allocator", "bench-allocator",
                "bench-host"}
    assert set(rows) == expected
    assert rows["machine"][0] == "passed"
    for step, (result, why) in rows.items():
        if step != "machine":
            assert result == "skipped", (step, result, why)
            assert why.startswith("no GPU: nvidia-smi"), (step, why)
    # The table is printed at the end too, one row per step.
    tail = p.stdout.splitlines()[-(len(expected) + 2):]
    assert tail[0].split()[:3] == ["step", "result", "seconds"]
    assert {line.split()[0] for line in tail[1:-1]} == expected
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "./machine.log" in tar.getnames()


def test_a_gpu_that_nvidia_smi_does_not_list_is_no_gpu(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    (fake / "nvidia-smi").chmod(0o755)
    p = run_check(tmp_path, str(tmp_path / "r"), path=f"{fake}{os.pathsep}{no_gpu_path(tmp_path)}")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = summary_rows((tmp_path / "r" / "summary.md").read_text())
    assert rows["build"] == ("skipped", rows["build"][1])
    assert "nvidia-smi lists none" in rows["build"][1]


def test_output_folder_defaults_to_out(tmp_path):
    env_out = tmp_path / "from-env"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTIDE_")}
    env.update(PATH=no_gpu_path(tmp_path), OUT=str(env_out))
    p = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (env_out / "summary.md").is_file()


@pytest.mark.parametrize("args, message", [(["--bogus"], "unknown option --bogus"),
                                           (["a", "b"], "one output folder only")])
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
