#pragma once
/// @file
/// CopyBuffers: the memory checkpoint saves copy subgroups into (copy-on-write) and read spilled
/// subgroups through, kept from one save to the next.
///
/// Why kept: the first write to fresh anonymous memory faults every page in, and the step that
/// copies a subgroup aside pays for it. On a 2-vCPU VM a copy into fresh memory ran at 0.4-1.6
/// GB/s, into memory already faulted in at about 10 GB/s (bench/results/checkpoint/). Between
/// saves the regions are handed to the kernel with MADV_FREE: while memory is plentiful they stay
/// and the next save writes them without a fault; when it is not, the kernel takes them back.

#include <cstddef>
#include <mutex>
#include <vector>

namespace memtide::tiering {

class CopyBuffers {
 public:
  /// A mapped region (2 MiB aligned), unmapped when dropped.
  class Region {
   public:
    Region() = default;
    Region(Region&& other) noexcept;
    Region& operator=(Region&& other) noexcept;
    Region(const Region&) = delete;
    Region& operator=(const Region&) = delete;
    ~Region();
    [[nodiscard]] unsigned char* data() const noexcept { return data_; }
    [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
    explicit operator bool() const noexcept { return data_ != nullptr; }

   private:
    friend class CopyBuffers;
    Region(unsigned char* data, std::size_t bytes) noexcept : data_(data), bytes_(bytes) {}
    unsigned char* data_ = nullptr;
    std::size_t bytes_ = 0;
  };

  /// A region of at least `bytes`: the smallest kept one that holds them, else a new mapping (kept
  /// ones too small are let go first, so what is kept does not grow past what saves use). An empty
  /// Region when the OS refuses the mapping.
  [[nodiscard]] Region take(std::size_t bytes);
  /// Keeps a region for the next take().
  void give(Region region);
  /// A save is over: keeps at most `keep` bytes of regions (the largest go first) and lets the
  /// kernel take their pages back when memory runs short.
  void idle(std::size_t keep);
  /// What is kept, in bytes.
  [[nodiscard]] std::size_t kept_bytes() const;

 private:
  mutable std::mutex mutex_;
  std::vector<Region> kept_;
};

}  // namespace memtide::tiering
