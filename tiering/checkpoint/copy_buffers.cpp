#include "memtide/tiering/checkpoint/copy_buffers.hpp"

#include <algorithm>
#include <utility>

#include "memtide/core/os.hpp"

namespace memtide::tiering {
namespace {
constexpr std::size_t kGrain = std::size_t{2} << 20;  // regions in whole 2 MiB (huge pages where THP is "always")
}  // namespace

CopyBuffers::Region::Region(Region&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

CopyBuffers::Region& CopyBuffers::Region::operator=(Region&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) (void)os::unmap(data_, bytes_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

CopyBuffers::Region::~Region() {
  if (data_ != nullptr) (void)os::unmap(data_, bytes_);
}

CopyBuffers::Region CopyBuffers::take(std::size_t bytes) {
  {
    std::lock_guard lock(mutex_);
    auto best = kept_.end();
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->bytes() >= bytes && (best == kept_.end() || it->bytes() < best->bytes())) best = it;
    }
    if (best != kept_.end()) {
      Region r = std::move(*best);
      kept_.erase(best);
      return r;
    }
    std::erase_if(kept_, [&](const Region& r) { return r.bytes() < bytes; });
  }
  const std::size_t size = (std::max<std::size_t>(bytes, 1) + kGrain - 1) / kGrain * kGrain;
  int err = 0;
  // Faulted in with one call: a copy into memory that faults page by page ran at 0.3-1.8 GB/s on
  // the VM of bench/results/checkpoint/; populated first, 1.2 GB took 0.3 s and the copy 0.12 s.
  // No huge-page advice: with THP defrag on "madvise" the first copy stalled in compaction.
  auto* p = static_cast<unsigned char*>(os::map(size, kGrain, false, err));
  if (p == nullptr) return {};
  (void)os::populate(p, size);  // refused (an older kernel): the copy faults them in instead
  return Region(p, size);
}

void CopyBuffers::give(Region region) {
  if (!region) return;
  std::lock_guard lock(mutex_);
  kept_.push_back(std::move(region));
}

void CopyBuffers::idle(std::size_t keep) {
  std::lock_guard lock(mutex_);
  std::sort(kept_.begin(), kept_.end(), [](const Region& a, const Region& b) { return a.bytes() < b.bytes(); });
  std::size_t total = 0;
  std::size_t n = 0;
  while (n < kept_.size() && total + kept_[n].bytes() <= keep) total += kept_[n++].bytes();
  kept_.resize(n);
  for (Region& r : kept_) (void)os::lazy_free(r.data(), r.bytes());
}

std::size_t CopyBuffers::kept_bytes() const {
  std::lock_guard lock(mutex_);
  std::size_t total = 0;
  for (const Region& r : kept_) total += r.bytes();
  return total;
}

}  // namespace memtide::tiering
