#pragma once
/// @file
/// An UpdateEngine for engine tests: 12,000 params in four subgroups of 3,000 over a data-mode
/// SimDevice, its state in a HostArena of 4 MiB slabs, the CPU step on the caller's thread. A
/// test's rig derives from it and lays the params out itself.

#include <cstddef>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/allocator/host_arena.hpp"
#include "memtide/device/sim_device.hpp"
#include "memtide/tiering/engine/update_engine.hpp"

namespace memtide::test {

struct SimEngine {
  static constexpr std::size_t kParams = 12'000;

  SimDevice device{SimConfig{}};
  CachingAllocator allocator{device};
  HostArena arena{[this] {
    HostArenaConfig c;
    c.device = &device;
    c.slab_bytes = 4 << 20;
    return c;
  }()};
  tiering::UpdateEngine engine{allocator, arena, kParams, {{0, 3000}, {3000, 6000}, {6000, 9000}, {9000, 12000}},
                               nullptr};
};

}  // namespace memtide::test
