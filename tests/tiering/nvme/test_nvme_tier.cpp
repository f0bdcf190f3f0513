// The NVMe tier of the UpdateEngine: with a host budget the state does not fit, spilled
// subgroups stream through staging and every policy still gives the CPU kernel's bits; their
// host pages are dropped between steps; each injected fault (EIO, ENOSPC, a short write on a
// write-back, a corrupt or truncated extent, an EIO on a read) is an IoError naming the subgroup
// and the file that loses nothing; bad setups fail at construction, naming what is wrong. Typed
// over SimDevice (data mode, real io_uring) and CudaDevice. On a phantom SimDevice the tier is
// timed at stated rates and the phase matches the PerfModel's walk.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "device_types.hpp"
#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/allocator/host_arena.hpp"
#include "memtide/core/error.hpp"
#include "memtide/device/sim_device.hpp"
#include "memtide/tiering/kernels/device_ops.hpp"
#include "memtide/tiering/engine/update_engine.hpp"

namespace memtide::tiering {
namespace {

namespace fs = std::filesystem;
using test::WithDevice;

constexpr std::size_t kN = 60'000;
constexpr std::size_t kPer = 6'000;  // 10 subgroups
// Host memory for the state of about half of them: 16 B/param for the rest, plus staging.
constexpr std::uint64_t kBudget = 16 * kN / 2 + 12 * 3 * kPer;

std::vector<std::pair<std::size_t, std::size_t>> cut(std::size_t n, std::size_t per) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (std::size_t s = 0; s < n; s += per) out.emplace_back(s, std::min(n, s + per));
  return out;
}

std::vector<Segment> whole(const UpdateEngine& e, std::int64_t step) {
  std::vector<Segment> out;
  for (std::size_t g = 0; g < e.subgroups().size(); ++g) {
    Segment s;
    s.subgroup = g;
    s.start = e.subgroups()[g].first;
    s.end = e.subgroups()[g].second;
    s.params.lr = 1e-3;
    s.params.weight_decay = 0.01;
    s.params.step = step;
    out.push_back(s);
  }
  return out;
}

struct State {
  std::vector<float> p, m, v, g;
};

State random_state(unsigned seed) {
  State s{std::vector<float>(kN), std::vector<float>(kN), std::vector<float>(kN), std::vector<float>(kN)};
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  for (std::size_t i = 0; i < kN; ++i) {
    s.p[i] = normal(rng);
    s.m[i] = normal(rng) * 0.1F;
    s.v[i] = std::abs(normal(rng)) * 0.01F;
    s.g[i] = normal(rng);
  }
  return s;
}

// The yardstick: one segment stepped by the CPU kernel directly, over `s`.
void reference_step(State& s, const Segment& seg) {
  AdamwArgs x;
  x.param = s.p.data() + seg.start;
  x.exp_avg = s.m.data() + seg.start;
  x.exp_avg_sq = s.v.data() + seg.start;
  x.grad = s.g.data() + seg.start;
  x.n = seg.end - seg.start;
  x.lr = seg.params.lr;
  x.weight_decay = seg.params.weight_decay;
  x.step = seg.params.step;
  adamw_step(x, nullptr);
}

// `steps` steps of every subgroup, as whole() makes them.
State reference(unsigned seed, std::int64_t steps) {
  State s = random_state(seed);
  for (std::int64_t step = 1; step <= steps; ++step) {
    for (auto [a, b] : cut(kN, kPer)) {
      Segment seg;
      seg.start = a;
      seg.end = b;
      seg.params.lr = 1e-3;
      seg.params.weight_decay = 0.01;
      seg.params.step = step;
      reference_step(s, seg);
    }
  }
  return s;
}

bool same(const float* a, const std::vector<float>& b, std::size_t from, std::size_t to) {
  return std::memcmp(a + from, b.data() + from, (to - from) * sizeof(float)) == 0;
}

template <typename Backend>
class NvmeTierTest : public WithDevice<Backend> {
 protected:
  void SetUp() override {
    WithDevice<Backend>::SetUp();
    if (this->IsSkipped()) return;
    char templ[] = "/tmp/memtide-tier-test-XXXXXX";
    ASSERT_NE(::mkdtemp(templ), nullptr);
    dir_ = templ;
    const fs::path probe = dir_ / "direct";
    const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT, 0600);
    if (fd < 0) GTEST_SKIP() << dir_ << " does not support O_DIRECT (tmpfs?)";
    ::close(fd);
    fs::remove(probe);
    AllocatorConfig ac;
    ac.headroom_margin = 1 << 20;
    allocator_ = std::make_unique<CachingAllocator>(this->device(), ac);
    HostArenaConfig hc;
    hc.device = &this->device();
    hc.slab_bytes = 4 << 20;
    arena_ = std::make_unique<HostArena>(hc);
  }
  void TearDown() override {
    allocator_.reset();
    arena_.reset();
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  EngineConfig config(std::uint64_t budget = kBudget) const {
    EngineConfig c;
    c.nvme.dir = dir_;
    c.nvme.host_budget_bytes = budget;
    c.nvme.io.block_bytes = 64 << 10;
    return c;
  }
  std::unique_ptr<UpdateEngine> make(EngineConfig c) {
    return std::make_unique<UpdateEngine>(*allocator_, *arena_, kN, cut(kN, kPer), nullptr, c);
  }
  // A fresh engine holding random_state(seed), spilled. `device_memory_in_budget` false: a
  // SimDevice stands in for a GPU whose memory is not the host's.
  std::unique_ptr<UpdateEngine> filled(unsigned seed, bool device_memory_in_budget = true) {
    EngineConfig c = config();
    c.nvme.device_memory_in_budget = device_memory_in_budget;
    auto e = make(c);
    const State s = random_state(seed);
    std::memcpy(e->param(), s.p.data(), kN * 4);
    std::memcpy(e->exp_avg(), s.m.data(), kN * 4);
    std::memcpy(e->exp_avg_sq(), s.v.data(), kN * 4);
    std::memcpy(e->grad(), s.g.data(), kN * 4);
    e->spill_host(kN);
    return e;
  }
  EngineStep step(UpdateEngine& e, Policy policy, std::int64_t n, std::optional<double> k = std::nullopt) {
    const EnginePlan p = e.plan(policy, policy == Policy::static_split ? 1.0 : 0.0, k);
    return e.step(p.plan.placement, p.plan.gpu_slots, whole(e, n), 1.0, 1.0, false, true, p.plan.prediction.total_ns);
  }
  std::size_t first_spilled(const UpdateEngine& e) const {
    for (std::size_t i = 0; i < e.on_nvme().size(); ++i) {
      if (e.on_nvme()[i]) return i;
    }
    return e.on_nvme().size();
  }
  fs::path dir_;
  std::unique_ptr<CachingAllocator> allocator_;
  std::unique_ptr<HostArena> arena_;
};
TYPED_TEST_SUITE(NvmeTierTest, test::DeviceBackends, test::BackendNames);

TYPED_TEST(NvmeTierTest, SpillsAboutHalfAndKeepsTheHostWithinTheBudget) {
  auto e = this->filled(1);
  const NvmeTierInfo info = e->nvme_info();
  EXPECT_GE(info.spilled, 3U);
  EXPECT_LE(info.spilled, 7U);
  EXPECT_LE(e->host_bytes(), kBudget + 3 * 4096 * 4) << "the arrays' registered pages, grads and staging";
  // The spill directory is private and its file is the process's own.
  struct stat st {};
  ASSERT_EQ(::stat(info.file.parent_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700U);
  ASSERT_EQ(::stat(info.file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600U);
  EXPECT_GE(static_cast<std::uint64_t>(st.st_size), 12 * info.spilled_params);
  // The spilled ranges hold no memory: their pages were dropped (they read as zeros).
  const std::size_t g = this->first_spilled(*e);
  const std::size_t mid = (e->subgroups()[g].first + e->subgroups()[g].second) / 2;
  unsigned char resident = 1;
  auto* page = reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(e->param() + mid) & ~std::uintptr_t{4095});
  ASSERT_EQ(::mincore(page, 4096, &resident), 0);
  EXPECT_EQ(resident & 1, 0) << "a spilled subgroup's page is still in memory";
  const fs::path file = info.file;
  e.reset();
  EXPECT_FALSE(fs::exists(file.parent_path())) << "a clean exit removes the spill directory";
}

TYPED_TEST(NvmeTierTest, EveryPolicyGivesTheCpuKernelsBits) {
  const State ref = reference(7, 3);
  struct Case {
    Policy policy;
    std::optional<double> k;
  };
  for (const Case& c : {Case{Policy::cpu, {}}, Case{Policy::interleaved, 2.0}, Case{Policy::interleaved, 1.0},
                        Case{Policy::automatic, {}}}) {
    if (c.policy != Policy::cpu && !device_ops_available(this->device())) continue;
    auto e = this->filled(7);
    std::size_t gpu_spilled = 0;
    for (std::int64_t n = 1; n <= 3; ++n) {
      const EnginePlan p = e->plan(c.policy, 0, c.k);
      for (std::size_t i = 0; i < p.plan.placement.size(); ++i) {
        gpu_spilled += e->on_nvme()[i] && p.plan.placement[i] == Placement::gpu;
      }
      const EngineStep r = e->step(p.plan.placement, p.plan.gpu_slots, whole(*e, n), 1.0, 1.0, false, true,
                                   p.plan.prediction.total_ns);
      ASSERT_FALSE(r.skipped);
      // Every spilled subgroup is read and written once, but residents (their state stays on the device).
      std::size_t moved = 0;
      for (std::size_t i = 0; i < p.plan.placement.size(); ++i) {
        moved += e->on_nvme()[i] && p.plan.placement[i] != Placement::gpu_static;
      }
      EXPECT_EQ(r.total.nvme.reads, moved);
      EXPECT_EQ(r.total.nvme.writes, moved);
    }
    if (c.policy == Policy::interleaved && c.k == 1.0) {
      EXPECT_GT(gpu_spilled, 0U) << "NVMe -> staging -> GPU ran";
    }
    e->sync_host();
    EXPECT_TRUE(same(e->param(), ref.p, 0, kN)) << "policy " << static_cast<int>(c.policy);
    EXPECT_TRUE(same(e->exp_avg(), ref.m, 0, kN));
    EXPECT_TRUE(same(e->exp_avg_sq(), ref.v, 0, kN));
  }
}

TYPED_TEST(NvmeTierTest, PartsOfASpilledSubgroupWithOtherHyperParametersRunSeparately) {
  auto e = this->filled(3);
  State ref = random_state(3);
  const std::size_t g = this->first_spilled(*e);
  const auto [a, b] = e->subgroups()[g];
  const std::size_t cut_at = a + (b - a) / 3;
  std::vector<Segment> segs = whole(*e, 1);
  Segment second = segs[g];
  segs[g].end = cut_at;
  second.start = cut_at;
  second.params.lr = 5e-3;  // another param group inside the same subgroup
  segs.push_back(second);
  const EnginePlan p = e->plan(Policy::cpu, 0, std::nullopt);
  (void)e->step(p.plan.placement, p.plan.gpu_slots, segs, 1.0, 1.0, false, true);
  for (const Segment& s : segs) reference_step(ref, s);
  e->sync_host();
  EXPECT_TRUE(same(e->param(), ref.p, 0, kN));
  EXPECT_TRUE(same(e->exp_avg(), ref.m, 0, kN));
  EXPECT_TRUE(same(e->exp_avg_sq(), ref.v, 0, kN));
}

// Parts of one spilled subgroup with a gap between them (a frozen param) in one run, even with
// a single read-ahead buffer: read once, written once, the gap untouched.
TYPED_TEST(NvmeTierTest, APartedSpilledSubgroupIsReadAndWrittenOnce) {
  EngineConfig c = this->config();
  c.nvme.read_ahead = 1;
  auto e = this->make(c);
  State ref = random_state(13);
  std::memcpy(e->param(), ref.p.data(), kN * 4);
  std::memcpy(e->exp_avg(), ref.m.data(), kN * 4);
  std::memcpy(e->exp_avg_sq(), ref.v.data(), kN * 4);
  std::memcpy(e->grad(), ref.g.data(), kN * 4);
  e->spill_host(kN);
  std::vector<Segment> segs;
  for (Segment s : whole(*e, 1)) {
    if (!e->on_nvme()[s.subgroup]) {
      segs.push_back(s);
      continue;
    }
    const std::size_t third = (s.end - s.start) / 3;
    Segment a = s, b = s;
    a.end = s.start + third;  // [start, start + third) and [start + 2 third, end): the middle is frozen
    b.start = s.start + 2 * third;
    segs.push_back(a);
    segs.push_back(b);
  }
  const EnginePlan p = e->plan(Policy::cpu, 0, std::nullopt);
  const EngineStep r = e->step(p.plan.placement, p.plan.gpu_slots, segs, 1.0, 1.0, false, true);
  EXPECT_EQ(r.total.nvme.reads, e->nvme_info().spilled);
  EXPECT_EQ(r.total.nvme.writes, e->nvme_info().spilled);
  for (const Segment& s : segs) reference_step(ref, s);
  e->sync_host();
  EXPECT_TRUE(same(e->param(), ref.p, 0, kN));
  EXPECT_TRUE(same(e->exp_avg(), ref.m, 0, kN));
  EXPECT_TRUE(same(e->exp_avg_sq(), ref.v, 0, kN));
}

// Spilled subgroups may be static GPU residents: their state comes from NVMe once and stays on
// the device, so later steps move nothing for them; when they leave (a CPU plan, the host taking
// over, another scheduler taking the subgroups) their newest state goes to NVMe before any read.
// Every path gives the CPU kernel's bits.
TYPED_TEST(NvmeTierTest, SpilledResidentsMoveNothingAndLoseNothingWhenTheyLeave) {
  if (!device_ops_available(this->device())) GTEST_SKIP() << "no device kernels in this build";
  for (const std::string leave : {"cpu plan", "host_changed", "retire"}) {
    auto e = this->filled(17, /*device_memory_in_budget=*/false);
    const std::size_t spilled = e->nvme_info().spilled;
    for (std::int64_t n = 1; n <= 3; ++n) {
      const EngineStep r = this->step(*e, Policy::static_split, n);
      EXPECT_EQ(r.total.params_gpu_static, kN) << "every subgroup resident, spilled ones too";
      if (n > 1) {
        EXPECT_EQ(r.total.nvme.reads, 0U) << leave << ": a resident's state stays on the device";
        EXPECT_EQ(r.total.nvme.writes, 0U) << leave;
      }
    }
    // The fourth step on the CPU; for "retire" with one subgroup in two parts of different
    // hyper-parameters, so other schedulers run it and the residents' one is retired.
    std::vector<Segment> segs = whole(*e, 4);
    if (leave == "host_changed") e->host_changed();  // a spilled resident's only copy is on the device
    if (leave == "retire") {
      std::size_t g = 0;
      while (e->on_nvme()[g]) ++g;
      Segment second = segs[g];
      segs[g].end = second.start = (segs[g].start + segs[g].end) / 2;
      second.params.lr = 5e-3;
      segs.push_back(second);
    }
    const EnginePlan p = e->plan(Policy::cpu, 0, std::nullopt);
    const EngineStep r = e->step(p.plan.placement, p.plan.gpu_slots, segs, 1.0, 1.0, false, true);
    EXPECT_EQ(r.total.nvme.reads, spilled) << leave;
    State ref = reference(17, 3);
    for (const Segment& s : segs) reference_step(ref, s);
    e->sync_host();
    for (std::size_t g = 0; g < e->subgroups().size(); ++g) {
      // host_changed makes the host arrays the truth: residents kept in host memory drop their
      // newer state, but a spilled one, whose host range held nothing, keeps it.
      if (leave == "host_changed" && !e->on_nvme()[g]) continue;
      const auto [a, b] = e->subgroups()[g];
      EXPECT_TRUE(same(e->param(), ref.p, a, b)) << leave << ", subgroup " << g;
      EXPECT_TRUE(same(e->exp_avg(), ref.m, a, b)) << leave << ", subgroup " << g;
      EXPECT_TRUE(same(e->exp_avg_sq(), ref.v, a, b)) << leave << ", subgroup " << g;
    }
  }
}

// On a device whose memory is host memory (a SimDevice), residents are host memory too: a
// budget that spills leaves no room for them, and the spilled subgroups come from NVMe each step.
TYPED_TEST(NvmeTierTest, OnADeviceOfHostMemoryResidentsCountAgainstTheHostBudget) {
  if (!this->device().properties().host_addressable) GTEST_SKIP() << "the device's memory is not host memory";
  if (!device_ops_available(this->device())) GTEST_SKIP() << "no device kernels in this build";
  for (const Policy policy : {Policy::static_split, Policy::automatic}) {
    auto e = this->filled(19);
    const std::size_t spilled = e->nvme_info().spilled;
    for (std::int64_t n = 1; n <= 3; ++n) {
      const EngineStep r = this->step(*e, policy, n);
      EXPECT_LE(e->host_bytes() + e->resident_bytes(), kBudget + 3 * 4096 * 4) << "step " << n;
      EXPECT_EQ(r.total.nvme.reads, spilled) << "step " << n;
      EXPECT_EQ(r.total.nvme.writes, spilled) << "step " << n;
    }
  }
}

// A failed write-back: the step fails naming the subgroup and the file, nothing is lost (each
// subgroup holds the state of before or after the step, the failed one after it), a checkpoint
// can be read, and the next step writes the held state first and goes on.
TYPED_TEST(NvmeTierTest, AFailedWriteBackLosesNothing) {
  const State before = random_state(5);
  const State after = reference(5, 1);
  struct Fault {
    NvmeFaults faults;
    const char* says;
  };
  for (const Fault& f : {Fault{NvmeFaults{EIO, false, 0}, "Input/output error"},
                         Fault{NvmeFaults{ENOSPC, false, 0}, "No space left"},
                         Fault{NvmeFaults{0, true, 0}, "short write"}}) {
    auto e = this->filled(5);
    e->nvme_tier()->inject_faults(f.faults);
    const std::size_t g = this->first_spilled(*e);
    try {
      (void)this->step(*e, Policy::cpu, 1);
      ADD_FAILURE() << "the step succeeded";
    } catch (const IoError& err) {
      const std::string what = err.what();
      EXPECT_NE(what.find("subgroup " + std::to_string(g)), std::string::npos) << what;
      EXPECT_NE(what.find(e->nvme_info().file.string()), std::string::npos) << what;
      EXPECT_NE(what.find(f.says), std::string::npos) << what;
    }
    ASSERT_EQ(e->nvme_info().held, std::vector<std::size_t>{g});
    e->sync_host();  // a checkpoint
    for (std::size_t i = 0; i < e->subgroups().size(); ++i) {
      const auto [a, b] = e->subgroups()[i];
      const bool stepped = same(e->param(), after.p, a, b) && same(e->exp_avg(), after.m, a, b) &&
                           same(e->exp_avg_sq(), after.v, a, b);
      const bool untouched = same(e->param(), before.p, a, b) && same(e->exp_avg(), before.m, a, b) &&
                             same(e->exp_avg_sq(), before.v, a, b);
      EXPECT_TRUE(stepped || untouched) << "subgroup " << i << " holds neither the old nor the new state";
      if (i <= g) {
        EXPECT_TRUE(stepped) << "subgroup " << i << " lost its step";
      }
    }
    // The next step writes the held subgroup first, then runs.
    (void)this->step(*e, Policy::cpu, 2);
    EXPECT_TRUE(e->nvme_info().held.empty());
  }
}

TYPED_TEST(NvmeTierTest, ACorruptOrTruncatedExtentIsCaughtNamingTheSubgroup) {
  for (const bool truncate : {false, true}) {
    auto e = this->filled(9);
    const NvmeTierInfo info = e->nvme_info();
    const int fd = ::open(info.file.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    if (truncate) {
      ASSERT_EQ(::ftruncate(fd, 0), 0);  // someone else, while training
    } else {
      const char junk[8] = {1, 2, 3, 4, 5, 6, 7, 8};
      ASSERT_EQ(::pwrite(fd, junk, sizeof junk, 100), static_cast<ssize_t>(sizeof junk));  // the first extent
    }
    ::fsync(fd);
    ::close(fd);
    try {
      (void)this->step(*e, Policy::cpu, 1);
      ADD_FAILURE() << "a " << (truncate ? "truncated" : "corrupt") << " extent was read";
    } catch (const IoError& err) {
      const std::string what = err.what();
      EXPECT_NE(what.find("subgroup " + std::to_string(this->first_spilled(*e))), std::string::npos) << what;
      EXPECT_NE(what.find(info.file.string()), std::string::npos) << what;
      EXPECT_NE(what.find(truncate ? "truncated" : "checksum mismatch"), std::string::npos) << what;
    }
  }
}

TYPED_TEST(NvmeTierTest, AFailedReadStopsTheStepAndTheNextOneRuns) {
  auto e = this->filled(11);
  e->nvme_tier()->inject_faults(NvmeFaults{0, false, EIO});
  EXPECT_THROW((void)this->step(*e, Policy::cpu, 1), IoError);
  EXPECT_TRUE(e->nvme_info().held.empty());
  e->sync_host();  // a checkpoint can be read
  const EngineStep r = this->step(*e, Policy::cpu, 2);
  EXPECT_EQ(r.total.nvme.reads, e->nvme_info().spilled);
}

TYPED_TEST(NvmeTierTest, BadSetupsFailAtConstructionNamingWhatIsWrong) {
  auto message = [&](EngineConfig c) -> std::string {
    try {
      (void)this->make(c);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EngineConfig c = this->config();
  c.nvme.dir = this->dir_ / "missing";
  EXPECT_NE(message(c).find((this->dir_ / "missing").string()), std::string::npos) << message(c);
  c = this->config();
  c.nvme.dir.clear();
  EXPECT_NE(message(c).find("no NVMe directory"), std::string::npos) << message(c);
  c = this->config(16 * kN / 10);  // not even the gradients fit
  EXPECT_NE(message(c).find("too small"), std::string::npos) << message(c);
  c = this->config();
  c.nvme.read_ahead = 0;
  EXPECT_NE(message(c).find("read_ahead"), std::string::npos) << message(c);
  // A budget the state fits: no tier at all.
  auto e = this->make(this->config(16 * kN + (1 << 20)));
  EXPECT_TRUE(e->on_nvme().empty());
  EXPECT_EQ(e->nvme_info().spilled, 0U);
}

// The simulator's NVMe tier: a phantom SimDevice times the transfers at stated rates, and the
// phase then takes what the PerfModel's walk predicts for the same plan.
TEST(NvmeTierSimulated, APhantomPhaseMatchesThePerfModel) {
  // A drive slower than the CPU update (the phase is the drive's), and one faster (the CPU's).
  for (const auto& [read, write] : {std::pair{6e9, 4e9}, std::pair{40e9, 30e9}}) {
    SimConfig sc;
    sc.phantom = true;
    SimDevice dev(sc);
    AllocatorConfig ac;
    ac.headroom_margin = 1 << 20;
    CachingAllocator alloc(dev, ac);
    HostArenaConfig hc;
    hc.device = &dev;
    HostArena arena(hc);
    constexpr std::size_t n = 2'000'000'000, per = 100'000'000;  // 2B params, 20 subgroups
    EngineConfig c;
    // Half spilled: 16 B/param, less 12 B for each spilled param, plus two subgroups of staging.
    c.nvme.host_budget_bytes = 112ULL * n / 10;
    c.nvme.read_bytes_per_s = read;
    c.nvme.write_bytes_per_s = write;
    c.defaults = sim_rates(sc);
    UpdateEngine e(alloc, arena, n, cut(n, per), nullptr, c);
    EXPECT_EQ(e.nvme_info().spilled, 10U);
    double cpu_ns = 0;
    for (const Policy policy : {Policy::cpu, Policy::automatic}) {
      std::vector<Placement> before;
      std::size_t compared = 0;
      for (std::int64_t s = 1; s <= 4; ++s) {
        const EnginePlan p = e.plan(policy, 0, std::nullopt);
        std::vector<Segment> segs;
        for (std::size_t g = 0; g < e.subgroups().size(); ++g) {
          Segment x;
          x.subgroup = g;
          x.start = e.subgroups()[g].first;
          x.end = e.subgroups()[g].second;
          x.params.step = s;
          segs.push_back(x);
        }
        const double storage0 = dev.storage_stats().busy_ns;
        const EngineStep r = e.step(p.plan.placement, p.plan.gpu_slots, segs, 1, 1, false, false, 0, true);
        // A plan the step before ran too (a changed one also moves residents, not in the phase's
        // model). Under auto, spilled subgroups are static residents: the walk once waited for an
        // NVMe read they never have and dropped their updates (predicted 140 ms, ran 235).
        if (p.plan.placement == before) {
          ++compared;
          EXPECT_NEAR(r.total.phase_ns / p.plan.prediction.total_ns, 1.0, 0.05)
              << "drive " << read << "/" << write << " B/s: predicted " << p.plan.prediction.total_ns
              << " ns (nvme " << p.plan.prediction.nvme_ns << ", cpu " << p.plan.prediction.cpu_ns << "), took "
              << r.total.phase_ns;
        }
        if (policy == Policy::cpu) cpu_ns = r.total.phase_ns;
        if (policy == Policy::automatic && p.plan.placement == before) {
          EXPECT_LT(r.total.phase_ns, cpu_ns) << "auto (spilled subgroups resident on the GPU) beats all-CPU";
        }
        // Spilled subgroups are read once each, but residents (their state stays on the device).
        double moved = 0;
        for (std::size_t g = 0; g < e.subgroups().size(); ++g) {
          if (e.on_nvme()[g] && p.plan.placement[g] != Placement::gpu_static) {
            moved += static_cast<double>(e.subgroups()[g].second - e.subgroups()[g].first);
          }
        }
        EXPECT_EQ(r.total.nvme.read_bytes, 12.0 * moved);
        if (moved > 0) {
          EXPECT_GT(dev.storage_stats().busy_ns, storage0);
        }
        before = p.plan.placement;
      }
      EXPECT_GE(compared, 1U) << "the plan settled";
    }
  }
}

}  // namespace
}  // namespace memtide::tiering
