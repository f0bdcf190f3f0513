#pragma once
/// @file
/// StateSnapshot: saves the optimizer's host state (fp32 params, exp_avg, exp_avg_sq) while
/// training goes on, with no second copy of it.
///
/// A save is asked for between two steps. From then on a writer thread streams the state, one
/// subgroup at a time, into a new folder beside the target; the engine calls `protect(i)` before it
/// changes the host state of subgroup i. If that subgroup is not written yet, protect() copies it
/// into a small buffer of bounded size (copy-on-write at subgroup granularity) or, when the buffer
/// is full, has the writer write it next and waits. So what is saved is exactly the state at the
/// moment the save was asked for, and the extra host memory is the buffer's bound. A subgroup the
/// writer is writing when the step reaches it is not waited for either: protect() copies the part
/// not yet written and the writer goes on from that copy at its next chunk. The writer
/// drops each written range from the page cache, so the file does not become a second copy
/// either.
///
/// The writer writes what lies on whole 4 KiB blocks with O_DIRECT, straight from the state (no
/// copy into the page cache), and the few bytes at a subgroup's edges through the page cache.
///
/// The folder is committed whole or not at all: `state.bin` (p, then m, then v, each n floats
/// from byte `offsets[k]`, which lies as far past a 4 KiB boundary as the array does in memory),
/// `meta.pt` (the front end's bytes) and `state.manifest` (a text file: the params, each subgroup's
/// range and the xxHash3 of its bytes), synced, then renamed onto the target (exchanged with a
/// previous checkpoint there, which is then removed). A save interrupted at any point leaves the
/// previous checkpoint as it was and a partial folder that `read_manifest` refuses and the next
/// save into the same target removes.
///
/// A sharded state (FSDP2, HSDP) is saved by several processes, each writing its part: one save
/// per process, each with the same `Config::Part::id`. Each part is committed as above into a
/// staging folder beside the target (`.<name>.memtide-parts-<id>/<part>`); the process whose part
/// completes the set claims the commit (an exclusive create, so exactly one does), writes
/// `parts.manifest` listing the parts, and renames the staging folder onto the target. A process
/// killed before its part is in leaves the target as it was; `read_parts` then names the parts
/// missing from the staging folder.

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "memtide/tiering/checkpoint/copy_buffers.hpp"
#include "memtide/tiering/checkpoint/save_target.hpp"

namespace memtide::tiering {

/// What a committed checkpoint's manifest says.
struct SnapshotManifest {
  std::uint64_t params = 0;
  std::uint64_t offsets[3] = {};  ///< where p, m and v start in state.bin, in bytes
  std::uint64_t file_bytes = 0;   ///< state.bin's size
  std::vector<std::pair<std::size_t, std::size_t>> subgroups;  ///< [first, end) element ranges
  std::vector<std::uint64_t> checksums;                        ///< xxHash3 of p, m, v of each subgroup
};

/// A save's progress, as the log and the timeline show it.
struct SnapshotProgress {
  std::uint64_t bytes_total = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t direct_bytes = 0;  ///< of those, written with O_DIRECT (not through the page cache)
  double elapsed_s = 0;         ///< since the save was asked for (to its end, the previous checkpoint removed)
  double committed_s = 0;       ///< from the ask until the checkpoint was in place (0: not yet)
  double write_s = 0;           ///< the writer's time in write and sync calls
  double waited_s = 0;          ///< time protect() blocked the engine, waiting for the writer
  std::uint64_t copied_bytes = 0;       ///< copied by protect() into the buffer, in all
  double copy_s = 0;                    ///< time protect() spent copying them (the engine's)
  std::uint64_t peak_buffer_bytes = 0;  ///< the buffer's largest size
  std::uint64_t buffer_bound = 0;
  bool done = false;       ///< committed, failed or cancelled
  bool committed = false;  ///< the target holds this save
  std::string error;       ///< why it failed ("" otherwise)
};

class StateSnapshot final : public SaveTarget {
 public:
  using Ranges = std::vector<std::pair<std::size_t, std::size_t>>;

  struct Config {
    std::filesystem::path target;  ///< the checkpoint folder (made, or a previous checkpoint replaced)
    const float* param = nullptr;  ///< the engine's host arrays, `n` floats each
    const float* exp_avg = nullptr;
    const float* exp_avg_sq = nullptr;
    std::size_t n = 0;
    Ranges subgroups;                ///< consecutive, covering [0, n)
    std::uint64_t buffer_bytes = 0;  ///< copy-on-write bound (0: two of the largest subgroup)
    std::string meta;                ///< the front end's bytes, saved as meta.pt
    /// Subgroups whose state is not in the arrays above but elsewhere (spilled to NVMe; empty:
    /// none), and how the writer reads one: into a 4 KiB-aligned buffer as [params | exp_avg |
    /// exp_avg_sq], returning the xxHash3 of those bytes, checked.
    std::vector<bool> elsewhere;
    std::function<std::uint64_t(std::size_t, void*)> read_elsewhere;

    /// One part of a checkpoint saved by several processes (absent: the whole checkpoint).
    struct Part {
      std::string id;                  ///< the same in every process's save of this checkpoint
      std::vector<std::string> names;  ///< every part's folder name, in one order on every process
      std::size_t index = 0;           ///< this process's part; part 0 also clears dead staging folders
    };
    std::optional<Part> part;

    /// Where copies and reads of spilled subgroups go, kept from one save to the next (null: this
    /// save's own).
    std::shared_ptr<CopyBuffers> buffers;

    /// Tests: called by the writer before each chunk it writes from the arrays (the subgroup, and
    /// the chunk's start in bytes of the subgroup's p, m, v in a row).
    std::function<void(std::size_t, std::uint64_t)> before_chunk;
  };

  /// Checks the target (its folder exists; it is absent or a memtide checkpoint, never a link, a
  /// file or another folder), removes partial folders dead saves left beside it, makes the new
  /// folder, reserves the file's space (a full disk is found here) and starts the writer.
  /// Throws InvalidArgument or IoError naming the path.
  static std::shared_ptr<StateSnapshot> start(Config config);
  /// Stops a running save (its partial folder is removed) and joins the writer.
  ~StateSnapshot() override;

  /// Before the state of subgroup `i` changes. Returns at once when the subgroup is saved or
  /// copied, or the save is over; else copies it (room in the buffer) or waits for the writer.
  /// One the writer is writing from the arrays: copies the part not yet written and waits at most
  /// for the chunk in flight.
  /// `p`, `m`, `v`: where the subgroup's state is now, when not in the arrays (a spilled
  /// subgroup's staging buffer); without them a subgroup kept elsewhere is waited for.
  void protect(std::size_t i, const float* p, const float* m, const float* v) override;
  void protect(std::size_t i) { protect(i, nullptr, nullptr, nullptr); }
  /// Blocks until the save is over; throws IoError with the writer's error.
  void wait() override;
  [[nodiscard]] bool done() const override { return progress().done; }
  /// Stops the writer and removes the partial folder; the target is left as it was.
  void cancel();
  [[nodiscard]] SnapshotProgress progress() const;
  [[nodiscard]] const std::filesystem::path& target() const noexcept { return config_.target; }
  /// The partial folder being written (gone once committed or cancelled).
  [[nodiscard]] const std::filesystem::path& partial() const noexcept { return partial_; }

  /// Reads and checks `folder/state.manifest`; with `verify`, also reads state.bin and checks
  /// every subgroup's checksum. Throws IoError naming the folder and what is missing or wrong.
  static SnapshotManifest read_manifest(const std::filesystem::path& folder, bool verify);
  /// The part folders of a checkpoint saved in parts (empty for a whole one), each checked to be
  /// there with its manifest. Throws IoError naming the folder and what is missing.
  static std::vector<std::string> read_parts(const std::filesystem::path& folder);
  /// The file names inside a checkpoint folder.
  static constexpr const char* kData = "state.bin";
  static constexpr const char* kMeta = "meta.pt";
  static constexpr const char* kManifest = "state.manifest";
  static constexpr const char* kParts = "parts.manifest";

  /// A fault the tests inject into the writer (fires once): errno for the next write.
  void inject_write_error(int err);
  /// Where array k (0: p, 1: m, 2: v) of `n` floats starts in state.bin when it lies `skew`
  /// bytes past a 4 KiB boundary in memory: each array has a 4 KiB-aligned slot of its own.
  static std::uint64_t array_offset(std::uint64_t n, std::size_t k, std::uint64_t skew) noexcept {
    return k * ((4 * n + 4096 + 4095) / 4096 * 4096) + skew % 4096;
  }
  static std::uint64_t file_bytes(std::uint64_t n) noexcept { return 3 * ((4 * n + 4096 + 4095) / 4096 * 4096); }

 private:
  // pending -> (copying -> copied -> writing_copy) or writing -> written; a subgroup reached
  // while the writer writes it from the arrays: writing -> copying_rest -> copied_rest ->
  // writing_copy (the writer took the copy at a chunk's start) -> written.
  enum class Stage : unsigned char { pending, copying, copied, writing_copy, writing, copying_rest, copied_rest, written };
  explicit StateSnapshot(Config config);
  void run();
  // `live`: p, m, v are the arrays themselves (protect() may hand over a copy of the rest).
  void write_subgroup(std::size_t i, const float* p, const float* m, const float* v, bool live);
  void write_piece(const unsigned char* src, std::size_t bytes, off_t at);
  void write_buffered(const unsigned char* src, std::size_t bytes, off_t at);
  void commit();
  void commit_parts();
  void committed_now();  // records progress_.committed_s
  void remove_partial() noexcept;
  [[nodiscard]] std::uint64_t subgroup_bytes(std::size_t i) const;

  Config config_;
  std::filesystem::path destination_;  // the target, or staging_ / this part's name
  std::filesystem::path staging_;      // a part's: the folder all parts go into before the target
  std::filesystem::path partial_;
  int fd_ = -1;
  int direct_fd_ = -1;  // the same file with O_DIRECT (-1: the file system refuses it)
  std::uint64_t offsets_[3] = {};  // where p, m, v start in state.bin
  std::vector<std::pair<off_t, std::size_t>> in_flight_;  // the writer's: chunks written back, not yet waited for
  std::chrono::steady_clock::time_point started_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<Stage> stage_;
  // A copied subgroup's p, m, v until written: each array at the same offset from a 4 KiB
  // boundary as its place in the file, so that the copy too is written with O_DIRECT.
  // A copy of the rest holds the bytes from `from` on (of p, m, v in a row); the arrays' pointers
  // are those of the whole arrays, valid from there.
  struct Copy {
    CopyBuffers::Region memory;
    const float* p = nullptr;
    const float* m = nullptr;
    const float* v = nullptr;
    std::uint64_t from = 0;   // the first byte it holds
    std::uint64_t bytes = 0;  // what it counts against the buffer's bound
  };
  // Copies subgroup i's bytes from `from` on out of p, m, v (unlocked: they do not change until
  // protect() returns). An empty Copy when there is no memory for it.
  [[nodiscard]] Copy copy_out(std::size_t i, const float* p, const float* m, const float* v, std::uint64_t from) const;
  std::vector<Copy> copies_;
  // Where array k (0 p, 1 m, 2 v) of subgroup i goes in a buffer of three regions from `base`
  // (copies, spilled subgroups read back): as far past a block boundary as in state.bin.
  [[nodiscard]] unsigned char* placed(unsigned char* base, std::size_t i, std::size_t k) const noexcept;
  CopyBuffers::Region read_buffer_;
  // The regions of copies and the read buffer held now, and at most (kept for the next save).
  void hold(std::size_t bytes);  // under mutex_
  std::size_t held_bytes_ = 0;
  std::size_t peak_held_bytes_ = 0;  // the writer's: a subgroup read from elsewhere, placed
  std::vector<std::uint64_t> checksums_;
  std::size_t cursor_ = 0;           // subgroups from the last down the writer has passed
  std::uint64_t write_at_ = 0;       // the start of the chunk the writer writes from the arrays
  std::vector<std::size_t> urgent_;  // subgroups protect() waits for, first first
  std::uint64_t buffer_used_ = 0;
  bool stop_ = false;
  int inject_errno_ = 0;
  SnapshotProgress progress_;
  std::thread writer_;
};

}  // namespace memtide::tiering
