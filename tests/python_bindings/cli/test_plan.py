"""`memtide plan` and the PerfModel bindings behind it."""

from __future__ import annotations

import json
import math

import pytest

import memtide

_POLICIES = ("cpu", "static", "interleaved", "auto")


def _plan_json(cli, *args: str) -> dict:
    r = cli("plan", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# ---- bindings -----------------------------------------------------------------------------------


def test_default_rates_are_the_model_fields():
    rates = memtide.default_rates()
    assert set(rates) == {
        "h2d_bytes_per_s", "d2h_bytes_per_s", "cpu_update_params_per_s", "gpu_update_params_per_s",
        "cpu_downscale_params_per_s", "host_dram_bytes_per_s", "cpu_dram_bytes_per_param",
        "nvme_read_bytes_per_s", "nvme_write_bytes_per_s",
    }
    assert all(v >= 0 for v in rates.values())


def test_plan_update_every_policy():
    sizes = [100_000_000] * 40
    for policy in _POLICIES:
        plan = memtide.plan_update(sizes, policy=policy, gpu_static_limit=4)
        assert plan["policy"] == policy
        assert len(plan["placement"]) == 40
        assert plan["placement"].count("g") == plan["gpu_streamed"]
        assert plan["placement"].count("s") == plan["static_residents"]
        pred = plan["prediction"]
        assert pred["bound_ns"] <= pred["total_ns"]
        assert pred["busiest"] in ("cpu", "gpu", "h2d", "d2h", "dram")
    auto = memtide.plan_update(sizes, gpu_static_limit=4)["prediction"]["total_ns"]
    for policy in ("cpu", "static", "interleaved"):
        other = memtide.plan_update(sizes, policy=policy, gpu_static_limit=4)["prediction"]["total_ns"]
        assert auto <= other * (1 + 1e-9)


def test_predict_update_matches_the_plan():
    sizes = [50_000_000] * 12
    plan = memtide.plan_update(sizes, policy="interleaved", k=3)
    assert plan["placement"] == "ccg" * 4
    pred = memtide.predict_update(sizes, plan["placement"])
    assert pred == plan["prediction"]


def test_rates_override_moves_the_plan():
    sizes = [100_000_000] * 40
    slow_cpu = memtide.plan_update(sizes, rates={"cpu_update_params_per_s": 0.5e9})
    fast_cpu = memtide.plan_update(sizes, rates={"cpu_update_params_per_s": 16e9})
    assert slow_cpu["gpu_streamed"] > fast_cpu["gpu_streamed"]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"rates": {"h2d_bytes_per_s": 0.0}}, "h2d_bytes_per_s"),
        ({"rates": {"gpu_update_params_per_s": math.nan}}, "gpu_update_params_per_s"),
        ({"rates": {"no_such_rate": 1.0}}, "no_such_rate"),
        ({"policy": "greedy"}, "policy"),
        ({"static_fraction": 2.0, "policy": "static"}, "static_fraction"),
        ({"gpu_slot_limit": -1}, "gpu_slot_limit"),
    ],
)
def test_plan_update_rejects_bad_inputs(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        memtide.plan_update([100] * 4, **kwargs)
    with pytest.raises(ValueError, match="subgroup_params"):
        memtide.plan_update([])
    with pytest.raises(ValueError, match="subgroup_params"):
        memtide.plan_update([100, 0])
    with pytest.raises(ValueError, match="placement"):
        memtide.predict_update([100, 100], "cx")


# ---- memtide plan -------------------------------------------------------------------------------


def test_plan_text_names_defaults_and_every_policy(cli):
    r = cli("plan")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "H100 testbed" in out
    for policy in _POLICIES:
        assert policy in out
    assert "busiest resource" in out
    assert "params/s" in out


def test_plan_json_layout(cli):
    result = _plan_json(cli, "--params", "20B", "--subgroup-size", "100M")
    assert result["subgroups"] == 200
    assert set(result["policies"]) == set(_POLICIES)
    auto = result["policies"]["auto"]
    assert result["k"] == auto["k"]
    assert result["static_residents"] == auto["static_residents"]
    assert result["gpu_slots"] == auto["gpu_slots"]
    for p in result["policies"].values():
        assert p["bound_s"] <= p["predicted_update_s"]
        assert p["throughput_params_per_s"] == pytest.approx(20e9 / p["predicted_update_s"])
        assert len(p["placement"]) == 200
    for other in ("cpu", "static", "interleaved"):
        assert auto["predicted_update_s"] <= result["policies"][other]["predicted_update_s"] * (1 + 1e-9)


def test_plan_param_spellings_agree(cli):
    a = _plan_json(cli, "--params", "7B")
    b = _plan_json(cli, "--params", "7e9")
    c = _plan_json(cli, "--params", "7000000000")
    assert a["params"] == b["params"] == c["params"] == 7_000_000_000
    assert a["policies"] == b["policies"] == c["policies"]


def test_plan_partial_last_subgroup(cli):
    result = _plan_json(cli, "--params", "1.05B", "--subgroup-size", "100M")
    assert result["subgroups"] == 11


def test_plan_gpu_memory_sets_slots_and_static_limit(cli):
    # 1B params: 4 GB persistent; 16 B x 100M = 1.6 GB per slot.
    base = ["--params", "1B", "--subgroup-size", "100M", "--margin", "0"]
    small = _plan_json(cli, *base, "--gpu-mem", str(4 * 10**9 + 2 * 1_600_000_000 + 1))
    assert small["gpu"]["slot_limit"] == 2
    assert small["gpu"]["static_limit"] == 0
    assert small["policies"]["auto"]["gpu_slots"] <= 2
    # A resident's block takes a segment of its own, rounded to 2 MiB: 5 need 5 x 2 MiB more.
    big = _plan_json(cli, *base, "--gpu-mem", str(4 * 10**9 + 8 * 1_600_000_000 + 5 * 2**21))
    assert big["gpu"]["slot_limit"] == 8
    assert big["gpu"]["static_limit"] == 5
    assert big["policies"]["auto"]["static_residents"] <= 5
    assert big["policies"]["static"]["static_residents"] == 2  # round(0.2 * 10)
    none = _plan_json(cli, *base, "--gpu-mem", str(4 * 10**9 + 1_000_000_000))
    assert none["gpu"]["slot_limit"] == 0
    for p in none["policies"].values():
        assert p["gpu_streamed"] == 0


def test_plan_rate_flags_change_the_plan(cli):
    slow = _plan_json(cli, "--cpu-update", "0.5")
    fast = _plan_json(cli, "--cpu-update", "20")
    assert slow["policies"]["auto"]["gpu_streamed"] > fast["policies"]["auto"]["gpu_streamed"]
    assert slow["rates"]["cpu_update_params_per_s"] == 0.5e9
    assert "--cpu-update" in slow["overridden"]
    unfused = _plan_json(cli, "--cpu-downscale", "8.7")
    fused = _plan_json(cli)
    assert (unfused["policies"]["cpu"]["predicted_update_s"]
            > fused["policies"]["cpu"]["predicted_update_s"])


def test_plan_policy_selects_the_top_level(cli):
    result = _plan_json(cli, "--policy", "interleaved", "--k", "3")
    assert result["policy"] == "interleaved"
    assert result["k"] == 3
    assert result["policies"]["interleaved"]["placement"].startswith("ccgccg")


def test_plan_host_memory_too_small_exits_1(cli):
    r = cli("plan", "--params", "20B", "--host-mem", "256GB")
    assert r.returncode == 1
    assert "NVMe" in r.stderr
    assert "Traceback" not in r.stderr


def test_plan_model_too_big_for_the_gpu_exits_1(cli):
    r = cli("plan", "--params", "30B", "--gpu-mem", "80GiB", "--host-mem", "1TB")
    assert r.returncode == 1
    assert "--gpu-mem" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--params", "lots"), ("--params", "0"), ("--params", "-5B"),
        ("--subgroup-size", "0"), ("--gpu-mem", "80XB"), ("--host-mem", "-1GB"),
        ("--h2d", "0"), ("--d2h", "nan"), ("--cpu-update", "-2"), ("--gpu-update", "fast"),
        ("--cpu-downscale", "-1"), ("--dram", "inf"), ("--static-fraction", "1.5"),
        ("--k", "-1"), ("--k", "0.5"), ("--policy", "greedy"), ("--margin", "lots"),
        ("--params", "1e30"), ("--params", "1e18"), ("--gpu-mem", "1e30"), ("--host-mem", "1e300"),
        # Finite but overflowing once scaled to B/s (it named rates.h2d_bytes_per_s), and too slow for any clock.
        ("--h2d", "1e308"), ("--d2h", "1e300"), ("--cpu-update", "1e308"), ("--gpu-update", "1e20"),
        ("--dram", "1e308"), ("--cpu-downscale", "1e308"), ("--nvme-read", "1e308"), ("--h2d", "1e-30"),
        ("--dram", "1e-30"), ("--cpu-update", "1e-12"),
    ],
)
def test_plan_bad_flag_exits_2_naming_it(cli, flag, value):
    r = cli("plan", f"{flag}={value}")
    assert r.returncode == 2
    assert flag in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args, where", [
    ((), "k = 1.6"),  # the 20B default streams: its stride is a number
    (("--params", "1B"), "every subgroup stays on the GPU as a static resident"),
    (("--policy", "cpu"), "every subgroup is updated on the CPU"),
    (("--policy", "static", "--params", "5B"), "the 40 subgroups that are not static residents are updated on the CPU"),
])
def test_plan_says_where_the_subgroups_go_when_nothing_is_streamed(cli, args, where):
    # It printed "auto: k = 0.000 (one in every k streamed subgroups on the GPU)", a stride of 0.
    r = cli("plan", *args)
    assert r.returncode == 0, r.stderr
    summary = r.stdout.strip().splitlines()[-1]
    assert where in summary, summary
    assert "k = 0.000" not in r.stdout


def test_plan_refuses_absurdly_small_subgroups_at_once(cli):
    r = cli("plan", "--params", "20B", "--subgroup-size", "1000")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "20000000 subgroups" in r.stderr and f"at most {memtide.MAX_SUBGROUPS}" in r.stderr


def test_a_state_larger_than_host_memory_is_planned_with_an_nvme_tier(cli):
    r = cli("plan", "--params", "20B", "--host-mem", "200GB", "--nvme-read", "6", "--nvme-write", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    nv = out["nvme"]
    assert nv["subgroups"] > 0 and nv["read_bytes_per_s"] == 6e9
    # What stays in host memory fits: every spilled subgroup takes its 12 B/param to the drive.
    assert out["host"]["optimizer_state"] - nv["state_bytes"] <= 200e9
    auto = out["policies"]["auto"]
    assert auto["busy_s"]["nvme"] > 0 and auto["predicted_update_s"] >= auto["busy_s"]["nvme"]
    # Without the drive's rates the same model is refused, naming the flags.
    q = cli("plan", "--params", "20B", "--host-mem", "200GB")
    assert q.returncode != 0 and "--nvme-read" in q.stderr and "memtide probe --nvme" in q.stderr
    z = cli("plan", "--params", "20B", "--host-mem", "10GB", "--nvme-read", "6", "--nvme-write", "3")
    assert z.returncode != 0 and "too small" in z.stderr and "Traceback" not in z.stderr
