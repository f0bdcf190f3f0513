"""memtide chosen and configured through PYTORCH_CUDA_ALLOC_CONF.

The parsing is tested in-process on plain dicts; the start-up hook, torch's entry point and the
allocator swap run in fresh interpreters, since each happens once per process.
"""

from __future__ import annotations

import json
import subprocess
import sysconfig

import pytest

alloc_conf = pytest.importorskip("_memtide_alloc_conf")

from memtide_testing import clean_env, run_python  # noqa: E402


def strip(env):
    env = dict(env)
    alloc_conf.strip_environ(env)
    return env


# ---- parsing (no torch) ---------------------------------------------------------------------------


def test_memtide_items_become_options_and_torch_items_stay_in_order():
    env = strip({"PYTORCH_CUDA_ALLOC_CONF":
                 "garbage_collection_threshold:0.6, backend:memtide,memtide_max_bytes:60GiB,"
                 "max_split_size_mb:512,memtide_Host_Node:1"})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.6,max_split_size_mb:512"
    assert env["MEMTIDE_MAX_BYTES"] == "60GiB"
    assert env["MEMTIDE_HOST_NODE"] == "1"
    assert env[alloc_conf.SELECTED] == "1"
    assert alloc_conf.origins(env) == {
        "max_bytes": "PYTORCH_CUDA_ALLOC_CONF item memtide_max_bytes:60GiB",
        "host_node": "PYTORCH_CUDA_ALLOC_CONF item memtide_Host_Node:1",
    }
    alloc_conf.check(env)  # no problem recorded


def test_a_variable_with_only_memtide_items_is_removed():
    env = strip({"PYTORCH_ALLOC_CONF": "backend:memtide"})  # the newer alias
    assert "PYTORCH_ALLOC_CONF" not in env
    assert env[alloc_conf.SELECTED] == "1"


def test_torchs_expandable_segments_spelling_reaches_memtide_too():
    env = strip({"PYTORCH_CUDA_ALLOC_CONF": "backend:memtide,expandable_segments:False"})
    assert env["MEMTIDE_EXPANDABLE_SEGMENTS"] == "False"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"  # torch accepts it
    # memtide's own item wins over torch's spelling; without backend:memtide it is torch's alone.
    env = strip({"PYTORCH_CUDA_ALLOC_CONF": "backend:memtide,expandable_segments:False,memtide_expandable_segments:1"})
    assert env["MEMTIDE_EXPANDABLE_SEGMENTS"] == "1"
    env = strip({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,memtide_record_history:1"})
    assert "MEMTIDE_EXPANDABLE_SEGMENTS" not in env


def test_options_without_the_backend_do_not_select_memtide():
    env = strip({"PYTORCH_CUDA_ALLOC_CONF": "memtide_record_history:1"})
    assert env["MEMTIDE_RECORD_HISTORY"] == "1"
    assert alloc_conf.SELECTED not in env


def test_variables_without_memtide_are_untouched():
    before = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "MEMTIDE_MAX_BYTES": "1GiB"}
    assert strip(before) == before


@pytest.mark.parametrize(
    "conf, env, words",
    [
        ("memtide_max_bytes", {}, ["memtide_max_bytes", "memtide_<option>:<value>"]),
        ("memtide_max_bytes:", {}, ["memtide_max_bytes:", "memtide_<option>:<value>"]),
        ("memtide_:3", {}, ["memtide_:3"]),
        ("memtide_max_bytes:1GiB,memtide_max_bytes:2GiB", {}, ["given twice", "1GiB", "2GiB"]),
        ("backend:memtide,backend:cudaMallocAsync", {}, ["backend:cudaMallocAsync", "keep one"]),
        ("memtide_max_bytes:1GiB", {"MEMTIDE_MAX_BYTES": "2GiB"}, ["memtide_max_bytes:1GiB", "MEMTIDE_MAX_BYTES", "2GiB"]),
        # '=' for ':': torch's own parser aborts the interpreter on it, so memtide names it first.
        ("backend=memtide", {}, ["'backend=memtide'", "'='", "write 'backend:memtide'"]),
        ("Backend = Memtide", {}, ["'Backend = Memtide'", "write 'Backend:Memtide'"]),
        ("memtide_max_bytes=1GiB", {}, ["'memtide_max_bytes=1GiB'", "write 'memtide_max_bytes:1GiB'"]),
    ],
)
def test_problems_are_recorded_and_memtide_items_still_removed(conf, env, words):
    out = strip({"PYTORCH_CUDA_ALLOC_CONF": conf + ",roundup_power2_divisions:4", **env})
    assert out["PYTORCH_CUDA_ALLOC_CONF"] in ("roundup_power2_divisions:4", "roundup_power2_divisions:4,backend:cudaMallocAsync",
                                              "backend:cudaMallocAsync,roundup_power2_divisions:4")
    with pytest.raises(alloc_conf.AllocConfError) as err:
        alloc_conf.check(out)
    for word in words:
        assert word in str(err.value)
    assert "PYTORCH_CUDA_ALLOC_CONF" in str(err.value)


@pytest.mark.parametrize("conf", ["Backend:memtide", "backend:MEMTIDE", "BACKEND: Memtide", "MEMTIDE_MAX_BYTES:1GiB,backend:memtide"])
def test_letter_case_does_not_make_memtide_items_vanish(conf):
    env = strip({"PYTORCH_CUDA_ALLOC_CONF": conf + ",max_split_size_mb:512"})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    assert env[alloc_conf.SELECTED] == "1"
    if "MAX_BYTES" in conf:
        assert env["MEMTIDE_MAX_BYTES"] == "1GiB"


def test_a_child_may_change_what_its_parents_variable_set():
    parent = strip({"PYTORCH_CUDA_ALLOC_CONF": "backend:memtide,memtide_max_bytes:1GiB"})
    child = strip({**parent, "PYTORCH_CUDA_ALLOC_CONF": "backend:memtide,memtide_max_bytes:2GiB"})
    alloc_conf.check(child)
    assert child["MEMTIDE_MAX_BYTES"] == "2GiB"
    assert alloc_conf.origins(child)["max_bytes"] == "PYTORCH_CUDA_ALLOC_CONF item memtide_max_bytes:2GiB"
    # A variable the user set is still theirs: a different value disagrees.
    user = strip({"MEMTIDE_MAX_BYTES": "1GiB", "PYTORCH_CUDA_ALLOC_CONF": "memtide_max_bytes:2GiB"})
    with pytest.raises(alloc_conf.AllocConfError, match="disagrees"):
        alloc_conf.check(user)


@pytest.mark.parametrize("a, b", [("1GiB", "1073741824"), ("1gib", "1GiB"), ("True", "1"), ("off", "false"),
                                  ("1.5GiB", "1536MiB")])
def test_equal_values_spelled_differently_agree(a, b):
    env = strip({"PYTORCH_CUDA_ALLOC_CONF": f"memtide_max_bytes:{a}", "MEMTIDE_MAX_BYTES": b})
    alloc_conf.check(env)
    assert not alloc_conf.same_value("1GiB", "2GiB") and not alloc_conf.same_value("true", "0")


def test_an_agreeing_environment_variable_is_fine():
    env = strip({"PYTORCH_CUDA_ALLOC_CONF": "memtide_max_bytes:1GiB", "MEMTIDE_MAX_BYTES": "1GiB"})
    alloc_conf.check(env)
    assert env["MEMTIDE_MAX_BYTES"] == "1GiB"


def test_random_variables_never_break_start_up():
    """A seeded property test of the parser that runs inside site.py: for any value of the
    variables (memtide items, torch items, junk, any letter case, separators), strip_environ never
    raises, removes every memtide item, keeps every other item in its order, and any problem it
    records names the variable."""
    import random

    rng = random.Random(1)
    pieces = ["backend:memtide", "Backend:MEMTIDE", "backend:cudaMallocAsync", "memtide_max_bytes:1GiB",
              "memtide_max_bytes:", "memtide_:3", "MEMTIDE_HOST_NODE:0", "memtide_record_history:true",
              "max_split_size_mb:512", "garbage_collection_threshold:0.6", "expandable_segments:True", "", " ",
              ":", ",", "memtide", "memtide_x:y:z", "backend:", "\u00e9:1", "memtide_max_bytes:2GiB"]
    for _ in range(20000):
        items = [rng.choice(pieces) if rng.random() < 0.8 else
                 "".join(rng.choice("memtide_:,abBK01 ") for _ in range(rng.randint(0, 12)))
                 for _ in range(rng.randint(0, 6))]
        var = rng.choice(alloc_conf.CONF_VARS)
        env = {var: ",".join(items)}
        if rng.random() < 0.3:
            env["MEMTIDE_MAX_BYTES"] = rng.choice(["1GiB", "2GiB", "1073741824"])
        out = strip(env)  # never raises
        if "memtide" not in env[var].lower():
            assert out == env  # not memtide's business: untouched
            continue
        kept = [i.strip() for i in env[var].split(",") if i.strip() and not alloc_conf.is_memtide_item(i)]
        assert out.get(var, "") == ",".join(kept), env
        for item in out.get(var, "").split(","):
            assert not alloc_conf.is_memtide_item(item), (env, out)
        if alloc_conf.ERROR in out:
            assert var in out[alloc_conf.ERROR], (env, out[alloc_conf.ERROR])


# ---- a fresh interpreter: .pth hook, torch's entry point, the swap ------------------------------

torch = pytest.importorskip("torch")

REPORT = """
import json, os, torch, memtide
print(json.dumps({"conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "max_bytes": memtide.options()["max_bytes"],
                  "installed": memtide.torch_allocator_installed(), "cuda_initialized": torch.cuda.is_initialized()}))
"""


def report(env):
    p = run_python(["-c", REPORT], env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_backend_memtide_installs_memtide_at_import_torch():
    r = report(clean_env(PYTORCH_CUDA_ALLOC_CONF="backend:memtide,memtide_max_bytes:1GiB,garbage_collection_threshold:0.6"))
    assert r == {"conf": "garbage_collection_threshold:0.6", "max_bytes": "1.00 GiB", "installed": True,
                 "cuda_initialized": False}


def test_without_the_backend_torch_keeps_its_allocator():
    r = report(clean_env(PYTORCH_CUDA_ALLOC_CONF="memtide_max_bytes:1GiB"))
    assert r["installed"] is False and r["max_bytes"] == "1.00 GiB" and r["conf"] is None


def test_autoload_off_then_import_memtide_installs_it():
    r = report(clean_env(PYTORCH_CUDA_ALLOC_CONF="backend:memtide", TORCH_DEVICE_BACKEND_AUTOLOAD="0"))
    assert r["installed"] is True


def test_autoload_off_and_no_import_memtide_says_so_once():
    env = clean_env(PYTORCH_CUDA_ALLOC_CONF="backend:memtide,memtide_max_bytes:1GiB", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    p = run_python(["-c", "import torch"], env=env)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("nothing acted on it") == 1 and "import memtide after torch" in p.stderr
    p = run_python(["-c", "import memtide, torch"], env=env)  # memtide first: still not acted on
    assert "nothing acted on it" in p.stderr
    p = run_python(["-c", "import torch, memtide"], env=env)  # acted on: nothing to say
    assert p.returncode == 0 and "nothing acted on it" not in p.stderr, p.stderr


def test_variable_set_inside_the_process_before_import_memtide():
    script = ("import os; os.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'backend:memtide,memtide_max_bytes:2GiB'\n"
              "import memtide\n" + REPORT)
    p = run_python(["-c", script], env=clean_env())
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["installed"] is True and r["max_bytes"] == "2.00 GiB" and r["conf"] is None


@pytest.mark.parametrize(
    "conf, words",
    [
        ("backend:memtide,memtide_bogus:1", ["memtide_bogus:1", "no option 'bogus'", "max_bytes"]),
        ("memtide_max_bytes:lots", ["memtide_max_bytes:lots", "MEMTIDE_MAX_BYTES=\"lots\"", "e.g."]),
        ("memtide_max_bytes", ["memtide_<option>:<value>"]),
        ("backend=memtide", ["'backend=memtide'", "write 'backend:memtide'"]),
    ],
)
def test_import_torch_stops_on_a_bad_memtide_item(conf, words):
    p = run_python(["-c", "import torch"], env=clean_env(PYTORCH_CUDA_ALLOC_CONF=conf))
    assert p.returncode != 0
    for word in words:
        assert word in p.stderr
    assert "Unrecognized key" not in p.stderr  # torch never saw memtide's item
    assert "INTERNAL ASSERT" not in p.stderr and "terminate called" not in p.stderr


def test_child_processes_make_the_same_choice():
    script = ("import subprocess, sys, torch, memtide\n"
              "assert memtide.torch_allocator_installed()\n"
              "subprocess.run([sys.executable, '-c', " + repr(REPORT) + "], check=True)\n")
    p = run_python(["-c", script], env=clean_env(PYTORCH_CUDA_ALLOC_CONF="backend:memtide,memtide_max_bytes:3GiB"))
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["installed"] is True and r["max_bytes"] == "3.00 GiB"


# ---- python -S: site.py never runs the .pth hook ------------------------------------------------

def no_site(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`python -S <args>`: torch and memtide are found through PYTHONPATH only."""
    purelib = sysconfig.get_paths()["purelib"]
    return run_python(["-S", *args], env=clean_env(PYTHONPATH=purelib, **env))


def test_python_dash_s_still_acts_on_memtide_items_at_import_torch():
    p = no_site("-c", REPORT, PYTORCH_CUDA_ALLOC_CONF="backend:memtide,memtide_max_bytes:1GiB")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["installed"] is True and r["max_bytes"] == "1.00 GiB" and r["conf"] is None


def test_python_dash_s_still_stops_on_a_bad_memtide_item():
    p = no_site("-c", "import torch", PYTORCH_CUDA_ALLOC_CONF="memtide_bogus:1")
    assert p.returncode != 0 and "memtide_bogus:1" in p.stderr and "no option 'bogus'" in p.stderr


def test_python_dash_s_with_autoload_off_acts_when_memtide_is_imported():
    p = no_site("-c", REPORT, PYTORCH_CUDA_ALLOC_CONF="Backend:MEMTIDE,memtide_max_bytes:3GiB",
                TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["installed"] is True and r["max_bytes"] == "3.00 GiB" and r["conf"] is None
