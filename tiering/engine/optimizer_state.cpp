#include "memtide/tiering/engine/optimizer_state.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "memtide/core/error.hpp"
#include "memtide/core/options.hpp"

namespace memtide::tiering {
namespace {

constexpr std::size_t kArrayAlign = 64;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

std::size_t resolve_subgroup_size(std::size_t requested) {
  return requested != 0 ? requested : static_cast<std::size_t>(options().subgroup_size);
}

std::vector<std::size_t> split(std::size_t total, std::size_t per) {
  std::vector<std::size_t> sizes;
  for (std::size_t at = 0; at < total; at += per) sizes.push_back(std::min(per, total - at));
  return sizes;
}

void check_total(std::size_t total, const char* who) {
  if (total == 0) throw InvalidArgument(std::string(who) + ": total_params must be > 0, got 0");
}

// Bytes of one fp32 array of a subgroup of `n` params; a subgroup block holds four of them.
std::size_t array_bytes(std::size_t n) { return round_up(n * sizeof(float), kArrayAlign); }

// The subgroup whose p, m, v and g arrays follow one another from `base`.
Subgroup carve(std::uintptr_t base, std::size_t offset, std::size_t n) {
  const std::size_t a = array_bytes(n);
  Subgroup g;
  g.offset = offset;
  g.n = n;
  g.param = reinterpret_cast<float*>(base);
  g.exp_avg = reinterpret_cast<float*>(base + a);
  g.exp_avg_sq = reinterpret_cast<float*>(base + 2 * a);
  g.grad = reinterpret_cast<float*>(base + 3 * a);
  return g;
}

}  // namespace

std::unique_ptr<OptimizerState> OptimizerState::owned(Device& device, SlabSource& slabs, std::size_t total_params,
                                                      std::size_t subgroup_size) {
  check_total(total_params, "OptimizerState::owned");
  if (is_phantom(device)) {
    throw InvalidArgument("OptimizerState::owned: the device is a phantom SimDevice; use OptimizerState::phantom");
  }
  const std::size_t per = resolve_subgroup_size(subgroup_size);
  std::unique_ptr<OptimizerState> s(new OptimizerState(device, StateMemory::owned));
  s->slabs_ = &slabs;
  std::size_t offset = 0;
  for (std::size_t n : split(total_params, per)) {
    HostSlab slab = slabs.map_slab(4 * array_bytes(n), kArrayAlign);
    s->owned_slabs_.push_back(slab);
    std::memset(slab.ptr, 0, 4 * array_bytes(n));
    s->subgroups_.push_back(carve(reinterpret_cast<std::uintptr_t>(slab.ptr), offset, n));
    offset += n;
  }
  s->total_ = total_params;
  return s;
}

std::unique_ptr<OptimizerState> OptimizerState::external(Device& device, const std::vector<ExternalSubgroup>& groups,
                                                         DType model_dtype) {
  if (groups.empty()) throw InvalidArgument("OptimizerState::external: no subgroups given");
  const bool any_model = std::any_of(groups.begin(), groups.end(), [](const ExternalSubgroup& e) { return e.model_param != nullptr; });
  if (any_model && model_dtype != DType::fp16 && model_dtype != DType::bf16) {
    throw InvalidArgument(std::string("OptimizerState::external: model params are given, so model_dtype must be fp16 or bf16, got ") +
                          dtype_name(model_dtype));
  }
  std::unique_ptr<OptimizerState> s(new OptimizerState(device, StateMemory::external));
  s->model_dtype_ = any_model ? model_dtype : DType::none;
  std::size_t offset = 0;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const ExternalSubgroup& e = groups[i];
    if (e.n == 0 || e.param == nullptr || e.exp_avg == nullptr || e.exp_avg_sq == nullptr || e.grad == nullptr) {
      throw InvalidArgument("OptimizerState::external: subgroup " + std::to_string(i) +
                            " needs n > 0 and four non-null arrays (n = " + std::to_string(e.n) + ")");
    }
    Subgroup g;
    g.offset = offset;
    g.n = e.n;
    g.param = e.param;
    g.exp_avg = e.exp_avg;
    g.exp_avg_sq = e.exp_avg_sq;
    g.grad = e.grad;
    g.model_param = e.model_param;
    s->subgroups_.push_back(g);
    offset += e.n;
  }
  s->total_ = offset;
  return s;
}

std::unique_ptr<OptimizerState> OptimizerState::phantom(Device& device, std::size_t total_params,
                                                        std::size_t subgroup_size) {
  check_total(total_params, "OptimizerState::phantom");
  if (!is_phantom(device)) {
    throw InvalidArgument("OptimizerState::phantom: device \"" + device.properties().name +
                          "\" stores data; phantom state needs a phantom SimDevice (sim_phantom=true)");
  }
  const std::size_t per = resolve_subgroup_size(subgroup_size);
  std::unique_ptr<OptimizerState> s(new OptimizerState(device, StateMemory::phantom));
  const std::vector<std::size_t> sizes = split(total_params, per);
  std::size_t bytes = 0;
  for (std::size_t n : sizes) bytes += 4 * array_bytes(n);
  s->phantom_base_ = reserve_phantom_host(bytes);
  s->phantom_bytes_ = bytes;
  device.host_register(s->phantom_base_, bytes);  // pinned: copies run at full rate
  auto at = reinterpret_cast<std::uintptr_t>(s->phantom_base_);
  std::size_t offset = 0;
  for (std::size_t n : sizes) {
    s->subgroups_.push_back(carve(at, offset, n));
    at += 4 * array_bytes(n);
    offset += n;
  }
  s->total_ = total_params;
  return s;
}

OptimizerState::~OptimizerState() {
  for (const HostSlab& slab : owned_slabs_) slabs_->unmap_slab(slab);
  if (phantom_base_ != nullptr) {
    try {
      device_.host_unregister(phantom_base_);
    } catch (const Error&) {
      // The device may already be gone from the simulated view; nothing was ever held.
    }
  }
}

std::size_t OptimizerState::largest_subgroup() const noexcept {
  std::size_t m = 0;
  for (const Subgroup& g : subgroups_) m = std::max(m, g.n);
  return m;
}

std::size_t OptimizerState::host_bytes() const noexcept {
  std::size_t b = 0;
  for (const HostSlab& slab : owned_slabs_) b += slab.bytes;
  return b;
}

void OptimizerState::set_model_params(void* device_params, DType dtype) {
  if (device_params != nullptr && dtype != DType::fp16 && dtype != DType::bf16) {
    throw InvalidArgument("OptimizerState::set_model_params: dtype must be fp16 or bf16 (the model's copy), got " +
                          std::to_string(static_cast<int>(dtype)));
  }
  model_dtype_ = device_params != nullptr ? dtype : DType::none;
  for (Subgroup& g : subgroups_) {
    g.model_param = device_params == nullptr ? nullptr : static_cast<unsigned char*>(device_params) + g.offset * 2;
  }
}

std::size_t OptimizerState::subgroup_of(std::size_t offset) const {
  if (offset >= total_) {
    throw InvalidArgument("OptimizerState::subgroup_of: offset " + std::to_string(offset) + " is past the " +
                          std::to_string(total_) + " parameters");
  }
  auto it = std::upper_bound(subgroups_.begin(), subgroups_.end(), offset,
                             [](std::size_t o, const Subgroup& g) { return o < g.offset; });
  return static_cast<std::size_t>(std::prev(it) - subgroups_.begin());
}

}  // namespace memtide::tiering
