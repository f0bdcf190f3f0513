// memtide._memtide: the runtime: version, backend, options, phases and headroom, allocator stats,
// snapshots, trace replay and topology.

#include <dlfcn.h>

#include <cstdio>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <vector>

#include "memtide/allocator/stats.hpp"
#include "memtide/allocator/transformer_trace.hpp"
#include "memtide/core/error.hpp"
#include "memtide/core/job.hpp"
#include "memtide/core/options.hpp"
#include "memtide/device/device.hpp"
#include "memtide/device/sim_device.hpp"
#include "memtide/device/topology.hpp"
#include "memtide/memtide.h"
#include "common.hpp"
#include "memtide/core/format.hpp"

namespace memtide::bindings {
namespace {

memtide::Phase phase_arg(const std::string& name, const char* argument) {
  const auto phase = memtide::parse_phase(name);
  if (!phase) {
    value_error(std::string(argument) + ": \"" + name + "\" is not a phase; expected forward, backward, update or other");
  }
  return *phase;
}


nb::dict watermark_dict(const memtide::PhaseWatermark& w) {
  nb::dict d;
  d["seen"] = w.seen;
  d["peak_allocated"] = w.peak_allocated;
  d["peak_reserved"] = w.peak_reserved;
  // A phase entered but never observed (nothing allocated or freed yet) has no low water.
  if (w.min_free == std::numeric_limits<std::uint64_t>::max()) {
    d["min_free"] = nb::none();
  } else {
    d["min_free"] = w.min_free;
  }
  d["duration_ns"] = w.duration_ns;
  return d;
}

nb::dict phases_dict(const memtide::IterationRecord& record) {
  nb::dict d;
  for (int i = 0; i < memtide::kPhaseCount; ++i) {
    const auto phase = static_cast<memtide::Phase>(i);
    d[memtide::phase_name(phase)] = watermark_dict(record.phases[static_cast<std::size_t>(i)]);
  }
  return d;
}

nb::dict iteration_dict(const memtide::IterationRecord& record) {
  nb::dict d;
  d["index"] = record.index;
  d["phases"] = phases_dict(record);
  return d;
}

nb::dict headroom_dict(const memtide::Headroom& h) {
  nb::dict d;
  d["bytes"] = h.bytes;
  d["limiting_phase"] = memtide::phase_name(h.limiting_phase);
  d["iterations_used"] = h.iterations_used;
  d["from_history"] = h.from_history;
  return d;
}

nb::dict phase_report_dict(const memtide::PhaseReport& r) {
  nb::dict d;
  d["current"] = memtide::phase_name(r.current);
  d["iterations"] = r.iterations;
  d["running"] = iteration_dict(r.running);
  nb::list history;
  for (const auto& record : r.history) history.append(iteration_dict(record));
  d["history"] = history;
  return d;
}

nb::dict cuda_status_dict() {
  const memtide::CudaStatus st = memtide::cuda_status();
  nb::dict d;
  d["compiled"] = st.compiled;
  d["usable"] = st.usable;
  d["device_count"] = st.device_count;
  d["runtime_version"] = st.runtime_version;
  d["driver_version"] = st.driver_version;
  d["reason"] = st.reason;
  return d;
}

nb::list option_table_list() {
  nb::list rows;
  for (const memtide::OptionInfo& row : memtide::option_table()) {
    nb::dict d;
    d["key"] = row.key;
    d["env"] = row.env;
    d["accepted"] = row.accepted;
    d["help"] = row.help;
    rows.append(d);
  }
  return rows;
}

std::string library_path() {
  Dl_info info{};
  // Any symbol defined in libmemtide.so names the file the loader mapped, wherever it came from.
  if (dladdr(reinterpret_cast<void*>(&memtide_version), &info) == 0 || info.dli_fname == nullptr) {
    throw std::runtime_error("dladdr could not locate libmemtide.so");
  }
  // Not canonical(): torch should dlopen the very path already mapped, symlinks included.
  return std::filesystem::absolute(info.dli_fname).lexically_normal().string();
}

int shape_field(const char* name, std::int64_t value) {
  if (value <= 0) value_error(std::string("transformer shape: ") + name + " must be positive, got " + std::to_string(value));
  if (value > INT_MAX) {
    value_error(std::string("transformer shape: ") + name + " must be at most " + std::to_string(INT_MAX) + ", got " +
                std::to_string(value));
  }
  return static_cast<int>(value);
}

nb::dict replay_transformer(std::int64_t layers, std::int64_t hidden, std::int64_t heads, std::int64_t seq,
                            std::int64_t batch, std::int64_t vocab, std::int64_t iterations,
                            std::int64_t bytes_per_element, const std::string& backend,
                            std::optional<std::int64_t> sim_capacity) {
  memtide::TransformerShape shape;
  shape.layers = shape_field("layers", layers);
  shape.hidden = shape_field("hidden", hidden);
  shape.heads = shape_field("heads", heads);
  shape.seq = shape_field("seq", seq);
  shape.batch = shape_field("batch", batch);
  shape.vocab = shape_field("vocab", vocab);
  shape.iterations = shape_field("iterations", iterations);
  shape.bytes_per_element = shape_field("bytes_per_element", bytes_per_element);
  if (sim_capacity && *sim_capacity <= 0) {
    value_error("sim_capacity must be a positive number of bytes, got " + std::to_string(*sim_capacity));
  }

  memtide::ReplayResult result;
  memtide::DeviceProperties props;
  std::uint64_t limit = 0;
  {
    // Pure C++ from here on; other Python threads may run while the trace replays.
    nb::gil_scoped_release nogil;
    const memtide::Backend resolved = memtide::resolve_backend(memtide::parse_backend(backend));
    std::unique_ptr<memtide::Device> device;
    if (resolved == memtide::Backend::sim) {
      // Phantom: the trace is tens of GiB for real models; only addresses are needed.
      memtide::SimConfig config;
      config.phantom = true;
      config.capacity = sim_capacity ? static_cast<std::size_t>(*sim_capacity) : memtide::options().sim_capacity;
      device = std::make_unique<memtide::SimDevice>(config);
    } else {
      device = memtide::open_device(resolved, 0);
    }
    const std::vector<memtide::TraceOp> trace = memtide::make_transformer_trace(shape);
    memtide::CachingAllocator alloc(*device, memtide::AllocatorConfig::from_options());
    result = memtide::replay(alloc, trace);
    props = device->properties();
    limit = alloc.limit();
  }

  nb::dict d;
  d["ops"] = result.ops;
  d["peak_allocated"] = result.peak_allocated;
  d["peak_reserved"] = result.peak_reserved;
  d["reserved_over_allocated"] = result.reserved_over_allocated;
  d["seconds"] = result.seconds;
  d["update_headroom"] = headroom_dict(result.update_headroom);
  d["iterations_finished"] = result.phases.iterations;
  // The last finished iteration is the steady state (the first one also creates optimizer state).
  const memtide::IterationRecord& last =
      result.phases.history.empty() ? result.phases.running : result.phases.history.back();
  d["phases"] = phases_dict(last);
  d["device"] = props.name;
  d["backend"] = props.backend;
  d["device_memory"] = static_cast<std::uint64_t>(props.total_memory);
  d["limit"] = limit;
  d["params"] = shape.parameters();
  d["shape"] = shape.describe();
  return d;
}


// ---- topology -------------------------------------------------------------------------------

nb::list int_list(const std::vector<int>& values) {
  nb::list out;
  for (int v : values) out.append(v);
  return out;
}

nb::dict topology_dict(const std::optional<std::string>& path) {
  std::optional<memtide::Topology> topo;
  {
    // hwloc's discovery reads sysfs and can take a while on large machines.
    nb::gil_scoped_release nogil;
    topo = path ? memtide::Topology::from_xml(*path) : memtide::Topology::discover();
  }
  nb::dict d;
  d["source"] = topo->source();
  d["hwloc"] = memtide::hwloc_available();
  nb::list nodes;
  for (const memtide::NumaNode& n : topo->numa_nodes()) {
    nb::dict nd;
    nd["os_index"] = n.os_index;
    nd["memory_bytes"] = n.memory_bytes;
    nd["cpus"] = int_list(n.cpus);
    nodes.append(nd);
  }
  d["numa_nodes"] = nodes;
  nb::list gpus;
  nb::list links;
  const int count = static_cast<int>(topo->gpus().size());
  for (const memtide::GpuInfo& g : topo->gpus()) {
    nb::dict gd;
    gd["index"] = g.index;
    gd["pci_bus_id"] = g.pci_bus_id;
    gd["numa_nodes"] = int_list(g.numa_nodes);
    gd["cpus"] = int_list(g.cpus);
    gd["locality_known"] = g.locality_known;
    gd["name"] = g.name;
    gd["preferred_node"] = topo->preferred_node(g.index);
    gd["local_cpus"] = int_list(topo->local_cpus(g.index));
    nb::list pci_path;
    for (const std::string& hop : g.pci_path) pci_path.append(hop);
    gd["pci_path"] = pci_path;
    gpus.append(gd);
    nb::list row;
    for (int b = 0; b < count; ++b) row.append(std::string(memtide::link_name(topo->link(g.index, b))));
    links.append(row);
  }
  d["gpus"] = gpus;
  d["links"] = links;
  return d;
}

}  // namespace

void bind_runtime(nb::module_& m) {
  m.def("version", [] { return std::string(memtide_version()); }, "memtide's version, e.g. \"0.1.0\".");
  m.def(
      "parse_bytes",
      [](const std::string& text) {
        const std::optional<std::uint64_t> v = memtide::parse_bytes(text);
        if (!v) value_error("\"" + text + "\" is not a size; expected e.g. 4096, 512MiB, 64GiB or 1.5TB");
        return *v;
      },
      "text"_a, "Bytes from a size such as \"64GiB\", \"512MB\" or \"4096\" (the options table's parser).");
  // core/job is the one home of torchrun's environment: Python asks it rather than reading RANK
  // itself, so a trace, a log line and a spill folder name the same rank.
  m.def("job_rank", [] { return memtide::job_rank(); },
        "torch.distributed's RANK of this process (0 to 2^20 - 1), or None in a single-process run (or when "
        "RANK is not a rank: warned once).");
  m.def("job_world_size", [] { return memtide::job_world_size(); },
        "torch.distributed's WORLD_SIZE (1 to 2^20), or None when unset or not a rank count (warned once).");
  m.def("format_bytes", [](std::uint64_t n, int decimals) { return memtide::format_bytes(n, decimals); }, "n"_a,
        "decimals"_a = 2, "\"1.50 GiB\", \"512 B\": binary units up to TiB, `decimals` (0-9) after the point.");
  m.def("format_duration_ns", [](double ns) { return memtide::format_duration_ns(ns); }, "ns"_a,
        "\"2.50 s\", \"12.34 ms\", \"4.2 us\", \"850 ns\".");
  m.def("format_count", [](double n) { return memtide::format_count(n); }, "n"_a,
        "\"1.31B\", \"5.92M\", \"350.00k\", \"12\": parameter and operation counts.");
  m.def("format_cpu_list", [](const std::vector<int>& cpus) { return memtide::format_cpu_list(cpus); }, "cpus"_a,
        "[0, 1, 2, 3, 8] -> \"0-3,8\", the kernel's cpu list notation.");
  m.def("backend", [] { return std::string(backend_name(memtide::Runtime::get().backend())); },
        "The backend the runtime's allocators use: \"cuda\" or \"sim\" (MEMTIDE_DEVICE resolved).");
  m.def("resolve_backend",
        [](const std::string& name) { return std::string(backend_name(memtide::resolve_backend(memtide::parse_backend(name)))); },
        "name"_a, "What \"auto\", \"cuda\" or \"sim\" resolves to on this machine.");
  m.def("cuda_status", &cuda_status_dict, "Whether CUDA is compiled in and usable here, and why not.");
  m.def("device_count", [] { return memtide::Runtime::get().device_count(); }, "Devices the runtime's backend offers.");

  m.def("options", [] { return memtide::describe(memtide::options()); },
        "Current option values as strings, keyed by option name. Raises ConfigError for a bad MEMTIDE_* value.");
  m.def("option_table", &option_table_list, "Every option: key, env, accepted values and help.");

  m.def(
      "mark_phase",
      [](const std::string& name) {
        const memtide::Phase phase = phase_arg(name, "mark_phase");
        memtide::Runtime& rt = memtide::Runtime::get();
        for (int d = 0; d < rt.device_count(); ++d) rt.allocator(d).mark_phase(phase);
      },
      "name"_a, "Enters a training phase (forward, backward, update, other) on every device.");
  m.def(
      "headroom",
      [](int device, const std::string& until, std::optional<std::int64_t> margin) {
        const memtide::Phase phase = phase_arg(until, "headroom: until");
        std::optional<std::uint64_t> keep;
        if (margin) {
          if (*margin < 0) value_error("headroom: margin must be >= 0, got " + std::to_string(*margin));
          keep = static_cast<std::uint64_t>(*margin);
        }
        return headroom_dict(allocator(device).headroom(phase, keep));
      },
      "device"_a = 0, "until"_a = "forward", "margin"_a = nb::none(),
      "Bytes that can be borrowed on `device` now and kept until phase `until` begins.");

  m.def("stats", [](int device) { return memtide::flatten(allocator(device).stats()); }, "device"_a = 0,
        "Allocator statistics with torch.cuda.memory_stats() names.");
  m.def("reset_peak_stats", [](int device) { allocator(device).reset_peak_stats(); }, "device"_a = 0,
        "Resets every peak statistic of `device` to its current value.");
  m.def(
      "empty_cache",
      [] {
        for (memtide::CachingAllocator* a : memtide::Runtime::get().opened()) {
          if (a != nullptr) a->empty_cache();
        }
      },
      "Returns every fully free cached segment to its device.");
  m.def(
      "record_history",
      [](bool enabled) {
        memtide::Runtime& rt = memtide::Runtime::get();
        for (int d = 0; d < rt.device_count(); ++d) rt.allocator(d).set_record_history(enabled);
      },
      "enabled"_a, "Turns the allocation trace used by snapshots on or off.");
  m.def(
      "dump_snapshot",
      [](const std::filesystem::path& path) {
        const std::string p = path.string();
        int rc = 0;
        {
          nb::gil_scoped_release nogil;
          rc = memtide_dump_snapshot(p.c_str());
        }
        // The C ABI's code picks the Python type: a bad path is a ValueError, a file that
        // cannot be written an OSError, as Python's own file functions raise.
        if (rc == MEMTIDE_INVALID_ARGUMENT) throw memtide::InvalidArgument(memtide_last_error());
        if (rc == MEMTIDE_IO_ERROR) throw memtide::IoError(memtide_last_error());
        if (rc != MEMTIDE_OK) throw std::runtime_error(memtide_last_error());
      },
      "path"_a, "Writes a pickle that pytorch.org/memory_viz and torch.cuda._memory_viz read.");
  m.def(
      "allocator_events",
      [](int device) {
        CachingAllocator& a = allocator(device);
        const Snapshot snap = a.snapshot();
        nb::list trace;
        if (!snap.device_traces.empty()) {
          for (const TraceEntry& e : snap.device_traces.front()) {
            trace.append(nb::make_tuple(trace_action_name(e.action), static_cast<double>(e.time_us) / 1e6, e.addr,
                                        e.size, e.stream));
          }
        }
        nb::list marks;
        for (const CachingAllocator::PhaseMark& mark : a.phase_marks()) {
          marks.append(nb::make_tuple(static_cast<double>(mark.time_us) / 1e6, phase_name(mark.phase)));
        }
        nb::dict d;
        d["trace"] = trace;
        d["phases"] = marks;
        d["limit_bytes"] = a.limit();
        return d;
      },
      "device"_a = 0,
      "What the allocator recorded since record_history(True): its trace, (action, t_s, addr, size,\n"
      "stream) with action alloc, free_requested, free_completed, segment_alloc, segment_free, segment_map,\n"
      "segment_unmap (an expandable segment growing and shrinking) or oom, and\n"
      "the phase marks (t_s, phase), on one clock; and its limit.");
  m.def("phase_report", [](int device) { return phase_report_dict(allocator(device).phase_report()); },
        "device"_a = 0, "Current phase, finished iterations and per-phase watermarks (running + remembered).");
  m.def("library_path", &library_path, "Absolute path of the loaded libmemtide.so (for CUDAPluggableAllocator).");

  m.def("replay_transformer", &replay_transformer, "layers"_a, "hidden"_a, "heads"_a, "seq"_a, "batch"_a, "vocab"_a,
        "iterations"_a, "bytes_per_element"_a = 2, "backend"_a = "auto", "sim_capacity"_a = nb::none(),
        "Replays the allocation trace of GPT-style training through a fresh CachingAllocator.\n\n"
        "On the sim backend the device is a phantom SimDevice (no bytes held) of `sim_capacity` bytes\n"
        "(default: MEMTIDE_SIM_CAPACITY). Returns peaks, per-phase watermarks of the last iteration,\n"
        "the update-phase headroom and timing.");

  m.def("topology", &topology_dict, "path"_a = nb::none(),
        "The GPU/NUMA topology as plain dicts and lists: `source`, `hwloc` (built with hwloc),\n"
        "`numa_nodes` [{os_index, memory_bytes, cpus}], `gpus` [{index, pci_bus_id, numa_nodes, cpus,\n"
        "locality_known, name, preferred_node, local_cpus, pci_path}] and `links`, the GPU x GPU matrix\n"
        "of nvidia-smi topo -m classes (X, PIX, PXB, PHB, NODE, SYS). `path`: an hwloc XML file to load\n"
        "instead of discovering this machine (MEMTIDE_TOPOLOGY, else hwloc, else sysfs).");
}

}  // namespace memtide::bindings
