// What memtide._memtide and memtide._sim both return: the PerfModel's rates, predictions and
// plans as dicts (and rates back from one). Compiled into each extension; each keeps its copy
// private (nanobind hides a module's symbols), and both convert the same way.

#include <optional>
#include <string>
#include <vector>

#include "common.hpp"

namespace memtide::bindings {

namespace {

struct RateField {
  const char* key;
  double tiering::Rates::*member;
};
constexpr RateField kRateFields[] = {
    {"h2d_bytes_per_s", &tiering::Rates::h2d_bytes_per_s},
    {"d2h_bytes_per_s", &tiering::Rates::d2h_bytes_per_s},
    {"cpu_update_params_per_s", &tiering::Rates::cpu_update_params_per_s},
    {"gpu_update_params_per_s", &tiering::Rates::gpu_update_params_per_s},
    {"cpu_downscale_params_per_s", &tiering::Rates::cpu_downscale_params_per_s},
    {"host_dram_bytes_per_s", &tiering::Rates::host_dram_bytes_per_s},
    {"cpu_dram_bytes_per_param", &tiering::Rates::cpu_dram_bytes_per_param},
    {"nvme_read_bytes_per_s", &tiering::Rates::nvme_read_bytes_per_s},
    {"nvme_write_bytes_per_s", &tiering::Rates::nvme_write_bytes_per_s},
};

}  // namespace

nb::dict rates_dict(const tiering::Rates& r) {
  nb::dict d;
  for (const RateField& f : kRateFields) d[f.key] = r.*f.member;
  return d;
}

// Starts from the C++ defaults; `overrides` may set any subset of the fields.
tiering::Rates rates_arg(const std::optional<nb::dict>& overrides) {
  tiering::Rates r;
  if (!overrides) return r;
  for (auto [key, value] : *overrides) {
    const std::string name = nb::cast<std::string>(key);
    bool known = false;
    for (const RateField& f : kRateFields) {
      if (name == f.key) {
        r.*f.member = nb::cast<double>(value);
        known = true;
      }
    }
    if (!known) {
      std::string keys;
      for (const RateField& f : kRateFields) keys += std::string(keys.empty() ? "" : ", ") + f.key;
      value_error("rates: unknown key \"" + name + "\"; known keys: " + keys);
    }
  }
  return r;
}

const char* policy_key(tiering::Policy p) {
  switch (p) {
    case tiering::Policy::cpu: return "cpu";
    case tiering::Policy::static_split: return "static";
    case tiering::Policy::interleaved: return "interleaved";
    case tiering::Policy::automatic: return "auto";
  }
  return "auto";
}

// One letter per subgroup: c (CPU), g (streamed through the GPU), s (GPU-static).
std::string placement_string(const std::vector<tiering::Placement>& placement) {
  std::string out;
  out.reserve(placement.size());
  for (tiering::Placement p : placement) {
    out += p == tiering::Placement::cpu ? 'c' : p == tiering::Placement::gpu ? 'g' : p == tiering::Placement::done ? 'd' : 's';
  }
  return out;
}

nb::dict prediction_dict(const tiering::Prediction& p) {
  nb::dict d;
  d["total_ns"] = p.total_ns;
  d["bound_ns"] = p.bound_ns;
  d["cpu_ns"] = p.cpu_ns;
  d["gpu_ns"] = p.gpu_ns;
  d["h2d_ns"] = p.h2d_ns;
  d["d2h_ns"] = p.d2h_ns;
  d["dram_ns"] = p.dram_ns;
  d["nvme_ns"] = p.nvme_ns;
  d["nvme_bytes"] = p.nvme_bytes;
  d["busiest"] = p.busiest;
  d["h2d_bytes"] = p.h2d_bytes;
  d["d2h_bytes"] = p.d2h_bytes;
  d["dram_bytes"] = p.dram_bytes;
  return d;
}

nb::list nvme_transfer_list(const std::vector<tiering::NvmeTransfer>& transfers) {
  nb::list out;
  for (const tiering::NvmeTransfer& t : transfers) {
    out.append(nb::make_tuple(t.what, t.subgroup, t.queued_ns / 1e9, t.start_ns / 1e9, t.end_ns / 1e9, t.bytes));
  }
  return out;
}

nb::dict plan_dict(const tiering::Plan& p) {
  nb::dict d;
  d["policy"] = policy_key(p.policy);
  d["placement"] = placement_string(p.placement);
  d["k"] = p.k;
  d["gpu_slots"] = p.gpu_slots;
  d["gpu_streamed"] = p.gpu_streamed;
  d["static_residents"] = p.static_residents;
  d["prediction"] = prediction_dict(p.prediction);
  return d;
}

}  // namespace memtide::bindings
