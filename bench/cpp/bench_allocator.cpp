// Allocator benchmarks: the cached fast path, under contention, and the transformer-trace replay
// that measures fragmentation (peak reserved / peak allocated) and update-phase headroom.
// Every benchmark runs on SimDevice and, when a GPU answers, on CudaDevice too.
//
// Figures are printed as counters; bench/cpp/run.sh turns the JSON into bench/results/allocator/.

#include <benchmark/benchmark.h>

#include <memory>
#include <mutex>
#include <vector>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/allocator/transformer_trace.hpp"
#include "memtide/device/sim_device.hpp"

using namespace memtide;

namespace {

std::unique_ptr<Device> make_device(bool cuda, bool phantom) {
  if (cuda) return open_device(Backend::cuda, 0);
  SimConfig c;
  c.phantom = phantom;
  return std::make_unique<SimDevice>(c);
}

/// One warm allocator per backend shared by the threads of a benchmark run.
struct Shared {
  std::unique_ptr<Device> device;
  std::unique_ptr<CachingAllocator> alloc;
};
Shared& shared(bool cuda) {
  static Shared sim;
  static Shared gpu;
  static std::mutex m;
  std::lock_guard lock(m);
  Shared& s = cuda ? gpu : sim;
  if (!s.alloc) {
    s.device = make_device(cuda, /*phantom=*/true);
    s.alloc = std::make_unique<CachingAllocator>(*s.device);
  }
  return s;
}

// alloc + free of one size on a warm cache: what a training step pays per tensor.
void BM_CachedAllocFree(benchmark::State& state, bool cuda) {
  CachingAllocator& a = *shared(cuda).alloc;
  const auto bytes = static_cast<std::size_t>(state.range(0));
  const Stream stream{};  // threads share one stream, so contended runs contend for one pool
  a.deallocate(a.allocate(bytes, stream), stream);  // warm
  for (auto _ : state) {
    void* p = a.allocate(bytes, stream);
    benchmark::DoNotOptimize(p);
    a.deallocate(p, stream);
  }
  state.SetItemsProcessed(state.iterations());
}

// A realistic mix: several tensors live at once, freed out of order.
void BM_CachedMixedWorkingSet(benchmark::State& state, bool cuda) {
  CachingAllocator& a = *shared(cuda).alloc;
  const std::size_t sizes[] = {4096, 65536, 1 << 20, 3 << 20, 512, 24 << 20, 8192, 12 << 20};
  void* live[8] = {};
  for (int i = 0; i < 8; ++i) live[i] = a.allocate(sizes[i], Stream{});
  unsigned k = 0;
  for (auto _ : state) {
    const unsigned i = (k * 5 + 3) % 8;  // a fixed, out-of-order pattern
    a.deallocate(live[i], Stream{});
    live[i] = a.allocate(sizes[i], Stream{});
    benchmark::DoNotOptimize(live[i]);
    ++k;
  }
  for (void* p : live) a.deallocate(p, Stream{});
  state.SetItemsProcessed(state.iterations());
}

void BM_TransformerReplay(benchmark::State& state, bool cuda) {
  TransformerShape shape;  // defaults: 24 layers, hidden 2048, seq 2048, batch 4
  shape.iterations = 3;
  const auto trace = make_transformer_trace(shape);
  ReplayResult r;
  std::uint64_t limit = 0;
  for (auto _ : state) {
    auto dev = make_device(cuda, /*phantom=*/true);
    CachingAllocator a(*dev);
    limit = a.limit();
    r = replay(a, trace);
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * r.ops));
  const double GiB = 1024.0 * 1024.0 * 1024.0;
  state.counters["params_M"] = static_cast<double>(shape.parameters()) / 1e6;
  state.counters["peak_alloc_GiB"] = static_cast<double>(r.peak_allocated) / GiB;
  state.counters["peak_resv_GiB"] = static_cast<double>(r.peak_reserved) / GiB;
  state.counters["resv_over_alloc"] = r.reserved_over_allocated;
  state.counters["update_headroom_GiB"] = static_cast<double>(r.update_headroom.bytes) / GiB;
  state.counters["limit_GiB"] = static_cast<double>(limit) / GiB;
  const auto& last = r.phases.history.back().phases;
  state.counters["fwd_peak_GiB"] = static_cast<double>(last[0].peak_allocated) / GiB;
  state.counters["bwd_peak_GiB"] = static_cast<double>(last[1].peak_allocated) / GiB;
  state.counters["upd_peak_GiB"] = static_cast<double>(last[2].peak_allocated) / GiB;
}

void register_all() {
  std::vector<std::pair<const char*, bool>> backends{{"sim", false}};
  if (cuda_status().usable) backends.emplace_back("cuda", true);
  for (auto [name, cuda] : backends) {
    const std::string suffix = std::string("/") + name;
    benchmark::RegisterBenchmark(("CachedAllocFree" + suffix).c_str(), BM_CachedAllocFree, cuda)
        ->Arg(4096)
        ->Arg(1 << 20)
        ->Arg(16 << 20)
        ->Repetitions(10)
        ->ReportAggregatesOnly(true);
    benchmark::RegisterBenchmark(("CachedAllocFreeContended" + suffix).c_str(), BM_CachedAllocFree, cuda)
        ->Arg(4096)
        ->Threads(2)
        ->Repetitions(5)
        ->ReportAggregatesOnly(true);
    benchmark::RegisterBenchmark(("CachedMixedWorkingSet" + suffix).c_str(), BM_CachedMixedWorkingSet, cuda)
        ->Repetitions(5)
        ->ReportAggregatesOnly(true);
    benchmark::RegisterBenchmark(("TransformerReplay" + suffix).c_str(), BM_TransformerReplay, cuda)
        ->Unit(benchmark::kMillisecond)
        ->Iterations(3);
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_all();
  benchmark::AddCustomContext("memtide_backend_gpu", cuda_status().usable ? "cuda" : cuda_status().reason);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
