#pragma once
// What a save (StateSnapshot) and a frozen state (FrozenState) both check of the engine's
// subgroups: consecutive, non-empty, from 0, covering the n elements of the state.

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "memtide/core/error.hpp"

namespace memtide::tiering::detail {

// The largest subgroup's size; throws InvalidArgument starting with `who`.
inline std::size_t check_subgroups(const std::vector<std::pair<std::size_t, std::size_t>>& subgroups, std::size_t n,
                                   const std::string& who) {
  std::size_t expect = 0, largest = 0;
  for (const auto& [first, end] : subgroups) {
    if (first != expect || end <= first) {
      throw InvalidArgument(who + ": subgroups must be consecutive, non-empty and start at 0 (got [" + std::to_string(first) +
                            ", " + std::to_string(end) + ") after " + std::to_string(expect) + ")");
    }
    largest = std::max(largest, end - first);
    expect = end;
  }
  if (expect != n) {
    throw InvalidArgument(who + ": the subgroups cover " + std::to_string(expect) + " params, the state has " + std::to_string(n));
  }
  return largest;
}

}  // namespace memtide::tiering::detail
