#pragma once
/// @file
/// The gradient path of backward (paper 4.1): low-precision gradients produced on the GPU are
/// upcast to fp32 on the GPU, chunk by chunk through a fixed pair of pre-allocated chunk buffers,
/// and copied D2H into their subgroup's pinned fp32 gradient buffer, on dedicated streams that
/// overlap backward compute. Transferring fp32 from pinned memory avoids the pageable staging
/// and host-side upcast that make DeepSpeed's gradient flush ~20x slower than PCIe.
///
/// Subgroups the plan updates on the GPU may keep their fp32 gradient on the GPU instead, as far
/// as the headroom passed to begin() allows; the UpdateScheduler then reads it there.
/// The non-finite check runs on the GPU as gradients pass, so the update phase need not rescan.
///
/// One push per element per optimizer step: a push writes its elements, it does not add to them.
/// With gradient accumulation the micro-batches accumulate in the producer's buffer (torch's
/// .grad, in low precision on the GPU) and the sink is fed after the last one; accumulating in
/// fp32 on the host instead would add a CPU pass per micro-batch (what DeepSpeed does).

#include <cstddef>
#include <cstdint>
#include <vector>

#include "memtide/allocator/caching_allocator.hpp"
#include "memtide/tiering/engine/optimizer_state.hpp"

namespace memtide::tiering {

class GradSink {
 public:
  /// `chunk_elems`: elements per upcast chunk (two fp32 chunk buffers are allocated once, here).
  GradSink(OptimizerState& state, CachingAllocator& allocator, std::size_t chunk_elems = std::size_t{1} << 22,
           Stream main_stream = {});
  ~GradSink();
  GradSink(const GradSink&) = delete;
  GradSink& operator=(const GradSink&) = delete;

  /// Starts a backward pass. Subgroups placed gpu or gpu_static keep their fp32 gradient on the
  /// GPU, in subgroup order, while the total fits `headroom_bytes`; the rest go to the host.
  void begin(const std::vector<Placement>& placement, std::uint64_t headroom_bytes);

  /// Gradients for flattened elements [offset, offset + n) are ready on `producer` (device
  /// memory, fp16/bf16/fp32). Enqueues their upcast (times `scale`) and transfer; returns at once.
  /// The source may be reused once `producer` has waited for consumed().
  void push(std::size_t offset, const void* grad, DType dtype, std::size_t n, Stream producer, float scale = 1.0F);

  /// An event that completes when everything pushed so far has been read from device memory.
  [[nodiscard]] Event consumed() const noexcept { return consumed_; }

  /// Records `event` where every host-bound gradient pushed so far has been written to the host
  /// (the copy stream carries them in push order).
  void record_landed(Event event) { device_.record_event(event, copy_); }

  /// Waits until every pushed gradient is in place (host buffers written, kept ones set on the
  /// subgroups as device_grad). Returns whether all gradients were finite.
  bool finish();

  /// Frees the kept device gradients and clears device_grad (after the update phase).
  void release();

  [[nodiscard]] std::uint64_t kept_bytes() const noexcept { return kept_bytes_; }
  [[nodiscard]] std::size_t kept_subgroups() const noexcept;
  [[nodiscard]] double bytes_to_host() const noexcept { return bytes_to_host_; }

 private:
  void push_piece(std::size_t sg, std::size_t local, const unsigned char* src, DType dtype, std::size_t n, float scale);

  OptimizerState& state_;
  Device& device_;
  CachingAllocator& allocator_;
  std::size_t chunk_elems_;
  Stream main_stream_;
  Stream convert_{}, copy_{};
  float* chunks_[2] = {nullptr, nullptr};
  Event converted_[2] = {};
  Event copied_[2] = {};
  bool copied_recorded_[2] = {false, false};
  std::size_t next_chunk_ = 0;
  Event producer_ready_{};
  Event consumed_{};
  unsigned int* device_counter_ = nullptr;
  PinnedBuffer host_counter_;
  std::vector<float*> kept_;  ///< per subgroup; device fp32 gradient or null
  std::uint64_t kept_bytes_ = 0;
  double bytes_to_host_ = 0;
};

}  // namespace memtide::tiering
