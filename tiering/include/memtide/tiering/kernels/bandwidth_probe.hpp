#pragma once
/// @file
/// A memory roof for the fused AdamW step: the same streams (fp32 p, m, v read and written, a
/// 2-byte gradient read, a 2-byte param copy written: 28 B/element) with almost no arithmetic,
/// tiled over the ThreadPool the same way. What it reaches is what the optimizer step could
/// reach if it were purely bandwidth-bound on this machine; a generic `a += s*b` loop has a
/// different read/write mix and is not that roof.

#include <cstddef>
#include <cstdint>

#include "memtide/core/thread_pool.hpp"

namespace memtide::tiering {

/// p += s*g, m += s, v += s, out = top half of p's bits, over n elements (g and out: bf16 bits).
/// `pool` null = the calling thread. The values are meaningless; only the traffic counts.
void stream_probe(float* p, float* m, float* v, const std::uint16_t* g, std::uint16_t* out, std::size_t n,
                  ThreadPool* pool);

}  // namespace memtide::tiering
