#pragma once
/// @file
/// Where each optimizer subgroup is updated, and the update policies that decide it.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace memtide::tiering {

/// Where one subgroup is updated in this iteration.
enum class Placement : std::uint8_t {
  cpu,         ///< updated on the host; its low-precision params go H2D
  gpu,         ///< state streamed H2D into a GPU slot, updated there, flushed D2H
  gpu_static,  ///< state resident on the GPU for the whole run (TwinFlow-style)
  /// updated before the phase (on the CPU during backward): nothing left to do, and not resident.
  /// Planners never choose it; a caller that did the update marks it so that the scheduler (cached
  /// by its subgroups) is the same as in a step that does everything.
  done,
};

/// How the plan is chosen.
enum class Policy : std::uint8_t {
  cpu,          ///< every subgroup on the CPU (ZeRO-Offload)
  static_split, ///< a fixed fraction resident on the GPU, the rest on the CPU (TwinFlow)
  interleaved,  ///< a fixed stride k (Deep Optimizer States with a hand-picked k)
  automatic,    ///< the PerfModel's plan, recomputed every iteration
};

/// The paper's interleaving with a stride `k` >= 1 that may be fractional: among the first
/// `n - static_residents` subgroups, one in every k goes to the GPU (k = 1: all of them; k = 2:
/// every other one; k = 1.5: two in three), starting with CPU work so both sides start at once.
/// k <= 0 sends none. The last `static_residents` subgroups are GPU-static (paper 4.1: static
/// residents last, so their updates cover the tail of the transfers).
inline std::vector<Placement> interleave(std::size_t n, double k, std::size_t static_residents) {
  std::vector<Placement> out(n, Placement::cpu);
  const std::size_t statics = static_residents < n ? static_residents : n;
  const std::size_t streamed = n - statics;
  for (std::size_t i = streamed; i < n; ++i) out[i] = Placement::gpu_static;
  if (!(k > 0)) return out;
  if (k < 1) k = 1;
  for (std::size_t i = 0; i < streamed; ++i) {
    const double a = std::floor(static_cast<double>(i) / k);
    const double b = std::floor(static_cast<double>(i + 1) / k);
    if (b > a) out[i] = Placement::gpu;
  }
  return out;
}

}  // namespace memtide::tiering
