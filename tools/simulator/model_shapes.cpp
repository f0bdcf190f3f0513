// The simulator's inputs: the model shapes it knows (the paper's Table 2), the checks of a model
// and a node, and the contenders' names.
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/simulator/iteration_sim.hpp"
#include "sim_checks.hpp"

namespace memtide::tiering {
namespace {

using sim::require;

struct Table2Row {
  const char* name;
  int layers, hidden, heads;
  double nominal_params;  // the size the paper states
};
// Deep Optimizer States, Table 2 (LLaMA2 7B/13B, Megatron 8.3B, GPT 10B, GPT-NeoX 20B), and one
// model at STRONGHOLD's scale for the layer window (39B: GPT-3's 8192 hidden, 48 layers).
constexpr Table2Row kTable2[] = {{"7B", 32, 4096, 32, 7e9},    {"8.3B", 72, 3072, 24, 8.3e9},
                                 {"10B", 50, 4096, 32, 10e9},  {"13B", 40, 5120, 40, 13e9},
                                 {"20B", 48, 6144, 64, 20e9},  {"40B", 48, 8192, 64, 40e9}};

}  // namespace

double ModelShape::layer_params() const {
  const double h = hidden;
  return 12 * h * h + 13 * h;
}

double ModelShape::params() const { return layers * layer_params() + static_cast<double>(vocab) * hidden; }

void ModelShape::validate() const {
  const std::pair<const char*, int> fields[] = {{"layers", layers}, {"hidden", hidden}, {"heads", heads},
                                                {"seq", seq},       {"micro_batch", micro_batch},
                                                {"micro_batches", micro_batches}, {"vocab", vocab}};
  for (const auto& [field, v] : fields) {
    require(v > 0, "model " + name + ": " + field + " must be positive, got " + std::to_string(v));
  }
  require(hidden % heads == 0, "model " + name + ": hidden " + std::to_string(hidden) +
                                   " is not a multiple of heads " + std::to_string(heads));
  require(hidden <= (1 << 20) && layers <= 100000 && seq <= (1 << 24) && vocab <= (1 << 24) &&
              micro_batch <= (1 << 16) && micro_batches <= 4096,
          "model " + name + ": a dimension is far beyond any model (hidden <= 2^20, layers <= 1e5, seq and vocab <= "
                            "2^24, micro_batch <= 65536, micro_batches <= 4096)");
}

ModelShape ModelShape::table2(const std::string& name) {
  for (const Table2Row& r : kTable2) {
    if (name == r.name) {
      ModelShape m;
      m.name = r.name;
      m.layers = r.layers;
      m.hidden = r.hidden;
      m.heads = r.heads;
      m.nominal_params = r.nominal_params;
      return m;
    }
  }
  std::string known;
  for (const Table2Row& r : kTable2) known += std::string(known.empty() ? "" : ", ") + r.name;
  throw InvalidArgument("model \"" + name + "\" is not one of the paper's Table 2 models (" + known +
                        "); give a custom shape instead");
}

const std::vector<std::string>& ModelShape::table2_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const Table2Row& r : kTable2) out.emplace_back(r.name);
    return out;
  }();
  return names;
}

void NodeSpec::validate() const {
  require(gpus >= 1 && gpus <= 1024, "node: gpus must be 1 to 1024, got " + std::to_string(gpus));
  require(nodes >= 1 && nodes <= 65536, "node: nodes must be 1 to 65536, got " + std::to_string(nodes));
  require(inter_node_bytes_per_s > 0 && std::isfinite(inter_node_bytes_per_s),
          "node: inter_node_bytes_per_s must be a positive rate, got " + std::to_string(inter_node_bytes_per_s));
  require(inter_node_latency_s >= 0 && inter_node_latency_s <= 1,
          "node: inter_node_latency_s must be 0 to 1 s, got " + std::to_string(inter_node_latency_s));
  const std::pair<const char*, double> rates[] = {{"gpu_flops", gpu_flops},
                                                  {"link_bytes_per_s", link_bytes_per_s},
                                                  {"pageable_flush_bytes_per_s", pageable_flush_bytes_per_s},
                                                  {"device.h2d_bytes_per_s", device.h2d_bytes_per_s},
                                                  {"device.d2h_bytes_per_s", device.d2h_bytes_per_s},
                                                  {"device.cpu_update_params_per_s", device.cpu_update_params_per_s},
                                                  {"device.gpu_update_params_per_s", device.gpu_update_params_per_s},
                                                  {"device.host_dram_bytes_per_s", device.host_dram_bytes_per_s}};
  for (const auto& [field, v] : rates) {
    require(v > 0 && std::isfinite(v), std::string("node: ") + field + " must be a positive rate, got " + std::to_string(v));
  }
  require(subgroup_params > 0, "node: subgroup_params must be positive");
  require(twinflow_static_fraction >= 0 && twinflow_static_fraction <= 1,
          "node: twinflow_static_fraction must be in [0, 1], got " + std::to_string(twinflow_static_fraction));
  require(device.capacity >= (std::size_t{1} << 30), "node: device.capacity must be at least 1 GiB");
  for (const auto& [field, v] : {std::pair{"nvme_read_bytes_per_s", nvme_read_bytes_per_s},
                                 std::pair{"nvme_write_bytes_per_s", nvme_write_bytes_per_s}}) {
    require(v > 0 && std::isfinite(v), std::string("node: ") + field + " must be a positive rate, got " + std::to_string(v));
  }
}

const char* to_string(Contender c) noexcept {
  switch (c) {
    case Contender::zero3_offload: return "zero3_offload";
    case Contender::twinflow: return "twinflow";
    case Contender::memtide: return "memtide";
  }
  return "?";
}

}  // namespace memtide::tiering
