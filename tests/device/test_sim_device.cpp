// The simulator's throughput model: what the planner will believe about time.

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/device/sim_device.hpp"

using namespace memtide;

namespace {
SimConfig phantom_config() {
  SimConfig c;
  c.phantom = true;
  c.capacity = 1ULL << 40;
  c.op_latency_ns = 0;
  return c;
}
constexpr double kGB = 1e9;
}  // namespace

TEST(SimDevice, PhantomModeHoldsNoBytesAtAnySize) {
  SimDevice d(phantom_config());
  void* p = d.allocate(512ULL << 30);  // 512 GiB
  EXPECT_EQ(d.used_bytes(), 512ULL << 30);
  void* q = d.allocate(1 << 20);
  EXPECT_NE(p, q);
  d.deallocate(p, 0);
  d.deallocate(q, 0);
  EXPECT_EQ(d.used_bytes(), 0u);
}

TEST(SimDevice, CapacityIsEnforced) {
  SimConfig c;
  c.capacity = 8 << 20;
  SimDevice d(c);
  void* p = d.allocate(6 << 20);
  EXPECT_THROW(d.allocate(4 << 20), OutOfMemory);
  d.deallocate(p, 0);
  EXPECT_NO_THROW(d.deallocate(d.allocate(8 << 20), 0));
}

TEST(SimDevice, RejectsForeignPointers) {
  SimDevice d;
  int x = 0;
  EXPECT_THROW(d.deallocate(&x, 4), InvalidArgument);
  void* p = d.allocate(4096);
  std::vector<char> host(8192);
  EXPECT_THROW(d.copy_async(p, host.data(), 8192, CopyKind::host_to_device, Stream{}), InvalidArgument);
  d.deallocate(p, 4096);
}

TEST(SimDevice, StorageTransfersRunOnTheirOwnEngineThroughTheDeviceInterface) {
  SimDevice sim(phantom_config());
  Device& d = sim;  // the NVMe tier asks the interface, never which device it has
  ASSERT_TRUE(d.times_storage());
  const Stream s = d.create_stream();
  d.enqueue_storage(s, 2 * kGB, 4 * kGB);
  EXPECT_NEAR(sim.stream_ready_ns(s), 0.5e9, 1.0);
  EXPECT_GT(sim.storage_stats().busy_ns, 0.0);
  EXPECT_THROW(d.enqueue_storage(s, -1, kGB), InvalidArgument);
  EXPECT_THROW(d.enqueue_storage(s, kGB, 0), InvalidArgument);
  d.destroy_stream(s);
}

TEST(SimDevice, PinnedCopyRunsAtLinkRate) {
  SimDevice d(phantom_config());
  const std::size_t bytes = 11ULL << 30;
  void* dev = d.allocate(bytes);
  auto* host = reinterpret_cast<void*>(std::uintptr_t{1} << 44);  // phantom: never touched
  d.host_register(host, bytes);
  d.copy_async(dev, host, bytes, CopyKind::host_to_device, Stream{});
  d.synchronize();
  EXPECT_NEAR(d.now_ns() / 1e9, static_cast<double>(bytes) / (55 * kGB), 1e-6);
}

TEST(SimDevice, PageableCopyIsSlower) {
  SimDevice d(phantom_config());
  const std::size_t bytes = 1ULL << 30;
  void* dev = d.allocate(bytes);
  auto* host = reinterpret_cast<void*>(std::uintptr_t{1} << 44);
  d.copy_async(dev, host, bytes, CopyKind::host_to_device, Stream{});
  d.synchronize();
  EXPECT_NEAR(d.now_ns() / 1e9, static_cast<double>(bytes) / (9 * kGB), 1e-6);
}

// The CPU step writes the model's copy where it lives when device memory is host memory: its
// "upload" is then a copy onto itself, which must keep the bytes and cost what the pinned
// upload it stands for costs, so simulated timelines do not change.
TEST(SimDevice, CopyOntoItselfKeepsTheBytesAndIsTimedAsAPinnedUpload) {
  SimConfig c;
  c.capacity = 64ULL << 20;
  c.op_latency_ns = 0;
  SimDevice d(c);
  ASSERT_TRUE(d.properties().host_addressable);
  const std::size_t bytes = 16ULL << 20;
  auto* dev = static_cast<unsigned char*>(d.allocate(bytes));
  for (std::size_t i = 0; i < bytes; ++i) dev[i] = static_cast<unsigned char>(i * 7 + 3);
  d.copy_async(dev, dev, bytes, CopyKind::host_to_device, Stream{});
  d.synchronize();
  for (std::size_t i = 0; i < bytes; i += 4093) ASSERT_EQ(dev[i], static_cast<unsigned char>(i * 7 + 3)) << i;
  EXPECT_NEAR(d.now_ns() / 1e9, static_cast<double>(bytes) / c.h2d_bytes_per_s, 1e-9);
  d.deallocate(dev, 0);
}

TEST(SimDevice, H2DAndD2HOverlapButSameDirectionSerializes) {
  SimDevice d(phantom_config());
  const std::size_t bytes = 1ULL << 30;
  void* a = d.allocate(bytes);
  void* b = d.allocate(bytes);
  auto* host = reinterpret_cast<void*>(std::uintptr_t{1} << 44);
  d.host_register(host, 4 * bytes);
  Stream s1 = d.create_stream();
  Stream s2 = d.create_stream();
  const double one = static_cast<double>(bytes) / (55 * kGB) * 1e9;

  d.copy_async(a, host, bytes, CopyKind::host_to_device, s1);
  d.copy_async(static_cast<char*>(host) + bytes, b, bytes, CopyKind::device_to_host, s2);
  d.synchronize();
  EXPECT_NEAR(d.now_ns(), one, one * 1e-6) << "full duplex: both directions at once";

  const double t0 = d.now_ns();
  d.copy_async(a, host, bytes, CopyKind::host_to_device, s1);
  d.copy_async(b, static_cast<char*>(host) + bytes, bytes, CopyKind::host_to_device, s2);
  d.synchronize();
  EXPECT_NEAR(d.now_ns() - t0, 2 * one, one * 1e-6) << "one H2D engine: copies queue";
}

TEST(SimDevice, HostWorkSharesDramWithDma) {
  SimConfig c = phantom_config();
  c.host_dram_bytes_per_s = 100 * kGB;  // tight DRAM so contention shows
  SimDevice d(c);
  const std::size_t bytes = 40ULL << 30;
  void* dev = d.allocate(bytes);
  auto* host = reinterpret_cast<void*>(std::uintptr_t{1} << 44);
  d.host_register(host, bytes);

  const double alone = d.host_work(60 * kGB, 80 * kGB);  // 0.75 s at 80 GB/s
  EXPECT_NEAR(alone, 0.75e9, 1e3);

  d.copy_async(dev, host, bytes, CopyKind::host_to_device, Stream{});  // takes 55 GB/s of DRAM
  const double shared = d.host_work(60 * kGB, 80 * kGB);
  EXPECT_GT(shared, alone * 1.2) << "CPU work must slow down while DMA uses DRAM";
}

TEST(SimDevice, StreamWaitEventDelaysOnlyLaterWork) {
  SimDevice d(phantom_config());
  const std::size_t bytes = 1ULL << 30;
  void* a = d.allocate(bytes);
  auto* host = reinterpret_cast<void*>(std::uintptr_t{1} << 44);
  d.host_register(host, bytes);
  Stream s1 = d.create_stream();
  Stream s2 = d.create_stream();
  Event e = d.create_event();
  d.copy_async(a, host, bytes, CopyKind::host_to_device, s1);
  d.record_event(e, s1);
  EXPECT_FALSE(d.event_query(e)) << "host clock has not reached the copy's end";
  d.stream_wait_event(s2, e);
  EXPECT_DOUBLE_EQ(d.stream_ready_ns(s2), d.stream_ready_ns(s1));
  d.event_synchronize(e);
  EXPECT_TRUE(d.event_query(e));
}

// Back-to-back transfers end exactly where the next one starts; the rounding residue of one must
// not stay reserved on the DRAM timeline after all of them are done (it used to, and slowed every
// later host_work).
TEST(SimDevice, FinishedTransfersLeaveNoDramReserved) {
  SimConfig c = phantom_config();
  c.op_latency_ns = 2000;
  SimDevice d(c);
  const std::size_t bytes = 400'000'000;  // a 100M-param fp32 array
  void* dev = d.allocate(bytes);
  auto* host = reinterpret_cast<void*>(std::uintptr_t{1} << 44);
  d.host_register(host, bytes);
  Stream up = d.create_stream();
  Stream down = d.create_stream();
  for (int i = 0; i < 60; ++i) {
    d.copy_async(dev, host, bytes, CopyKind::host_to_device, up);
    d.copy_async(host, dev, bytes, CopyKind::device_to_host, down);
    if (i % 3 == 0) d.host_work(3e9, 60e9);
  }
  d.synchronize();
  // All of DRAM is free again: work at the full DRAM rate runs at that rate.
  const double ns = d.host_work(c.host_dram_bytes_per_s, c.host_dram_bytes_per_s);
  EXPECT_NEAR(ns, 1e9, 1.0);
  d.destroy_stream(up);
  d.destroy_stream(down);
}

// Rates at or below 1 B/s (a user's --h2d 1e-9 or --dram 1e-30) used to leave every step of the
// DRAM timeline "saturated", and reserve() walked past its end forever. Each case runs in a child
// killed by an alarm, so a spin fails the test instead of hanging it.
TEST(SimDeviceDeathTest, SlowRatesStillFinish) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (const double dram : {1e-30, 0.5, 1.0, 100 * kGB}) {
    for (const double rate : {1e-30, 1e-9, 1.0, 80 * kGB}) {
      EXPECT_EXIT(
          {
            ::alarm(5);
            SimConfig c = phantom_config();
            c.host_dram_bytes_per_s = dram;
            SimDevice d(c);
            const double ns = d.host_work(1e3, rate);
            const double want = 1e3 / std::min(dram, rate) * 1e9;
            std::exit(std::abs(ns - want) <= want * 1e-9 ? 0 : 3);
          },
          ::testing::ExitedWithCode(0), "")
          << "DRAM " << dram << " B/s, transfer " << rate << " B/s";
    }
  }
}

TEST(SimDevice, ATransferPastAnyRepresentableTimeIsRefused) {
  SimConfig c = phantom_config();
  c.host_dram_bytes_per_s = 1e-290;
  SimDevice d(c);
  EXPECT_THROW(d.host_work(1e30, 1.0), InvalidArgument);  // 1e329 ns: infinite in a double
  EXPECT_EQ(d.now_ns(), 0.0) << "a refused transfer leaves the clock where it was";
  EXPECT_NEAR(d.host_work(1.0, 1.0), 1e299, 1e290);
}

TEST(SimDevicePhantom, StoresNoDataAndRunsNoBodies) {
  SimConfig config;
  config.phantom = true;
  SimDevice d(config);
  EXPECT_FALSE(d.properties().stores_data);
  bool ran = false;
  const double ns = d.run_host_work(HostWork{1e6, 0}, [&] { ran = true; });
  EXPECT_FALSE(ran);
  EXPECT_GT(ns, 0);  // the time is still charged
  DeviceKernel k;
  k.host = [&] { ran = true; };
  k.params = 1e6;
  const Stream s = d.create_stream();
  d.enqueue_kernel(s, k);
  d.stream_synchronize(s);
  EXPECT_FALSE(ran);
  EXPECT_GE(d.stream_ready_ns(s), 1e6 / config.gpu_update_params_per_s * 1e9 * 0.999);
  d.destroy_stream(s);
  EXPECT_TRUE(SimDevice(SimConfig{}).properties().stores_data);
}

// What layers above ask of a device, instead of which device it is: a SimDevice keeps time on a
// virtual clock, and in data mode (only) its memory is host memory.
TEST(SimDevice, SaysWhatItIsNotWhichItIs) {
  const DeviceProperties data = SimDevice(SimConfig{}).properties();
  EXPECT_TRUE(data.virtual_clock);
  EXPECT_TRUE(data.host_addressable);
  const DeviceProperties phantom = SimDevice(phantom_config()).properties();
  EXPECT_TRUE(phantom.virtual_clock);
  EXPECT_FALSE(phantom.host_addressable);
  EXPECT_FALSE(DeviceProperties{}.virtual_clock);  // a real device's defaults
  EXPECT_FALSE(DeviceProperties{}.host_addressable);
}
