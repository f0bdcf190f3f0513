"""``memtide probe``: the topology memtide plans with (like nvidia-smi topo -m), or an NVMe folder's rates."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict

import memtide
from memtide._files import check_input
from memtide._memtide import format_bytes, format_cpu_list

from ._common import EXIT_USAGE, UsageError, positive_size

# What each link class means, in the order of the matrix legend (worst first, as nvidia-smi lists them).
_LINK_LEGEND = (
    ("X", "the GPU itself"),
    ("SYS", "PCIe plus the link between NUMA nodes (sockets)"),
    ("NODE", "PCIe plus the path between two host bridges of one NUMA node"),
    ("PHB", "PCIe through one host bridge (the CPU's root complex)"),
    ("PXB", "several PCIe bridges, no host bridge (cascaded switches)"),
    ("PIX", "at most one PCIe switch"),
)


def _probe_json(topo: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "source": topo["source"],
        "numa_nodes": topo["numa_nodes"],
        "gpus": topo["gpus"],
        "links": topo["links"],
    }


def _print_probe(topo: Dict[str, Any]) -> None:
    gpus = topo["gpus"]
    print(f"source    {topo['source']}" + ("" if topo["hwloc"] else "  (memtide built without hwloc)"))
    print()
    if gpus:
        names = [f"GPU{g['index']}" for g in gpus]
        width = max(6, max(len(n) for n in names) + 2)
        cpu_col = [format_cpu_list(g["cpus"]) or "N/A" for g in gpus]
        numa_col = [",".join(str(n) for n in g["numa_nodes"]) if g["locality_known"] else "N/A" for g in gpus]
        cpu_w = max(len("CPU Affinity"), max(len(c) for c in cpu_col)) + 2
        print(" " * width + "".join(f"{n:<{width}}" for n in names) + f"{'CPU Affinity':<{cpu_w}}NUMA Affinity")
        for i, name in enumerate(names):
            cells = "".join(f"{link:<{width}}" for link in topo["links"][i])
            print(f"{name:<{width}}{cells}{cpu_col[i]:<{cpu_w}}{numa_col[i]}")
        print()
        print("Legend:")
        for code, meaning in _LINK_LEGEND:
            print(f"  {code:<4} = {meaning}")
        print()
        print("GPUs:")
        for g in gpus:
            print(f"  GPU{g['index']}  {g['pci_bus_id']}  {g['name']}")
        for g in gpus:
            if not g["locality_known"]:
                print(f"  GPU{g['index']}: NUMA locality unknown; memtide uses node {g['preferred_node']} (the most memory) "
                      f"and cpus {format_cpu_list(g['local_cpus']) or 'none'} for it")
    else:
        print("no NVIDIA GPU found")
    print()
    print("NUMA nodes:")
    for node in topo["numa_nodes"]:
        memory = format_bytes(node["memory_bytes"]) if node["memory_bytes"] else "memory unknown"
        print(f"  node {node['os_index']}  {memory:>12}  cpus {format_cpu_list(node['cpus']) or 'none'}")


def _cmd_probe_nvme(args: argparse.Namespace) -> int:
    if not getattr(memtide._memtide, "HAVE_NVME", False):
        raise UsageError("memtide probe --nvme: this memtide was built without the NVMe tier "
                         "(needs liburing-dev and libxxhash-dev)")
    if not args.json:
        print(f"memtide probe: writing and reading {format_bytes(args.nvme_bytes)} in {args.nvme} "
              "(io_uring, O_DIRECT, queue depth 32, 1 MiB requests) ...", file=sys.stderr, flush=True)
    try:
        r = memtide._memtide.nvme_probe(args.nvme, args.nvme_bytes)
    except OSError as e:
        raise UsageError(f"memtide probe --nvme: {e}") from None
    r["stale_spills"] = [{"path": p, "bytes": b, "age_s": a} for p, b, a in r["stale_spills"]]
    if args.json:
        json.dump(r, sys.stdout, indent=2)
        print()
        return 0
    print(f"nvme      {r['dir']}: write {r['write_bytes_per_s'] / 1e9:.2f} GB/s, read "
          f"{r['read_bytes_per_s'] / 1e9:.2f} GB/s ({format_bytes(r['bytes'])}, direct I/O, queue depth "
          f"{r['queue_depth']}, {format_bytes(r['block_bytes'])} requests)")
    for s in r["stale_spills"]:
        print(f"stale     {s['path']}: {format_bytes(s['bytes'])}, {s['age_s'] / 3600:.1f} h old, left by a process "
              "that is gone (remove it to free the space)")
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    if args.nvme is not None:
        return _cmd_probe_nvme(args)
    if args.topology is not None:
        check_input(args.topology, "--topology")  # a FIFO or a folder: refused naming it, exit 2
        if not os.path.exists(args.topology):
            print(f"memtide probe: --topology {args.topology!r} does not exist; expected an hwloc XML file "
                  "(lstopo --of xml)", file=sys.stderr)
            return EXIT_USAGE
    topo = memtide.topology(args.topology)
    if args.json:
        json.dump(_probe_json(topo), sys.stdout, indent=2)
        print()
    else:
        _print_probe(topo)
    return 0


def add_parser(sub) -> None:
    probe = sub.add_parser(
        "probe",
        help="GPUs, NUMA nodes, GPU-local cores and PCIe links (like nvidia-smi topo -m)",
        description="Shows the topology memtide plans with: each GPU's PCIe links to the others, its local "
        "cores and NUMA nodes, and the NUMA nodes with their memory. Sources: --topology, else "
        "MEMTIDE_TOPOLOGY, else this machine through hwloc, else sysfs.",
    )
    probe.add_argument("--json", action="store_true", help="print JSON instead of text")
    probe.add_argument("--topology", metavar="FILE", default=None,
                       help="an hwloc XML file (lstopo --of xml) to show instead of this machine")
    probe.add_argument("--nvme", metavar="DIR", default=None,
                       help="measure DIR's sequential write and read rates as the NVMe tier uses it (io_uring, "
                       "O_DIRECT), and list spills that crashed runs left there")
    probe.add_argument("--nvme-bytes", type=positive_size, default=1 << 30, metavar="SIZE",
                       help="bytes written and read by --nvme (default: 1GiB)")
    probe.set_defaults(func=_cmd_probe)
