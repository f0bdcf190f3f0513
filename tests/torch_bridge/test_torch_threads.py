"""TieredAdamW's CPU step on torch's intra-op threads (memtide.torch_bridge.use_torch_threads).

Why it matters: on memtide's own pool the step shared the cores with torch's OpenMP workers,
still spinning after backward. The checks: with the bridge the step's chunks run on torch's
workers and give the same bits as memtide's own pool; without it memtide keeps its pool and says
so once. Each case runs in a fresh interpreter, torch imported before memtide as users do.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import memtide  # noqa: E402
import memtide.torch_bridge as torch_bridge  # noqa: E402
from memtide_testing import clean_env, run_python  # noqa: E402


def bridge_expected() -> bool:
    """The install builds the bridge wherever memtide has CUDA and torch does (no GPU needed)."""
    return memtide.cuda_status()["compiled"] and torch.version.cuda is not None


def run(script: str, **env: str):
    p = run_python(["-c", script], env=clean_env(MEMTIDE_DEVICE="sim", **env))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


TRAIN = """
import json, torch
torch.set_num_threads(2)
import memtide, memtide.torch_bridge as tb
from memtide import _memtide
from memtide.optim import TieredAdamW

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512))

x = torch.randn(8, 512, generator=torch.Generator().manual_seed(1))
out = {}
"""


@pytest.fixture
def need_bridge():
    if not bridge_expected():
        pytest.skip("the bridge needs memtide and torch with CUDA")


def test_step_runs_on_torchs_workers_with_the_bits_of_memtides_pool(need_bridge):
    r, _ = run(TRAIN + """
on, off = model(), model()
oa = TieredAdamW(on.parameters(), lr=1e-2, weight_decay=0.1, policy="cpu")
ob = TieredAdamW(off.parameters(), lr=1e-2, weight_decay=0.1, policy="cpu")
out["executor_after_init"] = _memtide.cpu_executor()
before = tb.torch_thread_counts()
for step in range(4):
    for m, o, threads in ((on, oa, True), (off, ob, False)):
        tb.use_torch_threads(threads)
        assert _memtide.cpu_executor() == ("torch" if threads else None)
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
after = tb.torch_thread_counts()
out["jobs"] = after["jobs"] - before["jobs"]
out["worker_calls"] = after["worker_calls"] - before["worker_calls"]
out["same_bits"] = all(torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32))
                       for a, b in zip(on.parameters(), off.parameters()))
out["moved"] = not torch.equal(on[0].weight, model()[0].weight)
print(json.dumps(out))
""")
    assert r["executor_after_init"] == "torch", "TieredAdamW did not put the CPU step on torch's threads"
    assert r["jobs"] >= 4, r
    assert r["worker_calls"] >= 4, f"no share of the step ran on torch's workers: {r}"
    assert r["moved"]
    assert r["same_bits"], "torch's threads changed the step's results"


def test_without_the_bridge_memtide_keeps_its_pool_and_says_so_once():
    r, err = run(TRAIN + """
opts = []
for _ in range(2):
    m = model()
    o = TieredAdamW(m.parameters(), lr=1e-2, policy="cpu")
    o.zero_grad()
    m(x).square().mean().backward()
    o.step()
    opts.append(o)
out["executor"] = _memtide.cpu_executor()
out["use"] = tb.use_torch_threads()
print(json.dumps(out))
""", MEMTIDE_TORCH_BRIDGE="false", MEMTIDE_LOG_LEVEL="info")
    assert r["executor"] is None and r["use"] is False
    lines = [ln for ln in err.splitlines() if "runs on memtide's own threads" in ln]
    assert len(lines) == 1, err
    assert "MEMTIDE_TORCH_BRIDGE=false" in lines[0]


def test_use_torch_threads_can_be_turned_off(need_bridge):
    r, _ = run(TRAIN + """
out["on"] = tb.use_torch_threads()
out["while_on"] = _memtide.cpu_executor()
out["off"] = tb.use_torch_threads(False)
out["while_off"] = _memtide.cpu_executor()
TieredAdamW(model().parameters(), policy="cpu")
out["after_a_new_optimizer"] = _memtide.cpu_executor()
print(json.dumps(out))
""")
    assert r == {"on": True, "while_on": "torch", "off": False, "while_off": None, "after_a_new_optimizer": None}, \
        "an optimizer built after use_torch_threads(False) must keep to memtide's pool"


@pytest.mark.parametrize("value", ["no", "false", 0, 1, None, 2.0])
def test_use_torch_threads_takes_only_a_bool(value):
    # A truthy string would have turned it on; the choice is the program's and must say what it means.
    choice = torch_bridge._threads_choice
    with pytest.raises(TypeError, match="enable must be True or False"):
        torch_bridge.use_torch_threads(value)
    assert torch_bridge._threads_choice is choice  # nothing changed
