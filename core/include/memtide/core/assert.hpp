#pragma once
/// @file
/// Tiered internal asserts, as in mimalloc: level 1 checks are cheap and always on in debug builds;
/// level 2 checks walk data structures and are on only when MEMTIDE_DEBUG >= 2. Release builds
/// compile both away. These guard memtide's own invariants, never user input (that throws).

#include <cstdio>
#include <cstdlib>

#ifndef MEMTIDE_DEBUG
#ifdef NDEBUG
#define MEMTIDE_DEBUG 0
#else
#define MEMTIDE_DEBUG 1
#endif
#endif

namespace memtide::detail {
[[noreturn]] inline void assert_fail(const char* expr, const char* file, int line) {
  std::fprintf(stderr, "memtide: internal assertion failed: %s (%s:%d)\n", expr, file, line);
  std::abort();
}
}  // namespace memtide::detail

#define MEMTIDE_ASSERT_IMPL(expr) \
  ((expr) ? static_cast<void>(0) : ::memtide::detail::assert_fail(#expr, __FILE__, __LINE__))

#if MEMTIDE_DEBUG >= 1
#define MEMTIDE_ASSERT(expr) MEMTIDE_ASSERT_IMPL(expr)
#else
#define MEMTIDE_ASSERT(expr) static_cast<void>(0)
#endif

#if MEMTIDE_DEBUG >= 2
#define MEMTIDE_ASSERT_EXPENSIVE(expr) MEMTIDE_ASSERT_IMPL(expr)
#else
#define MEMTIDE_ASSERT_EXPENSIVE(expr) static_cast<void>(0)
#endif
