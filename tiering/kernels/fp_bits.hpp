// Bit-exact fp16/bf16 <-> fp32 conversions shared by the CPU kernels (scalar paths and tails)
// and the CUDA kernels, so every path rounds and treats NaN the same way and the GPU step can be
// compared with the CPU step bit for bit. Integer arithmetic only; no intrinsics.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MEMTIDE_HD __host__ __device__ __forceinline__
#else
#define MEMTIDE_HD inline
#endif

namespace memtide::tiering::fp {

MEMTIDE_HD float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
MEMTIDE_HD std::uint32_t to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

MEMTIDE_HD float bf16_to_f(std::uint16_t b) { return from_bits(static_cast<std::uint32_t>(b) << 16); }

// Round to nearest even; NaN -> 0x7FC0 (as c10::BFloat16 does).
MEMTIDE_HD std::uint16_t f_to_bf16(float f) {
  const std::uint32_t u = to_bits(f);
  const std::uint32_t rounded = (u + 0x7FFFU + ((u >> 16) & 1U)) >> 16;
  const bool nan = (u & 0x7FFFFFFFU) > 0x7F800000U;
  return static_cast<std::uint16_t>(nan ? 0x7FC0U : rounded);
}

// Exact; NaNs keep their payload with the quiet bit set (as VCVTPH2PS does).
MEMTIDE_HD float fp16_to_f(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000U) << 16;
  const std::uint32_t em = h & 0x7FFFU;
  std::uint32_t bits;
  if (em >= 0x7C00U) {
    const std::uint32_t mant = (em & 0x3FFU) << 13;
    bits = 0x7F800000U | mant | (mant != 0 ? 0x00400000U : 0U);
  } else if (em >= 0x0400U) {
    bits = (em << 13) + 0x38000000U;  // rebias 15 -> 127
  } else {
    bits = to_bits(static_cast<float>(em) * 0x1p-24F);  // subnormal or zero: exact
  }
  return from_bits(sign | bits);
}

// Round to nearest even with subnormals; overflow -> inf; NaN -> quiet NaN keeping the top
// payload bits (as VCVTPS2PH does).
MEMTIDE_HD std::uint16_t f_to_fp16(float f) {
  const std::uint32_t u = to_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000U;
  const std::uint32_t x = u & 0x7FFFFFFFU;
  std::uint32_t h;
  if (x > 0x7F800000U) {
    h = 0x7E00U | ((x >> 13) & 0x3FFU);
  } else if (x >= 0x477FF000U) {  // >= 65520 rounds to inf
    h = 0x7C00U;
  } else if (x >= 0x38800000U) {  // normal fp16
    h = (x + 0x0FFFU + ((x >> 13) & 1U) - 0x38000000U) >> 13;
  } else {
    // |f| < 2^-14: adding 0.5 leaves the value rounded (nearest even) to a multiple of 2^-24.
    // (volatile-free: both compilers keep this addition, no contraction applies to a lone add.)
    const float t = from_bits(x) + 0.5F;
    h = to_bits(t) - 0x3F000000U;
  }
  return static_cast<std::uint16_t>(sign | h);
}

MEMTIDE_HD std::uint32_t nonfinite_bit(float g) { return (to_bits(g) & 0x7F800000U) == 0x7F800000U ? 1U : 0U; }

}  // namespace memtide::tiering::fp
