#pragma once
// Global operator new that can be told to fail: for testing that code which allocates while it
// changes its state (map nodes, vectors) leaves that state as it was when an allocation fails.
// Only binaries that compile failing_new.cpp have it; the failure is per thread.

#include <cstddef>

namespace memtide::test {

/// The `n`-th operator new of this thread from now (0 = the next) throws std::bad_alloc, once.
void fail_nth_new(std::size_t n) noexcept;
/// Disarms it.
void stop_failing_new() noexcept;
/// Whether the armed failure fired since fail_nth_new().
[[nodiscard]] bool new_failed() noexcept;

}  // namespace memtide::test
