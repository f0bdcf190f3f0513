#pragma once
/// @file
/// FrozenState: the optimizer's host state (fp32 params, exp_avg, exp_avg_sq) as it was at one
/// moment, read by a writer that is not memtide's while steps go on.
///
/// StateSnapshot writes memtide's own checkpoint folder and so chooses the order it writes in.
/// torch.distributed.checkpoint's writer (`dcp.async_save`) reads the tensors of a state dict in
/// an order of its own, from a thread of its own, and its default stager first copies the whole
/// state into host memory so that the steps after the save cannot change what it reads. A
/// FrozenState takes that copy's place: the reader reads the ranges it was told of through
/// `read()`, and the engine calls `protect(i)` before a step changes subgroup i. A subgroup whose
/// ranges are all read is let go; one not yet read is copied into a bounded buffer, or, when the
/// buffer is full, the step waits until the reader has read it. A read returns the bytes as they
/// were when the state was frozen, from the arrays or from the copy.
///
/// The reader's order is not memtide's to choose, so a step may wait longer than with
/// StateSnapshot (which writes a subgroup a step waits for next). A reader that reads nothing for
/// `Config::stall` while a step or a caller waits is given up on: the state is let go, the steps
/// go on, and every later read throws, so a stalled or failed save never stops training and never
/// writes bytes of a later step.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "memtide/tiering/checkpoint/copy_buffers.hpp"
#include "memtide/tiering/checkpoint/save_target.hpp"
#include "memtide/tiering/checkpoint/state_snapshot.hpp"

namespace memtide::tiering {

class FrozenState final : public SaveTarget {
 public:
  using Ranges = std::vector<std::pair<std::size_t, std::size_t>>;

  /// Elements [first, end) of one array: 0 params, 1 exp_avg, 2 exp_avg_sq.
  struct Range {
    std::size_t array = 0;
    std::size_t first = 0;
    std::size_t end = 0;
  };

  struct Config {
    const float* arrays[3] = {};  ///< the engine's host arrays, `n` floats each
    std::size_t n = 0;
    Ranges subgroups;             ///< consecutive, covering [0, n)
    /// What the reader will read, each range as often as it is given (a tensor in a state dict
    /// twice is read twice); nothing else is kept.
    std::vector<Range> needed;
    std::uint64_t buffer_bytes = 0;  ///< copy-on-write bound (0: two of the largest subgroup)
    std::shared_ptr<CopyBuffers> buffers;  ///< where copies go (null: this state's own)
    std::string target;  ///< where the reader writes (for the log and the timeline)
    /// How long the reader may read nothing while someone waits for it before it is given up on.
    std::chrono::duration<double> stall{300.0};
  };

  /// Checks the config (ranges inside the arrays, subgroups covering them); throws
  /// InvalidArgument naming what is wrong.
  static std::shared_ptr<FrozenState> start(Config config);
  ~FrozenState() override;

  /// Copies the frozen values of `range` into `dst` (range.end - range.first floats). Throws
  /// InvalidArgument for a range outside what was needed (its bytes may have changed since), and
  /// Error once the state was closed or given up on.
  void read(const Range& range, float* dst);
  /// The reader will read only within `ranges` from now on (DCP's plan for this rank: a tensor
  /// that every rank holds is written by one of them): each array of each subgroup none of them
  /// falls in is let go, so the steps no longer copy it or wait for it. A later read there still
  /// never sees a step's bytes: it throws once a step has changed the subgroup.
  void keep_only(const std::vector<Range>& ranges);
  /// The reader is done (or failed: `error` says why): the state is let go, and the steps no
  /// longer protect anything. Waits for reads in progress; later reads throw.
  void close(const std::string& error = "");

  void protect(std::size_t i, const float* p, const float* m, const float* v) override;
  /// Closed (or given up on).
  [[nodiscard]] bool done() const override;
  /// Blocks until closed; throws IoError when it was closed with an error or given up on.
  void wait() override;
  /// bytes_total (needed), bytes_written (read so far), waited_s, copied_bytes, copy_s,
  /// peak_buffer_bytes, buffer_bound, done, committed (closed without error), error.
  [[nodiscard]] SnapshotProgress progress() const;
  [[nodiscard]] const std::string& target() const noexcept { return config_.target; }

 private:
  // pending -> copying -> copied -> read, or pending -> read; `read` also for a subgroup
  // nothing of which is needed.
  enum class Stage : unsigned char { pending, copying, copied, read };
  explicit FrozenState(Config config);
  // Under mutex_: a subgroup whose needed elements are all read lets its copy go.
  void settle(std::size_t i);
  // Under mutex_: waits for a change, and gives the reader up when it has read nothing for the
  // stall limit while `who` waited.
  void wait_for_reader(std::unique_lock<std::mutex>& lock, const char* who);
  void give_up(const char* who);
  // Calls each(i, a, b) for every subgroup i that [first, end) overlaps, with the overlap [a, b).
  template <typename Each>
  void for_each_subgroup(std::size_t first, std::size_t end, Each each) const;

  Config config_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<Stage> stage_;
  std::vector<unsigned> readers_;       // reads in progress, per subgroup
  std::vector<std::size_t> left_;       // element reads still to come: 3 per subgroup, one per array
  std::vector<bool> touched_;           // a step has been let change the subgroup's arrays
  [[nodiscard]] std::size_t left(std::size_t i) const;  // of all three arrays
  std::map<std::size_t, std::size_t> needed_[3];  // merged [first, end) per array: what may be read
  struct Copy {
    CopyBuffers::Region memory;
    const float* at[3] = {};  // each array's copy of the subgroup (null: not needed)
    std::uint64_t bytes = 0;
  };
  std::vector<Copy> copies_;
  std::uint64_t buffer_used_ = 0;
  std::size_t held_bytes_ = 0;
  std::size_t peak_held_bytes_ = 0;
  bool closed_ = false;
  std::string error_;
  std::chrono::steady_clock::time_point started_;
  std::chrono::steady_clock::time_point last_read_;
  SnapshotProgress progress_;
};

}  // namespace memtide::tiering
