#pragma once
/// @file
/// Fault injection into the os layer (memtide/core/os.hpp), for tests: not part of the API.

#include <cstddef>

namespace memtide::os {

/// Fault injection for tests. Thread-safe; costs one relaxed atomic load per call when unused.
namespace testing {

enum class Call : int { map, unmap, advise, bind, page_nodes, discard, protect };  ///< reserve() counts as map
inline constexpr int kCalls = 7;

/// The `nth` call of `call` from now on (0 = the next) fails with `err`, once; the call itself is
/// not made. One armed failure per kind; arming again replaces it.
void fail_nth(Call call, std::size_t nth, int err) noexcept;
/// Disarms every failure, zeroes the counts and starts counting (calls are counted only once a
/// test has called this or fail_nth).
void reset() noexcept;
/// Calls of `call` since the last reset, failed ones included.
[[nodiscard]] std::size_t count(Call call) noexcept;

}  // namespace testing
}  // namespace memtide::os
