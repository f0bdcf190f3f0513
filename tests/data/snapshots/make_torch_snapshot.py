#!/usr/bin/env python3
"""Writes torch_2_1_snapshot.pickle: a small CUDA memory snapshot in the format of
torch.cuda.memory._snapshot() as torch 2.1 wrote it (pickle protocol 2 from
torch.cuda.memory._dump_snapshot; segments with blocks and frames, one device trace with
time_us), for the tests of `memtide timeline snapshot.pickle`.

It was NOT produced by a GPU run: the machine this was made on has no GPU, so the snapshot is
built here, by the structure torch documents (torch/cuda/memory.py, _snapshot's docstring, 2.1)
and its allocator keeps (a 2 MiB small-pool segment and 20 MiB large-pool segments rounded as
torch's caching allocator rounds them, frees completed after they are requested). The numbers it
must give are stated in EXPECTED below and checked by the tests against what memtide reads.

    python tests/data/snapshots/make_torch_snapshot.py   # rewrites the pickle beside this script
"""

from __future__ import annotations

import os
import pickle

MiB = 1 << 20
STREAM = 0


def frames(*names):
    # torch records the innermost frame first.
    return [{"filename": "train.py", "line": 10 + i, "name": n} for i, n in enumerate(names)]


def build():
    trace, t = [], 1_700_000_000_000_000  # time_us: microseconds on the host's clock

    def entry(action, addr, size, where=()):
        nonlocal t
        t += 250
        trace.append({"action": action, "addr": addr, "size": size, "stream": STREAM, "time_us": t,
                      "frames": frames(*where)})

    seg_a, seg_b, small = 0x7F0000000000, 0x7F0002000000, 0x7F0004000000
    entry("segment_alloc", seg_a, 20 * MiB)
    entry("alloc", seg_a, 8 * MiB, ("linear", "forward", "train_step"))
    entry("alloc", seg_a + 8 * MiB, 6 * MiB, ("gelu", "forward", "train_step"))
    entry("segment_alloc", small, 2 * MiB)
    entry("alloc", small, 512, ("sum", "loss", "train_step"))
    entry("segment_alloc", seg_b, 20 * MiB)
    entry("alloc", seg_b, 12 * MiB, ("matmul_backward", "backward", "train_step"))  # the peak: 26 MiB + 512
    entry("free_requested", seg_a + 8 * MiB, 6 * MiB, ("gelu_backward", "backward", "train_step"))
    entry("free_completed", seg_a + 8 * MiB, 6 * MiB, ("gelu_backward", "backward", "train_step"))
    entry("free_requested", seg_b, 12 * MiB, ("step", "optimizer", "train_step"))
    entry("free_completed", seg_b, 12 * MiB, ("step", "optimizer", "train_step"))
    entry("alloc", seg_a + 8 * MiB, 4 * MiB, ("zeros_like", "optimizer", "train_step"))

    def block(addr, size, state, where=()):
        return {"address": addr, "size": size, "requested_size": size, "state": state, "frames": frames(*where)}

    def segment(addr, total, blocks, kind="large"):
        allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        return {"device": 0, "address": addr, "total_size": total, "allocated_size": allocated,
                "active_size": allocated, "requested_size": allocated, "stream": STREAM, "segment_type": kind,
                "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                "blocks": blocks}

    segments = [
        segment(seg_a, 20 * MiB, [block(seg_a, 8 * MiB, "active_allocated", ("linear", "forward", "train_step")),
                                  block(seg_a + 8 * MiB, 4 * MiB, "active_allocated",
                                        ("zeros_like", "optimizer", "train_step")),
                                  block(seg_a + 12 * MiB, 8 * MiB, "inactive")]),
        segment(seg_b, 20 * MiB, [block(seg_b, 20 * MiB, "inactive")]),
        segment(small, 2 * MiB, [block(small, 512, "active_allocated", ("sum", "loss", "train_step")),
                                 block(small + 512, 2 * MiB - 512, "inactive")], kind="small"),
    ]
    return {"segments": segments, "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1}}


#: What the snapshot says, for the tests.
EXPECTED = {"segments": 3, "reserved_bytes": 42 * MiB, "allocated_bytes": 12 * MiB + 512,
            "peak_allocated": 26 * MiB + 512, "largest_at_peak": 12 * MiB, "trace_entries": 12}


def main() -> None:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_2_1_snapshot.pickle")
    with open(path, "wb") as f:
        pickle.dump(build(), f, protocol=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
