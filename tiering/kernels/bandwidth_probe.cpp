#include "memtide/tiering/kernels/bandwidth_probe.hpp"

#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "memtide/core/error.hpp"

namespace memtide::tiering {
namespace {

// Elements per inner block: the new p's top halves wait here (L1) when `out` is streamed.
constexpr std::size_t kProbeBlock = 256;

// One body, compiled for the widest vectors the CPU has (GCC picks the clone at load time), so
// the probe is bound by memory, not by instruction issue.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void probe_block(float* __restrict p, float* __restrict m, float* __restrict v, const std::uint16_t* __restrict g,
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

// Non-temporal copy of `bytes` from L1 to dst (8-byte MOVNTI: baseline x86-64; the write-combining
// buffers merge them into whole lines). Unaligned ends and other CPUs: memcpy.
void stream_bytes(void* dst_base, const void* src_base, std::size_t bytes) {
  auto* dst = static_cast<unsigned char*>(dst_base);
  const auto* src = static_cast<const unsigned char*>(src_base);
  std::size_t j = 0;
#if defined(__x86_64__)
  j = (8 - reinterpret_cast<std::uintptr_t>(dst) % 8) % 8;
  if (j > bytes) j = bytes;
  std::memcpy(dst, src, j);
  for (; j + 8 <= bytes; j += 8) {
    long long q;
    std::memcpy(&q, src + j, sizeof q);
    _mm_stream_si64(reinterpret_cast<long long*>(dst + j), q);
  }
#endif
  std::memcpy(dst + j, src + j, bytes - j);
}

void prefetch_ahead(const float* p, const float* m, const float* v, const std::uint16_t* g, std::size_t i,
                    std::size_t k, std::size_t distance, std::size_t end) {
#if defined(__x86_64__)
  for (std::size_t j = i; j < i + k; j += 16) {  // one line of each fp32 stream per 16 elements
    const std::size_t at = j + distance;
    if (at >= end) break;
    _mm_prefetch(reinterpret_cast<const char*>(p + at), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(m + at), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v + at), _MM_HINT_T0);
    if ((j & 31) == 0) _mm_prefetch(reinterpret_cast<const char*>(g + at), _MM_HINT_T0);
  }
#else
  (void)p, (void)m, (void)v, (void)g, (void)i, (void)k, (void)distance, (void)end;
#endif
}

void probe_range(float* p, float* m, float* v, const std::uint16_t* g, std::uint16_t* out, std::size_t n,
                 const StreamWay& way) {
  if (!way.stream_out && !way.stream_all && way.prefetch == 0) {
    probe_block(p, m, v, g, out, n);
    return;
  }
  alignas(64) float pb[kProbeBlock], mb[kProbeBlock], vb[kProbeBlock];
  alignas(64) std::uint16_t ob[kProbeBlock];
  for (std::size_t i = 0; i < n; i += kProbeBlock) {
    const std::size_t k = n - i < kProbeBlock ? n - i : kProbeBlock;
    if (way.prefetch != 0) prefetch_ahead(p, m, v, g, i, k, way.prefetch, n);
    if (way.stream_all) {
      std::memcpy(pb, p + i, k * sizeof(float));
      std::memcpy(mb, m + i, k * sizeof(float));
      std::memcpy(vb, v + i, k * sizeof(float));
      probe_block(pb, mb, vb, g + i, ob, k);
      stream_bytes(p + i, pb, k * sizeof(float));
      stream_bytes(m + i, mb, k * sizeof(float));
      stream_bytes(v + i, vb, k * sizeof(float));
      stream_bytes(out + i, ob, k * 2);
    } else if (way.stream_out) {
      probe_block(p + i, m + i, v + i, g + i, ob, k);
      stream_bytes(out + i, ob, k * 2);
    } else {
      probe_block(p + i, m + i, v + i, g + i, out + i, k);
    }
  }
#if defined(__x86_64__)
  if (way.stream_out || way.stream_all) _mm_sfence();
#endif
}

}  // namespace

void stream_probe(float* p, float* m, float* v, const std::uint16_t* g, std::uint16_t* out, std::size_t n,
                  ThreadPool* pool, const StreamWay& way) {
  if (n == 0) return;
  if (p == nullptr || m == nullptr || v == nullptr || g == nullptr || out == nullptr) {
    throw InvalidArgument("stream_probe: every array must be non-null for n = " + std::to_string(n));
  }
  const std::size_t threads = pool == nullptr ? 1 : pool->size();
  // tile 0: one contiguous share per thread (cut at 16-element lines).
  const std::size_t tile = way.tile != 0 ? way.tile : ((n + threads - 1) / threads + 15) / 16 * 16;
  const std::size_t tiles = (n + tile - 1) / tile;
  auto run = [&](std::size_t t) {
    const std::size_t b = t * tile;
    const std::size_t e = b + tile < n ? b + tile : n;
    probe_range(p + b, m + b, v + b, g + b, out + b, e - b, way);
  };
  if (pool == nullptr || pool->size() == 1) {
    for (std::size_t t = 0; t < tiles; ++t) run(t);
  } else {
    pool->parallel_for(tiles, run);
  }
}

}  // namespace memtide::tiering
