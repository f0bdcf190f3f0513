// memtide._memtide: the update-phase PerfModel (plans, predictions, fitting device memory), the
// layer window's sizing and the NVMe probe. The engine TieredAdamW drives is in engine.cpp.

#include <algorithm>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "memtide/allocator/host_arena.hpp"
#include "memtide/core/thread_pool.hpp"
#include "memtide/tiering/model/calibration.hpp"
#include "memtide/tiering/window/layer_window.hpp"
#include "memtide/tiering/engine/param_layout.hpp"
#include "memtide/tiering/model/perf_model.hpp"
#include "memtide/core/error.hpp"
#if MEMTIDE_HAVE_NVME
#include "memtide/tiering/nvme/nvme_store.hpp"
#endif
#include "common.hpp"

#include <nanobind/stl/tuple.h>

namespace memtide::bindings {

// ---- update-phase PerfModel ------------------------------------------------------------------

std::size_t count_arg(const char* name, std::int64_t value) {
  if (value < 0) value_error(std::string(name) + " must be >= 0, got " + std::to_string(value));
  return static_cast<std::size_t>(value);
}

tiering::Workload workload_arg(const std::vector<std::int64_t>& subgroup_params, std::int64_t low_precision_bytes,
                               bool grads_on_host, std::int64_t gpu_slot_limit, std::int64_t gpu_static_limit) {
  tiering::Workload w;
  w.subgroup_params.reserve(subgroup_params.size());
  for (std::int64_t p : subgroup_params) w.subgroup_params.push_back(count_arg("subgroup_params", p));
  w.low_precision_bytes = count_arg("low_precision_bytes", low_precision_bytes);
  w.grads_on_host = grads_on_host;
  w.gpu_slot_limit = count_arg("gpu_slot_limit", gpu_slot_limit);
  w.gpu_static_limit = count_arg("gpu_static_limit", gpu_static_limit);
  return w;
}

tiering::Policy policy_arg(const std::string& name) {
  for (auto p : {tiering::Policy::cpu, tiering::Policy::static_split, tiering::Policy::interleaved,
                 tiering::Policy::automatic}) {
    if (name == policy_key(p)) return p;
  }
  // The C++ enumerators' spellings are accepted too.
  if (name == "static_split") return tiering::Policy::static_split;
  if (name == "automatic") return tiering::Policy::automatic;
  value_error("policy: \"" + name + "\" is not a policy; expected cpu, static, interleaved or auto");
}

std::vector<tiering::Placement> placement_arg(const std::string& text) {
  std::vector<tiering::Placement> out;
  out.reserve(text.size());
  for (char c : text) {
    if (c == 'c') out.push_back(tiering::Placement::cpu);
    else if (c == 'g') out.push_back(tiering::Placement::gpu);
    else if (c == 's') out.push_back(tiering::Placement::gpu_static);
    else if (c == 'd') out.push_back(tiering::Placement::done);
    else value_error(std::string("placement: '") + c + "' is not a placement; expected c (CPU), g (streamed GPU), s (GPU-static) "
                     "or d (done: updated before the phase)");
  }
  return out;
}

namespace {

nb::dict plan_update(const std::vector<std::int64_t>& subgroup_params, const std::string& policy,
                     const std::optional<nb::dict>& rates, double static_fraction, std::optional<double> k,
                     std::int64_t low_precision_bytes, bool grads_on_host, std::int64_t gpu_slot_limit,
                     std::int64_t gpu_static_limit, const std::optional<std::vector<bool>>& on_nvme,
                     std::int64_t nvme_read_ahead) {
  tiering::Workload w =
      workload_arg(subgroup_params, low_precision_bytes, grads_on_host, gpu_slot_limit, gpu_static_limit);
  if (on_nvme) w.on_nvme = *on_nvme;
  w.nvme_read_ahead = count_arg("nvme_read_ahead", nvme_read_ahead);
  const tiering::Rates r = rates_arg(rates);
  const tiering::Policy pol = policy_arg(policy);
  tiering::Plan plan;
  {
    nb::gil_scoped_release nogil;
    plan = tiering::PerfModel{}.plan(w, r, pol, static_fraction, k);
  }
  return plan_dict(plan);
}

nb::dict predict_update(const std::vector<std::int64_t>& subgroup_params, const std::string& placement,
                        const std::optional<nb::dict>& rates, std::int64_t low_precision_bytes, bool grads_on_host,
                        std::int64_t gpu_slot_limit) {
  const tiering::Workload w = workload_arg(subgroup_params, low_precision_bytes, grads_on_host, gpu_slot_limit, 0);
  const tiering::Rates r = rates_arg(rates);
  const std::vector<tiering::Placement> pl = placement_arg(placement);
  tiering::Prediction p;
  {
    nb::gil_scoped_release nogil;
    p = tiering::PerfModel{}.predict(w, r, pl);
  }
  return prediction_dict(p);
}

// ---- fitting device memory -------------------------------------------------------------------

std::vector<bool> fit_host_budget(const std::vector<std::int64_t>& subgroup_params, std::int64_t host_budget_bytes,
                                  std::int64_t gpu_static_limit, std::int64_t nvme_read_ahead) {
  tiering::Workload w = workload_arg(subgroup_params, 2, true, 0, gpu_static_limit);
  w.nvme_read_ahead = count_arg("nvme_read_ahead", nvme_read_ahead);
  tiering::fit_host_budget(w, count_arg("host_budget_bytes", host_budget_bytes));
  return w.on_nvme.empty() ? std::vector<bool>(w.subgroup_params.size(), false) : w.on_nvme;
}

nb::dict fit_gpu_budget(const std::vector<std::int64_t>& subgroup_params, std::int64_t update_bytes,
                        std::int64_t resident_bytes, bool grads_on_host) {
  tiering::Workload w = workload_arg(subgroup_params, 2, grads_on_host, 0, 0);
  tiering::fit_gpu_budget(w, tiering::GpuBudget{count_arg("update_bytes", update_bytes),
                                                count_arg("resident_bytes", resident_bytes)});
  std::size_t largest = 0;
  for (std::size_t n : w.subgroup_params) largest = std::max(largest, n);
  nb::dict d;
  d["gpu_slot_limit"] = w.gpu_slot_limit;
  d["gpu_static_limit"] = w.gpu_static_limit;
  d["slot_bytes"] = tiering::gpu_slot_bytes(largest, grads_on_host);
  d["resident_bytes"] = tiering::gpu_slot_bytes(largest, true);
  return d;
}

}  // namespace

#if MEMTIDE_HAVE_NVME
// Sequential write then read of `bytes` through NvmeStore in `dir` (direct I/O, the store's
// queue depth and block size), with the spills other processes left there.
nb::dict nvme_probe(const std::string& dir, std::uint64_t bytes, std::size_t queue_depth, std::size_t block_bytes) {
  if (bytes < tiering::NvmeStore::kAlign || bytes > (std::uint64_t{1} << 40)) {
    value_error("nvme_probe: bytes must be 4 KiB to 1 TiB, got " + std::to_string(bytes));
  }
  nb::list stale;
  for (const tiering::StaleSpill& s : tiering::SpillDir::find_stale(dir)) {
    stale.append(nb::make_tuple(s.path.string(), s.bytes, s.age_s));
  }
  double write_s = 0, read_s = 0;
  std::uint64_t moved = 0;
  std::string file;
  {
    nb::gil_scoped_release nogil;
    tiering::SpillDir spill(dir);
    tiering::NvmeConfig config;
    config.queue_depth = queue_depth;
    config.block_bytes = block_bytes;
    // Extents of 256 MiB, one buffer reused: the rate of the store, not of the page cache.
    const std::uint64_t extent = std::min<std::uint64_t>(bytes, std::uint64_t{256} << 20);
    const std::size_t n = static_cast<std::size_t>((bytes + extent - 1) / extent);
    tiering::NvmeStore store(spill, std::vector<std::uint64_t>(n, extent), config);
    file = store.file().string();
    void* buffer = nullptr;
    if (posix_memalign(&buffer, tiering::NvmeStore::kAlign, extent) != 0) throw memtide::OutOfMemory("nvme_probe: no buffer");
    std::unique_ptr<void, decltype(&std::free)> owned(buffer, &std::free);
    std::memset(buffer, 0x5a, extent);
    for (std::size_t i = 0; i < n; ++i) store.write(i, buffer, extent);
    for (std::size_t i = 0; i < n; ++i) store.read(i, buffer);
    const auto c = store.counters();
    write_s = c.write_s;
    read_s = c.read_s;
    moved = c.bytes_written;
  }
  nb::dict d;
  d["dir"] = dir;
  d["bytes"] = moved;
  d["write_bytes_per_s"] = write_s > 0 ? static_cast<double>(moved) / write_s : 0.0;
  d["read_bytes_per_s"] = read_s > 0 ? static_cast<double>(moved) / read_s : 0.0;
  d["queue_depth"] = queue_depth;
  d["block_bytes"] = block_bytes;
  d["stale_spills"] = stale;
  return d;
}
#endif

namespace {
std::vector<tiering::BlockProfile> block_profiles(const nb::list& blocks) {
  std::vector<tiering::BlockProfile> out;
  for (nb::handle h : blocks) {
    const nb::dict d = nb::cast<nb::dict>(h);
    tiering::BlockProfile b;
    for (auto [key, value] : d) {
      const std::string k = nb::cast<std::string>(key);
      if (k == "forward_ns") b.forward_ns = nb::cast<double>(value);
      else if (k == "backward_ns") b.backward_ns = nb::cast<double>(value);
      else if (k == "h2d_ns") b.h2d_ns = nb::cast<double>(value);
      else if (k == "d2h_ns") b.d2h_ns = nb::cast<double>(value);
      else if (k == "bytes") b.bytes = nb::cast<std::uint64_t>(value);
      else throw InvalidArgument("block profile: unknown key '" + k + "' (forward_ns, backward_ns, h2d_ns, d2h_ns, bytes)");
    }
    out.push_back(b);
  }
  return out;
}
}  // namespace

void bind_tiering(nb::module_& m) {
  m.def(
      "choose_window",
      [](const nb::list& blocks, std::uint64_t available, double async_ns) {
        const tiering::WindowSize w = tiering::choose_window(block_profiles(blocks), available, async_ns);
        nb::dict d;
        d["blocks"] = w.blocks;
        d["hides_transfers"] = w.hides_transfers;
        d["peak_bytes"] = w.peak_bytes;
        d["why"] = w.why;
        return d;
      },
      "blocks"_a, "available"_a, "async_ns"_a = 0.0,
      "The layer window's size (tiering::choose_window): `blocks` is a list of dicts with forward_ns,\n"
      "backward_ns, h2d_ns, d2h_ns and bytes per block; returns blocks (m), hides_transfers,\n"
      "peak_bytes and why. Raises ValueError, with the numbers, when one block and its prefetch do not fit.");
  m.def(
      "fit_before_end",
      [](const std::vector<std::tuple<std::size_t, double, double>>& candidates, double end_ns, std::size_t cap) {
        std::vector<tiering::BackwardCandidate> c;
        c.reserve(candidates.size());
        for (const auto& [subgroup, ready, work] : candidates) c.push_back({subgroup, ready, work});
        return tiering::fit_before_end(std::move(c), end_ns, cap);
      },
      "candidates"_a, "end_ns"_a, "cap"_a,
      "Which subgroups one host worker updates before backward ends (tiering::fit_before_end):\n"
      "`candidates` are (subgroup, ready_ns, work_ns); returns the subgroups taken, in order, at most `cap`.");
  m.def(
      "window_pass_ns",
      [](const nb::list& blocks, int window, double async_ns) {
        return tiering::window_pass_ns(block_profiles(blocks), window, async_ns);
      },
      "blocks"_a, "m"_a, "async_ns"_a = 0.0,
      "The modelled forward + backward time with a window of m blocks (tiering::window_pass_ns).");
#if MEMTIDE_HAVE_NVME
  m.def("nvme_probe", &nvme_probe, "dir"_a, "bytes"_a = std::uint64_t{1} << 30, "queue_depth"_a = 32,
        "block_bytes"_a = std::size_t{1} << 20,
        "Measures sequential write and read rates of `dir` through NvmeStore (io_uring, O_DIRECT,\n"
        "checksummed extents), and lists spill directories that dead processes left there.");
  m.attr("HAVE_NVME") = true;
  m.def("remove_spill_dirs", &tiering::SpillDir::remove_all_live,
        "Removes the spill folders this process made (tiering::SpillDir::remove_all_live); memtide\n"
        "calls it at interpreter exit. Returns how many were removed.");
#else
  m.attr("HAVE_NVME") = false;
  m.def("remove_spill_dirs", [] { return std::size_t{0}; }, "No NVMe tier in this build: nothing to remove.");
#endif
  m.def("default_rates", [] { return rates_dict(tiering::Rates{}); },
        "The update-phase PerfModel's default rates (bytes/s, params/s, bytes/param), keyed by field.");
  m.def("plan_update", &plan_update, "subgroup_params"_a, "policy"_a = "auto", "rates"_a = nb::none(),
        "static_fraction"_a = 0.0, "k"_a = nb::none(), "low_precision_bytes"_a = 2, "grads_on_host"_a = true,
        "gpu_slot_limit"_a = 3, "gpu_static_limit"_a = 0, "on_nvme"_a = nb::none(), "nvme_read_ahead"_a = 2,
        "The PerfModel's update-phase plan for `policy` (cpu, static, interleaved, auto): the one\n"
        "placement function. `static_fraction`: the GPU-resident share (static, interleaved, auto with k);\n"
        "`k`: the stride, one in every k subgroups on the GPU (interleaved: default 2; auto: None searches).\n\n"
        "`rates` overrides any of default_rates(). Returns policy, placement (one letter per subgroup:\n"
        "c CPU, g streamed GPU, s GPU-static), k, gpu_slots, gpu_streamed, static_residents and the\n"
        "prediction (total_ns, bound_ns, per-resource busy ns, busiest, bytes moved).");
  m.def("predict_update", &predict_update, "subgroup_params"_a, "placement"_a, "rates"_a = nb::none(),
        "low_precision_bytes"_a = 2, "grads_on_host"_a = true, "gpu_slot_limit"_a = 3,
        "The PerfModel's predicted update phase for `placement` (one letter per subgroup: c, g, s).");

  m.def("fit_host_budget", &fit_host_budget, "subgroup_params"_a, "host_budget_bytes"_a, "gpu_static_limit"_a = 0,
        "nvme_read_ahead"_a = 2,
        "Which subgroups must live on NVMe for the host state (16 B/param) to fit `host_budget_bytes`:\n"
        "the fewest, spread evenly, never among the last `gpu_static_limit` (one bool per subgroup).");
  m.attr("MAX_SUBGROUPS") = tiering::kMaxSubgroups;
  m.attr("USEFUL_SLOTS") = tiering::kUsefulSlots;
  m.attr("STATE_BYTES_PER_PARAM") = static_cast<int>(tiering::kStateBytesPerParam);
  m.attr("GRAD_BYTES_PER_PARAM") = static_cast<int>(tiering::kGradBytesPerParam);
  m.attr("GPU_MODEL_BYTES_PER_PARAM") = static_cast<int>(tiering::kGpuModelBytesPerParam);
  m.def(
      "cut_subgroups",
      [](std::int64_t n, std::int64_t size, const std::string& size_name) {
        return tiering::cut_subgroups(count_arg("n", n), count_arg(size_name.c_str(), size), size_name.c_str());
      },
      "n"_a, "size"_a, "size_name"_a = "subgroup_size",
      "`n` params cut into subgroups of `size` elements (the last may be smaller): [(start, end), ...].\n"
      "ValueError for more than MAX_SUBGROUPS, naming the smallest size that fits (`size_name`: its name).");
  // The spellings policy_arg takes first, in the order the CLI lists them.
  m.attr("POLICIES") = nb::make_tuple(policy_key(tiering::Policy::cpu), policy_key(tiering::Policy::static_split),
                                      policy_key(tiering::Policy::interleaved), policy_key(tiering::Policy::automatic));
  m.def("fit_gpu_budget", &fit_gpu_budget, "subgroup_params"_a, "update_bytes"_a, "resident_bytes"_a,
        "grads_on_host"_a = true,
        "What a plan may hold: streamed slots in `update_bytes` (memory free during the update phase)\n"
        "and static residents in `resident_bytes` (free through the whole iteration). Returns\n"
        "gpu_slot_limit, gpu_static_limit, slot_bytes and resident_bytes (one resident).");
}

}  // namespace memtide::bindings
