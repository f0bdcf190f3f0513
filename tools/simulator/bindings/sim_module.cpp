// memtide._sim: the iteration simulator (whole ZeRO-3 iterations on a phantom SimDevice), an
// extension of its own over libmemtide_sim.so so that libmemtide.so and memtide._memtide do not
// carry it; `memtide simulate` and memtide.simulate_iteration load it when first asked.

#include <optional>
#include <string>

#include "memtide/simulator/iteration_sim.hpp"
#include "memtide/simulator/node_sim.hpp"
#include "memtide/simulator/update_sweep.hpp"
#include "common.hpp"  // python_bindings/module/: what the bindings of both extensions share

namespace memtide::bindings {
namespace {

using tiering::Contender;
using tiering::ModelShape;
using tiering::NodeSpec;

// The node's knobs by name, for overrides from Python and for simulation_defaults().
struct NodeField {
  const char* key;
  double (*get)(const NodeSpec&);
  void (*set)(NodeSpec&, double);
};
#define MEMTIDE_NODE_FIELD(key, expr) \
  {key, [](const NodeSpec& n) { return static_cast<double>(n.expr); }, [](NodeSpec& n, double v) { n.expr = static_cast<decltype(n.expr)>(v); }}
const NodeField kNodeFields[] = {
    MEMTIDE_NODE_FIELD("gpus", gpus),
    MEMTIDE_NODE_FIELD("nodes", nodes),
    MEMTIDE_NODE_FIELD("inter_node_bytes_per_s", inter_node_bytes_per_s),
    MEMTIDE_NODE_FIELD("inter_node_latency_s", inter_node_latency_s),
    MEMTIDE_NODE_FIELD("gpu_flops", gpu_flops),
    MEMTIDE_NODE_FIELD("link_bytes_per_s", link_bytes_per_s),
    MEMTIDE_NODE_FIELD("pageable_flush_bytes_per_s", pageable_flush_bytes_per_s),
    MEMTIDE_NODE_FIELD("subgroup_params", subgroup_params),
    MEMTIDE_NODE_FIELD("twinflow_static_fraction", twinflow_static_fraction),
    MEMTIDE_NODE_FIELD("capacity_bytes", device.capacity),
    MEMTIDE_NODE_FIELD("h2d_bytes_per_s", device.h2d_bytes_per_s),
    MEMTIDE_NODE_FIELD("d2h_bytes_per_s", device.d2h_bytes_per_s),
    MEMTIDE_NODE_FIELD("cpu_update_params_per_s", device.cpu_update_params_per_s),
    MEMTIDE_NODE_FIELD("gpu_update_params_per_s", device.gpu_update_params_per_s),
    MEMTIDE_NODE_FIELD("host_dram_bytes_per_s", device.host_dram_bytes_per_s),
    MEMTIDE_NODE_FIELD("host_budget_bytes", host_budget_bytes),
    MEMTIDE_NODE_FIELD("nvme_read_bytes_per_s", nvme_read_bytes_per_s),
    MEMTIDE_NODE_FIELD("nvme_write_bytes_per_s", nvme_write_bytes_per_s),
    MEMTIDE_NODE_FIELD("updates_during_backward", updates_during_backward),
    MEMTIDE_NODE_FIELD("speculative_backup", speculative_backup),
};
#undef MEMTIDE_NODE_FIELD

NodeSpec node_arg(const std::optional<nb::dict>& overrides, bool checkpointing) {
  NodeSpec n;
  n.checkpointing = checkpointing;
  if (!overrides) return n;
  for (auto [key, value] : *overrides) {
    const std::string name = nb::cast<std::string>(key);
    const NodeField* field = nullptr;
    for (const NodeField& f : kNodeFields) {
      if (name == f.key) field = &f;
    }
    if (field == nullptr) {
      std::string keys;
      for (const NodeField& f : kNodeFields) keys += std::string(keys.empty() ? "" : ", ") + f.key;
      value_error("node: unknown key \"" + name + "\"; known keys: " + keys);
    }
    double v = -1;
    // An int too big for a double fails the cast (std::bad_cast): it is out of range all the same.
    if (!nb::try_cast<double>(value, v) || !(v >= 0) || !std::isfinite(v) || v > 1e18) {
      value_error("node: " + name + " = " + nb::cast<std::string>(nb::repr(value)) +
                  " is not accepted: expected a number from 0 to 1e18");
    }
    field->set(n, v);
  }
  return n;
}

nb::dict times_dict(const tiering::PhaseTimes& t) {
  nb::dict d;
  d["forward_s"] = t.forward_s;
  d["backward_s"] = t.backward_s;
  d["update_s"] = t.update_s;
  d["iteration_s"] = t.iteration_s;
  return d;
}

Contender contender_arg(const std::string& name) {
  for (Contender c : tiering::kContenders) {
    if (name == tiering::to_string(c)) return c;
  }
  value_error("contender \"" + name + "\" is not accepted: expected zero3_offload, twinflow or memtide");
}

ModelShape model_arg(const std::optional<std::string>& model, const std::optional<nb::dict>& shape) {
  ModelShape m;
  if (model) m = ModelShape::table2(*model);
  if (shape) {
    for (auto [key, value] : *shape) {
      const std::string k = nb::cast<std::string>(key);
      int* field = k == "layers"          ? &m.layers
                   : k == "hidden"        ? &m.hidden
                   : k == "heads"         ? &m.heads
                   : k == "seq"           ? &m.seq
                   : k == "micro_batch"   ? &m.micro_batch
                   : k == "micro_batches" ? &m.micro_batches
                   : k == "vocab"         ? &m.vocab
                                          : nullptr;
      if (field == nullptr) {
        value_error("shape: unknown key \"" + k + "\"; known keys: layers, hidden, heads, seq, micro_batch, "
                    "micro_batches, vocab");
      }
      long long v = 0;
      if (!nb::try_cast<long long>(value, v) || v <= 0 || v > (1LL << 30)) {
        value_error("shape: " + k + " = " + nb::cast<std::string>(nb::repr(value)) + " must be 1 to 2^30");
      }
      *field = static_cast<int>(v);
    }
    if (!model) m.name = "custom";
  }
  return m;
}

void window_arg(NodeSpec& n, const nb::object& window) {
  if (window.is_none()) return;
  {
    if (nb::isinstance<nb::str>(window) && nb::cast<std::string>(window) == "auto") {
      n.window_blocks = NodeSpec::kWindowAuto;
    } else if (long long blocks = -1; nb::isinstance<nb::int_>(window) && !nb::isinstance<nb::bool_>(window) &&
               nb::try_cast<long long>(window, blocks) && blocks >= 0 && blocks <= (1LL << 30)) {
      n.window_blocks = static_cast<int>(blocks);
    } else {
      value_error("window = " + nb::cast<std::string>(nb::repr(window)) +
                  " is not accepted: expected None, a number of blocks >= 0 (0: no window) or \"auto\"");
    }
  }
}

nb::dict result_dict(const tiering::IterationResult& r, const ModelShape& m, const std::string& contender,
                     bool record_ops) {
  nb::dict d;
  d["contender"] = contender;
  d["model"] = m.name;
  d["params"] = m.params();
  d["simulated"] = times_dict(r.simulated);
  d["predicted"] = times_dict(r.predicted);
  nb::dict peaks, reserved;
  for (Phase p : {Phase::forward, Phase::backward, Phase::update}) {
    peaks[phase_name(p)] = r.peak_bytes[static_cast<int>(p)];
    reserved[phase_name(p)] = r.peak_reserved_bytes[static_cast<int>(p)];
  }
  d["peak_bytes"] = peaks;
  d["peak_reserved_bytes"] = reserved;
  d["capacity_bytes"] = r.capacity_bytes;
  d["plan"] = plan_dict(r.plan);
  d["update_bound_s"] = r.update_bound_s;
  d["grad_bytes_to_host"] = r.grad_bytes_to_host;
  d["nvme_subgroups"] = r.nvme_subgroups;
  d["nvme_bytes"] = r.nvme_bytes;
  d["window"] = r.window_blocks;
  d["window_why"] = r.window_why;
  d["window_h2d_bytes"] = r.window_h2d_bytes;
  d["collective_s"] = r.collective_s;
  d["alloc_retries"] = r.alloc_retries;
  d["backward_update_params"] = r.backward_update_params;
  d["backward_update_busy_s"] = r.backward_update_busy_s;
  d["phase_start_s"] = nb::make_tuple(r.phase_start_s[0], r.phase_start_s[1], r.phase_start_s[2]);
  d["end_s"] = r.end_s;
  nb::list spans;
  for (const auto& span : r.spans) spans.append(nb::make_tuple(memtide::phase_name(span.phase), span.start_s, span.end_s));
  d["phase_spans"] = spans;
  d["host_state_bytes"] = r.host_state_bytes;
  d["nvme_staging_bytes"] = r.nvme_staging_bytes;
  d["nvme_file_bytes"] = r.nvme_file_bytes;
  if (record_ops) {
    nb::list ops;
    for (const SimOp& op : r.ops) ops.append(nb::make_tuple(op.engine, op.start_ns / 1e9, op.end_ns / 1e9, op.bytes));
    d["ops"] = ops;
    nb::list memory;
    for (const auto& sample : r.memory) memory.append(nb::make_tuple(sample.t_ns / 1e9, sample.allocated, sample.reserved));
    d["memory"] = memory;
    nb::list tiering;
    for (const tiering::TieringOp& op : r.tiering) {
      tiering.append(nb::make_tuple(op.what, op.subgroup, op.start_ns / 1e9, op.end_ns / 1e9, op.bytes));
    }
    d["tiering"] = tiering;
    d["nvme_transfers"] = nvme_transfer_list(r.nvme_transfers);
  }
  return d;
}

nb::dict simulate(const std::optional<std::string>& model, const std::optional<nb::dict>& shape,
                  const std::string& contender, const std::optional<nb::dict>& node, bool checkpointing,
                  int iterations, bool record_ops, const nb::object& window, bool save,
                  double save_write_bytes_per_s, std::uint64_t save_buffer_bytes) {
  const ModelShape m = model_arg(model, shape);
  NodeSpec n = node_arg(node, checkpointing);
  window_arg(n, window);
  const Contender c = contender_arg(contender);
  if (save_write_bytes_per_s < 0) value_error("save_write_bytes_per_s must be >= 0 (0: the NVMe write rate)");
  tiering::SimulationOptions options{iterations, record_ops};
  options.save = save;
  options.save_write_bytes_per_s = save_write_bytes_per_s;
  options.save_buffer_bytes = save_buffer_bytes;
  tiering::IterationResult r;
  {
    nb::gil_scoped_release nogil;
    r = tiering::simulate_iteration(m, n, c, options);
  }
  nb::dict d = result_dict(r, m, contender, record_ops);
  if (r.save.ran) {
    nb::dict s;
    s["state_bytes"] = r.save.state_bytes;
    s["write_bytes_per_s"] = r.save.write_bytes_per_s;
    s["save_s"] = r.save.save_s;
    s["iteration_s"] = r.save.iteration_s;
    s["waited_s"] = r.save.waited_s;
    s["copied_bytes"] = r.save.copied_bytes;
    s["peak_buffer_bytes"] = r.save.peak_buffer_bytes;
    s["buffer_bound_bytes"] = r.save.buffer_bound_bytes;
    d["save"] = s;
  }
  return d;
}

// A node of ranks (tiering::simulate_node): per placement, per contender, the node's iteration
// (its slowest rank) and every rank's share of the host and result.
nb::dict simulate_node(const std::optional<std::string>& model, const std::optional<nb::dict>& shape,
                       const std::optional<nb::dict>& node, bool checkpointing, int iterations, const nb::object& window,
                       const std::optional<std::string>& host, const std::optional<std::string>& topology, int gpus,
                       const std::vector<std::string>& placements, const std::vector<std::string>& contenders) {
  const ModelShape m = model_arg(model, shape);
  NodeSpec n = node_arg(node, checkpointing);
  window_arg(n, window);
  if (host && topology) value_error("give host or topology, not both");
  tiering::HostSpec h;
  if (topology) {
    h = tiering::HostSpec::from_topology(Topology::from_xml(*topology),
                                         host ? tiering::HostSpec::preset(*host) : tiering::HostSpec::preset("4xh100-2s"));
  } else if (host) {
    h = tiering::HostSpec::preset(*host);
  } else {
    h = tiering::HostSpec::two_sockets(gpus);
  }
  std::vector<tiering::HostPlacement> where;
  for (const std::string& p : placements) where.push_back(tiering::host_placement(p));
  std::vector<Contender> who;
  for (const std::string& c : contenders) who.push_back(contender_arg(c));
  tiering::NodeSimulation sim;
  {
    nb::gil_scoped_release nogil;
    sim = tiering::simulate_node(m, n, h, where, who, tiering::SimulationOptions{iterations, false});
  }
  nb::dict out;
  out["model"] = m.name;
  out["params"] = m.params();
  out["host"] = h.name;
  out["nodes"] = sim.nodes;
  out["gpus_per_node"] = static_cast<int>(h.gpus.size());
  nb::list sockets;
  for (const tiering::HostSocket& k : h.sockets) {
    nb::dict d;
    d["cores"] = k.cores;
    d["dram_bytes_per_s"] = k.dram_bytes_per_s;
    d["memory_bytes"] = k.memory_bytes;
    sockets.append(d);
  }
  out["sockets"] = sockets;
  nb::list gpu_list;
  for (const tiering::HostGpu& g : h.gpus) gpu_list.append(nb::make_tuple(g.socket, g.uplink));
  out["gpus"] = gpu_list;
  nb::list runs;
  for (const tiering::NodeRun& run : sim.runs) {
    nb::dict d;
    d["contender"] = tiering::to_string(run.contender);
    d["placement"] = tiering::to_string(run.placement);
    d["iteration_s"] = run.iteration_s;
    d["slowest_rank"] = run.slowest_rank;
    nb::list ranks;
    for (const tiering::RankRun& rank : run.ranks) {
      nb::dict r = result_dict(rank.result, m, tiering::to_string(run.contender), false);
      const tiering::RankShare& s = rank.share;
      nb::dict share;
      share["gpu"] = s.gpu;
      share["socket"] = s.socket;
      share["cores"] = s.cores;
      share["cpu_update_params_per_s"] = s.cpu_update_params_per_s;
      share["host_dram_bytes_per_s"] = s.host_dram_bytes_per_s;
      share["h2d_bytes_per_s"] = s.h2d_bytes_per_s;
      share["d2h_bytes_per_s"] = s.d2h_bytes_per_s;
      share["nvme_read_bytes_per_s"] = s.nvme_read_bytes_per_s;
      share["nvme_write_bytes_per_s"] = s.nvme_write_bytes_per_s;
      share["busiest"] = s.busiest;
      r["share"] = share;
      ranks.append(r);
    }
    d["ranks"] = ranks;
    runs.append(d);
  }
  out["runs"] = runs;
  return out;
}

nb::dict simulation_defaults() {
  const NodeSpec n;
  nb::dict d;
  for (const NodeField& f : kNodeFields) d[f.key] = f.get(n);
  d["checkpointing"] = n.checkpointing;
  nb::list models;
  for (const std::string& name : ModelShape::table2_names()) {
    const ModelShape m = ModelShape::table2(name);
    nb::dict row;
    row["name"] = name;
    row["layers"] = m.layers;
    row["hidden"] = m.hidden;
    row["heads"] = m.heads;
    row["seq"] = m.seq;
    row["micro_batch"] = m.micro_batch;
    row["vocab"] = m.vocab;
    row["params"] = m.params();
    models.append(row);
  }
  d["models"] = models;
  return d;
}

// A report (rows for a CSV and a table), so it crosses as plain rows.
nb::dict update_sweep(double host_dram_bytes_per_s, int gpus, std::size_t gpu_slots,
                      const std::vector<std::string>& models) {
  tiering::UpdateSweepSetup setup;
  setup.host_dram_bytes_per_s = host_dram_bytes_per_s;
  setup.gpus = gpus;
  setup.gpu_slots = gpu_slots;
  setup.models = models;
  tiering::UpdateSweep sweep;
  {
    nb::gil_scoped_release release;
    sweep = tiering::simulate_update_sweep(setup);
  }
  nb::list rows, verdicts;
  for (const tiering::UpdateSweepRow& r : sweep.rows) {
    nb::dict d;
    d["model"] = r.model;
    d["params"] = r.params;
    d["shard_params"] = r.shard_params;
    d["subgroups"] = r.subgroups;
    d["policy"] = r.policy;
    d["k"] = r.k;
    d["statics"] = r.statics;
    d["slots"] = r.slots;
    d["gpu_fraction"] = r.gpu_fraction;
    d["grads"] = r.grads_on_gpu ? "gpu" : "host";
    d["update_s"] = r.update_s;
    d["predicted_s"] = r.predicted_s;
    d["bound_s"] = r.bound_s;
    d["throughput_gps"] = r.throughput_gps;
    d["speedup_vs_cpu"] = r.speedup_vs_cpu;
    d["cpu_busy_s"] = r.cpu_busy_s;
    d["gpu_busy_s"] = r.gpu_busy_s;
    d["h2d_busy_s"] = r.h2d_busy_s;
    d["d2h_busy_s"] = r.d2h_busy_s;
    d["h2d_d2h_overlap_s"] = r.h2d_d2h_overlap_s;
    d["wall_ms"] = r.wall_ms;
    rows.append(d);
  }
  for (const tiering::UpdateSweepVerdict& v : sweep.verdicts) {
    nb::dict d;
    d["model"] = v.model;
    d["grads"] = v.grads_on_gpu ? "gpu" : "host";
    d["cpu_s"] = v.cpu_s;
    d["static20_s"] = v.static20_s;
    d["best_k"] = v.best_k;
    d["best_s"] = v.best_s;
    d["plan_k"] = v.plan_k;
    d["plan_predicted_s"] = v.plan_predicted_s;
    d["plan_s"] = v.plan_s;
    d["within_tolerance"] = v.within_tolerance;
    verdicts.append(d);
  }
  nb::dict out;
  out["rows"] = rows;
  out["verdicts"] = verdicts;
  out["tolerance"] = tiering::UpdateSweep::tolerance;
  return out;
}

}  // namespace

}  // namespace memtide::bindings

NB_MODULE(_sim, m) {
  using namespace memtide::bindings;
  m.doc() = "memtide's iteration simulator: whole ZeRO-3 training iterations on a phantom SimDevice.";
  // memtide._memtide registers how memtide's C++ errors become Python ones (ValueError,
  // MemoryError, ...); nanobind shares those translators between extensions built alike.
  nb::module_::import_("memtide._memtide");

  m.def("simulate_iteration", &simulate, "model"_a = nb::none(), "shape"_a = nb::none(), "contender"_a = "memtide",
        "node"_a = nb::none(), "checkpointing"_a = true, "iterations"_a = 3, "record_ops"_a = false,
        "window"_a = nb::none(), "save"_a = false, "save_write_bytes_per_s"_a = 0.0, "save_buffer_bytes"_a = 0,
        "Whole ZeRO-3 training iterations of one rank on a phantom SimDevice, with memtide's real allocator,\n"
        "phase tracker, gradient path, planner and scheduler (see iteration_sim.hpp).\n\n"
        "`model`: a Table 2 name (7B, 8.3B, 10B, 13B, 20B); `shape` overrides or gives its fields (layers,\n"
        "hidden, heads, seq, micro_batch, micro_batches, vocab). `contender`: zero3_offload, twinflow or\n"
        "memtide. `node` overrides simulation_defaults(). Returns the last iteration: simulated and\n"
        "predicted phase times, peak bytes per phase, capacity, the update plan and its bound.\n\n"
        "`window` (memtide only): the layer window in blocks, or \"auto\" (NodeSpec::window_blocks); the\n"
        "result's `window` is the size it ran with (0: none) and `window_why` how auto chose it.\n\n"
        "`save`: then ask for a checkpoint save of the rank's optimizer state (a SimulatedSave at\n"
        "`save_write_bytes_per_s`, 0: the node's NVMe write rate; copy-on-write buffer `save_buffer_bytes`,\n"
        "0: two subgroups) and run iterations beside it until it is written: the result's `save` has\n"
        "their times, the steps' waits and the save's own time.");
  m.def("simulate_update_sweep", &update_sweep, "host_dram_bytes_per_s"_a = 220e9, "gpus"_a = 4, "gpu_slots"_a = 4,
        "models"_a = std::vector<std::string>{},
        "The update phase alone (tiering::simulate_update_sweep): all-CPU, static 20% and interleaved over a\n"
        "sweep of k, and the automatic plan against the best k, per Table 2 model (default 7B to 20B).\n"
        "Returns {rows, verdicts, tolerance}: one row per simulated phase, one verdict per model and\n"
        "gradient placement.");
  m.def("simulate_node", &simulate_node, "model"_a = nb::none(), "shape"_a = nb::none(), "node"_a = nb::none(),
        "checkpointing"_a = true, "iterations"_a = 3, "window"_a = nb::none(), "host"_a = nb::none(),
        "topology"_a = nb::none(), "gpus"_a = 4,
        "placements"_a = std::vector<std::string>{"memtide", "node0", "interleave", "first_touch"},
        "contenders"_a = std::vector<std::string>{"zero3_offload", "twinflow", "memtide"},
        "Every rank of one node (tiering::simulate_node), each on its share of the host while the others\n"
        "run: `host` a preset (4xh100-2s, 8xh100-2s-switches), `topology` an hwloc XML file (its sockets\n"
        "and GPUs; the rates of `host`, default 4xh100-2s), else `gpus` GPUs on the paper's two sockets.\n"
        "`node` as simulate_iteration's (its `nodes` adds nodes joined by modelled rings). Returns the\n"
        "node's iteration (its slowest rank) per placement and contender, and each rank's share and result.");
  m.def("simulation_defaults", &simulation_defaults,
        "The node the simulator assumes unless told otherwise (the paper's 4 x H100), and the Table 2 models.");
}
