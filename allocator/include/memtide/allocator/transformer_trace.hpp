#pragma once
/// @file
/// A synthetic but faithful allocation trace of GPT-style training, and its replay through a
/// CachingAllocator. It is the allocator's workload for the main job and the benchmark until real
/// traces (the timeline tool) replace it.
///
/// Per iteration: forward allocates each block's saved activations (and short-lived workspaces),
/// then the logits; backward walks the blocks in reverse, freeing their activations and creating
/// parameter gradients (kept until the update ends, as zero_grad(set_to_none=True) does); update
/// creates the AdamW state on the first step and per-tensor temporaries on every step.

#include <cstdint>
#include <string>
#include <vector>

#include "memtide/allocator/caching_allocator.hpp"

namespace memtide {

struct TransformerShape {
  int layers = 24;
  int hidden = 2048;
  int heads = 16;
  int seq = 2048;
  int batch = 4;
  int vocab = 50304;
  int bytes_per_element = 2;   ///< bf16/fp16 activations and params
  int iterations = 3;
  bool fp32_master = true;     ///< mixed precision: fp32 master params + two fp32 moments

  [[nodiscard]] std::uint64_t parameters() const;
  [[nodiscard]] std::string describe() const;
};

struct TraceOp {
  enum class Kind : std::uint8_t { alloc, free, phase };
  Kind kind = Kind::alloc;
  Phase phase = Phase::other;  ///< for Kind::phase
  std::uint32_t id = 0;        ///< tensor id, for alloc and free
  std::uint64_t bytes = 0;     ///< for alloc
};

/// The trace for `shape.iterations` iterations. Throws InvalidArgument for a non-positive field.
std::vector<TraceOp> make_transformer_trace(const TransformerShape& shape);

struct ReplayResult {
  std::uint64_t ops = 0;
  std::uint64_t peak_allocated = 0;
  std::uint64_t peak_reserved = 0;
  double reserved_over_allocated = 0;  ///< peak reserved / peak allocated
  Headroom update_headroom;            ///< asked at the start of the last update phase
  PhaseReport phases;
  double seconds = 0;                  ///< wall time of the replay
};

/// Replays `trace` on `stream`, marking phases. Frees everything it allocated before returning,
/// also when an allocation throws.
ReplayResult replay(CachingAllocator& allocator, const std::vector<TraceOp>& trace, Stream stream = {});

}  // namespace memtide
