#include "memtide/tiering/kernels/bandwidth_probe.hpp"

#include <cstring>

#include "memtide/core/error.hpp"
#include "memtide/tiering/kernels/adamw_cpu.hpp"

namespace memtide::tiering {
namespace {

// One body, compiled for the widest vectors the CPU has (GCC picks the clone at load time), so
// the probe is bound by memory, not by instruction issue.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void probe_range(float* __restrict p, float* __restrict m, float* __restrict v, const std::uint16_t* __restrict g,
                 std::uint16_t* __restrict out, std::size_t n) {
  const float s = 1e-3F;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t gb = static_cast<std::uint32_t>(g[i]) << 16;
    float gf;
    std::memcpy(&gf, &gb, sizeof gf);
    const float pi = p[i] + s * gf;
    p[i] = pi;
    m[i] = m[i] + s;
    v[i] = v[i] + s;
    std::uint32_t pb;
    std::memcpy(&pb, &pi, sizeof pb);
    out[i] = static_cast<std::uint16_t>(pb >> 16);
  }
}

}  // namespace

void stream_probe(float* p, float* m, float* v, const std::uint16_t* g, std::uint16_t* out, std::size_t n,
                  ThreadPool* pool) {
  if (n == 0) return;
  if (p == nullptr || m == nullptr || v == nullptr || g == nullptr || out == nullptr) {
    throw InvalidArgument("stream_probe: every array must be non-null for n = " + std::to_string(n));
  }
  const std::size_t tiles = (n + kAdamwTile - 1) / kAdamwTile;
  auto tile = [&](std::size_t t) {
    const std::size_t b = t * kAdamwTile;
    const std::size_t e = b + kAdamwTile < n ? b + kAdamwTile : n;
    probe_range(p + b, m + b, v + b, g + b, out + b, e - b);
  };
  if (pool == nullptr || pool->size() == 1) {
    for (std::size_t t = 0; t < tiles; ++t) tile(t);
  } else {
    pool->parallel_for(tiles, tile);
  }
}

}  // namespace memtide::tiering
