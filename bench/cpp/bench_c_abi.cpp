// The C ABI's hot path: a cached allocation and its free through the exported functions of
// libmemtide.so (memtide_malloc / memtide_free, what torch's pluggable allocator calls for every
// tensor), beside the same pair on the CachingAllocator directly. Target (issue: memtide as torch's
// allocator): at most 100 ns per pair, median, on the 2-core development machine.
//
// The runtime's device is the one MEMTIDE_DEVICE picks (the simulated one without a GPU).

#include <benchmark/benchmark.h>

#include <cstdlib>

#include "memtide/memtide.h"

namespace {

void BM_CAbiAllocFree(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  void* warm = memtide_malloc(bytes, 0, nullptr);
  if (warm == nullptr) {
    state.SkipWithError("memtide_malloc failed");
    return;
  }
  memtide_free(warm, bytes, 0, nullptr);
  for (auto _ : state) {
    void* p = memtide_malloc(bytes, 0, nullptr);
    benchmark::DoNotOptimize(p);
    memtide_free(p, bytes, 0, nullptr);
  }
  state.SetItemsProcessed(state.iterations());
}

}  // namespace

BENCHMARK(BM_CAbiAllocFree)->Arg(512)->Arg(4096)->Arg(1 << 20)->Arg(16 << 20)->Repetitions(10)->ReportAggregatesOnly(true);

BENCHMARK_MAIN();
