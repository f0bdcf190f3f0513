// The last resort before an allocation fails: the lenders (what tiering borrowed) are asked to give
// back; when that is not enough, the out-of-memory error says where the memory went.

#include <algorithm>

#include "caching_allocator_internal.hpp"
#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/log.hpp"

namespace memtide {
namespace {
// Set while this thread asks the lenders: an allocation a lender makes meanwhile does not ask again.
thread_local bool t_reclaiming = false;
}  // namespace

std::uint64_t LenderRegistry::add(Lender lender) {
  std::lock_guard lock(mutex_);
  const std::uint64_t id = next_++;
  lenders_.emplace_back(id, std::move(lender));
  return id;
}

void LenderRegistry::remove(std::uint64_t id) {
  std::lock_guard lock(mutex_);
  lenders_.erase(std::remove_if(lenders_.begin(), lenders_.end(), [&](const auto& l) { return l.first == id; }),
                 lenders_.end());
}

std::uint64_t LenderRegistry::reclaim(std::uint64_t needed, std::string& loans) {
  if (t_reclaiming) return 0;
  t_reclaiming = true;
  struct Reset {
    ~Reset() { t_reclaiming = false; }
  } reset;
  std::uint64_t given = 0;
  try {
    std::lock_guard lock(mutex_);
    for (auto& [id, lender] : lenders_) {
      if (lender.give_back) given += lender.give_back(needed);
      const std::uint64_t still = lender.borrowed ? lender.borrowed() : 0;
      if (still > 0) loans += (loans.empty() ? "" : ", ") + lender.name + " " + format_bytes(still);
    }
  } catch (const std::exception& e) {
    // A lender that fails to give back leaves the allocation to fail as it would have.
    MEMTIDE_LOG(warn, std::string("CachingAllocator: a lender could not give memory back: ") + e.what());
  }
  if (given > 0) {
    MEMTIDE_LOG(info, "CachingAllocator: out of memory; lenders gave back " + format_bytes(given) + " and the allocation is retried");
  }
  return given;
}

void CachingAllocator::Impl::throw_oom_locked(std::size_t bytes, Stream stream, const std::string& loans) {
  ++stats_.num_ooms;
  history_.record(TraceAction::oom, 0, bytes, stream);
  MemInfo mem{};
  try {
    mem = device_.mem_info();
  } catch (const Error&) {
    // The message is still useful without the device's own view.
  }
  const auto allocated = static_cast<std::uint64_t>(stats_.allocated_bytes[0].current);
  const auto reserved = static_cast<std::uint64_t>(stats_.reserved_bytes[0].current);
  std::string msg = "memtide: out of memory on " + device_.properties().backend + " device " +
                    std::to_string(device_.properties().index) + ": tried to allocate " + format_bytes(bytes) +
                    ". Limit " + format_bytes(limit_) + "; allocated " + format_bytes(allocated) + ", reserved " +
                    format_bytes(reserved) + " (" + format_bytes(reserved - allocated) +
                    " cached in fragments too small or on other streams); device free " + format_bytes(mem.free) +
                    " of " + format_bytes(mem.total) + ". Current phase: " + phase_name(tracker_.phase()) + ".";
  const auto& history = tracker_.history();
  if (!history.empty()) {
    msg += " Peak allocated in the last iteration:";
    const IterationRecord& last = history.back();
    for (int i = 0; i < kPhaseCount; ++i) {
      const PhaseWatermark& w = last.phases[i];
      if (w.seen) msg += std::string(" ") + phase_name(static_cast<Phase>(i)) + " " + format_bytes(w.peak_allocated) + ";";
    }
  } else {
    msg += " No training iteration has completed yet (no phase history).";
  }
  msg += loans.empty() ? " Nothing is on loan to tiering."
                       : " Still on loan to tiering after asking for it back: " + loans + ".";
  msg += " Lower the batch size, or raise MEMTIDE_MEMORY_FRACTION / MEMTIDE_MAX_BYTES if they are set.";
  throw OutOfMemory(msg);
}

std::uint64_t CachingAllocator::add_lender(Lender lender) { return impl_->lenders_.add(std::move(lender)); }

void CachingAllocator::remove_lender(std::uint64_t id) { impl_->lenders_.remove(id); }

}  // namespace memtide
