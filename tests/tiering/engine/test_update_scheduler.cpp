// UpdateScheduler, OptimizerState and GradSink, typed over SimDevice (data mode) and CudaDevice.
// The yardstick is the CPU kernel run directly: every placement must give the same bits.

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "device_types.hpp"
#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/core/error.hpp"
#include "memtide/tiering/engine/grad_sink.hpp"
#include "memtide/tiering/kernels/device_ops.hpp"
#include "memtide/tiering/engine/update_scheduler.hpp"

namespace memtide::tiering {
namespace {

using test::WithDevice;

// Pinned slabs from the heap, registered with the device (HostArena stands in for this in
// production).
class HeapSlabs final : public SlabSource {
 public:
  explicit HeapSlabs(Device& device) : device_(device) {}
  int live = 0;

 private:
  HostSlab do_map_slab(std::size_t bytes, std::size_t alignment) override {
    const std::size_t a = std::max<std::size_t>(alignment, 64);
    void* p = std::aligned_alloc(a, (bytes + a - 1) / a * a);
    if (p == nullptr) throw OutOfMemory("HeapSlabs");
    device_.host_register(p, bytes);
    ++live;
    return HostSlab{p, bytes, -1, true};
  }
  void do_unmap_slab(const HostSlab& slab) override {
    device_.host_unregister(slab.ptr);
    std::free(slab.ptr);
    --live;
  }
  Device& device_;
};

struct Pattern {
  const char* name;
  double k;
  std::size_t statics;
  std::size_t slots;
};

// A random problem: the state the scheduler updates, a copy the CPU kernel updates directly,
// and the model's low-precision params on the device.
template <typename Backend>
class UpdateSchedulerTest : public WithDevice<Backend> {
 protected:
  void SetUp() override {
    WithDevice<Backend>::SetUp();
    if (this->IsSkipped()) return;
    allocator_ = std::make_unique<CachingAllocator>(this->device());
    slabs_ = std::make_unique<HeapSlabs>(this->device());
    pool_ = std::make_unique<ThreadPool>(2);
  }
  void TearDown() override {
    if (allocator_ && model_ != nullptr) allocator_->deallocate(model_, Stream{});
  }

  void make_problem(unsigned seed, std::size_t subgroup, std::size_t total, DType dtype = DType::bf16) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0F, 1.0F);
    state_ = OptimizerState::owned(this->device(), *slabs_, total, subgroup);
    dtype_ = dtype;
    model_ = allocator_->allocate(total * 2, Stream{});
    this->device().memset_async(model_, 0, total * 2, Stream{});
    state_->set_model_params(model_, dtype);
    ref_p_.resize(total);
    ref_m_.resize(total);
    ref_v_.resize(total);
    ref_g_.resize(total);
    ref_out_.assign(total, 0);
    for (std::size_t i = 0; i < total; ++i) {
      ref_p_[i] = normal(rng);
      ref_m_[i] = 0.1F * normal(rng);
      ref_v_[i] = 0.01F * std::abs(normal(rng));
      ref_g_[i] = normal(rng);
    }
    for (std::size_t s = 0; s < state_->size(); ++s) {
      Subgroup& g = (*state_)[s];
      std::memcpy(g.param, ref_p_.data() + g.offset, g.n * 4);
      std::memcpy(g.exp_avg, ref_m_.data() + g.offset, g.n * 4);
      std::memcpy(g.exp_avg_sq, ref_v_.data() + g.offset, g.n * 4);
      std::memcpy(g.grad, ref_g_.data() + g.offset, g.n * 4);
    }
    this->device().synchronize();
  }

  void reference_step(const StepParams& p) {
    for (std::size_t s = 0; s < state_->size(); ++s) {
      const Subgroup& g = (*state_)[s];
      AdamwArgs a;
      a.param = ref_p_.data() + g.offset;
      a.exp_avg = ref_m_.data() + g.offset;
      a.exp_avg_sq = ref_v_.data() + g.offset;
      a.grad = ref_g_.data() + g.offset;
      a.param_out = ref_out_.data() + g.offset;
      a.param_out_dtype = dtype_;
      a.n = g.n;
      a.lr = p.lr;
      a.weight_decay = p.weight_decay;
      a.step = p.step;
      a.grad_scale = p.grad_scale;
      adamw_step(a, nullptr);
    }
  }

  // Compares state and model params bit for bit; returns the number of mismatching arrays.
  void expect_matches_reference(const char* what) {
    std::vector<std::uint16_t> model(state_->total_params());
    this->device().copy_async(model.data(), model_, model.size() * 2, CopyKind::device_to_host, Stream{});
    this->device().synchronize();
    for (std::size_t s = 0; s < state_->size(); ++s) {
      const Subgroup& g = (*state_)[s];
      EXPECT_EQ(0, std::memcmp(g.param, ref_p_.data() + g.offset, g.n * 4)) << what << ": param of subgroup " << s;
      EXPECT_EQ(0, std::memcmp(g.exp_avg, ref_m_.data() + g.offset, g.n * 4)) << what << ": exp_avg of subgroup " << s;
      EXPECT_EQ(0, std::memcmp(g.exp_avg_sq, ref_v_.data() + g.offset, g.n * 4)) << what << ": exp_avg_sq of " << s;
    }
    EXPECT_EQ(0, std::memcmp(model.data(), ref_out_.data(), model.size() * 2)) << what << ": low-precision params";
  }

  Plan plan_for(const Pattern& pat) const {
    Plan plan;
    plan.placement = interleave(state_->size(), pat.k, pat.statics);
    plan.k = pat.k;
    plan.gpu_slots = pat.slots;
    plan.static_residents = pat.statics;
    return plan;
  }

  std::unique_ptr<CachingAllocator> allocator_;
  std::unique_ptr<HeapSlabs> slabs_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<OptimizerState> state_;
  void* model_ = nullptr;
  DType dtype_ = DType::bf16;
  std::vector<float> ref_p_, ref_m_, ref_v_, ref_g_;
  std::vector<std::uint16_t> ref_out_;
};

TYPED_TEST_SUITE(UpdateSchedulerTest, test::DeviceBackends, test::BackendNames);

const Pattern kPatterns[] = {
    {"all cpu", 0, 0, 0},          {"static 2", 0, 2, 0},        {"interleaved k=1", 1, 0, 2},
    {"interleaved k=2", 2, 0, 2},  {"interleaved k=3", 3, 0, 1}, {"interleaved k=1.5", 1.5, 0, 3},
    {"k=2 + 1 static", 2, 1, 2},
};

TYPED_TEST(UpdateSchedulerTest, EveryPlacementMatchesTheCpuKernelBitwise) {
  unsigned seed = 1;
  for (const Pattern& pat : kPatterns) {
    for (DType dtype : {DType::bf16, DType::fp16}) {
      // Odd sizes: the last subgroup is short, none is a multiple of a vector width.
      std::mt19937 rng(seed++);
      const std::size_t sg = 700 + rng() % 600;
      const std::size_t total = 5 * sg + 1 + rng() % (sg - 1);
      this->make_problem(seed, sg, total, dtype);
      {
        UpdateScheduler sched(*this->state_, *this->allocator_, this->pool_.get());
        for (std::int64_t step = 1; step <= 2; ++step) {
          StepParams p;
          p.lr = 1e-2;
          p.step = step;
          p.grad_scale = 0.5;
          this->reference_step(p);
          const StepReport r = sched.run(this->plan_for(pat), p);
          EXPECT_FALSE(r.skipped);
          EXPECT_EQ(r.params_cpu + r.params_gpu + r.params_gpu_static, total) << pat.name;
        }
        sched.sync_to_host();
      }
      this->expect_matches_reference(pat.name);
      this->allocator_->deallocate(this->model_, Stream{});
      this->model_ = nullptr;
      this->state_.reset();
    }
  }
  EXPECT_EQ(this->slabs_->live, 0) << "owned slabs must go back to their source";
}

TYPED_TEST(UpdateSchedulerTest, PlanChangesMoveStaticResidentsInAndOut) {
  this->make_problem(7, 512, 512 * 6 + 77);
  UpdateScheduler sched(*this->state_, *this->allocator_, this->pool_.get());
  const Pattern seq[] = {{"static 3", 0, 3, 0}, {"k=2", 2, 0, 2}, {"static 1 + k=1", 1, 1, 1}, {"cpu", 0, 0, 0}};
  std::int64_t step = 1;
  for (const Pattern& pat : seq) {
    StepParams p;
    p.step = step++;
    this->reference_step(p);
    sched.run(this->plan_for(pat), p);
    EXPECT_EQ(sched.is_resident(this->state_->size() - 1), pat.statics > 0) << pat.name;
  }
  sched.release_residents();
  this->expect_matches_reference("plan sequence");
}

// Residents share one block per pack; a count that shrinks or grows inside a pack moves the
// pack out and in again, and no step's result may be lost on the way.
TYPED_TEST(UpdateSchedulerTest, ResidentCountsThatChangeInsideAPackKeepEveryStep) {
  this->make_problem(5, 512, 512 * 8 + 19);
  UpdateScheduler sched(*this->state_, *this->allocator_, this->pool_.get());
  std::int64_t step = 1;
  for (std::size_t statics : {3, 2, 5, 1, 4, 0, 6}) {
    StepParams p;
    p.step = step++;
    this->reference_step(p);
    sched.run(this->plan_for(Pattern{"statics", 0, statics, 0}), p);
    EXPECT_EQ(sched.resident_count(), statics);
    const std::size_t n = this->state_->size();
    for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(sched.is_resident(i), i >= n - statics) << statics << " " << i;
  }
  sched.release_residents();
  this->expect_matches_reference("resident counts 3 2 5 1 4 0 6");
}

TYPED_TEST(UpdateSchedulerTest, DiscardedResidentsComeBackFromTheHostArrays) {
  this->make_problem(11, 512, 512 * 5 + 31);
  UpdateScheduler sched(*this->state_, *this->allocator_, this->pool_.get());
  const Pattern pat{"static 2", 0, 2, 0};
  const std::size_t last = this->state_->size() - 1;
  StepParams p;
  this->reference_step(p);
  sched.run(this->plan_for(pat), p);
  sched.sync_to_host();
  ASSERT_TRUE(sched.is_resident(last));
  // The host arrays change behind the scheduler's back (a checkpoint load): the new values must
  // win over the resident device copy, which is dropped, not copied back.
  Subgroup& g = (*this->state_)[last];
  for (std::size_t i = 0; i < g.n; ++i) {
    g.param[i] += 1.0F;
    this->ref_p_[g.offset + i] = g.param[i];
  }
  sched.discard_residents();
  EXPECT_FALSE(sched.is_resident(last));
  this->expect_matches_reference("after discard: the host arrays are untouched");
  p.step = 2;
  this->reference_step(p);
  sched.run(this->plan_for(pat), p);
  EXPECT_TRUE(sched.is_resident(last));
  sched.sync_to_host();
  this->expect_matches_reference("the step after a discard");
}

TYPED_TEST(UpdateSchedulerTest, NonFiniteGradientSkipsTheWholeStep) {
  this->make_problem(3, 600, 600 * 5 + 11);
  UpdateScheduler sched(*this->state_, *this->allocator_, this->pool_.get());
  const Pattern pat{"k=2 + static", 2, 1, 2};
  StepParams p;
  this->reference_step(p);  // a good first step, so a resident exists when the bad one comes
  ASSERT_FALSE(sched.run(this->plan_for(pat), p).skipped);
  Subgroup& g = (*this->state_)[3];
  g.grad[g.n / 2] = std::numeric_limits<float>::infinity();
  p.step = 2;
  const StepReport r = sched.run(this->plan_for(pat), p);
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(r.params_cpu + r.params_gpu + r.params_gpu_static, 0U);
  sched.sync_to_host();
  this->expect_matches_reference("after a skipped step");  // reference took only step 1
}

TYPED_TEST(UpdateSchedulerTest, NothingIsAllocatedInsideTheLoop) {
  this->make_problem(5, 900, 900 * 7 + 3);
  UpdateScheduler sched(*this->state_, *this->allocator_, this->pool_.get());
  const Pattern pat{"k=1.5", 1.5, 1, 3};
  for (std::int64_t step = 1; step <= 3; ++step) {
    StepParams p;
    p.step = step;
    const StepReport r = sched.run(this->plan_for(pat), p);
    EXPECT_EQ(r.loop_allocations, 0) << "step " << step;
    EXPECT_EQ(r.loop_device_allocs, 0) << "step " << step;
    // Setup takes the 3 slots (and, the first time, the static resident).
    EXPECT_EQ(r.setup_allocations, step == 1 ? 4 : 3) << "step " << step;
  }
  const AllocatorStats before = this->allocator_->stats();
  sched.run(this->plan_for(pat), StepParams{});
  EXPECT_EQ(this->allocator_->stats().num_device_alloc, before.num_device_alloc) << "slots must come from the cache";
}

TYPED_TEST(UpdateSchedulerTest, GradSinkUpcastsOnTheDeviceAndFeedsTheScheduler) {
  const std::size_t sg = 1000;
  const std::size_t total = sg * 6 + 123;
  this->make_problem(11, sg, total);
  Device& dev = this->device();
  // The model's fp16 gradients on the device, pushed in pieces that straddle subgroups.
  std::vector<std::uint16_t> g16(total);
  for (std::size_t i = 0; i < total; ++i) {
    g16[i] = fp32_to_fp16(this->ref_g_[i] * 64.0F);
    this->ref_g_[i] = fp16_to_fp32(g16[i]) * (1.0F / 64.0F);
  }
  void* dgrad = this->allocator_->allocate(total * 2, Stream{});
  dev.copy_async(dgrad, g16.data(), total * 2, CopyKind::host_to_device, Stream{});
  const Pattern pat{"k=2", 2, 0, 2};
  const Plan plan = this->plan_for(pat);
  GradSink sink(*this->state_, *this->allocator_, 256);
  // Headroom for two subgroups' fp32 grads: the first two GPU subgroups keep theirs.
  sink.begin(plan.placement, 2 * sg * 4);
  EXPECT_EQ(sink.kept_subgroups(), 2U);
  const std::size_t piece = 777;
  for (std::size_t at = 0; at < total; at += piece) {
    const std::size_t n = std::min(piece, total - at);
    sink.push(at, static_cast<const unsigned char*>(dgrad) + at * 2, DType::fp16, n, Stream{}, 1.0F / 64.0F);
  }
  ASSERT_TRUE(sink.finish());
  for (std::size_t s = 0; s < this->state_->size(); ++s) {
    const Subgroup& g = (*this->state_)[s];
    if (g.device_grad != nullptr) continue;
    EXPECT_EQ(0, std::memcmp(g.grad, this->ref_g_.data() + g.offset, g.n * 4)) << "host grad of subgroup " << s;
  }
  UpdateScheduler sched(*this->state_, *this->allocator_, this->pool_.get());
  StepParams p;
  p.grads_finite = true;  // the sink checked them
  this->reference_step(p);
  sched.run(plan, p);
  sink.release();
  this->expect_matches_reference("grads through the GradSink");

  // An overflowing gradient is caught on the way.
  g16[total - 5] = 0x7c00;  // fp16 +inf
  dev.copy_async(dgrad, g16.data(), total * 2, CopyKind::host_to_device, Stream{});
  sink.begin(plan.placement, 0);
  sink.push(0, dgrad, DType::fp16, total, Stream{}, 1.0F);
  EXPECT_FALSE(sink.finish());
  dev.synchronize();
  this->allocator_->deallocate(dgrad, Stream{});
}

// SimDevice only: the virtual clock shows whether the streams really overlap.
TYPED_TEST(UpdateSchedulerTest, StreamsOverlapOnTheSimulatedMachine) {
  if (this->sim() == nullptr) GTEST_SKIP() << "timing structure is checked on SimDevice";
  this->make_problem(9, 64 * 1024, 64 * 1024 * 12);
  UpdateScheduler sched(*this->state_, *this->allocator_, this->pool_.get());
  const StepReport r = sched.run(this->plan_for({"k=1.5", 1.5, 0, 3}), StepParams{});
  EXPECT_GT(r.h2d_d2h_overlap_ns, 0.0) << "prefetch and flush must run at the same time";
  EXPECT_LT(r.phase_ns, r.cpu.busy_ns + r.gpu.busy_ns + r.h2d.busy_ns + r.d2h.busy_ns);
  EXPECT_GT(r.h2d.bytes, 0.0);
  EXPECT_GT(r.d2h.bytes, 0.0);
  const Measurements m = r.measurements();
  EXPECT_GT(m.h2d_bytes_per_ns, 0.0);
  EXPECT_GT(m.cpu_update_params_per_ns, 0.0);
  EXPECT_GT(m.gpu_update_params_per_ns, 0.0);
}

TEST(UpdateSchedulerPhantom, TwentyBillionParamsWithoutHostBytes) {
  SimConfig config;
  config.phantom = true;
  SimDevice dev(config);
  CachingAllocator allocator(dev);
  auto state = OptimizerState::phantom(dev, 20'000'000'000ULL, 100'000'000ULL);
  ASSERT_EQ(state->size(), 200U);
  EXPECT_EQ(state->host_bytes(), 0U);
  void* model = allocator.allocate(state->total_params() * 2, Stream{});
  state->set_model_params(model, DType::bf16);
  UpdateScheduler sched(*state, allocator, nullptr);
  Plan plan;
  plan.placement = interleave(state->size(), 1.5, 10);
  plan.gpu_slots = 4;
  const auto t0 = std::chrono::steady_clock::now();
  const StepReport r = sched.run(plan, StepParams{});
  const double wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.params_cpu + r.params_gpu + r.params_gpu_static, state->total_params());
  EXPECT_GT(r.phase_ns, 0.0);
  std::printf("phantom 20B plan: simulated %.3f s, wall %.3f s\n", r.phase_ns / 1e9, wall_s);
  sched.release_residents();
  allocator.deallocate(model, Stream{});
}

// 7.6 MiB residents (500K params) one block each took 20 MiB per two (the plan counted 15.3),
// so the plan overran the device. In packs they reserve what resident_packs() counts.
TEST(UpdateSchedulerPhantom, ResidentsReserveWhatThePlanCounts) {
  SimConfig config;
  config.phantom = true;
  SimDevice dev(config);
  const std::size_t n = 500'000;
  auto state = OptimizerState::phantom(dev, 200 * n, n);
  const ResidentPacks packs = resident_packs(n);
  ASSERT_GT(packs.per_pack, 2U);
  const std::size_t counts[] = {2 * packs.per_pack + 3, packs.per_pack, packs.per_pack + 1, 7};
  for (std::size_t statics : counts) {  // each count from an empty allocator: what it reserves
    CachingAllocator allocator(dev);
    UpdateScheduler sched(*state, allocator, nullptr);
    const auto base = static_cast<std::uint64_t>(allocator.stats().reserved_bytes[0].current);
    Plan plan;
    plan.placement = interleave(state->size(), 0, statics);
    plan.static_residents = statics;
    (void)sched.run(plan, StepParams{});
    ASSERT_EQ(sched.resident_count(), statics);
    const auto reserved = static_cast<std::uint64_t>(allocator.stats().reserved_bytes[0].current) - base;
    // Whole packs at their rounded size; the partial one shares a 20 MiB segment at worst.
    EXPECT_LE(reserved, packs.bytes_for(statics) + (20ULL << 20)) << statics << " residents";
    sched.release_residents();
  }
  // One after the other in one allocator: the blocks held are the plan's count, no more.
  CachingAllocator allocator(dev);
  UpdateScheduler sched(*state, allocator, nullptr);
  for (std::size_t statics : counts) {
    Plan plan;
    plan.placement = interleave(state->size(), 0, statics);
    plan.static_residents = statics;
    (void)sched.run(plan, StepParams{});
    ASSERT_EQ(sched.resident_count(), statics);
    EXPECT_GE(sched.held_bytes(), statics * packs.slot_bytes) << statics << " residents";
    EXPECT_LE(sched.held_bytes(), packs.bytes_for(statics) + (1ULL << 20)) << statics << " residents";
  }
  sched.release_residents();
  EXPECT_LT(sched.held_bytes(), 1ULL << 20);  // the device counter alone
}

TEST(OptimizerStateTest, SubgroupsCoverTheParametersAndRejectBadInput) {
  SimDevice dev;
  HeapSlabs slabs(dev);
  auto s = OptimizerState::owned(dev, slabs, 1000, 300);
  ASSERT_EQ(s->size(), 4U);
  EXPECT_EQ((*s)[3].n, 100U);
  EXPECT_EQ(s->subgroup_of(599), 1U);
  EXPECT_EQ(s->subgroup_of(600), 2U);
  for (std::size_t i = 0; i < s->size(); ++i) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>((*s)[i].exp_avg) % 64, 0U);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>((*s)[i].grad) % 64, 0U);
  }
  EXPECT_THROW((void)s->subgroup_of(1000), InvalidArgument);
  EXPECT_THROW(s->set_model_params(reinterpret_cast<void*>(64), DType::fp32), InvalidArgument);
  EXPECT_THROW((void)OptimizerState::owned(dev, slabs, 0, 10), InvalidArgument);
  EXPECT_THROW((void)OptimizerState::phantom(dev, 10, 10), InvalidArgument);  // data-mode device
  EXPECT_THROW((void)OptimizerState::external(dev, {ExternalSubgroup{}}), InvalidArgument);
  float a[3], b[3], c[3], d[3];
  auto e = OptimizerState::external(dev, {{a, b, c, d, 2}, {a, b, c, d, 1}});
  EXPECT_EQ(e->total_params(), 3U);
  EXPECT_EQ((*e)[1].offset, 2U);
}

TEST(DeviceOpsTest, SimConvertRoundTripsAndRejectsUnsupportedPairs) {
  SimDevice dev;
  const std::size_t n = 100;
  auto* d32 = static_cast<float*>(dev.allocate(n * 4));
  auto* d16 = static_cast<std::uint16_t*>(dev.allocate(n * 2));
  std::vector<float> h(n);
  for (std::size_t i = 0; i < n; ++i) h[i] = static_cast<float>(i) * 0.37F - 10.0F;
  dev.copy_async(d32, h.data(), n * 4, CopyKind::host_to_device, Stream{});
  convert_async(dev, Stream{}, d16, DType::bf16, d32, DType::fp32, n);
  convert_async(dev, Stream{}, d32, DType::fp32, d16, DType::bf16, n, 2.0F);
  std::vector<float> back(n);
  dev.copy_async(back.data(), d32, n * 4, CopyKind::device_to_host, Stream{});
  dev.synchronize();
  for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(back[i], bf16_to_fp32(fp32_to_bf16(h[i])) * 2.0F) << i;
  EXPECT_THROW(convert_async(dev, Stream{}, d16, DType::fp16, d16, DType::bf16, n), InvalidArgument);
  AdamwArgs a;
  a.skip_if_nonfinite = true;
  a.n = 1;
  EXPECT_THROW(adamw_step_async(dev, Stream{}, a), InvalidArgument);
  dev.deallocate(d32, n * 4);
  dev.deallocate(d16, n * 2);
}

}  // namespace
}  // namespace memtide::tiering
