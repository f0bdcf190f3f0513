#pragma once
// A Device that forwards to a SimDevice and fails the Nth call that can fail, for testing that an
// operation which throws half-way leaves everything as it found it (the strong guarantee).

#include <atomic>
#include <memory>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/device/sim_device.hpp"

namespace memtide::test {

class FailingDevice final : public Device {
 public:
  explicit FailingDevice(SimConfig config = {}) : inner_(std::make_unique<SimDevice>(config)) {
    props_ = inner_->properties();
  }
  /// The `n`th failable call from now (1 = the next) throws Error; 0 = never.
  void fail_at(int n) { countdown_ = n; }
  /// Reports another backend with that backend's clock ("cuda": the host's wall clock, for code
  /// that acts only where clocks are wall clocks).
  void pretend_backend(const std::string& backend) {
    props_.backend = backend;
    props_.virtual_clock = backend != "cuda";
  }
  /// Failable calls made since the last fail_at().
  [[nodiscard]] int calls() const { return calls_; }
  [[nodiscard]] SimDevice& inner() { return *inner_; }
  /// Offers the inner device's virtual memory (off by default: a device without it).
  void enable_vmm(bool on) { vmm_ = on; }

 private:
  void maybe_fail(const char* what) {
    ++calls_;
    if (countdown_ > 0 && --countdown_ == 0) throw Error(std::string("injected failure in ") + what);
  }
  void* do_allocate(std::size_t bytes) override {
    maybe_fail("allocate");
    return inner_->allocate(bytes);
  }
  void do_deallocate(void* ptr, std::size_t bytes) override { inner_->deallocate(ptr, bytes); }
  std::size_t do_vmm_granularity() override { return vmm_ ? inner_->vmm_granularity() : 0; }
  void* do_reserve_address(std::size_t bytes) override {
    maybe_fail("reserve_address");
    return inner_->reserve_address(bytes);
  }
  void do_release_address(void* base, std::size_t bytes) override { inner_->release_address(base, bytes); }
  void do_map_memory(void* at, std::size_t bytes) override {
    maybe_fail("map_memory");
    inner_->map_memory(at, bytes);
  }
  void do_unmap_memory(void* at, std::size_t bytes) override { inner_->unmap_memory(at, bytes); }
  Stream do_create_stream() override {
    maybe_fail("create_stream");
    return inner_->create_stream();
  }
  void do_destroy_stream(Stream stream) override { inner_->destroy_stream(stream); }
  Event do_create_event(bool timing) override {
    maybe_fail("create_event");
    return inner_->create_event(timing);
  }
  void do_destroy_event(Event event) override { inner_->destroy_event(event); }
  void do_record_event(Event event, Stream stream) override {
    maybe_fail("record_event");
    inner_->record_event(event, stream);
  }
  void do_stream_wait_event(Stream stream, Event event) override {
    maybe_fail("stream_wait_event");
    inner_->stream_wait_event(stream, event);
  }
  bool do_event_query(Event event) override {
    maybe_fail("event_query");
    return inner_->event_query(event);
  }
  void do_event_synchronize(Event event) override {
    maybe_fail("event_synchronize");
    inner_->event_synchronize(event);
  }
  float do_event_elapsed_ms(Event start, Event end) override { return inner_->event_elapsed_ms(start, end); }
  void do_stream_synchronize(Stream stream) override { inner_->stream_synchronize(stream); }
  void do_synchronize() override { inner_->synchronize(); }
  void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, Stream stream) override {
    maybe_fail("copy_async");
    inner_->copy_async(dst, src, bytes, kind, stream);
  }
  void do_memset_async(void* ptr, int value, std::size_t bytes, Stream stream) override {
    maybe_fail("memset_async");
    inner_->memset_async(ptr, value, bytes, stream);
  }
  void do_host_register(void* ptr, std::size_t bytes) override {
    maybe_fail("host_register");
    inner_->host_register(ptr, bytes);
  }
  void do_host_unregister(void* ptr) override { inner_->host_unregister(ptr); }
  MemInfo do_mem_info() override { return inner_->mem_info(); }
  void do_enqueue_kernel(Stream stream, const DeviceKernel& kernel) override {
    maybe_fail("enqueue_kernel");
    inner_->enqueue_kernel(stream, kernel);
  }
  [[nodiscard]] bool do_can_run(const DeviceKernel& kernel) const override { return inner_->can_run(kernel); }
  double do_host_now_ns() override { return inner_->host_now_ns(); }
  double do_run_host_work(const HostWork& work, const std::function<void()>& body) override {
    return inner_->run_host_work(work, body);
  }

  std::unique_ptr<SimDevice> inner_;
  int countdown_ = 0;
  bool vmm_ = false;
  int calls_ = 0;
};

}  // namespace memtide::test
