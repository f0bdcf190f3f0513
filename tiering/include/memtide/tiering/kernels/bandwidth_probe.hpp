#pragma once
/// @file
/// A memory roof for the fused AdamW step: the same streams (fp32 p, m, v read and written, a
/// 2-byte gradient read, a 2-byte param copy written: 28 B/element) with almost no arithmetic.
/// What it reaches is what the optimizer step could reach if it were purely bandwidth-bound on
/// this machine; a generic `a += s*b` loop has a different read/write mix and is not that roof.
///
/// The probe can stream those bytes several ways (StreamWay): the benchmark tries them all, with
/// and without huge pages under the arrays and on one thread or the pool, and calls the best one
/// the roof. Which way wins depends on the size and the machine (bench/results/adamw/); streaming
/// p, m and v too (read first, so their lines are in cache anyway) and software prefetch ahead of
/// the hardware prefetchers were slower at every size measured there.

#include <cstddef>
#include <cstdint>

#include "memtide/core/thread_pool.hpp"
#include "memtide/tiering/kernels/adamw_cpu.hpp"

namespace memtide::tiering {

/// One way of streaming the probe's bytes.
struct StreamWay {
  /// Elements per task handed to a thread; 0 = one contiguous share per thread.
  std::size_t tile = kAdamwTile;
  /// The write-only copy (`out`) with non-temporal stores (no read-for-ownership of its lines).
  bool stream_out = false;
  /// The read streams with non-temporal stores too (p, m and v as well as out).
  bool stream_all = false;
  /// Software prefetch this many elements ahead on every read stream; 0 = the hardware's alone.
  std::size_t prefetch = 0;
};

/// p += s*g, m += s, v += s, out = top half of p's bits, over n elements (g and out: bf16 bits).
/// `pool` null = the calling thread. The values are meaningless; only the traffic counts.
void stream_probe(float* p, float* m, float* v, const std::uint16_t* g, std::uint16_t* out, std::size_t n,
                  ThreadPool* pool, const StreamWay& way = {});

}  // namespace memtide::tiering
