#include "memtide/tiering/engine/grad_sink.hpp"

#include <algorithm>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/tiering/kernels/device_ops.hpp"

namespace memtide::tiering {

GradSink::GradSink(OptimizerState& state, CachingAllocator& allocator, std::size_t chunk_elems, Stream main_stream)
    : state_(state), device_(state.device()), allocator_(allocator), chunk_elems_(chunk_elems), main_stream_(main_stream) {
  if (chunk_elems == 0) throw InvalidArgument("GradSink: chunk_elems must be >= 1, got 0");
  if (&allocator.device() != &device_) {
    throw InvalidArgument("GradSink: the allocator and the optimizer state belong to different devices");
  }
  convert_ = device_.create_stream();
  copy_ = device_.create_stream();
  for (int b = 0; b < 2; ++b) {
    chunks_[b] = static_cast<float*>(allocator_.allocate(chunk_elems_ * sizeof(float), main_stream_));
    converted_[b] = device_.create_event();
    copied_[b] = device_.create_event();
  }
  producer_ready_ = device_.create_event();
  consumed_ = device_.create_event();
  device_counter_ = static_cast<unsigned int*>(allocator_.allocate(sizeof(unsigned int), main_stream_));
  host_counter_ = PinnedBuffer(device_, 64);
  kept_.assign(state_.size(), nullptr);
  // Buffers were allocated on the main stream; the sink's streams start after that.
  device_.record_event(producer_ready_, main_stream_);
  device_.stream_wait_event(convert_, producer_ready_);
  device_.stream_wait_event(copy_, producer_ready_);
  device_.memset_async(device_counter_, 0, sizeof(unsigned int), convert_);
}

GradSink::~GradSink() {
  try {
    device_.stream_synchronize(convert_);
    device_.stream_synchronize(copy_);
    release();
    for (float* c : chunks_) allocator_.deallocate(c, main_stream_);
    allocator_.deallocate(device_counter_, main_stream_);
    for (int b = 0; b < 2; ++b) {
      device_.destroy_event(converted_[b]);
      device_.destroy_event(copied_[b]);
    }
    device_.destroy_event(producer_ready_);
    device_.destroy_event(consumed_);
    device_.destroy_stream(convert_);
    device_.destroy_stream(copy_);
  } catch (const Error&) {
    // Destructors never throw.
  }
}

std::size_t GradSink::kept_subgroups() const noexcept {
  return static_cast<std::size_t>(std::count_if(kept_.begin(), kept_.end(), [](float* p) { return p != nullptr; }));
}

void GradSink::begin(const std::vector<Placement>& placement, std::uint64_t headroom_bytes) {
  if (placement.size() != state_.size()) {
    throw InvalidArgument("GradSink::begin: placement has " + std::to_string(placement.size()) +
                          " entries, the optimizer state has " + std::to_string(state_.size()) + " subgroups");
  }
  release();
  std::uint64_t budget = headroom_bytes;
  for (std::size_t i = 0; i < state_.size(); ++i) {
    if (placement[i] == Placement::cpu) continue;
    const std::uint64_t bytes = state_[i].n * sizeof(float);
    if (bytes > budget) break;  // keep a prefix: the first GPU subgroups are needed first
    kept_[i] = static_cast<float*>(allocator_.allocate(bytes, main_stream_));
    budget -= bytes;
    kept_bytes_ += bytes;
  }
  device_.memset_async(device_counter_, 0, sizeof(unsigned int), convert_);
}

void GradSink::push(std::size_t offset, const void* grad, DType dtype, std::size_t n, Stream producer, float scale) {
  if (n == 0) return;
  if (grad == nullptr) throw InvalidArgument("GradSink::push: null gradient for " + std::to_string(n) + " elements");
  if (offset + n > state_.total_params()) {
    throw InvalidArgument("GradSink::push: elements [" + std::to_string(offset) + ", " + std::to_string(offset + n) +
                          ") are past the " + std::to_string(state_.total_params()) + " parameters");
  }
  device_.record_event(producer_ready_, producer);
  device_.stream_wait_event(convert_, producer_ready_);
  const auto* src = static_cast<const unsigned char*>(grad);
  const std::size_t elem = dtype_size(dtype);
  // A range may span subgroups: boundaries need not align with tensors.
  std::size_t done = 0;
  while (done < n) {
    const std::size_t sg = state_.subgroup_of(offset + done);
    const Subgroup& g = state_[sg];
    const std::size_t local = offset + done - g.offset;
    const std::size_t take = std::min(n - done, g.n - local);
    push_piece(sg, local, src + done * elem, dtype, take, scale);
    done += take;
  }
  device_.record_event(consumed_, convert_);
}

void GradSink::push_piece(std::size_t sg, std::size_t local, const unsigned char* src, DType dtype, std::size_t n,
                          float scale) {
  const std::size_t elem = dtype_size(dtype);
  count_nonfinite_async(device_, convert_, src, dtype, n, 1.0, static_cast<double>(scale), device_counter_);
  if (kept_[sg] != nullptr) {  // stays on the GPU: upcast straight into the kept buffer
    convert_async(device_, convert_, kept_[sg] + local, DType::fp32, src, dtype, n, scale);
    return;
  }
  float* host = state_[sg].grad + local;
  for (std::size_t at = 0; at < n; at += chunk_elems_) {
    const std::size_t take = std::min(chunk_elems_, n - at);
    const std::size_t b = next_chunk_++ % 2;
    if (copied_recorded_[b]) device_.stream_wait_event(convert_, copied_[b]);  // chunk b left for the host
    convert_async(device_, convert_, chunks_[b], DType::fp32, src + at * elem, dtype, take, scale);
    device_.record_event(converted_[b], convert_);
    device_.stream_wait_event(copy_, converted_[b]);
    device_.copy_async(host + at, chunks_[b], take * sizeof(float), CopyKind::device_to_host, copy_);
    device_.record_event(copied_[b], copy_);
    copied_recorded_[b] = true;
    bytes_to_host_ += static_cast<double>(take * sizeof(float));
  }
}

bool GradSink::finish() {
  auto* host = static_cast<unsigned int*>(host_counter_.data());
  device_.stream_wait_event(copy_, consumed_);
  device_.copy_async(host, device_counter_, sizeof(unsigned int), CopyKind::device_to_host, copy_);
  device_.stream_synchronize(convert_);
  device_.stream_synchronize(copy_);
  for (std::size_t i = 0; i < state_.size(); ++i) state_[i].device_grad = kept_[i];
  return is_phantom(device_) || *host == 0;
}

void GradSink::release() {
  bool any = false;
  for (std::size_t i = 0; i < kept_.size(); ++i) {
    if (kept_[i] == nullptr) continue;
    if (!any) device_.synchronize();  // the update phase may still read them
    any = true;
    allocator_.deallocate(kept_[i], main_stream_);
    kept_[i] = nullptr;
    state_[i].device_grad = nullptr;
  }
  kept_bytes_ = 0;
}

}  // namespace memtide::tiering
