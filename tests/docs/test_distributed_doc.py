"""The snippets of docs/distributed.md run as a user would run them: each Python block preceded by
a `<!-- run: python -->` or `<!-- run: torchrun N -->` line is written to a file and run (torchrun:
N ranks, gloo on CPU), and must exit 0. The snippets check their own results (that the model
trained, that a checkpoint loads); a block marked `<!-- run: no, REASON -->` is shown only."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from memtide_testing import clean_env

DOC = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
MARK = re.compile(r"<!-- run: (?P<how>[^>]*?) -->\s*```python\n(?P<code>.*?)```", re.S)


def snippets():
    text = DOC.read_text()
    found = []
    for m in MARK.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        found.append(pytest.param(m["how"].strip(), m["code"], id=f"line{line}"))
    return found


def test_every_python_block_is_marked():
    text = DOC.read_text()
    blocks = len(re.findall(r"```python\n", text))
    assert blocks == len(snippets()), "a ```python block of docs/distributed.md has no <!-- run: ... --> line"


@pytest.mark.parametrize("how, code", snippets())
def test_snippet_runs(how, code, tmp_path):
    if how.startswith("no"):
        pytest.skip(f"shown only: {how[2:].strip(' ,')}")
    script = tmp_path / "snippet.py"
    script.write_text(code)
    if how == "python":
        command = [sys.executable, str(script)]
    else:
        kind, ranks = how.split()
        assert kind == "torchrun", how
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                   str(script)]
    env = clean_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-4000:])


def test_every_multi_process_snippet_ends_its_process_group():
    # A gloo group alive at interpreter exit can abort the process after training finished
    # (pytorch/pytorch#190489): the snippets show the ending a user should copy.
    for param in snippets():
        how, code = param.values
        if how.startswith("torchrun"):
            *_, ending, flush, leave = code.rstrip().splitlines()
            assert "destroy_process_group()" in ending or "end_training()" in ending, (param.id, ending)
            # ... and leaves without the interpreter's shutdown, in which gloo's threads may still
            # free tensors and abort the process (docs/distributed.md, "Ending a run").
            assert flush == "sys.stdout.flush()" and leave.startswith("os._exit(0)"), (param.id, flush, leave)
