// PinnedHeap on mimalloc exclusive arenas, one per slab, with one heap per thread per arena.
//
// libmimalloc is dlopen'ed RTLD_LOCAL and only its heap/arena entry points are called: Debian
// builds it unprefixed, so linking it would replace malloc for the whole process.

#include <string>

#include "memtide/core/error.hpp"
#include "pinned_heap_internal.hpp"

#if MEMTIDE_HAVE_MIMALLOC_H

#include <dlfcn.h>
#include <mimalloc.h>

#include <atomic>
#include <shared_mutex>
#include <unordered_map>

#include "memtide/core/format.hpp"
#include "memtide/core/log.hpp"

namespace memtide::detail {
namespace {

constexpr const char* kLibrary = "libmimalloc.so.2";
// mimalloc 2.0 places segments on 32 MiB boundaries and hands arena memory out in such blocks;
// an arena that does not start on a segment boundary is accepted and then crashes the first
// allocation. 64 MiB keeps both the start and the size safe.
constexpr std::size_t kArenaUnit = std::size_t{64} << 20;

struct MimallocApi {
  bool (*manage)(void*, std::size_t, bool, bool, bool, int, bool, mi_arena_id_t*) = nullptr;
  mi_heap_t* (*heap_new_in_arena)(mi_arena_id_t) = nullptr;
  void* (*heap_malloc_aligned)(mi_heap_t*, std::size_t, std::size_t) = nullptr;
  void (*free)(void*) = nullptr;
  std::string error;
};

const MimallocApi& api() {
  static const MimallocApi a = [] {
    MimallocApi r;
    void* h = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);  // never dlclose'd (see jemalloc)
    if (h == nullptr) {
      const char* e = dlerror();
      r.error = std::string("dlopen(\"") + kLibrary + "\") failed: " + (e ? e : "unknown error");
      return r;
    }
    r.manage = reinterpret_cast<decltype(r.manage)>(dlsym(h, "mi_manage_os_memory_ex"));
    r.heap_new_in_arena = reinterpret_cast<decltype(r.heap_new_in_arena)>(dlsym(h, "mi_heap_new_in_arena"));
    r.heap_malloc_aligned = reinterpret_cast<decltype(r.heap_malloc_aligned)>(dlsym(h, "mi_heap_malloc_aligned"));
    r.free = reinterpret_cast<decltype(r.free)>(dlsym(h, "mi_free"));
    if (!r.manage || !r.heap_new_in_arena || !r.heap_malloc_aligned || !r.free) {
      r.error = std::string(kLibrary) + " lacks mi_manage_os_memory_ex/mi_heap_new_in_arena (needs mimalloc >= 2.0.6)";
    }
    return r;
  }();
  return a;
}

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// Heaps this thread made, per engine (keyed by a serial number that is never reused, so an
// entry left by a destroyed engine can never be mistaken for a live one's). mimalloc deletes a
// thread's heaps itself when the thread exits.
struct ThreadHeaps {
  std::vector<mi_heap_t*> heaps;  // index = arena index in the engine
  std::size_t last = 0;           // where the last allocation succeeded
};
thread_local std::unordered_map<std::uint64_t, ThreadHeaps> t_heaps;
std::atomic<std::uint64_t> g_serial{1};

class MimallocEngine final : public Engine {
 public:
  MimallocEngine(SlabPool& pool, std::size_t slab_bytes)
      : pool_(pool), slab_bytes_(round_up(slab_bytes, kArenaUnit)), serial_(g_serial.fetch_add(1)) {}

  ~MimallocEngine() override {
    // mimalloc 2.0 cannot forget an arena, and threads that used it may still hold its
    // segments (and read their headers when they exit), so the slabs stay mapped.
    pool_.keep_mapped();
    t_heaps.erase(serial_);
    MEMTIDE_LOG(info, "PinnedHeap (mimalloc): " + std::to_string(pool_.count()) + " slabs (" +
                          format_bytes(pool_.reserved()) + ") stay mapped until the process exits");
  }

  void* allocate(std::size_t bytes, std::size_t alignment) override {
    ThreadHeaps& mine = t_heaps[serial_];
    // Arenas this thread added for the request that still cannot serve it mean mimalloc never
    // will: give up rather than map slabs (and use up arenas) forever. Not after the first: other
    // threads may fill a fresh arena before this one gets to it (seen in the stress test).
    constexpr int kGrowths = 4;
    for (int grew = 0;;) {
      std::vector<mi_arena_id_t> arenas;
      {
        std::shared_lock lock(mutex_);
        arenas = arenas_;
      }
      const std::size_t n = arenas.size();
      if (mine.heaps.size() < n) mine.heaps.resize(n, nullptr);
      for (std::size_t k = 0; k < n; ++k) {
        const std::size_t i = (mine.last + k) % n;
        if (mine.heaps[i] == nullptr) {
          mine.heaps[i] = api().heap_new_in_arena(arenas[i]);
          if (mine.heaps[i] == nullptr) throw OutOfMemory("PinnedHeap (mimalloc): mi_heap_new_in_arena failed");
        }
        if (void* p = api().heap_malloc_aligned(mine.heaps[i], bytes, alignment)) {
          mine.last = i;
          return p;
        }
      }
      if (grew == kGrowths) {
        throw OutOfMemory("PinnedHeap (mimalloc): " + std::to_string(bytes) + " bytes aligned to " +
                          std::to_string(alignment) + " could not be served even from " +
                          std::to_string(kGrowths) + " fresh arenas");
      }
      if (grow(n, bytes, alignment)) ++grew;
    }
  }

  void deallocate(void* ptr, std::size_t, std::size_t) noexcept override { api().free(ptr); }

 private:
  // Adds an arena unless another thread did since this one saw `seen` arenas; true when it did.
  bool grow(std::size_t seen, std::size_t bytes, std::size_t alignment) {
    std::unique_lock lock(mutex_);
    if (arenas_.size() != seen) return false;
    // Arenas double with what this engine holds (up to slab_bytes_): few arenas for a large
    // heap (mimalloc 2.0 allows 64 per process), little pinned for a small one. Room for the
    // object, its alignment and a segment's metadata either way.
    const std::size_t grown = std::min(slab_bytes_, std::max(kArenaUnit, arena_bytes_));
    const std::size_t size = std::max(grown, round_up(bytes + alignment + (std::size_t{1} << 20), kArenaUnit));
    const HostSlab slab = pool_.map(size, kArenaUnit);
    const std::size_t usable = slab.bytes / kArenaUnit * kArenaUnit;
    mi_arena_id_t id{};
    // is_large: the memory is pinned, so mimalloc never decommits or resets it.
    if (!api().manage(slab.ptr, usable, /*is_committed=*/true, /*is_large=*/true, /*is_zero=*/false,
                      slab.numa_node, /*exclusive=*/true, &id)) {
      pool_.unmap(slab);
      throw OutOfMemory("PinnedHeap (mimalloc): mi_manage_os_memory_ex refused a " + format_bytes(usable) +
                        " slab (mimalloc 2.0 keeps at most 64 arenas per process; raise "
                        "MEMTIDE_PINNED_HEAP_SLAB_SIZE)");
    }
    arenas_.push_back(id);
    arena_bytes_ += usable;
    return true;
  }

  SlabPool& pool_;
  const std::size_t slab_bytes_;
  const std::uint64_t serial_;
  std::shared_mutex mutex_;
  std::vector<mi_arena_id_t> arenas_;
  std::size_t arena_bytes_ = 0;
};

}  // namespace

bool mimalloc_available(std::string* why) {
  const MimallocApi& a = api();
  if (a.error.empty()) return true;
  if (why != nullptr) *why = a.error;
  return false;
}

std::unique_ptr<Engine> make_mimalloc_engine(SlabPool& pool, std::size_t slab_bytes) {
  std::string why;
  if (!mimalloc_available(&why)) throw Error("PinnedHeap backend mimalloc is not usable: " + why);
  return std::make_unique<MimallocEngine>(pool, slab_bytes);
}

}  // namespace memtide::detail

#else  // !MEMTIDE_HAVE_MIMALLOC_H

namespace memtide::detail {

bool mimalloc_available(std::string* why) {
  if (why != nullptr) *why = "memtide was built without mimalloc.h (install libmimalloc-dev and rebuild)";
  return false;
}

std::unique_ptr<Engine> make_mimalloc_engine(SlabPool&, std::size_t) {
  std::string why;
  mimalloc_available(&why);
  throw Error("PinnedHeap backend mimalloc is not built: " + why);
}

}  // namespace memtide::detail

#endif
