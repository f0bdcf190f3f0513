// Every replaceable form of operator new and delete, on malloc and free, so that sanitizers see
// matching pairs (their own operator delete would otherwise meet memory from this new).

#include "failing_new.hpp"

#include <cstdlib>
#include <new>

namespace {

thread_local long g_countdown = -1;  // constant-initialized: safe to read inside operator new
thread_local bool g_fired = false;

void* checked_alloc(std::size_t n, std::size_t align) {
  if (g_countdown >= 0 && g_countdown-- == 0) {
    g_fired = true;
    throw std::bad_alloc();
  }
  if (n == 0) n = 1;
  void* p = nullptr;
  if (align <= alignof(std::max_align_t)) {
    p = std::malloc(n);
  } else if (posix_memalign(&p, align, n) != 0) {
    p = nullptr;
  }
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

void* nothrow_alloc(std::size_t n, std::size_t align) noexcept {
  try {
    return checked_alloc(n, align);
  } catch (...) {
    return nullptr;
  }
}

}  // namespace

namespace memtide::test {
void fail_nth_new(std::size_t n) noexcept {
  g_fired = false;
  g_countdown = static_cast<long>(n);
}
void stop_failing_new() noexcept { g_countdown = -1; }
bool new_failed() noexcept { return g_fired; }
}  // namespace memtide::test

void* operator new(std::size_t n) { return checked_alloc(n, 0); }
void* operator new[](std::size_t n) { return checked_alloc(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) { return checked_alloc(n, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return checked_alloc(n, static_cast<std::size_t>(a)); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return nothrow_alloc(n, 0); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return nothrow_alloc(n, 0); }
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return nothrow_alloc(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return nothrow_alloc(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
