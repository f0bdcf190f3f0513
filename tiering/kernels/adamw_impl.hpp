// The AdamW loop, compiled once per ISA: adamw_scalar.cpp, adamw_avx2.cpp and adamw_avx512.cpp
// each define MEMTIDE_ADAMW_SUFFIX (and MEMTIDE_ADAMW_AVX2 / MEMTIDE_ADAMW_AVX512) and include this
// file. Everything here has internal linkage, so the differently compiled copies never merge.
// The translation units are built with -ffp-contract=off and without -ffast-math: every path
// performs the same IEEE operations in the same order and gives the same bits.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>  // the scalar path too: MOVNTI and SFENCE are baseline x86-64
#endif

#include "adamw_consts.hpp"
#include "fp_bits.hpp"
#include "memtide/tiering/kernels/adamw_cpu.hpp"

namespace {

using memtide::tiering::AdamwArgs;
using memtide::tiering::DType;
using memtide::tiering::detail::AdamwConsts;

// Elements per inner block: the converted gradient and the new params wait here (L1-resident).
constexpr std::size_t kBlock = 256;

using memtide::tiering::fp::bf16_to_f;
using memtide::tiering::fp::f_to_bf16;
using memtide::tiering::fp::f_to_fp16;
using memtide::tiering::fp::fp16_to_f;
using memtide::tiering::fp::nonfinite_bit;

inline std::uint16_t load_u16(const void* base, std::size_t i) {
  std::uint16_t v;
  std::memcpy(&v, static_cast<const unsigned char*>(base) + 2 * i, sizeof v);
  return v;
}
inline void store_u16(void* base, std::size_t i, std::uint16_t v) {
  std::memcpy(static_cast<unsigned char*>(base) + 2 * i, &v, sizeof v);
}

template <DType G>
inline void load_grad(const void* grad, std::size_t i0, std::size_t k, float* __restrict out) {
  if constexpr (G == DType::fp32) {
    std::memcpy(out, static_cast<const float*>(grad) + i0, k * sizeof(float));
  } else if constexpr (G == DType::bf16) {
    const auto* src = static_cast<const unsigned char*>(grad) + 2 * i0;
    for (std::size_t j = 0; j < k; ++j) {
      std::uint16_t b;
      std::memcpy(&b, src + 2 * j, sizeof b);
      out[j] = bf16_to_f(b);
    }
  } else {
    const auto* src = static_cast<const unsigned char*>(grad) + 2 * i0;
    std::size_t j = 0;
#if defined(MEMTIDE_ADAMW_AVX512)
    for (; j + 16 <= k; j += 16) {
      _mm512_storeu_ps(out + j, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * j))));
    }
#elif defined(MEMTIDE_ADAMW_AVX2)
    for (; j + 8 <= k; j += 8) {
      _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * j))));
    }
#endif
    for (; j < k; ++j) out[j] = fp16_to_f(load_u16(src, j));
  }
}

template <DType O>
inline void store_out(void* dst_base, std::size_t i0, std::size_t k, const float* __restrict p) {
  auto* dst = static_cast<unsigned char*>(dst_base) + 2 * i0;
  if constexpr (O == DType::bf16) {
    for (std::size_t j = 0; j < k; ++j) {
      const std::uint16_t b = f_to_bf16(p[j]);
      std::memcpy(dst + 2 * j, &b, sizeof b);
    }
  } else if constexpr (O == DType::fp16) {
    std::size_t j = 0;
#if defined(MEMTIDE_ADAMW_AVX512)
    for (; j + 16 <= k; j += 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * j),
                          _mm512_cvtps_ph(_mm512_loadu_ps(p + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#elif defined(MEMTIDE_ADAMW_AVX2)
    for (; j + 8 <= k; j += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * j),
                       _mm256_cvtps_ph(_mm256_loadu_ps(p + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    for (; j < k; ++j) store_u16(dst, j, f_to_fp16(p[j]));
  }
}


// Copies a block's finished low-precision params from L1 to their destination with
// non-temporal stores: the copy is written once and read by someone else (the H2D copy, the next
// forward), so the plain stores' read-for-ownership of each destination line is pure waste; it is
// 2 of the step's 28 B/param, and streaming them was worth 11% on the step's roof (see
// bandwidth_probe.hpp). Bytes before the first aligned vector and after the last go through memcpy.
inline void stream_copy(void* dst_base, const void* src_base, std::size_t bytes) {
  auto* dst = static_cast<unsigned char*>(dst_base);
  const auto* src = static_cast<const unsigned char*>(src_base);
#if defined(MEMTIDE_ADAMW_AVX512)
  constexpr std::size_t kVec = 64;
#elif defined(MEMTIDE_ADAMW_AVX2)
  constexpr std::size_t kVec = 32;
#elif defined(__x86_64__)
  constexpr std::size_t kVec = 8;
#else
  constexpr std::size_t kVec = 0;
#endif
  std::size_t head = 0;
  if constexpr (kVec != 0) {
    head = (kVec - reinterpret_cast<std::uintptr_t>(dst) % kVec) % kVec;
    if (head > bytes) head = bytes;
  } else {
    head = bytes;
  }
  std::memcpy(dst, src, head);
  std::size_t j = head;
#if defined(MEMTIDE_ADAMW_AVX512)
  for (; j + 64 <= bytes; j += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + j), _mm512_loadu_si512(src + j));
  }
#elif defined(MEMTIDE_ADAMW_AVX2)
  for (; j + 32 <= bytes; j += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + j),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j)));
  }
#elif defined(__x86_64__)
  for (; j + 8 <= bytes; j += 8) {  // MOVNTI: SSE2, so every x86-64 has it
    long long q;
    std::memcpy(&q, src + j, sizeof q);
    _mm_stream_si64(reinterpret_cast<long long*>(dst + j), q);
  }
#endif
  std::memcpy(dst + j, src + j, bytes - j);
}

// Orders a thread's non-temporal stores before whatever it does next (the pool's hand-back).
inline void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// Elements ahead of the block being computed whose lines prefetch_window requests: 1 KiB of each
// fp32 stream. From DRAM one core of the Intel Xeon VM is bound by the misses it keeps in flight,
// not by the divider (one thread takes twice as long as two; in cache the same loop runs twice as
// fast), and its hardware prefetchers alone keep too few: asking for every line 1 KiB ahead took
// another 7-9% off the step per core there, after reading the gradient in place (see
// bench/results/adamw/2026-11-28-intel-xeon-2core-kernel.md). 512 B to 3 KiB ahead measured alike;
// asking only for the first lines of each 4 KiB page gained nothing. Where the state sits in the
// last-level cache the requests cost 0-7% (a step that is a fraction of a millisecond there).
constexpr std::size_t kPrefetchAhead = 256;
static_assert(kBlock % 32 == 0 && kPrefetchAhead % 32 == 0, "prefetch_window steps by whole lines of every stream");

// always_inline: GCC 12 finds a function of prefetches alone free of side effects (pure-const) and
// deletes every call to it that it did not inline: the 16-bit gradient paths lost theirs so.
template <DType G>
[[gnu::always_inline]] inline void prefetch_window(const AdamwArgs& a, std::size_t b, std::size_t e) {
  constexpr std::size_t kGradBytes = G == DType::fp32 ? 4 : 2;
  for (std::size_t j = b; j < e; j += 16) {
    __builtin_prefetch(a.param + j, 0, 3);
    __builtin_prefetch(a.exp_avg + j, 0, 3);
    __builtin_prefetch(a.exp_avg_sq + j, 0, 3);
    if (kGradBytes == 4 || (j - b) % 32 == 0) {
      __builtin_prefetch(static_cast<const unsigned char*>(a.grad) + kGradBytes * j, 0, 3);
    }
  }
}

// One block: returns 1 if a scaled gradient was non-finite.
template <DType G, DType O, bool kL2, bool kStream>
std::uint32_t adamw_block(const AdamwArgs& a, const AdamwConsts& c, std::size_t i0, std::size_t k) {
  // An fp32 gradient is read where it lies: staging it in L1 (a REP MOVSQ per block, then a second
  // read) made the step 7-10% slower per core from DRAM on the Intel VM, and saved nothing.
  alignas(64) float staged[G == DType::fp32 ? 1 : kBlock];
  alignas(64) float out[kBlock];
  if constexpr (G != DType::fp32) load_grad<G>(a.grad, i0, k, staged);
  const float* __restrict g = G == DType::fp32 ? static_cast<const float*>(a.grad) + i0 : staged;
  float* __restrict P = a.param + i0;
  float* __restrict M = a.exp_avg + i0;
  float* __restrict V = a.exp_avg_sq + i0;
  const float gs = c.grad_scale, clip = c.clip, decay = c.decay, wd = c.wd, w1 = c.w1, b2 = c.beta2,
              omb2 = c.one_minus_beta2, inv_bc2 = c.inv_bc2_sqrt, eps = c.eps, neg_step = c.neg_step;
  std::uint32_t bad = 0;
  for (std::size_t j = 0; j < k; ++j) {
    float gj = g[j] * gs;
    gj = gj * clip;
    bad |= nonfinite_bit(gj);
    float p = P[j];
    if constexpr (kL2) {
      gj = std::fma(wd, p, gj);  // torch's add(alpha=) is a fused multiply-add too
    } else {
      p = p * decay;
    }
    float m = M[j];
    m = std::fma(w1, gj - m, m);  // torch's vectorized lerp_ is an explicit fused multiply-add
    float v = V[j];
    v = v * b2;
    v = v + (omb2 * gj) * gj;
    const float denom = std::sqrt(v) * inv_bc2 + eps;
    p = p + (neg_step * m) / denom;
    P[j] = p;
    M[j] = m;
    V[j] = v;
    out[j] = p;
  }
  if constexpr (O != DType::none) {
    if constexpr (kStream) {
      alignas(64) std::uint16_t low[kBlock];
      store_out<O>(low, 0, k, out);
      stream_copy(static_cast<unsigned char*>(a.param_out) + 2 * i0, low, 2 * k);
    } else {
      store_out<O>(a.param_out, i0, k, out);
    }
  }
  return bad;
}

template <DType G, DType O, bool kL2, bool kStream>
bool adamw_range_s(const AdamwArgs& a, const AdamwConsts& c, std::size_t begin, std::size_t end) {
  std::uint32_t bad = 0;
  for (std::size_t i = begin; i < end; i += kBlock) {
    const std::size_t k = end - i < kBlock ? end - i : kBlock;
    const std::size_t ahead = end - i > kPrefetchAhead ? i + kPrefetchAhead : end;
    prefetch_window<G>(a, ahead, end - ahead > k ? ahead + k : end);
    bad |= adamw_block<G, O, kL2, kStream>(a, c, i, k);
  }
  if constexpr (kStream) stream_fence();
  return bad != 0;
}

template <DType G, DType O, bool kL2>
bool adamw_range_t(const AdamwArgs& a, const AdamwConsts& c, std::size_t begin, std::size_t end) {
  if constexpr (O != DType::none) {
    if (a.out_stores == memtide::tiering::OutStores::streaming) return adamw_range_s<G, O, kL2, true>(a, c, begin, end);
  }
  return adamw_range_s<G, O, kL2, false>(a, c, begin, end);
}

template <DType G, bool kL2>
bool adamw_range_o(const AdamwArgs& a, const AdamwConsts& c, std::size_t b, std::size_t e) {
  switch (a.param_out_dtype) {
    case DType::fp16: return adamw_range_t<G, DType::fp16, kL2>(a, c, b, e);
    case DType::bf16: return adamw_range_t<G, DType::bf16, kL2>(a, c, b, e);
    default: return adamw_range_t<G, DType::none, kL2>(a, c, b, e);
  }
}

template <bool kL2>
bool adamw_range_g(const AdamwArgs& a, const AdamwConsts& c, std::size_t b, std::size_t e) {
  switch (a.grad_dtype) {
    case DType::fp16: return adamw_range_o<DType::fp16, kL2>(a, c, b, e);
    case DType::bf16: return adamw_range_o<DType::bf16, kL2>(a, c, b, e);
    default: return adamw_range_o<DType::fp32, kL2>(a, c, b, e);
  }
}

template <DType G>
bool nonfinite_t(const void* grad, float gs, float clip, std::size_t begin, std::size_t end) {
  alignas(64) float g[kBlock];
  std::uint32_t bad = 0;
  for (std::size_t i = begin; i < end; i += kBlock) {
    const std::size_t k = end - i < kBlock ? end - i : kBlock;
    load_grad<G>(grad, i, k, g);
    for (std::size_t j = 0; j < k; ++j) {
      float gj = g[j] * gs;
      gj = gj * clip;
      bad |= nonfinite_bit(gj);
    }
    if (bad != 0) break;
  }
  return bad != 0;
}

// The gradient into the flat fp32 buffer, upcast on the way, with the NaN/Inf check in the same
// pass (the values are in registers anyway). Returns true if every element was finite.
template <DType G, bool kStream>
bool copy_grad_t(float* dst, const void* src, std::size_t begin, std::size_t end) {
  std::uint32_t bad = 0;
  if constexpr (!kStream && G != DType::fp16) {
    // Plain stores: one loop that widens, checks and stores (the compiler vectorises it), with
    // no block staged in L1 and copied out again. fp16 keeps the staged path and its F16C loads.
    for (std::size_t i = begin; i < end; ++i) {
      float x;
      if constexpr (G == DType::fp32) {
        x = static_cast<const float*>(src)[i];
      } else {
        x = bf16_to_f(load_u16(src, i));
      }
      bad |= nonfinite_bit(x);
      dst[i] = x;
    }
    return bad == 0;
  }
  alignas(64) float g[kBlock];
  for (std::size_t i = begin; i < end; i += kBlock) {
    const std::size_t k = end - i < kBlock ? end - i : kBlock;
    load_grad<G>(src, i, k, g);
    for (std::size_t j = 0; j < k; ++j) bad |= nonfinite_bit(g[j]);
    if constexpr (kStream) {
      stream_copy(dst + i, g, k * sizeof(float));
    } else {
      std::memcpy(dst + i, g, k * sizeof(float));
    }
  }
  if constexpr (kStream) stream_fence();
  return bad == 0;
}

template <bool kStream>
bool copy_grad_s(float* dst, const void* src, DType dtype, std::size_t begin, std::size_t end) {
  switch (dtype) {
    case DType::fp16: return copy_grad_t<DType::fp16, kStream>(dst, src, begin, end);
    case DType::bf16: return copy_grad_t<DType::bf16, kStream>(dst, src, begin, end);
    default: return copy_grad_t<DType::fp32, kStream>(dst, src, begin, end);
  }
}

}  // namespace

#ifdef MEMTIDE_ADAMW_SUFFIX
#define MEMTIDE_ADAMW_CAT2(a, b) a##b
#define MEMTIDE_ADAMW_CAT(a, b) MEMTIDE_ADAMW_CAT2(a, b)

namespace memtide::tiering::detail {

bool MEMTIDE_ADAMW_CAT(adamw_range_, MEMTIDE_ADAMW_SUFFIX)(const AdamwArgs& a, const AdamwConsts& c, std::size_t begin,
                                                          std::size_t end) {
  return a.l2 ? adamw_range_g<true>(a, c, begin, end) : adamw_range_g<false>(a, c, begin, end);
}

bool MEMTIDE_ADAMW_CAT(nonfinite_range_, MEMTIDE_ADAMW_SUFFIX)(const void* grad, DType dtype, float grad_scale,
                                                              float clip, std::size_t begin, std::size_t end) {
  switch (dtype) {
    case DType::fp16: return nonfinite_t<DType::fp16>(grad, grad_scale, clip, begin, end);
    case DType::bf16: return nonfinite_t<DType::bf16>(grad, grad_scale, clip, begin, end);
    default: return nonfinite_t<DType::fp32>(grad, grad_scale, clip, begin, end);
  }
}

bool MEMTIDE_ADAMW_CAT(copy_grad_range_, MEMTIDE_ADAMW_SUFFIX)(float* dst, const void* src, DType dtype, bool stream,
                                                              std::size_t begin, std::size_t end) {
  return stream ? copy_grad_s<true>(dst, src, dtype, begin, end) : copy_grad_s<false>(dst, src, dtype, begin, end);
}

}  // namespace memtide::tiering::detail
#endif
