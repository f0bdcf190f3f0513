// PinnedHeap benchmarks.
//
// StagingMix: host bytes reserved (slabs mapped) over bytes requested, at their peaks, for the
// pinned staging buffers of a training step: fp16 parameter staging buffers that live for the
// whole run, fp32 gradient staging buffers allocated layer by layer in backward and freed after
// the optimizer step, odd-sized transient buffers of 1-16 MiB and many small ones, over several
// iterations. Compared with a model of PyTorch's CachingHostAllocator policy: every request
// rounded up to the next power of two, freed blocks cached by that size and reused only for it,
// nothing returned. No byte is touched: only the bookkeeping is measured.
//
// AllocFree: one allocate+deallocate pair per size on a warm heap, per backend, with glibc
// malloc (pageable) as a reference.

#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "memtide/allocator/mmap_slab_source.hpp"
#include "memtide/allocator/pinned_heap.hpp"

using namespace memtide;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr double GiB = 1024.0 * 1024.0 * 1024.0;

// One request stream, replayed identically against every allocator.
struct Op {
  bool alloc;
  std::size_t id;
  std::size_t bytes;
};

// A transformer's tensors as fp32 bytes, each staged in chunks of at most 64 MiB.
struct Shape {
  std::size_t hidden, ffn, vocab, layers;
  unsigned seed;
};
// A: GPT-2-XL-like widths (hidden 1600, FFN 6400, vocab 50257), 12 layers: 30.7 MB qkv, 41 MB
// FFN matrices, 6.4 KB norms and biases. B: hidden 2304, FFN 9216, vocab 32000, 8 layers: the
// FFN matrices (84.9 MB) split into a 64 MiB and an odd 17 MiB chunk.
constexpr Shape kMixA{1600, 6400, 50257, 12, 42};
constexpr Shape kMixB{2304, 9216, 32000, 8, 7};

std::vector<std::size_t> tensor_bytes(const Shape& m) {
  const std::size_t h = m.hidden, f = m.ffn;
  std::vector<std::size_t> elements{m.vocab * h};
  for (std::size_t l = 0; l < m.layers; ++l) {
    for (std::size_t n : {3 * h * h, 3 * h, h * h, h, h, h, f * h, f, h * f, h, h, h}) elements.push_back(n);
  }
  std::vector<std::size_t> t;
  for (std::size_t n : elements) {
    for (std::size_t bytes = n * 4; bytes > 0;) {
      t.push_back(std::min(bytes, 64 * MiB));
      bytes -= t.back();
    }
  }
  return t;
}

std::vector<Op> staging_trace(const Shape& shape, int iterations) {
  std::vector<Op> ops;
  std::size_t next = 0;
  const std::vector<std::size_t> tensors = tensor_bytes(shape);
  // fp16 parameter staging: lives for the whole run.
  for (std::size_t b : tensors) ops.push_back({true, next++, b / 2});
  std::mt19937_64 rng(shape.seed);
  std::vector<std::size_t> transient_ids;
  std::vector<std::size_t> small_ids;
  auto transient = [&] {
    // Odd medium buffers (1-16 MiB) and small ones (64 B-64 KiB), a bounded number live.
    if (transient_ids.size() >= 24) {
      const std::size_t k = rng() % transient_ids.size();
      ops.push_back({false, transient_ids[k], 0});
      transient_ids.erase(transient_ids.begin() + static_cast<std::ptrdiff_t>(k));
    }
    const auto medium = static_cast<std::size_t>(std::exp2(20.0 + 4.0 * static_cast<double>(rng() % 1000) / 1000.0));
    ops.push_back({true, next, medium + rng() % 4096});
    transient_ids.push_back(next++);
    for (int s = 0; s < 8; ++s) {
      if (small_ids.size() >= 512) {
        const std::size_t k = rng() % small_ids.size();
        ops.push_back({false, small_ids[k], 0});
        small_ids.erase(small_ids.begin() + static_cast<std::ptrdiff_t>(k));
      }
      const auto small = static_cast<std::size_t>(std::exp2(6.0 + 10.0 * static_cast<double>(rng() % 1000) / 1000.0));
      ops.push_back({true, next, small});
      small_ids.push_back(next++);
    }
  };
  for (int it = 0; it < iterations; ++it) {
    // Backward: fp32 gradient staging, last layer first.
    std::vector<std::size_t> grads;
    for (auto t = tensors.rbegin(); t != tensors.rend(); ++t) {
      ops.push_back({true, next, *t});
      grads.push_back(next++);
      if (rng() % 4 == 0) transient();
    }
    // Optimizer step: gradients are consumed and freed in forward order.
    for (auto g = grads.rbegin(); g != grads.rend(); ++g) {
      ops.push_back({false, *g, 0});
      if (rng() % 8 == 0) transient();
    }
  }
  return ops;
}

struct Replay {
  std::size_t peak_requested = 0;
  std::size_t peak_reserved = 0;
  std::size_t slabs = 0;
};

// Slab size and direct threshold come from the options table (MEMTIDE_PINNED_HEAP_SLAB_SIZE,
// MEMTIDE_PINNED_HEAP_DIRECT_THRESHOLD); `no_direct` turns the direct path off.
Replay replay_pinned_heap(PinnedHeapBackend backend, bool no_direct, const std::vector<Op>& ops) {
  MmapSlabSource* source = new MmapSlabSource();  // mimalloc needs it to outlive the process's use
  Replay r;
  {
    PinnedHeapConfig config = PinnedHeapConfig::from_options();
    config.backend = backend;
    if (no_direct) config.direct_threshold = 0;
    PinnedHeap heap(*source, config);
    std::vector<void*> ptr(ops.size(), nullptr);
    for (const Op& op : ops) {
      if (op.alloc) {
        ptr[op.id] = heap.allocate(op.bytes, 64);
      } else {
        heap.deallocate(ptr[op.id]);
      }
    }
    const PinnedHeapStats s = heap.stats();
    r = {s.requested_peak, s.reserved_peak, s.slab_count};
  }
  if (backend == PinnedHeapBackend::jemalloc) delete source;
  return r;
}

Replay replay_pow2_cache(const std::vector<Op>& ops) {
  std::map<std::size_t, std::size_t> cached;  // rounded size -> free blocks of it
  std::vector<std::size_t> size(ops.size(), 0);
  std::size_t live = 0, reserved = 0;
  Replay r;
  for (const Op& op : ops) {
    if (op.alloc) {
      const std::size_t b = std::bit_ceil(op.bytes);
      if (cached[b] > 0) {
        --cached[b];
      } else {
        reserved += b;
      }
      size[op.id] = op.bytes;
      live += op.bytes;
    } else {
      ++cached[std::bit_ceil(size[op.id])];
      live -= size[op.id];
    }
    r.peak_requested = std::max(r.peak_requested, live);
    r.peak_reserved = std::max(r.peak_reserved, reserved);
  }
  return r;
}

const std::vector<Op>& trace(int mix) {
  static const std::vector<Op> a = staging_trace(kMixA, 8);
  static const std::vector<Op> b = staging_trace(kMixB, 8);
  return mix == 0 ? a : b;
}

void report(benchmark::State& state, const Replay& r, int mix) {
  state.counters["peak_requested_GiB"] = static_cast<double>(r.peak_requested) / GiB;
  state.counters["peak_reserved_GiB"] = static_cast<double>(r.peak_reserved) / GiB;
  state.counters["reserved_over_requested"] = static_cast<double>(r.peak_reserved) / static_cast<double>(r.peak_requested);
  state.counters["slabs"] = static_cast<double>(r.slabs);
  state.counters["requests"] = static_cast<double>(trace(mix).size());
}

void BM_StagingMix(benchmark::State& state, PinnedHeapBackend backend, bool no_direct) {
  if (std::string why; !pinned_heap_backend_available(backend, &why)) {
    state.SkipWithError(why.c_str());
    return;
  }
  Replay r;
  try {
    for (auto _ : state) r = replay_pinned_heap(backend, no_direct, trace(static_cast<int>(state.range(0))));
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  report(state, r, static_cast<int>(state.range(0)));
}

void BM_StagingMixPow2Cache(benchmark::State& state) {
  Replay r;
  for (auto _ : state) r = replay_pow2_cache(trace(static_cast<int>(state.range(0))));
  report(state, r, static_cast<int>(state.range(0)));
}

// Warm heaps live until the process exits and are never destroyed: a static destructor order
// between heap and source would be one more thing to get right, and mimalloc wants its arenas
// mapped to the end anyway.
PinnedHeap& warm_heap(PinnedHeapBackend backend) {
  static auto* source = new MmapSlabSource();
  static auto* heaps = new std::map<PinnedHeapBackend, PinnedHeap*>();
  PinnedHeap*& h = (*heaps)[backend];
  if (h == nullptr) {
    PinnedHeapConfig config = PinnedHeapConfig::from_options();
    config.backend = backend;
    h = new PinnedHeap(*source, config);
  }
  return *h;
}

void BM_AllocFree(benchmark::State& state, PinnedHeapBackend backend) {
  if (std::string why; !pinned_heap_backend_available(backend, &why)) {
    state.SkipWithError(why.c_str());
    return;
  }
  PinnedHeap& heap = warm_heap(backend);
  const auto bytes = static_cast<std::size_t>(state.range(0));
  heap.deallocate(heap.allocate(bytes));
  for (auto _ : state) {
    void* p = heap.allocate(bytes);
    benchmark::DoNotOptimize(p);
    heap.deallocate(p);
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_AllocFreeGlibc(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = std::malloc(bytes);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
  state.SetItemsProcessed(state.iterations());
}

void sizes(benchmark::internal::Benchmark* b) {
  for (long s : {64L, 4096L, 65536L, 1L << 20, 16L << 20}) b->Arg(s);
}

}  // namespace

BENCHMARK_CAPTURE(BM_StagingMix, jemalloc, PinnedHeapBackend::jemalloc, false)->ArgName("mix")->Arg(0)->Arg(1)->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_StagingMix, jemalloc_no_direct, PinnedHeapBackend::jemalloc, true)->ArgName("mix")->Arg(0)->Arg(1)->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_StagingMix, mimalloc, PinnedHeapBackend::mimalloc, false)->ArgName("mix")->Arg(0)->Arg(1)->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_StagingMix, mimalloc_no_direct, PinnedHeapBackend::mimalloc, true)->ArgName("mix")->Arg(0)->Arg(1)->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_StagingMixPow2Cache)->ArgName("mix")->Arg(0)->Arg(1)->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_AllocFree, jemalloc, PinnedHeapBackend::jemalloc)->Apply(sizes)->MinTime(0.2);
BENCHMARK_CAPTURE(BM_AllocFree, mimalloc, PinnedHeapBackend::mimalloc)->Apply(sizes)->MinTime(0.2);
BENCHMARK(BM_AllocFreeGlibc)->Apply(sizes)->MinTime(0.2);

// jemalloc needs more static TLS than glibc keeps spare for dlopen; restart once with the
// tunable that enlarges it (see PinnedHeap's docs).
int main(int argc, char** argv) {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables == nullptr || std::strstr(tunables, "optional_static_tls") == nullptr) {
    std::string value = "glibc.rtld.optional_static_tls=16384";
    if (tunables != nullptr && *tunables != '\0') value = std::string(tunables) + ":" + value;
    setenv("GLIBC_TUNABLES", value.c_str(), 1);
    execv("/proc/self/exe", argv);
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
