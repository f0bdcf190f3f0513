// The Device contract, written once and run against every backend.

#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "device_types.hpp"
#include "memtide/core/error.hpp"

using namespace memtide;
using memtide::test::WithDevice;

template <typename B>
class DeviceContract : public WithDevice<B> {};
TYPED_TEST_SUITE(DeviceContract, memtide::test::DeviceBackends, memtide::test::BackendNames);

TYPED_TEST(DeviceContract, PropertiesDescribeTheDevice) {
  const DeviceProperties& p = this->device().properties();
  EXPECT_FALSE(p.name.empty());
  EXPECT_GT(p.total_memory, 0u);
  EXPECT_TRUE(p.backend == "sim" || p.backend == "cuda");
  const MemInfo m = this->device().mem_info();
  EXPECT_LE(m.free, m.total);
}

TYPED_TEST(DeviceContract, AllocateAlignsAndMemInfoFollows) {
  Device& d = this->device();
  const MemInfo before = d.mem_info();
  void* p = d.allocate(3 << 20);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 256, 0u);
  if (this->sim() != nullptr) {
    EXPECT_EQ(d.mem_info().free, before.free - (3u << 20));
  }
  d.deallocate(p, 3 << 20);
  EXPECT_THROW(d.allocate(0), InvalidArgument);
}

TYPED_TEST(DeviceContract, CopiesRoundTripThroughDeviceMemory) {
  Device& d = this->device();
  const std::size_t n = 1 << 20;
  std::vector<std::uint32_t> src(n), dst(n, 0);
  std::iota(src.begin(), src.end(), 7u);
  const std::size_t bytes = n * sizeof(std::uint32_t);
  void* a = d.allocate(bytes);
  void* b = d.allocate(bytes);
  Stream s = d.create_stream();
  d.copy_async(a, src.data(), bytes, CopyKind::host_to_device, s);
  d.copy_async(b, a, bytes, CopyKind::device_to_device, s);
  d.copy_async(dst.data(), b, bytes, CopyKind::device_to_host, s);
  d.stream_synchronize(s);
  EXPECT_EQ(src, dst);
  d.memset_async(b, 0xAB, bytes, s);
  d.copy_async(dst.data(), b, bytes, CopyKind::device_to_host, s);
  d.stream_synchronize(s);
  EXPECT_EQ(dst[n / 2], 0xABABABABu);
  d.destroy_stream(s);
  d.deallocate(a, bytes);
  d.deallocate(b, bytes);
}

TYPED_TEST(DeviceContract, RegisteredHostMemoryCopies) {
  Device& d = this->device();
  std::vector<char> host(1 << 20, 'x');
  d.host_register(host.data(), host.size());
  void* p = d.allocate(host.size());
  d.copy_async(p, host.data(), host.size(), CopyKind::host_to_device, Stream{});
  // From registered memory the copy is truly asynchronous: the host must wait before reusing it.
  d.synchronize();
  std::fill(host.begin(), host.end(), 'y');
  d.copy_async(host.data(), p, host.size(), CopyKind::device_to_host, Stream{});
  d.synchronize();
  EXPECT_EQ(host[12345], 'x');
  d.host_unregister(host.data());
  d.deallocate(p, host.size());
}

// A copy may start inside a registered range and run past its end (the NVMe tier's spilled
// neighbours of registered runs do), or the other way round.
TYPED_TEST(DeviceContract, CopiesMayCrossTheEdgeOfARegisteredRange) {
  Device& d = this->device();
  const std::size_t page = 4096, bytes = 8 * page;
  std::vector<char> host(bytes + page);
  char* base = host.data() + (page - reinterpret_cast<std::uintptr_t>(host.data()) % page) % page;
  for (std::size_t i = 0; i < bytes; ++i) base[i] = static_cast<char>(i * 7 % 251);
  d.host_register(base + 2 * page, 3 * page);  // pages 2-4 only
  void* p = d.allocate(bytes);
  d.copy_async(p, base + page + 100, 6 * page, CopyKind::host_to_device, Stream{});     // outside, in, out
  d.copy_async(base + 3 * page, p, 4 * page, CopyKind::device_to_host, Stream{});      // in, then out
  d.synchronize();
  for (std::size_t i = 0; i < 4 * page; ++i) {
    ASSERT_EQ(base[3 * page + i], static_cast<char>((page + 100 + i) * 7 % 251)) << "byte " << i;
  }
  d.host_unregister(base + 2 * page);
  d.deallocate(p, bytes);
}

TYPED_TEST(DeviceContract, EventsOrderStreams) {
  Device& d = this->device();
  Stream a = d.create_stream();
  Stream b = d.create_stream();
  Event e = d.create_event(/*timing=*/true);
  Event start = d.create_event(/*timing=*/true);
  std::vector<char> host(8 << 20, 1);
  void* p = d.allocate(host.size());
  d.record_event(start, a);
  d.copy_async(p, host.data(), host.size(), CopyKind::host_to_device, a);
  d.record_event(e, a);
  d.stream_wait_event(b, e);
  d.memset_async(p, 0, host.size(), b);  // must run after the copy
  d.stream_synchronize(b);
  EXPECT_TRUE(d.event_query(e));
  EXPECT_GE(d.event_elapsed_ms(start, e), 0.0f);
  d.copy_async(host.data(), p, host.size(), CopyKind::device_to_host, b);
  d.stream_synchronize(b);
  EXPECT_EQ(host[4096], 0);
  d.destroy_event(e);
  d.destroy_event(start);
  d.destroy_stream(a);
  d.destroy_stream(b);
  d.deallocate(p, host.size());
}

TEST(DeviceFactory, ParsesBackendsAndRejectsOthers) {
  EXPECT_EQ(parse_backend("auto"), Backend::automatic);
  EXPECT_EQ(parse_backend("sim"), Backend::sim);
  EXPECT_EQ(parse_backend("cuda"), Backend::cuda);
  EXPECT_THROW(parse_backend("gpu"), ConfigError);
}

TEST(DeviceFactory, AutoFallsBackToSimWithoutAGpu) {
  const CudaStatus st = cuda_status();
  if (st.usable) {
    EXPECT_EQ(resolve_backend(Backend::automatic), Backend::cuda);
    EXPECT_GE(st.device_count, 1);
  } else {
    EXPECT_FALSE(st.reason.empty());
    EXPECT_EQ(resolve_backend(Backend::automatic), Backend::sim);
    EXPECT_THROW(open_device(Backend::cuda, 0), Error);
    auto d = open_device(Backend::automatic, 0);
    EXPECT_EQ(d->properties().backend, "sim");
  }
}

TEST(DeviceFactory, SimHasExactlyOneDevice) {
  EXPECT_EQ(device_count(Backend::sim), 1);
  EXPECT_THROW(open_device(Backend::sim, 1), InvalidArgument);
}

// A kernel runs in the form the device can run, ordered on its stream; the one it cannot run is
// refused with the device named, not silently dropped.
TYPED_TEST(DeviceContract, KernelsRunInTheFormTheDeviceHas) {
  Device& d = this->device();
  const Stream s = d.create_stream();
  int ran = 0;
  DeviceKernel k;
  k.hbm_bytes = 1 << 20;
  k.host = [&] { ran = 1; };
  k.launch = [&](Stream) { ran = 2; };  // stands in for a launch: it runs on the host at enqueue
  ASSERT_TRUE(d.can_run(k));
  d.enqueue_kernel(s, k);
  d.stream_synchronize(s);
  EXPECT_EQ(ran, this->sim() != nullptr ? 1 : 2);

  DeviceKernel none;  // neither form
  EXPECT_FALSE(d.can_run(none));
  try {
    d.enqueue_kernel(s, none);
    FAIL() << "a kernel the device cannot run was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(d.properties().name), std::string::npos) << e.what();
  }
  k.hbm_bytes = -1;
  EXPECT_THROW(d.enqueue_kernel(s, k), InvalidArgument);
  d.destroy_stream(s);
}

// Host work runs its body (the device stores data) and takes time on the device's host clock.
TYPED_TEST(DeviceContract, HostWorkRunsOnTheHostClock) {
  Device& d = this->device();
  bool ran = false;
  const double t0 = d.host_now_ns();
  const double ns = d.run_host_work(HostWork{64e6, 2e6}, [&] { ran = true; });
  EXPECT_TRUE(ran);
  EXPECT_GE(ns, 0);
  EXPECT_GE(d.host_now_ns() - t0, ns * 0.999);
  if (this->sim() != nullptr) {
    // 2M params at the simulated CPU step rate: the virtual clock moved by exactly that much or more.
    EXPECT_GE(ns, 2e6 / this->sim()->config().cpu_update_params_per_s * 1e9 * 0.999);
  }
  EXPECT_THROW(d.run_host_work(HostWork{-1, 0}, [] {}), InvalidArgument);
}

// Storage transfers are timed where the device keeps a clock for the drive (a simulated one); a
// GPU leaves the drive to the transfers themselves and refuses to time them.
TYPED_TEST(DeviceContract, StorageTransfersAreTimedOnlyWhereTheDeviceHasAStorageClock) {
  Device& d = this->device();
  const Stream s = d.create_stream();
  EXPECT_EQ(d.times_storage(), this->sim() != nullptr);
  if (d.times_storage()) {
    d.enqueue_storage(s, 1e6, 1e9);
    d.stream_synchronize(s);
  } else {
    EXPECT_THROW(d.enqueue_storage(s, 1e6, 1e9), Error);
  }
  EXPECT_THROW(d.enqueue_storage(s, 1e6, -1), InvalidArgument);
  d.destroy_stream(s);
}

TYPED_TEST(DeviceContract, VirtualMemoryMapsGranulesIntoAReservation) {
  Device& d = this->device();
  const std::size_t g = d.vmm_granularity();
  if (g == 0) GTEST_SKIP() << d.properties().name << " has no virtual memory management";
  const std::size_t before = d.mem_info().free;
  auto* base = static_cast<unsigned char*>(d.reserve_address(8 * g));
  ASSERT_NE(base, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(base) % g, 0u);
  d.map_memory(base, 2 * g);
  d.map_memory(base + 2 * g, g);  // adjacent mappings are one usable range
  if (d.properties().backend == "sim") {
    EXPECT_EQ(d.mem_info().free, before - 3 * g);
  }
  Stream s = d.create_stream();
  std::vector<unsigned char> out(3 * g, 0);
  d.memset_async(base, 0x5A, 3 * g, s);
  d.copy_async(out.data(), base, 3 * g, CopyKind::device_to_host, s);
  d.stream_synchronize(s);
  if (d.properties().stores_data) {
    EXPECT_EQ(out.front(), 0x5A);
    EXPECT_EQ(out.back(), 0x5A);
  }
  // Any run of granules can go back on its own, here the middle one of three.
  d.unmap_memory(base + g, g);
  d.unmap_memory(base, g);
  d.unmap_memory(base + 2 * g, g);
  if (d.properties().backend == "sim") {
    EXPECT_EQ(d.mem_info().free, before);
  }
  d.release_address(base, 8 * g);
  d.destroy_stream(s);
  EXPECT_THROW(d.map_memory(base + 1, g), InvalidArgument);        // not on a granule
  EXPECT_THROW((void)d.reserve_address(g + 1), InvalidArgument);   // not a granule multiple
}

TEST(SimDeviceVmm, RefusesWhatCudaWouldRefuse) {
  SimConfig c;
  c.capacity = 8ULL << 20;
  SimDevice d(c);
  const std::size_t g = d.vmm_granularity();
  ASSERT_EQ(g, 2u << 20);
  auto* base = static_cast<unsigned char*>(d.reserve_address(8 * g));
  EXPECT_THROW(d.map_memory(base + 8 * g, g), InvalidArgument);  // outside the reservation
  d.map_memory(base, g);
  EXPECT_THROW(d.map_memory(base, g), InvalidArgument);          // mapped already
  EXPECT_THROW(d.map_memory(base + g, 4 * g), OutOfMemory);      // 8 MiB device: 2 in use, 8 asked
  EXPECT_EQ(d.used_bytes(), g);                                   // nothing mapped by the failure
  EXPECT_THROW(d.unmap_memory(base + g, g), InvalidArgument);    // never mapped
  EXPECT_THROW(d.release_address(base, 8 * g), InvalidArgument); // still mapped inside
  // A kernel or copy must stay inside mapped memory.
  EXPECT_THROW(d.memset_async(base, 0, 2 * g, Stream{}), InvalidArgument);
  d.unmap_memory(base, g);
  d.release_address(base, 8 * g);
  EXPECT_THROW(d.release_address(base, 8 * g), InvalidArgument); // released already
}
