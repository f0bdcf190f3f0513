// memtide._memtide: pinned host arrays from the HostArena of a device.

#include <atomic>
#include <cstdio>
#include <optional>
#include <vector>

#include "memtide/allocator/host_arena.hpp"
#include "common.hpp"

namespace memtide::bindings {
namespace {

// ---- pinned host memory -----------------------------------------------------------------------

memtide::HostArena& host_arena(int device, std::optional<int> numa_node) {
  memtide::Runtime& rt = memtide::Runtime::get();
  return numa_node ? rt.host_arena(device, *numa_node) : rt.host_arena(device);
}

// An array over a fresh buffer of the host arena. The owner capsule returns the buffer when the
// last view of it dies: the ndarray, or the torch tensor made from it with torch.from_dlpack.
nb::ndarray<> host_empty(const std::vector<std::int64_t>& shape, std::uint8_t code, std::uint8_t bits, int device,
                         std::optional<int> numa_node) {
  using nb::dlpack::dtype_code;
  const bool known = (code == static_cast<std::uint8_t>(dtype_code::Float) && (bits == 16 || bits == 32 || bits == 64)) ||
                     (code == static_cast<std::uint8_t>(dtype_code::Bfloat) && bits == 16) ||
                     (code == static_cast<std::uint8_t>(dtype_code::Int) && (bits == 8 || bits == 16 || bits == 32 || bits == 64)) ||
                     (code == static_cast<std::uint8_t>(dtype_code::UInt) && bits == 8);
  if (!known) value_error("host_empty: DLPack dtype (code " + std::to_string(code) + ", " + std::to_string(bits) + " bits) is not supported");
  // nanobind aborts the process on an array of more dimensions than it supports; torch allows
  // at most 64 anyway.
  constexpr std::size_t kMaxDims = 64;
  if (shape.size() > kMaxDims) {
    value_error("host.empty: shape has " + std::to_string(shape.size()) + " dimensions; at most " +
                std::to_string(kMaxDims) + " are supported");
  }
  std::size_t bytes = bits / 8;
  std::vector<std::size_t> dims;
  for (std::int64_t d : shape) {
    if (d < 0) value_error("host.empty: shape has a negative dimension (" + std::to_string(d) + ")");
    const auto u = static_cast<std::size_t>(d);
    if (u != 0 && bytes > SIZE_MAX / u) value_error("host.empty: shape holds more bytes than a size_t can count");
    bytes *= u;
    dims.push_back(u);
  }
  // Large buffers start on 2 MiB boundaries, and tensors may be streamed together (a step's
  // params, moments and gradients): each starts k * kStreamSkew in, k turning over 0..7, as the
  // engine's own arrays do.
  constexpr std::size_t kSkew = memtide::kStreamSkew, kSkews = 8, kSkewFrom = std::size_t{2} << 20;
  static std::atomic<std::size_t> turn{0};
  const std::size_t skew =
      bytes >= kSkewFrom ? (turn.fetch_add(1, std::memory_order_relaxed) % kSkews) * kSkew : 0;
  if (bytes > SIZE_MAX - skew) value_error("host.empty: shape holds more bytes than a size_t can count");
  void* base = nullptr;
  {
    nb::gil_scoped_release nogil;  // a new slab maps, touches and registers: milliseconds
    // An empty tensor still gets a real buffer, so every tensor has a valid data pointer.
    base = host_arena(device, numa_node).allocate(bytes == 0 ? 1 : bytes + skew);
  }
  void* ptr = static_cast<char*>(base) + skew;
  nb::capsule owner(base, [](void* p) noexcept {
    try {
      memtide::Runtime::get().host_free(p);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "memtide: freeing a pinned host tensor failed: %s\n", e.what());
    }
  });
  nb::dlpack::dtype dt{code, bits, 1};
  return nb::ndarray<>(ptr, dims.size(), dims.data(), owner, nullptr, dt, nb::device::cpu::value, 0);
}

nb::dict host_stats(int device, std::optional<int> numa_node) {
  const memtide::HostArenaStats s = host_arena(device, numa_node).stats();
  nb::dict d;
  d["numa_node"] = host_arena(device, numa_node).config().numa_node;
  d["reserved_bytes"] = s.reserved_bytes;
  d["allocated_bytes"] = s.allocated_bytes;
  d["peak_allocated_bytes"] = s.peak_allocated_bytes;
  d["allocations"] = s.allocations;
  d["slabs"] = s.slabs;
  d["registered_slabs"] = s.registered_slabs;
  d["fallback_slabs"] = s.fallback_slabs;
  d["slabs_released"] = s.slabs_released;
  nb::dict per_node;
  for (const auto& [node, b] : s.bytes_per_node) per_node[nb::int_(node)] = b;
  d["bytes_per_node"] = per_node;
  d["map_bind_seconds"] = s.map_bind_seconds;
  d["touch_seconds"] = s.touch_seconds;
  d["register_seconds"] = s.register_seconds;
  return d;
}

nb::dict host_placement(std::uintptr_t address, std::size_t bytes, int device, std::optional<int> numa_node) {
  const memtide::PlacementReport r = host_arena(device, numa_node).verify_placement(reinterpret_cast<const void*>(address), bytes);
  nb::dict d;
  d["known"] = r.known;
  d["wanted_node"] = r.wanted_node;
  d["pages_sampled"] = r.pages_sampled;
  d["pages_not_present"] = r.pages_not_present;
  nb::dict per_node;
  for (const auto& [node, pages] : r.pages_per_node) per_node[nb::int_(node)] = pages;
  d["pages_per_node"] = per_node;
  d["on_wanted_node"] = r.on_wanted_node();
  d["reason"] = r.reason;
  return d;
}

}  // namespace

void bind_host(nb::module_& m) {
  m.def("host_empty", &host_empty, "shape"_a, "code"_a, "bits"_a, "device"_a = 0, "numa_node"_a = nb::none(),
        "An uninitialized pinned host array (DLPack type code and bits) from the device's host arena;\n"
        "the buffer goes back to the arena when the array and every tensor made from it are gone.\n"
        "Use memtide.host.empty for torch tensors.");
  m.def("host_stats", &host_stats, "device"_a = 0, "numa_node"_a = nb::none(),
        "Statistics of the pinned host arena of `device` (on `numa_node`, default: the device's node).");
  m.def(
      "host_release_free_slabs",
      [](int device, std::optional<int> numa_node) {
        nb::gil_scoped_release nogil;
        return host_arena(device, numa_node).release_free_slabs();
      },
      "device"_a = 0, "numa_node"_a = nb::none(), "Unmaps the arena's slabs that hold no live buffer; returns the bytes.");
  m.def("host_node", [](int device) { return memtide::Runtime::get().host_node(device); }, "device"_a = 0,
        "The NUMA node whose memory serves `device`'s pinned host buffers (-1 = not bound).");
  m.def("host_placement", &host_placement, "address"_a, "bytes"_a, "device"_a = 0, "numa_node"_a = nb::none(),
        "Which NUMA nodes sampled pages of [address, address + bytes) are on (move_pages).");
}

}  // namespace memtide::bindings
