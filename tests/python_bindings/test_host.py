"""memtide.host.empty: pinned torch tensors from the host arena, via DLPack."""

from __future__ import annotations

import gc
import textwrap

import pytest

import memtide
from memtide_testing import clean_env, run_python

torch = pytest.importorskip("torch")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64, torch.uint8]


@pytest.fixture(scope="module", autouse=True)
def give_slabs_back():
    yield
    gc.collect()
    memtide.host.release_free_slabs()
    memtide.host.release_free_slabs(numa_node=0)


def allocated() -> int:
    gc.collect()
    return memtide.host.stats()["allocated_bytes"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_has_shape_dtype_strides_and_is_writable(dtype):
    t = memtide.host.empty((3, 5, 7), dtype=dtype)
    assert t.shape == (3, 5, 7)
    assert t.dtype == dtype
    assert t.stride() == (35, 7, 1)
    assert t.is_contiguous()
    assert t.device.type == "cpu"
    assert t.data_ptr() % 256 == 0
    t.fill_(3)
    t[1, 2, 3] = 5
    assert t.to(torch.float64).sum().item() == 3 * 105 - 3 + 5
    ref = torch.arange(105, dtype=torch.int64).reshape(3, 5, 7).to(dtype)
    t.copy_(ref)
    assert torch.equal(t, ref)


def test_default_dtype_and_shape_forms():
    assert memtide.host.empty(10).dtype == torch.float32
    assert memtide.host.empty(10).shape == (10,)
    assert memtide.host.empty(torch.Size([2, 3])).shape == (2, 3)
    assert memtide.host.empty([4]).shape == (4,)
    assert memtide.host.empty(()).shape == ()
    z = memtide.host.empty((0, 3))
    assert z.shape == (0, 3) and z.numel() == 0


SKEW = 4096 + 64  # large buffers start k * SKEW into their block, k = 0..7


def test_buffer_goes_back_to_the_arena_when_the_tensor_dies():
    before = allocated()
    t = memtide.host.empty((1024, 1024), dtype=torch.float32)  # 4 MiB
    held = allocated() - before
    assert 4 * 1024 * 1024 <= held <= 4 * 1024 * 1024 + 7 * SKEW + 256
    view = t[10:20]
    del t
    assert allocated() == before + held, "a view keeps the buffer alive"
    view.fill_(1.0)
    del view
    assert allocated() == before
    # The freed memory is reused: the next tensor of that size starts in the block the last one
    # did (at its own skew).
    a = memtide.host.empty((1024, 1024))
    p = a.data_ptr()
    del a
    b = memtide.host.empty((1024, 1024))
    assert (b.data_ptr() - p) % SKEW == 0 and abs(b.data_ptr() - p) <= 7 * SKEW


def test_large_buffers_streamed_together_do_not_share_cache_sets():
    # Buffers of 2 MiB and more start on huge-page boundaries; aligned alike, element i of each
    # falls in one cache set and a step streaming them evicts itself.
    ts = [memtide.host.empty(1 << 20) for _ in range(4)]  # 4 MiB each
    offsets = [t.data_ptr() % (2 << 20) for t in ts]
    assert len(set(offsets)) == 4, offsets
    for t in ts:
        assert t.data_ptr() % 64 == 0  # still cache-line (and AVX-512) aligned
    for i, t in enumerate(ts):
        t.fill_(i)
    assert [int(t.min()) for t in ts] == [int(t.max()) for t in ts] == [0, 1, 2, 3]
    small = [memtide.host.empty(1000) for _ in range(3)]
    assert all(t.data_ptr() % 256 == 0 for t in small)


def test_buffers_do_not_overlap():
    ts = [memtide.host.empty(1000 + i, dtype=torch.uint8) for i in range(20)]
    for i, t in enumerate(ts):
        t.fill_(i)
    for i, t in enumerate(ts):
        assert int(t.min()) == i and int(t.max()) == i


def test_slabs_are_registered_with_the_device():
    memtide.host.empty(16)
    s = memtide.host.stats()
    assert s["slabs"] >= 1
    assert s["registered_slabs"] == s["slabs"]
    assert s["reserved_bytes"] >= s["allocated_bytes"]
    assert s["touch_seconds"] > 0


def test_placement_on_node_zero():
    t = memtide.host.empty((256, 1024), numa_node=0)
    t.zero_()
    p = memtide.host.placement(t, numa_node=0)
    if not p["known"]:
        pytest.skip(f"placement unknown: {p['reason']}")
    assert p["wanted_node"] == 0
    assert p["on_wanted_node"], p
    assert p["pages_per_node"] == {0: p["pages_sampled"]}
    assert memtide.host.stats(numa_node=0)["bytes_per_node"].get(0, 0) > 0


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(shape=(2, -1)), ValueError, "negative dimension"),
        (dict(shape="abc"), TypeError, "shape must be"),
        (dict(shape=(2, 1.5)), TypeError, "shape must be"),
        (dict(shape=(True,)), TypeError, "shape must be"),
        (dict(shape=4, dtype=torch.complex64), ValueError, "torch.complex64 is not supported"),
        (dict(shape=4, dtype="float32"), TypeError, "must be a torch.dtype"),
        (dict(shape=4, device=99), ValueError, "device 99 is out of range"),
        (dict(shape=4, device="cpu"), ValueError, "must be a CUDA device"),
        (dict(shape=4, device=-1), ValueError, "out of range"),
        (dict(shape=4, numa_node=7), ValueError, "valid nodes"),
        (dict(shape=4, numa_node="0"), TypeError, "numa_node must be"),
        (dict(shape=(1 << 40, 1 << 40)), ValueError, "more bytes than"),
        (dict(shape=(1 << 48,)), MemoryError, "cannot allocate"),
        (dict(shape=(1,) * 129), ValueError, "129 dimensions"),  # nanobind aborted the process here
        (dict(shape=(1,) * 65), ValueError, "at most 64"),
    ],
)
def test_errors_name_the_bad_input(kwargs, error, text):
    with pytest.raises(error, match=text):
        memtide.host.empty(**kwargs)


def test_the_most_dimensions_work():
    t = memtide.host.empty((1,) * 64)
    assert t.dim() == 64 and t.numel() == 1


def test_device_forms():
    assert memtide.host.empty(4, device=torch.device("cuda", 0)).shape == (4,)
    assert memtide.host.empty(4, device="cuda:0").shape == (4,)


def test_options_cap_and_node_in_a_fresh_process():
    script = textwrap.dedent(
        """
        import gc, memtide, torch
        assert memtide.host.node(0) == 0
        a = memtide.host.empty((256, 1024))            # 1 MiB: one slab
        b = memtide.host.empty((256, 1024))            # a second slab
        s = memtide.host.stats()
        assert s["numa_node"] == 0 and s["slabs"] == 2, s
        try:
            memtide.host.empty((256, 1024))
        except MemoryError as e:
            assert "host_max_bytes" in str(e), e
        else:
            raise SystemExit("no MemoryError at the cap")
        del a; gc.collect()
        c = memtide.host.empty((256, 1024))            # fits again
        del b, c; gc.collect()
        assert memtide.host.release_free_slabs() == 2 * 1024 * 1024
        print("ok")
        """
    )
    env = clean_env(MEMTIDE_HOST_SLAB_SIZE="1MiB", MEMTIDE_HOST_MAX_BYTES="2MiB", MEMTIDE_HOST_NODE="0",
                    MEMTIDE_DEVICE="sim")
    r = run_python(["-c", script], env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_bad_host_options_fail_with_the_key():
    r = run_python(["-c", "import memtide; memtide.host.empty(4)"],
                   env=clean_env(MEMTIDE_HOST_NODE_FULL="sometimes"))
    assert r.returncode != 0
    assert "MEMTIDE_HOST_NODE_FULL" in r.stderr and "strict or fallback" in r.stderr
