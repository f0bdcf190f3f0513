// Host-tier benchmarks: what pinning a GiB costs, and HostArena's alloc/free latency.
//
// Pinning: a HostArena slab (mmap, mbind to node 0 when libnuma is there, first touch on 1 or 2
// threads, one registration with the device) against the plain single-threaded way (mmap +
// memset) and, when a GPU answers, cudaHostAlloc. The slab is registered with CudaDevice when a
// GPU is usable and with SimDevice otherwise (whose registration only records the range), which
// the `device` context entry says. Each iteration maps, touches, registers and (untimed) frees
// `bytes`; counters give seconds per GiB and the split into map+bind, touch and register.
//
// Figures are printed as counters; SUITE=host bench/cpp/run.sh turns the JSON into bench/results/host-arena/.

#include <benchmark/benchmark.h>
#include <sys/mman.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "memtide/allocator/host_arena.hpp"
#include "memtide/core/thread_pool.hpp"
#include "memtide/device/sim_device.hpp"

#ifdef MEMTIDE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

using namespace memtide;

namespace {

constexpr std::size_t kPinBytes = std::size_t{512} << 20;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

bool use_cuda() {
  static const bool usable = cuda_status().usable;
  return usable;
}

Device& device() {
  static std::unique_ptr<Device> d = use_cuda() ? open_device(Backend::cuda, 0) : std::make_unique<SimDevice>();
  return *d;
}

void per_gib(benchmark::State& state, double seconds, std::size_t bytes) {
  state.counters["s_per_GiB"] = seconds / (static_cast<double>(bytes) / kGiB);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

// A whole slab, made the HostArena way. Args: touch threads, NUMA node (-1 = not bound),
// transparent huge pages (0/1).
void BM_SlabPin(benchmark::State& state) {
  const auto threads = static_cast<std::size_t>(state.range(0));
  const int node = static_cast<int>(state.range(1));
  ThreadPool pool(threads);
  HostArenaConfig c;
  c.numa_node = node;
  c.huge_pages = state.range(2) != 0;
  c.slab_bytes = kPinBytes;
  c.toucher = &pool;
  c.device = &device();
  double total = 0, map = 0, touch = 0, reg = 0;
  bool first = true;
  for (auto _ : state) {
    HostArena arena(c);
    const auto t0 = std::chrono::steady_clock::now();
    void* p = arena.allocate(kPinBytes);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s);
    benchmark::DoNotOptimize(p);
    const HostArenaStats st = arena.stats();
    total += s;
    map += st.map_bind_seconds;
    touch += st.touch_seconds;
    reg += st.register_seconds;
    state.PauseTiming();
    if (node >= 0 && first) {
      const PlacementReport r = arena.verify_placement(p, kPinBytes);
      state.SetLabel(r.describe());
    }
    first = false;
    arena.deallocate(p);  // the arena's destructor unregisters and unmaps, untimed
    state.ResumeTiming();
  }
  per_gib(state, total / static_cast<double>(state.iterations()), kPinBytes);
  const double n = static_cast<double>(state.iterations()) / 1e3;
  state.counters["map_bind_ms"] = map / n;
  state.counters["touch_ms"] = touch / n;
  state.counters["register_ms"] = reg / n;
}

// The plain way: one thread, mmap + memset (what an unpinned numpy/torch buffer costs to fill).
void BM_MmapMemset(benchmark::State& state) {
  double total = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    void* p = mmap(nullptr, kPinBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      state.SkipWithError("mmap failed");
      return;
    }
    std::memset(p, 0, kPinBytes);
    benchmark::ClobberMemory();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s);
    total += s;
    state.PauseTiming();
    munmap(p, kPinBytes);
    state.ResumeTiming();
  }
  per_gib(state, total / static_cast<double>(state.iterations()), kPinBytes);
}

#ifdef MEMTIDE_HAVE_CUDA
// What torch's pin_memory / cudaHostAlloc costs for the same size (GPU machines only).
void BM_CudaHostAlloc(benchmark::State& state) {
  device();  // makes sure the CUDA context exists before timing
  double total = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    void* p = nullptr;
    if (cudaHostAlloc(&p, kPinBytes, cudaHostAllocDefault) != cudaSuccess) {
      state.SkipWithError("cudaHostAlloc failed");
      return;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s);
    total += s;
    state.PauseTiming();
    cudaFreeHost(p);
    state.ResumeTiming();
  }
  per_gib(state, total / static_cast<double>(state.iterations()), kPinBytes);
}
#endif

HostArena& warm_arena() {
  static HostArena* arena = [] {
    HostArenaConfig c;
    c.slab_bytes = 64 << 20;
    c.device = &device();
    static HostArena a(c);
    a.deallocate(a.allocate(1));  // maps the first slab outside the timed loop
    return &a;
  }();
  return *arena;
}

// One alloc + free of a fixed size on a warm arena: a split on allocate, a coalesce on free.
void BM_ArenaAllocFree(benchmark::State& state) {
  HostArena& a = warm_arena();
  const auto bytes = static_cast<std::size_t>(state.range(0));
  for (auto _ : state) {
    void* p = a.allocate(bytes);
    benchmark::DoNotOptimize(p);
    a.deallocate(p);
  }
  state.SetItemsProcessed(state.iterations());
}

// 64 live buffers of 4 KiB..1 MiB, one freed and one allocated per step at random: best fit
// over a fragmented free set.
void BM_ArenaMixed(benchmark::State& state) {
  HostArena& a = warm_arena();
  std::mt19937 rng(42);
  std::vector<void*> live;
  auto size = [&] { return std::size_t{4096} << (rng() % 9); };
  for (int i = 0; i < 64; ++i) live.push_back(a.allocate(size()));
  for (auto _ : state) {
    const std::size_t k = rng() % live.size();
    a.deallocate(live[k]);
    live[k] = a.allocate(size());
  }
  for (void* p : live) a.deallocate(p);
  state.SetItemsProcessed(state.iterations());
}

void register_all() {
  std::vector<int> nodes{-1};
  if (HostArena::numa_supported()) nodes.push_back(0);
  for (int node : nodes) {
    for (int threads : {1, 2}) {
      for (int huge : {0, 1}) {
        benchmark::RegisterBenchmark("SlabPin", BM_SlabPin)
            ->ArgNames({"threads", "node", "thp"})
            ->Args({threads, node, huge})
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond)
            ->Iterations(2)
            ->Repetitions(3)
            ->ReportAggregatesOnly(true);
      }
    }
  }
  benchmark::RegisterBenchmark("MmapMemset", BM_MmapMemset)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond)
      ->Iterations(2)
      ->Repetitions(3)
      ->ReportAggregatesOnly(true);
#ifdef MEMTIDE_HAVE_CUDA
  if (use_cuda()) {
    benchmark::RegisterBenchmark("CudaHostAlloc", BM_CudaHostAlloc)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(2)
        ->Repetitions(3)
        ->ReportAggregatesOnly(true);
  }
#endif
  benchmark::RegisterBenchmark("ArenaAllocFree", BM_ArenaAllocFree)
      ->Arg(4096)
      ->Arg(1 << 20)
      ->Repetitions(5)
      ->ReportAggregatesOnly(true);
  benchmark::RegisterBenchmark("ArenaMixed", BM_ArenaMixed)->Repetitions(5)->ReportAggregatesOnly(true);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_all();
  benchmark::AddCustomContext("memtide_pin_bytes", std::to_string(kPinBytes));
  benchmark::AddCustomContext("memtide_register_device",
                              use_cuda() ? device().properties().name + " (cudaHostRegister)"
                                         : "SimDevice (records the range; no GPU: " + cuda_status().reason + ")");
  benchmark::AddCustomContext("memtide_numa", HostArena::numa_supported() ? "libnuma, slabs bound with mbind" : "no libnuma: not bound");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
