// PinnedHeap on a jemalloc arena whose extents come from slabs.
//
// libjemalloc is dlopen'ed RTLD_LOCAL and only its explicit-arena entry points are called:
// Debian builds it unprefixed, so linking it would replace malloc for the whole process.

#include <string>

#include "memtide/core/error.hpp"
#include "pinned_heap_internal.hpp"

#if MEMTIDE_HAVE_JEMALLOC_H

#include <dlfcn.h>
#include <jemalloc/jemalloc.h>
#include <sys/types.h>

#include <bit>
#include <cstring>
#include <exception>
#include <utility>

#include "memtide/core/log.hpp"

namespace memtide::detail {
namespace {

constexpr const char* kLibrary = "libjemalloc.so.2";

struct JemallocApi {
  void* (*mallocx)(std::size_t, int) = nullptr;
  void (*sdallocx)(void*, std::size_t, int) = nullptr;
  int (*mallctl)(const char*, void*, std::size_t*, void*, std::size_t) = nullptr;
  std::string error;  // empty when usable
};

const JemallocApi& api() {
  static const JemallocApi a = [] {
    JemallocApi r;
    // Never dlclose'd: the library owns arena state until the process exits.
    void* h = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      r.error = std::string("dlopen(\"") + kLibrary + "\") failed: " + (e ? e : "unknown error");
      if (r.error.find("static TLS") != std::string::npos) {
        // jemalloc's thread state is initial-exec TLS (about 2.6 KiB), more than glibc keeps
        // spare for libraries loaded after start-up; only a start-up tunable enlarges it.
        r.error += " (jemalloc needs static TLS: start the process with "
                   "GLIBC_TUNABLES=glibc.rtld.optional_static_tls=16384, or use mimalloc)";
      }
      return r;
    }
    r.mallocx = reinterpret_cast<decltype(r.mallocx)>(dlsym(h, "mallocx"));
    r.sdallocx = reinterpret_cast<decltype(r.sdallocx)>(dlsym(h, "sdallocx"));
    r.mallctl = reinterpret_cast<decltype(r.mallctl)>(dlsym(h, "mallctl"));
    if (!r.mallocx || !r.sdallocx || !r.mallctl) {
      r.error = std::string(kLibrary) + " lacks mallocx/sdallocx/mallctl (not jemalloc 5?)";
    }
    return r;
  }();
  return a;
}

// The exception a hook caught, rethrown by the allocating thread once mallocx returns null
// (hooks are called from C and must not throw through jemalloc).
thread_local std::exception_ptr t_hook_error;

class JemallocEngine;

// jemalloc passes the hooks pointer back to every hook; it points at `hooks`, the first member,
// which leads back to the engine.
struct HookBlock {
  extent_hooks_t hooks;
  JemallocEngine* engine;
};

class JemallocEngine final : public Engine {
 public:
  explicit JemallocEngine(SlabRanges& ranges) : ranges_(ranges) {
    block_.hooks = extent_hooks_t{&hook_alloc, &hook_dalloc, &hook_destroy, &hook_commit, &hook_decommit,
                                  nullptr,  // purge_lazy: unsupported, pinned pages stay
                                  nullptr,  // purge_forced
                                  &hook_split, &hook_merge};
    block_.engine = this;
    extent_hooks_t* hooks = &block_.hooks;
    std::size_t len = sizeof arena_;
    if (int rc = api().mallctl("arenas.create", &arena_, &len, &hooks, sizeof hooks); rc != 0) {
      throw Error("PinnedHeap: jemalloc arenas.create failed (error " + std::to_string(rc) + ")");
    }
    // Never purge: returning pinned pages to the OS would unpin nothing and only cost faults.
    for (const char* what : {"dirty_decay_ms", "muzzy_decay_ms"}) {
      ssize_t never = -1;
      const std::string name = "arena." + std::to_string(arena_) + "." + what;
      if (int rc = api().mallctl(name.c_str(), nullptr, nullptr, &never, sizeof never); rc != 0) {
        throw Error("PinnedHeap: jemalloc " + name + " = -1 failed (error " + std::to_string(rc) + ")");
      }
    }
    flags_ = MALLOCX_ARENA(arena_) | MALLOCX_TCACHE_NONE;
  }

  ~JemallocEngine() override {
    // Hands every extent (and the arena's metadata, also carved from slabs) back via the hooks.
    const std::string name = "arena." + std::to_string(arena_) + ".destroy";
    if (int rc = api().mallctl(name.c_str(), nullptr, nullptr, nullptr, 0); rc != 0) {
      MEMTIDE_LOG(warn, "PinnedHeap: jemalloc " + name + " failed (error " + std::to_string(rc) + ")");
    }
  }

  void* allocate(std::size_t bytes, std::size_t alignment) override {
    t_hook_error = nullptr;  // only an error from this call's hooks explains a null below
    void* p = api().mallocx(bytes, flags(alignment));
    if (p != nullptr) return p;
    if (t_hook_error) std::rethrow_exception(std::exchange(t_hook_error, nullptr));
    throw OutOfMemory("PinnedHeap (jemalloc): no memory for " + std::to_string(bytes) + " bytes");
  }

  void deallocate(void* ptr, std::size_t bytes, std::size_t alignment) noexcept override {
    api().sdallocx(ptr, bytes, flags(alignment));
  }

 private:
  int flags(std::size_t alignment) const {
    // jemalloc aligns small sizes only to their size class (an 8 B object to 8 B): always ask.
    return alignment > 1 ? flags_ | MALLOCX_LG_ALIGN(std::countr_zero(alignment)) : flags_;
  }
  static JemallocEngine& self(extent_hooks_t* h) { return *reinterpret_cast<HookBlock*>(h)->engine; }

  static void* hook_alloc(extent_hooks_t* h, void* new_addr, std::size_t size, std::size_t alignment, bool* zero,
                          bool* commit, unsigned) {
    try {
      SlabRanges& r = self(h).ranges_;
      // new_addr: jemalloc wants to grow an extent in place; only that exact range will do.
      void* p = new_addr != nullptr ? (r.take_at(new_addr, size) ? new_addr : nullptr) : r.take(size, alignment);
      if (p == nullptr) return nullptr;
      if (*zero) std::memset(p, 0, size);
      *commit = true;
      return p;
    } catch (...) {
      t_hook_error = std::current_exception();
      return nullptr;
    }
  }
  // No exception may cross jemalloc's C frames. A range that cannot be taken back (its map
  // nodes could not be allocated) stays jemalloc's: dalloc opts out and jemalloc retains it.
  static bool hook_dalloc(extent_hooks_t* h, void* addr, std::size_t size, bool, unsigned) {
    try {
      self(h).ranges_.give(addr, size);
      return false;
    } catch (...) {
      return true;
    }
  }
  static void hook_destroy(extent_hooks_t* h, void* addr, std::size_t size, bool, unsigned) {
    try {
      self(h).ranges_.give(addr, size);
    } catch (...) {
      // At arena destruction: the range stays mapped in its slab, which the pool unmaps.
    }
  }
  // Slab memory is always committed; refusing decommit keeps it so.
  static bool hook_commit(extent_hooks_t*, void*, std::size_t, std::size_t, std::size_t, unsigned) { return false; }
  static bool hook_decommit(extent_hooks_t*, void*, std::size_t, std::size_t, std::size_t, unsigned) { return true; }
  static bool hook_split(extent_hooks_t*, void*, std::size_t, std::size_t, std::size_t, bool, unsigned) {
    return false;
  }
  // Two slabs may be adjacent in the address space; an extent must never span both.
  static bool hook_merge(extent_hooks_t* h, void* a, std::size_t, void* b, std::size_t, bool, unsigned) {
    return !self(h).ranges_.same_slab(a, b);
  }

  SlabRanges& ranges_;
  HookBlock block_{};
  unsigned arena_ = 0;
  int flags_ = 0;
};

}  // namespace

bool jemalloc_available(std::string* why) {
  const JemallocApi& a = api();
  if (a.error.empty()) return true;
  if (why != nullptr) *why = a.error;
  return false;
}

std::unique_ptr<Engine> make_jemalloc_engine(SlabRanges& ranges) {
  std::string why;
  if (!jemalloc_available(&why)) throw Error("PinnedHeap backend jemalloc is not usable: " + why);
  return std::make_unique<JemallocEngine>(ranges);
}

}  // namespace memtide::detail

#else  // !MEMTIDE_HAVE_JEMALLOC_H

namespace memtide::detail {

bool jemalloc_available(std::string* why) {
  if (why != nullptr) *why = "memtide was built without jemalloc/jemalloc.h (install libjemalloc-dev and rebuild)";
  return false;
}

std::unique_ptr<Engine> make_jemalloc_engine(SlabRanges&) {
  std::string why;
  jemalloc_available(&why);
  throw Error("PinnedHeap backend jemalloc is not built: " + why);
}

}  // namespace memtide::detail

#endif
