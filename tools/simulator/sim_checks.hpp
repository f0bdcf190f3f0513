#pragma once
// The argument check of the simulator's files (private to tools/simulator/).

#include <string>

#include "memtide/core/error.hpp"

namespace memtide::tiering::sim {

// Throws InvalidArgument saying `what` unless `ok`.
inline void require(bool ok, const std::string& what) {
  if (!ok) throw InvalidArgument(what);
}

}  // namespace memtide::tiering::sim
