#include "memtide/tiering/nvme/nvme_store.hpp"

#include <fcntl.h>
#include <liburing.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>
#include <utility>

#include "memtide/core/error.hpp"
#include "memtide/core/job.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/log.hpp"

namespace memtide::tiering {
namespace fs = std::filesystem;

namespace {

constexpr const char* kPrefix = "memtide-spill-";

// The live spill directories of this process, for SpillDir::remove_all_live. Never destroyed:
// it is used from exit paths after static destructors may have run.
struct LiveDirs {
  std::mutex mutex;
  std::vector<SpillDir*> dirs;
  pid_t owner = 0;  // the process that made them (a forked child's copy names its parent's)
};

LiveDirs& live_dirs() {
  static auto* live = new LiveDirs;  // NOLINT(cppcoreguidelines-owning-memory): deliberately leaked
  return *live;
}

std::uint64_t round_up(std::uint64_t v, std::uint64_t to) { return (v + to - 1) / to * to; }

std::string errno_text(int err) { return std::strerror(err); }

std::uint64_t tree_bytes(const fs::path& dir) {
  std::uint64_t total = 0;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec), end;
       !ec && it != end; it.increment(ec)) {
    if (it->is_regular_file(ec)) total += it->file_size(ec);
  }
  return total;
}

}  // namespace

// ---- SpillDir -------------------------------------------------------------------------------

SpillDir::SpillDir(const fs::path& parent) {
  std::error_code ec;
  const fs::file_status st = fs::status(parent, ec);
  if (ec || !fs::exists(st)) {
    throw IoError("spill directory " + parent.string() + " does not exist; create it (on the NVMe drive) first");
  }
  if (!fs::is_directory(st)) throw IoError("spill directory " + parent.string() + " is not a directory");
  if (::access(parent.c_str(), W_OK | X_OK) != 0) {
    throw IoError("spill directory " + parent.string() + " is not writable: " + errno_text(errno));
  }
  // Absolute: the folder is removed at exit, and the process may have changed directory by then.
  const fs::path base = fs::absolute(parent, ec);
  if (ec) throw IoError("spill directory " + parent.string() + ": " + ec.message());
  // memtide-spill-PID[-rankR]-XXXXXX: the pid first (a leftover's owner is found by it), the rank
  // for the user who looks at the folders of a job's ranks side by side.
  const std::optional<int> rank = job_rank();
  std::string templ = (base / (std::string(kPrefix) + std::to_string(::getpid()) +
                               (rank ? "-rank" + std::to_string(*rank) : std::string()) + "-XXXXXX"))
                          .string();
  if (::mkdtemp(templ.data()) == nullptr) {  // mode 0700, a fresh unpredictable name
    throw IoError("spill directory " + parent.string() + ": cannot create a private folder: " + errno_text(errno));
  }
  path_ = templ;
  owner_ = ::getpid();
  LiveDirs& live = live_dirs();
  std::lock_guard lock(live.mutex);
  if (live.owner != owner_) {
    live.dirs.clear();  // the parent's, inherited through fork: not this process's to remove
    live.owner = owner_;
  }
  try {
    live.dirs.push_back(this);
  } catch (...) {
    ::rmdir(path_.c_str());  // no destructor runs for a constructor that throws
    throw;
  }
}

SpillDir::~SpillDir() {
  {
    LiveDirs& live = live_dirs();
    std::lock_guard lock(live.mutex);
    live.dirs.erase(std::remove(live.dirs.begin(), live.dirs.end(), this), live.dirs.end());
  }
  remove();
}

void SpillDir::remove() noexcept {
  // A forked child's copy names its parent's folder, which is not the child's to remove.
  if (removed_.exchange(true) || owner_ != ::getpid()) return;
  std::error_code ec;
  fs::remove_all(path_, ec);  // never follows links: a planted one is removed, not its target
  if (!ec) return;
  try {
    MEMTIDE_LOG(warn, "SpillDir: could not remove " + path_.string() + ": " + ec.message());
  } catch (...) {  // NOLINT(bugprone-empty-catch): out of memory on an exit path; the folder is reported at the next start
  }
}

std::size_t SpillDir::remove_all_live() noexcept {
  LiveDirs& live = live_dirs();
  std::lock_guard lock(live.mutex);
  if (live.owner != ::getpid()) return 0;
  std::size_t removed = 0;
  for (SpillDir* d : live.dirs) {
    removed += d->removed_ ? 0 : 1;
    d->remove();
  }
  return removed;
}

std::vector<StaleSpill> SpillDir::find_stale(const fs::path& parent) {
  std::vector<StaleSpill> out;
  std::error_code ec;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(kPrefix, 0) != 0 || !it->is_directory(ec) || it->is_symlink(ec)) continue;
    const std::string rest = name.substr(std::strlen(kPrefix));
    const long pid = std::strtol(rest.c_str(), nullptr, 10);
    if (pid <= 0) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM) continue;  // still running
    StaleSpill s;
    s.path = it->path();
    s.bytes = tree_bytes(it->path());
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) == 0) {
      s.age_s = std::max(0.0, static_cast<double>(::time(nullptr) - st.st_mtime));
    }
    out.push_back(s);
  }
  return out;
}

// ---- io_uring -------------------------------------------------------------------------------

struct NvmeStore::Ring {
  io_uring ring{};
  bool ready = false;
  ~Ring() {
    if (ready) io_uring_queue_exit(&ring);
  }
};

NvmeStore::NvmeStore(const SpillDir& dir, const std::vector<std::uint64_t>& extent_bytes, NvmeConfig config,
                     std::vector<std::size_t> names)
    : read_ring_(std::make_unique<Ring>()), write_ring_(std::make_unique<Ring>()), config_(config),
      names_(std::move(names)) {
  if (!names_.empty() && names_.size() != extent_bytes.size()) {
    throw InvalidArgument("NvmeStore: " + std::to_string(names_.size()) + " names for " +
                          std::to_string(extent_bytes.size()) + " extents");
  }
  if (config_.queue_depth == 0 || config_.queue_depth > 4096) {
    throw InvalidArgument("NvmeStore: queue_depth must be 1 to 4096, got " + std::to_string(config_.queue_depth));
  }
  if (config_.block_bytes == 0 || config_.block_bytes % kAlign != 0 || config_.block_bytes > (std::size_t{1} << 30)) {
    throw InvalidArgument("NvmeStore: block_bytes must be a multiple of 4 KiB up to 1 GiB, got " +
                          std::to_string(config_.block_bytes));
  }
  if (extent_bytes.empty()) throw InvalidArgument("NvmeStore: no subgroups to spill");
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < extent_bytes.size(); ++i) {
    if (extent_bytes[i] == 0) throw InvalidArgument("NvmeStore: subgroup " + std::to_string(i) + " has 0 bytes");
    Extent e;
    e.offset = offset;
    e.capacity = round_up(extent_bytes[i], kAlign);
    offset += e.capacity;
    extents_.push_back(e);
  }
  file_bytes_ = offset;
  file_ = dir.path() / "state.spill";
  fd_ = ::open(file_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_DIRECT, 0600);
  if (fd_ < 0) {
    const int err = errno;
    throw IoError("NvmeStore: cannot create " + file_.string() + ": " + errno_text(err) +
                  (err == EINVAL ? " (its file system does not support direct I/O: tmpfs? choose a folder on the "
                                   "NVMe drive)"
                                 : ""));
  }
  // Reserve it all now: a full disk is found at setup, not in the middle of training.
  if (const int err = ::posix_fallocate(fd_, 0, static_cast<off_t>(file_bytes_)); err != 0) {
    const std::string why = errno_text(err);
    ::close(fd_);
    ::unlink(file_.c_str());
    fd_ = -1;
    throw IoError("NvmeStore: cannot reserve " + format_bytes(file_bytes_) + " in " + file_.string() + ": " + why +
                  " (the spill directory needs " + std::to_string(file_bytes_) + " bytes free)");
  }
  // One ring for reads and one for writes: a reader and a writer may run at once (NvmeStaging
  // keeps the drive busy across extents that way).
  for (Ring* r : {read_ring_.get(), write_ring_.get()}) {
    if (const int rc = io_uring_queue_init(static_cast<unsigned>(config_.queue_depth), &r->ring, 0); rc < 0) {
      ::close(fd_);
      ::unlink(file_.c_str());
      fd_ = -1;
      throw IoError("NvmeStore: io_uring is not available: " + errno_text(-rc) +
                    " (kernel >= 5.1, and not blocked by seccomp or io_uring_disabled)");
    }
    r->ready = true;
  }
}

NvmeStore::~NvmeStore() {
  read_ring_.reset();
  write_ring_.reset();
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(file_.c_str());
  }
}

void NvmeStore::fail(const char* what, std::size_t i, const std::string& why) const {
  const std::size_t name = i < names_.size() ? names_[i] : i;
  throw IoError(std::string("NvmeStore: ") + what + " of subgroup " + std::to_string(name) + " in " + file_.string() +
                " failed: " + why);
}

std::string NvmeStore::transfer(Dir dir, std::uint64_t offset, void* buffer, std::uint64_t bytes) {
  struct Request {
    std::uint64_t at, len;
  };
  std::vector<Request> requests;
  for (std::uint64_t at = 0; at < bytes; at += config_.block_bytes) {
    requests.push_back({at, std::min<std::uint64_t>(config_.block_bytes, bytes - at)});
  }
  io_uring* ring = &(dir == Dir::write ? write_ring_ : read_ring_)->ring;
  std::string problem;
  std::size_t next = 0, in_flight = 0;
  auto* base = static_cast<unsigned char*>(buffer);
  while (next < requests.size() || in_flight > 0) {
    while (next < requests.size() && in_flight < config_.queue_depth && problem.empty()) {
      io_uring_sqe* sqe = io_uring_get_sqe(ring);
      if (sqe == nullptr) break;
      const Request& r = requests[next];
      if (dir == Dir::write) {
        io_uring_prep_write(sqe, fd_, base + r.at, static_cast<unsigned>(r.len), offset + r.at);
      } else {
        io_uring_prep_read(sqe, fd_, base + r.at, static_cast<unsigned>(r.len), offset + r.at);
      }
      io_uring_sqe_set_data64(sqe, next);
      ++next;
      ++in_flight;
    }
    if (in_flight == 0) break;  // a failure stopped new submissions and all are reaped
    io_uring_cqe* cqe = nullptr;
    const int rc = io_uring_submit_and_wait(ring, 1);
    if (rc < 0 && rc != -EINTR) {
      if (problem.empty()) problem = "io_uring: " + errno_text(-rc);
      // Nothing more can be reaped reliably; the file's state for this range is unknown.
      break;
    }
    while (io_uring_peek_cqe(ring, &cqe) == 0 && cqe != nullptr) {
      const Request& r = requests[io_uring_cqe_get_data64(cqe)];
      int res = cqe->res;
      if (dir == Dir::write && faults_.fail_write_errno != 0) {
        res = -std::exchange(faults_.fail_write_errno, 0);
      } else if (dir == Dir::write && faults_.short_write) {
        faults_.short_write = false;
        res = static_cast<int>(r.len / 2);
      } else if (dir == Dir::read && faults_.fail_read_errno != 0) {
        res = -std::exchange(faults_.fail_read_errno, 0);
      }
      if (problem.empty()) {
        if (res < 0) {
          problem = errno_text(-res);
        } else if (static_cast<std::uint64_t>(res) < r.len) {
          problem = dir == Dir::write
                        ? "short write (" + std::to_string(res) + " of " + std::to_string(r.len) + " bytes at offset " +
                              std::to_string(offset + r.at) + ")"
                        : "short read (" + std::to_string(res) + " of " + std::to_string(r.len) + " bytes at offset " +
                              std::to_string(offset + r.at) + "): the file was truncated";
        }
      }
      io_uring_cqe_seen(ring, cqe);
      --in_flight;
    }
  }
  return problem;
}

void NvmeStore::write(std::size_t i, const void* src, std::uint64_t bytes) {
  if (i >= extents_.size()) throw InvalidArgument("NvmeStore::write: no subgroup " + std::to_string(i));
  Extent& e = extents_[i];
  if (bytes == 0 || bytes > e.capacity) {
    throw InvalidArgument("NvmeStore::write: subgroup " + std::to_string(i) + " holds 1 to " +
                          std::to_string(e.capacity) + " bytes, got " + std::to_string(bytes));
  }
  if (reinterpret_cast<std::uintptr_t>(src) % kAlign != 0) {
    throw InvalidArgument("NvmeStore::write: the buffer of subgroup " + std::to_string(i) +
                          " is not aligned to 4 KiB (direct I/O)");
  }
  const std::uint64_t checksum = XXH3_64bits(src, bytes);
  e.written = false;  // until this write is verified, the extent holds nothing trustworthy
  const auto t0 = std::chrono::steady_clock::now();
  const std::string why = transfer(Dir::write, e.offset, const_cast<void*>(src), round_up(bytes, kAlign));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard lock(counters_mutex_);
    counters_.write_s += took;
    if (why.empty()) counters_.bytes_written += bytes;
  }
  if (!why.empty()) fail("write", i, why);
  e.bytes = bytes;
  e.checksum = checksum;
  e.written = true;
}

void NvmeStore::read(std::size_t i, void* dst) {
  if (i >= extents_.size()) throw InvalidArgument("NvmeStore::read: no subgroup " + std::to_string(i));
  const Extent& e = extents_[i];
  if (!e.written) {
    throw InvalidArgument("NvmeStore::read: subgroup " + std::to_string(i) + " in " + file_.string() +
                          " holds no verified write");
  }
  if (reinterpret_cast<std::uintptr_t>(dst) % kAlign != 0) {
    throw InvalidArgument("NvmeStore::read: the buffer of subgroup " + std::to_string(i) +
                          " is not aligned to 4 KiB (direct I/O)");
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::string why = transfer(Dir::read, e.offset, dst, round_up(e.bytes, kAlign));
  {
    std::lock_guard lock(counters_mutex_);
    counters_.read_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (!why.empty()) fail("read", i, why);
  if (const std::uint64_t sum = XXH3_64bits(dst, e.bytes); sum != e.checksum) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "checksum mismatch (xxh3 %016llx, written %016llx): the extent is corrupt",
                  static_cast<unsigned long long>(sum), static_cast<unsigned long long>(e.checksum));
    fail("read", i, buf);
  }
  std::lock_guard lock(counters_mutex_);
  counters_.bytes_read += e.bytes;
}

std::uint64_t NvmeStore::read_beside(std::size_t i, void* dst) const {
  if (i >= extents_.size()) throw InvalidArgument("NvmeStore::read_beside: no subgroup " + std::to_string(i));
  const Extent& e = extents_[i];
  if (!e.written) {
    throw InvalidArgument("NvmeStore::read_beside: subgroup " + std::to_string(names_.empty() ? i : names_[i]) + " in " +
                          file_.string() + " holds no verified write");
  }
  if (reinterpret_cast<std::uintptr_t>(dst) % kAlign != 0) {
    throw InvalidArgument("NvmeStore::read_beside: the buffer is not aligned to 4 KiB (direct I/O)");
  }
  auto* out = static_cast<unsigned char*>(dst);
  const std::uint64_t total = round_up(e.bytes, kAlign);
  for (std::uint64_t done = 0; done < total;) {
    const std::size_t take = static_cast<std::size_t>(std::min<std::uint64_t>(config_.block_bytes, total - done));
    const ssize_t r = ::pread(fd_, out + done, take, static_cast<off_t>(e.offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) fail("read", i, r < 0 ? std::system_category().message(errno) : "short read (the file was truncated)");
    done += static_cast<std::uint64_t>(r);
  }
  if (const std::uint64_t sum = XXH3_64bits(dst, e.bytes); sum != e.checksum) {
    fail("read", i, "checksum mismatch: the extent is corrupt");
  }
  return e.checksum;
}

}  // namespace memtide::tiering
