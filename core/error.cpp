#include "memtide/core/error.hpp"

// The hierarchy is header-only; this translation unit anchors the library so the vtables of
// the exception classes have one home when the static library is linked into libmemtide.so.
namespace memtide {
namespace {
[[maybe_unused]] const OutOfMemory* anchor = nullptr;
}
}  // namespace memtide
