#pragma once
/// @file
/// NvmeStore: optimizer subgroups spilled to NVMe when the host-RAM budget cannot hold them,
/// streamed with io_uring and O_DIRECT, every extent checksummed (xxHash3) and checked on every
/// read, so that a truncated or corrupt spill file is an error naming the subgroup and the file,
/// never bad state fed to training.
///
/// The spill lives in a private directory per process (SpillDir): created 0700 under the
/// directory the user names, its one file created 0600 with O_EXCL|O_NOFOLLOW, space reserved up
/// front with fallocate (a full disk is found at setup, not in the middle of training), removed
/// on a clean exit. Directories left by a crashed run are found at start and reported with their
/// size and age.
///
/// Each subgroup owns one extent of the file, aligned to the direct-I/O block. Writes and reads
/// are split into `block_bytes` requests, at most `queue_depth` in flight. A write is verified
/// (every request complete, no short write) before it counts; until then the caller keeps its
/// copy. One reader and one writer may run at once (a ring each), on different extents; no two
/// readers or two writers.

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace memtide::tiering {

/// A stale spill directory of an earlier process that did not exit cleanly.
struct StaleSpill {
  std::filesystem::path path;
  std::uint64_t bytes = 0;
  double age_s = 0;
};

/// The private spill directory of this process under `parent`.
class SpillDir {
 public:
  /// Checks `parent` (exists, is a directory, writable; a link the user named is followed) and makes
  /// `parent/memtide-spill-<pid>-<random>` with mode 0700. Throws IoError naming the path.
  explicit SpillDir(const std::filesystem::path& parent);
  /// Removes the directory and what memtide put in it.
  ~SpillDir();
  /// Removes the directory and what is in it now; files memtide holds open stay usable through
  /// their descriptors until closed. Idempotent (the destructor calls it); a forked child's copy
  /// leaves its parent's directory alone.
  void remove() noexcept;
  SpillDir(const SpillDir&) = delete;
  SpillDir& operator=(const SpillDir&) = delete;

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  /// Spill directories under `parent` whose process is gone.
  static std::vector<StaleSpill> find_stale(const std::filesystem::path& parent);
  /// Removes every spill directory this process has made and not yet removed (a forked child
  /// leaves its parent's alone). For exit paths that skip destructors: Python's interpreter does
  /// not destroy objects still referenced at exit, and a process ended by a signal it re-raises
  /// (Ctrl-C) runs no C++ exit handlers. The engines that own them keep working on their open
  /// files. Returns how many were removed.
  static std::size_t remove_all_live() noexcept;

 private:
  std::filesystem::path path_;
  pid_t owner_ = 0;                   // the process that made it
  std::atomic<bool> removed_{false};  // by remove(), from the destructor or remove_all_live
};

struct NvmeConfig {
  std::size_t queue_depth = 32;                 ///< requests in flight
  std::size_t block_bytes = std::size_t{1} << 20;  ///< bytes per request (a multiple of 4 KiB)
};

/// Faults a test can inject into the next completions (each fires once).
struct NvmeFaults {
  int fail_write_errno = 0;    ///< the next write request completes with -errno (EIO, ENOSPC)
  bool short_write = false;    ///< the next write request completes with half its bytes
  int fail_read_errno = 0;     ///< the next read request completes with -errno
};

class NvmeStore {
 public:
  /// A spill file in `dir` holding `extent_bytes[i]` bytes for subgroup i, reserved with
  /// fallocate. Throws IoError naming the path and the bytes needed when it cannot be created or
  /// reserved (ENOSPC at setup), and InvalidArgument for a bad config.
  /// `names`: the subgroup number each extent's errors name (empty: the extent's index).
  NvmeStore(const SpillDir& dir, const std::vector<std::uint64_t>& extent_bytes, NvmeConfig config = {},
            std::vector<std::size_t> names = {});
  ~NvmeStore();
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  /// Writes `bytes` (at most the extent) of subgroup `i` from `src` (aligned to 4 KiB; the
  /// tail past `bytes` up to the next block is written as zeros) and waits until every request
  /// is complete. Throws IoError naming the subgroup, the file and the cause (EIO, ENOSPC, a
  /// short write); the extent then counts as not written and `src` is untouched.
  void write(std::size_t i, const void* src, std::uint64_t bytes);
  /// Reads subgroup `i` into `dst` (aligned, room for the extent rounded up to the block) and
  /// checks its checksum. Throws IoError naming the subgroup and the file for an I/O error, a
  /// short read (the file was truncated) or a checksum mismatch, and InvalidArgument for a
  /// subgroup never written.
  void read(std::size_t i, void* dst);
  /// Reads subgroup `i` as read() does, but with plain synchronous reads on this thread, not the
  /// reader's ring: for a reader beside the staging (a checkpoint's writer), which must not touch
  /// extent `i` while it is being written. Returns its checksum (checked).
  std::uint64_t read_beside(std::size_t i, void* dst) const;

  [[nodiscard]] const std::filesystem::path& file() const noexcept { return file_; }
  [[nodiscard]] std::size_t subgroups() const noexcept { return extents_.size(); }
  [[nodiscard]] std::uint64_t file_bytes() const noexcept { return file_bytes_; }
  /// Bytes written and read so far, and the time spent waiting for them.
  struct Counters {
    std::uint64_t bytes_written = 0, bytes_read = 0;
    double write_s = 0, read_s = 0;
  };
  [[nodiscard]] Counters counters() const {
    std::lock_guard lock(counters_mutex_);
    return counters_;
  }
  /// For tests: the next completions fail as `faults` says.
  void inject(const NvmeFaults& faults) { faults_ = faults; }
  /// The direct-I/O alignment buffers must have.
  static constexpr std::size_t kAlign = 4096;

 private:
  struct Extent {
    std::uint64_t offset = 0;
    std::uint64_t capacity = 0;  // bytes reserved (a multiple of the block)
    std::uint64_t bytes = 0;     // bytes of the last verified write
    std::uint64_t checksum = 0;
    bool written = false;
  };
  enum class Dir { write, read };
  /// Submits [offset, offset + bytes) of `buffer` in block requests, waits, returns the first
  /// failure's description (empty on success) and the bytes each request moved.
  std::string transfer(Dir dir, std::uint64_t offset, void* buffer, std::uint64_t bytes);
  [[noreturn]] void fail(const char* what, std::size_t i, const std::string& why) const;

  struct Ring;
  std::unique_ptr<Ring> read_ring_, write_ring_;
  NvmeConfig config_;
  std::filesystem::path file_;
  int fd_ = -1;
  std::vector<Extent> extents_;
  std::vector<std::size_t> names_;
  std::uint64_t file_bytes_ = 0;
  mutable std::mutex counters_mutex_;
  Counters counters_;
  NvmeFaults faults_;
};

}  // namespace memtide::tiering
