#pragma once
// The device memory an UpdateEngine's plan may use, from the phase tracker's record of the
// iterations (private to the engine; the rules are in docs/architecture.md, "UpdateEngine").

#include <cstddef>
#include <cstdint>
#include <string>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/tiering/engine/engine_types.hpp"
#include "memtide/tiering/model/perf_model.hpp"

namespace memtide::tiering {

// Device memory the engine holds, which the phase tracker counted as used: its static residents
// (all phases), its streamed slots (the update phase) and its kept gradients (backward and update).
struct EngineLoans {
  std::uint64_t residents = 0;
  std::uint64_t slots = 0;
  std::uint64_t kept_grads = 0;
};

// Streamed slots may use the lowest free memory of the update phase (and what follows it until
// the next forward); static residents stay through forward and backward, so they get the lowest
// free memory of the whole iteration beside its peak reservation. Both add the engine's loans
// back, are capped by the device's free memory plus this allocator's cache, and leave the
// allocator's headroom margin. Without a phase mark only the present is known.
EngineBudget plan_budget(CachingAllocator& allocator, const Workload& work, const EngineLoans& own);

inline std::uint64_t sat_sub(std::uint64_t a, std::uint64_t b) { return a > b ? a - b : 0; }

// "1 static resident", "3 static residents".
std::string count_words(std::size_t n, const char* what);

}  // namespace memtide::tiering
