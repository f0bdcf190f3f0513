#include "model_inputs.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "memtide/core/error.hpp"

namespace memtide::tiering {
namespace {

void require_rate(const char* field, double v) {
  if (!(v > 0) || !std::isfinite(v)) {
    throw InvalidArgument(std::string("PerfModel: rates.") + field + " = " + show_number(v) +
                          " is not accepted: expected a positive, finite number");
  }
}

void require_non_negative(const char* field, double v) {
  if (!(v >= 0) || !std::isfinite(v)) {
    throw InvalidArgument(std::string("PerfModel: rates.") + field + " = " + show_number(v) +
                          " is not accepted: expected a finite number >= 0");
  }
}

}  // namespace

std::string show_number(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

void validate_model_inputs(const Workload& work, const Rates& r) {
  require_rate("h2d_bytes_per_s", r.h2d_bytes_per_s);
  require_rate("d2h_bytes_per_s", r.d2h_bytes_per_s);
  require_rate("cpu_update_params_per_s", r.cpu_update_params_per_s);
  require_rate("gpu_update_params_per_s", r.gpu_update_params_per_s);
  require_non_negative("cpu_downscale_params_per_s", r.cpu_downscale_params_per_s);
  require_rate("host_dram_bytes_per_s", r.host_dram_bytes_per_s);
  require_non_negative("cpu_dram_bytes_per_param", r.cpu_dram_bytes_per_param);
  if (work.subgroup_params.empty()) {
    throw InvalidArgument("PerfModel: workload.subgroup_params is empty: expected at least one subgroup");
  }
  if (work.subgroup_params.size() > kMaxSubgroups) {
    throw InvalidArgument("PerfModel: " + std::to_string(work.subgroup_params.size()) + " subgroups, at most " +
                          std::to_string(kMaxSubgroups) + " are accepted: make the subgroups larger");
  }
  for (std::size_t i = 0; i < work.subgroup_params.size(); ++i) {
    if (work.subgroup_params[i] == 0) {
      throw InvalidArgument("PerfModel: workload.subgroup_params[" + std::to_string(i) +
                            "] = 0 is not accepted: every subgroup needs at least one param");
    }
  }
  if (!work.grad_on_device.empty() && work.grad_on_device.size() != work.subgroup_params.size()) {
    throw InvalidArgument("PerfModel: workload.grad_on_device has " + std::to_string(work.grad_on_device.size()) +
                          " entries, there are " + std::to_string(work.subgroup_params.size()) + " subgroups");
  }
  require_non_negative("nvme_read_bytes_per_s", r.nvme_read_bytes_per_s);
  require_non_negative("nvme_write_bytes_per_s", r.nvme_write_bytes_per_s);
  if (!work.on_nvme.empty()) {
    if (work.on_nvme.size() != work.subgroup_params.size()) {
      throw InvalidArgument("PerfModel: workload.on_nvme has " + std::to_string(work.on_nvme.size()) +
                            " entries, there are " + std::to_string(work.subgroup_params.size()) + " subgroups");
    }
    if (std::find(work.on_nvme.begin(), work.on_nvme.end(), true) != work.on_nvme.end()) {
      require_rate("nvme_read_bytes_per_s", r.nvme_read_bytes_per_s);
      require_rate("nvme_write_bytes_per_s", r.nvme_write_bytes_per_s);
      if (work.nvme_read_ahead == 0) {
        throw InvalidArgument("PerfModel: workload.nvme_read_ahead = 0 is not accepted: expected at least 1");
      }
    }
  }
  if (work.low_precision_bytes == 0 || work.low_precision_bytes > 4) {
    throw InvalidArgument("PerfModel: workload.low_precision_bytes = " + std::to_string(work.low_precision_bytes) +
                          " is not accepted: expected 1 to 4");
  }
}

}  // namespace memtide::tiering
