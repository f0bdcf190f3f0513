#include "memtide/tiering/checkpoint/state_snapshot.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <system_error>

#if MEMTIDE_HAVE_NVME
#include <xxhash.h>
#endif

#include "memtide/core/error.hpp"
#include "memtide/core/files.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/log.hpp"
#include "subgroup_ranges.hpp"

namespace memtide::tiering {
namespace fs = std::filesystem;

namespace {

constexpr std::size_t kChunk = std::size_t{8} << 20;  // bytes per write call
constexpr std::size_t kChunksInFlight = 8;            // written back but not yet waited for
constexpr const char* kPartialTag = ".memtide-partial-";
constexpr const char* kStagingTag = ".memtide-parts-";
constexpr const char* kFormat = "memtide-state 2";  // 1: arrays back to back (not read any more)
constexpr std::size_t kBlock = 4096;                 // O_DIRECT's alignment of memory, offsets and sizes
constexpr const char* kPartsFormat = "memtide-parts 1";

constexpr const char* kExpected = ".parts-expected";  // in a staging folder: every part's name
constexpr const char* kClaim = ".commit";              // in a staging folder: made by the committer

// A subgroup's p, m, v laid out for O_DIRECT in one buffer of three regions: each array as far
// past a block boundary as its place in state.bin, so that its whole blocks go straight to disk.
// A region holds n floats and up to a block of skew, rounded up to whole blocks.
std::size_t placed_region_bytes(std::size_t n) { return (n * sizeof(float) + 2 * kBlock - 1) / kBlock * kBlock; }

std::string err_text(int err) { return files::errno_text(err); }

IoError io_error(const std::string& what, int err) { return IoError(what + ": " + err_text(err)); }

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// ---- the file calls of a save, in one place ----------------------------------------------------

void write_all(int fd, const void* data, std::size_t bytes, off_t offset, const fs::path& file) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, p, bytes, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw io_error("writing " + file.string() + " at byte " + std::to_string(offset), errno);
    if (n == 0) throw IoError("writing " + file.string() + " at byte " + std::to_string(offset) + ": no progress");
    p += n;
    bytes -= static_cast<std::size_t>(n);
    offset += n;
  }
}

// Written bytes leave the page cache soon after they are written: a save of a state that fills
// host memory must not fill it a second time with dirty pages. Write-back of each chunk starts at
// once (start_writeback); it is waited for and dropped a few chunks later (finish_writeback), so
// the disk always has the next ones queued.
void start_writeback(int fd, off_t offset, std::size_t bytes, const fs::path& file) {
  if (::sync_file_range(fd, offset, static_cast<off_t>(bytes), SYNC_FILE_RANGE_WRITE) != 0 && errno != ENOSYS &&
      errno != EINVAL) {
    throw io_error("writing back " + file.string(), errno);
  }
}

void finish_writeback(int fd, off_t offset, std::size_t bytes, const fs::path& file) {
  if (::sync_file_range(fd, offset, static_cast<off_t>(bytes),
                        SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER) != 0 &&
      errno != ENOSYS && errno != EINVAL) {
    throw io_error("writing back " + file.string(), errno);
  }
  (void)::posix_fadvise(fd, offset, static_cast<off_t>(bytes), POSIX_FADV_DONTNEED);
}

void sync_folder(const fs::path& folder) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw io_error("opening folder " + folder.string(), errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) throw io_error("syncing folder " + folder.string(), err);
}

void put_file(const fs::path& path, const std::string& bytes) {
  if (std::string why = files::write_atomically(path.string(), bytes); !why.empty()) throw IoError(why);
}

bool is_regular(const fs::path& file) {
  struct stat st {};
  return ::lstat(file.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_checkpoint(const fs::path& folder) {
  return is_regular(folder / StateSnapshot::kManifest) || is_regular(folder / StateSnapshot::kParts);
}

// What memtide will not replace: a link, a file, a folder that is not one of its checkpoints.
std::string refuse_target(const fs::path& target) {
  struct stat st {};
  if (::lstat(target.c_str(), &st) != 0) {
    return errno == ENOENT ? "" : "cannot inspect " + target.string() + ": " + err_text(errno);
  }
  if (S_ISLNK(st.st_mode)) return target.string() + " is a symbolic link; memtide saves only into a real folder";
  if (!S_ISDIR(st.st_mode)) return target.string() + " exists and is not a folder";
  if (!is_checkpoint(target)) {
    return target.string() + " is a folder that is not a memtide checkpoint (no " + StateSnapshot::kManifest +
           "); memtide replaces only its own checkpoints";
  }
  return "";
}

fs::path parent_of(const fs::path& target) {
  const fs::path parent = target.parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

std::string hidden_prefix(const fs::path& target, const char* tag) {
  std::string s = ".";  // appended, not `"." + name`: GCC 12's -Wrestrict misfires on that at -O3
  s.append(target.filename().string());
  s.append(tag);
  return s;
}

std::string partial_prefix(const fs::path& target) { return hidden_prefix(target, kPartialTag); }
std::string staging_prefix(const fs::path& target) { return hidden_prefix(target, kStagingTag); }

// Staging folders of earlier saves in parts beside `target`, other than `keep`. Part 0 removes
// them when a new save starts: every process has finished its previous save by then (the front
// end agrees on the new id among them after each waited for its own), so what is left is dead.
void remove_other_staging(const fs::path& target, const std::string& keep) {
  const std::string prefix = staging_prefix(target);
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(parent_of(target), ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0 || name == prefix + keep) continue;
    std::error_code rm;
    fs::remove_all(e.path(), rm);
    MEMTIDE_LOG(warn, "checkpoint: removed " + e.path().string() + ", left by a save in parts that did not complete" +
                          (rm ? "; could not remove all of it: " + rm.message() : ""));
  }
}

// Moves the folder `from` onto `target`: exchanged with a previous checkpoint there in one step
// (which is then removed), or renamed when there is none.
// Puts the folder `from` at `target`, replacing a previous checkpoint there. Returns where the
// previous one now is ("" if there was none), for the caller to remove once the save is counted
// committed: removing gigabytes of extents is cleanup, not part of the save.
fs::path put_in_place(const fs::path& from, const fs::path& target) {
  if (std::string why = refuse_target(target); !why.empty()) throw IoError("checkpoint: " + why);
  struct stat st {};
  if (::lstat(target.c_str(), &st) == 0) {
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
      sync_folder(parent_of(target));
      return from;  // the previous checkpoint, now at `from`
    }
    if (errno != EINVAL && errno != ENOSYS) throw io_error("replacing " + target.string(), errno);
    // A file system without the exchange: the previous one moves aside first, so one complete
    // checkpoint is always there under some name.
    const fs::path aside = parent_of(target) / (partial_prefix(target) + std::to_string(::getpid()) + "-previous");
    if (::rename(target.c_str(), aside.c_str()) != 0) throw io_error("moving " + target.string() + " aside", errno);
    if (::rename(from.c_str(), target.c_str()) != 0) {
      const int err = errno;
      (void)::rename(aside.c_str(), target.c_str());
      throw io_error("renaming " + from.string() + " to " + target.string(), err);
    }
    sync_folder(parent_of(target));
    return aside;
  }
  if (::rename(from.c_str(), target.c_str()) != 0) {
    throw io_error("renaming " + from.string() + " to " + target.string(), errno);
  }
  sync_folder(parent_of(target));
  return {};
}

void remove_previous(const fs::path& previous) {
  if (previous.empty()) return;
  std::error_code ec;
  fs::remove_all(previous, ec);
  if (ec) MEMTIDE_LOG(warn, "checkpoint: could not remove the previous checkpoint at " + previous.string() + ": " + ec.message());
}

std::vector<std::string> read_lines(const fs::path& file) {
  std::ifstream in(file);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Why there is no checkpoint at `folder`, with what a save that did not complete left beside it.
IoError no_checkpoint(const fs::path& folder) {
  std::string why = "checkpoint: no checkpoint at " + folder.string();
  const fs::path target = fs::absolute(folder).lexically_normal();
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(parent_of(target), ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(partial_prefix(target), 0) == 0) {
      why += " (" + e.path().string() + " is a save that did not complete)";
      break;
    }
    if (name.rfind(staging_prefix(target), 0) == 0) {
      std::string missing;
      for (const std::string& part : read_lines(e.path() / kExpected)) {
        if (!part.empty() && !is_regular(e.path() / part / StateSnapshot::kManifest)) missing += (missing.empty() ? "" : ", ") + part;
      }
      why += " (" + e.path().string() + " is a save in parts that did not complete" +
             (missing.empty() ? std::string(")") : "; missing: " + missing + ")");
      break;
    }
  }
  return IoError(why);
}

bool is_plain_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.front() != '.' && name.find('/') == std::string::npos &&
         name.find('\n') == std::string::npos;
}

// Partial folders beside `target` whose save died with its process: removed, and said so.
void remove_dead_partials(const fs::path& target) {
  const std::string prefix = partial_prefix(target);
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(parent_of(target), ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
    if (pid <= 0 || pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    std::error_code rm;
    fs::remove_all(e.path(), rm);
    MEMTIDE_LOG(warn, "checkpoint: removed " + e.path().string() + ", left by an interrupted save (process " +
                          std::to_string(pid) + " is gone)" + (rm ? "; could not remove all of it: " + rm.message() : ""));
  }
}

std::string hex64(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

// ---- the save ----------------------------------------------------------------------------------

StateSnapshot::StateSnapshot(Config config) : config_(std::move(config)) {}

std::uint64_t StateSnapshot::subgroup_bytes(std::size_t i) const {
  return 3 * sizeof(float) * static_cast<std::uint64_t>(config_.subgroups[i].second - config_.subgroups[i].first);
}

std::shared_ptr<StateSnapshot> StateSnapshot::start(Config config) {
#if !MEMTIDE_HAVE_NVME
  (void)config;
  throw InvalidArgument("checkpoint: memtide was built without xxHash (libxxhash-dev), which saves need");
#else
  if (config.target.empty()) throw InvalidArgument("checkpoint: the target path is empty");
  if (config.n > 0 && (config.param == nullptr || config.exp_avg == nullptr || config.exp_avg_sq == nullptr)) {
    throw InvalidArgument("checkpoint: the state arrays must not be null");
  }
  const std::size_t largest = detail::check_subgroups(config.subgroups, config.n, "checkpoint");
  if (!config.elsewhere.empty() && (config.elsewhere.size() != config.subgroups.size() || !config.read_elsewhere)) {
    throw InvalidArgument("checkpoint: subgroups kept elsewhere need one flag per subgroup and a reader");
  }
  if (config.buffer_bytes == 0) config.buffer_bytes = 2 * 3 * sizeof(float) * static_cast<std::uint64_t>(largest);
  if (!config.buffers) config.buffers = std::make_shared<CopyBuffers>();
  config.target = fs::absolute(config.target).lexically_normal();
  if (config.target.filename().empty()) config.target = config.target.parent_path();
  const fs::path parent = parent_of(config.target);
  std::error_code ec;
  if (!fs::is_directory(parent, ec)) throw IoError("checkpoint: cannot save to " + config.target.string() + ": folder " + parent.string() + " does not exist");
  if (std::string why = refuse_target(config.target); !why.empty()) throw InvalidArgument("checkpoint: " + why);
  fs::path destination = config.target, staging;
  if (config.part) {
    const Config::Part& part = *config.part;
    const bool id_ok = !part.id.empty() && part.id.size() <= 64 &&
                       std::all_of(part.id.begin(), part.id.end(), [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) != 0; });
    if (!id_ok) throw InvalidArgument("checkpoint: a part's id must be 1 to 64 letters or digits, got '" + part.id + "'");
    if (part.index >= part.names.size()) {
      throw InvalidArgument("checkpoint: part " + std::to_string(part.index) + " of " + std::to_string(part.names.size()) + " parts");
    }
    for (std::size_t i = 0; i < part.names.size(); ++i) {
      if (!is_plain_name(part.names[i])) throw InvalidArgument("checkpoint: part name '" + part.names[i] + "' is not a plain folder name");
      if (std::find(part.names.begin(), part.names.begin() + static_cast<std::ptrdiff_t>(i), part.names[i]) !=
          part.names.begin() + static_cast<std::ptrdiff_t>(i)) {
        throw InvalidArgument("checkpoint: part name '" + part.names[i] + "' is given twice");
      }
    }
    staging = parent / (staging_prefix(config.target) + part.id);
    if (part.index == 0) remove_other_staging(config.target, part.id);
    if (::mkdir(staging.c_str(), 0700) != 0) {
      struct stat st {};
      if (errno != EEXIST || ::lstat(staging.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
        throw io_error("checkpoint: cannot make " + staging.string(), errno);
      }
    }
    std::string expected;
    for (const std::string& name : part.names) expected += name + "\n";
    put_file(staging / kExpected, expected);  // every part writes the same: what a reader says is missing
    destination = staging / part.names[part.index];
    if (std::string why = refuse_target(destination); !why.empty()) throw InvalidArgument("checkpoint: " + why);
  }
  remove_dead_partials(destination);

  std::shared_ptr<StateSnapshot> s(new StateSnapshot(std::move(config)));
  const Config& c = s->config_;
  s->destination_ = destination;
  s->staging_ = staging;
  std::random_device rd;
  s->partial_ = parent_of(destination) / (partial_prefix(destination) + std::to_string(::getpid()) + "-" +
                                          hex64((std::uint64_t{rd()} << 32) ^ rd()).substr(8));
  if (::mkdir(s->partial_.c_str(), 0700) != 0) throw io_error("checkpoint: cannot make " + s->partial_.string(), errno);
  try {
    const fs::path data = s->partial_ / kData;
    s->fd_ = ::open(data.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (s->fd_ < 0) throw io_error("checkpoint: cannot create " + data.string(), errno);
    const std::uint64_t total = 3 * sizeof(float) * static_cast<std::uint64_t>(c.n);
    const std::uint64_t file_bytes = StateSnapshot::file_bytes(c.n);
    const float* arrays[3] = {c.param, c.exp_avg, c.exp_avg_sq};
    for (std::size_t k = 0; k < 3; ++k) {
      s->offsets_[k] = array_offset(c.n, k, reinterpret_cast<std::uintptr_t>(arrays[k]));
    }
    if (file_bytes > 0) {
      if (const int err = ::posix_fallocate(s->fd_, 0, static_cast<off_t>(file_bytes)); err != 0) {
        throw io_error("checkpoint: cannot reserve " + format_bytes(file_bytes) + " for " + data.string(), err);
      }
    }
    // Where the file system takes it (not tmpfs, say): whole blocks go straight from the state.
    s->direct_fd_ = ::open(data.c_str(), O_WRONLY | O_DIRECT | O_NOFOLLOW | O_CLOEXEC);
    s->stage_.assign(c.subgroups.size(), Stage::pending);
    s->copies_.resize(c.subgroups.size());
    s->checksums_.assign(c.subgroups.size(), 0);
    s->progress_.bytes_total = total;
    s->progress_.buffer_bound = c.buffer_bytes;
    s->started_ = std::chrono::steady_clock::now();
    const std::string part = c.part ? " (part " + std::to_string(c.part->index + 1) + " of " + std::to_string(c.part->names.size()) + ")" : "";
    MEMTIDE_LOG(info, "checkpoint: saving " + format_bytes(total) + " of optimizer state to " + c.target.string() + part +
                          " while training goes on (copy-on-write buffer up to " + format_bytes(c.buffer_bytes) + ")");
    s->writer_ = std::thread([raw = s.get()] { raw->run(); });
  } catch (...) {
    s->remove_partial();
    throw;
  }
  return s;
#endif
}

StateSnapshot::~StateSnapshot() {
  cancel();
  if (writer_.joinable()) writer_.join();
  if (fd_ >= 0) ::close(fd_);
  if (direct_fd_ >= 0) ::close(direct_fd_);
}

void StateSnapshot::cancel() {
  std::lock_guard lock(mutex_);
  if (progress_.done) return;
  stop_ = true;
  changed_.notify_all();
}

void StateSnapshot::inject_write_error(int err) {
  std::lock_guard lock(mutex_);
  inject_errno_ = err;
}


unsigned char* StateSnapshot::placed(unsigned char* base, std::size_t i, std::size_t k) const noexcept {
  const auto [first, end] = config_.subgroups[i];
  return base + k * placed_region_bytes(end - first) + (offsets_[k] + first * sizeof(float)) % kBlock;
}

void StateSnapshot::hold(std::size_t bytes) {
  held_bytes_ += bytes;
  peak_held_bytes_ = std::max(peak_held_bytes_, held_bytes_);
}

StateSnapshot::Copy StateSnapshot::copy_out(std::size_t i, const float* p, const float* m, const float* v,
                                            std::uint64_t from) const {
  const auto [first, end] = config_.subgroups[i];
  const std::size_t n = end - first;
  const std::uint64_t array_bytes = n * sizeof(float);
  Copy copy;
  // Each array's copy placed as in the file, so that it too goes with O_DIRECT. Only the bytes
  // from `from` on are copied; a new region is faulted in whole (CopyBuffers::take), since it is
  // kept for the next copies, mostly of whole subgroups.
  copy.memory = config_.buffers->take(3 * placed_region_bytes(n));
  if (!copy.memory) return copy;
  copy.from = from;
  const float* source[3] = {p, m, v};
  const float** to[3] = {&copy.p, &copy.m, &copy.v};
  for (std::size_t k = 0; k < 3; ++k) {
    unsigned char* at = placed(copy.memory.data(), i, k);
    *to[k] = reinterpret_cast<const float*>(at);
    const std::uint64_t lo = k * array_bytes;
    if (from >= lo + array_bytes) continue;
    const std::uint64_t skip = from > lo ? from - lo : 0;
    std::memcpy(at + skip, reinterpret_cast<const unsigned char*>(source[k]) + skip, array_bytes - skip);
  }
  return copy;
}

void StateSnapshot::protect(std::size_t i, const float* p, const float* m, const float* v) {
  std::unique_lock lock(mutex_);
  if (i >= stage_.size()) return;
  const auto t0 = std::chrono::steady_clock::now();
  bool waited = false;
  double copying_s = 0;  // of the time in here: copying, not waiting
  for (;;) {
    if (progress_.done || stop_) break;  // over: nothing left to keep
    const Stage s = stage_[i];
    if (s == Stage::copied || s == Stage::writing_copy || s == Stage::written) break;
    const bool kept_elsewhere = !config_.elsewhere.empty() && config_.elsewhere[i];
    // What can be copied aside: a pending subgroup whose state is at hand (one kept elsewhere,
    // on NVMe, and not handed over is the writer's to read), or the rest of one the writer is
    // writing from the arrays (one read from elsewhere is waited for: the read must not see the
    // step's write-back).
    std::uint64_t from = 0;
    bool copy = false;
    if (s == Stage::pending) {
      copy = p != nullptr || !kept_elsewhere;
    } else if (s == Stage::writing && !kept_elsewhere) {
      copy = true;
      from = write_at_;
    }
    const std::uint64_t bytes = subgroup_bytes(i) - from;
    if (copy && buffer_used_ + bytes <= config_.buffer_bytes) {
      if (p == nullptr) {
        const std::size_t first = config_.subgroups[i].first;
        p = config_.param + first;
        m = config_.exp_avg + first;
        v = config_.exp_avg_sq + first;
      }
      const bool rest = s == Stage::writing;
      stage_[i] = rest ? Stage::copying_rest : Stage::copying;
      buffer_used_ += bytes;
      progress_.peak_buffer_bytes = std::max(progress_.peak_buffer_bytes, buffer_used_);
      lock.unlock();
      const auto copy_t0 = std::chrono::steady_clock::now();
      Copy c = copy_out(i, p, m, v, from);
      const double copy_s = seconds_since(copy_t0);
      lock.lock();
      progress_.copy_s += copy_s;
      copying_s += copy_s;
      if (progress_.done || stop_) break;  // the save ended meanwhile (its end let the buffer go)
      if (!c.memory) {
        // No memory for the copy: wait for the writer instead.
        buffer_used_ -= bytes;
        if (stage_[i] == Stage::copying) stage_[i] = Stage::pending;
        if (stage_[i] == Stage::copying_rest) stage_[i] = Stage::writing;
      } else if (stage_[i] == Stage::copying || stage_[i] == Stage::copying_rest) {
        c.bytes = bytes;
        hold(c.memory.bytes());
        copies_[i] = std::move(c);
        progress_.copied_bytes += bytes;
        stage_[i] = rest ? Stage::copied_rest : Stage::copied;
        changed_.notify_all();
        if (!rest) break;
        continue;  // the writer takes the copy at its next chunk: waited for below
      } else {
        buffer_used_ -= bytes;  // the writer finished the subgroup meanwhile
        config_.buffers->give(std::move(c.memory));
        continue;
      }
    }
    if (stage_[i] == Stage::pending) {
      if (std::find(urgent_.begin(), urgent_.end(), i) == urgent_.end()) urgent_.push_back(i);
      changed_.notify_all();
    }
    waited = true;
    changed_.wait(lock);
  }
  if (waited) progress_.waited_s += std::max(0.0, seconds_since(t0) - copying_s);
}

void StateSnapshot::run() {
  const std::size_t count = stage_.size();
  std::string error;
  try {
    std::size_t logged_quarter = 0;
    for (;;) {
      std::unique_lock lock(mutex_);
      if (stop_) throw IoError("cancelled");
      std::size_t i = count;
      bool from_copy = false;
      while (!urgent_.empty() && i == count) {
        if (stage_[urgent_.front()] == Stage::pending) i = urgent_.front();
        urgent_.erase(urgent_.begin());
      }
      for (std::size_t j = 0; i == count && j < count; ++j) {  // copies first: they free the buffer
        if (stage_[j] == Stage::copied) {
          i = j;
          from_copy = true;
        }
      }
      // From the last subgroup down: a step updates them from the first up, so the ones it
      // reaches first are those it can copy aside, and it meets the writer late, if at all.
      while (i == count && cursor_ < count && stage_[count - 1 - cursor_] != Stage::pending) ++cursor_;
      if (i == count && cursor_ < count) i = count - 1 - cursor_;
      if (i == count) {
        if (std::find(stage_.begin(), stage_.end(), Stage::copying) != stage_.end()) {
          changed_.wait(lock);
          continue;
        }
        break;  // every subgroup written
      }
      stage_[i] = from_copy ? Stage::writing_copy : Stage::writing;
      write_at_ = 0;
      lock.unlock();
      const auto [first, end] = config_.subgroups[i];
      const std::size_t n = end - first;
      if (from_copy) {
        const Copy& c = copies_[i];
        write_subgroup(i, c.p, c.m, c.v, false);
      } else if (!config_.elsewhere.empty() && config_.elsewhere[i]) {
        // From the spill file: read whole and checked ([p | m | v] from a block boundary), then
        // each array moved to its place's skew, as a copy is laid out, and written as any other
        // subgroup, O_DIRECT included. The moves go from the last array down: each lands past
        // where it was read and past the arrays still to move.
        if (!read_buffer_) {
          std::size_t largest = 0;
          for (std::size_t j = 0; j < count; ++j) {
            if (config_.elsewhere[j]) largest = std::max(largest, config_.subgroups[j].second - config_.subgroups[j].first);
          }
          read_buffer_ = config_.buffers->take(3 * placed_region_bytes(largest));
          if (!read_buffer_) throw std::bad_alloc();
          std::lock_guard held(mutex_);
          hold(read_buffer_.bytes());
        }
        unsigned char* base = read_buffer_.data();
        const std::uint64_t expect = config_.read_elsewhere(i, base);
        const float* arrays[3] = {};
        for (std::size_t k = 3; k-- > 0;) {
          unsigned char* at = placed(base, i, k);
          std::memmove(at, base + k * n * sizeof(float), n * sizeof(float));
          arrays[k] = reinterpret_cast<const float*>(at);
        }
        write_subgroup(i, arrays[0], arrays[1], arrays[2], false);
        std::lock_guard check(mutex_);
        if (checksums_[i] != expect) {
          throw IoError("checkpoint: subgroup " + std::to_string(i) + " changed while it was read from where it is kept");
        }
      } else {
        write_subgroup(i, config_.param + first, config_.exp_avg + first, config_.exp_avg_sq + first, true);
      }
      lock.lock();
      if (copies_[i].memory) {  // the subgroup's copy, or a copy of its rest the writer went on from
        buffer_used_ -= copies_[i].bytes;
        held_bytes_ -= copies_[i].memory.bytes();
        config_.buffers->give(std::move(copies_[i].memory));
        copies_[i] = Copy{};
      }
      stage_[i] = Stage::written;
      progress_.bytes_written += subgroup_bytes(i);
      changed_.notify_all();
      const std::size_t quarter = progress_.bytes_total ? 4 * progress_.bytes_written / progress_.bytes_total : 4;
      if (quarter > logged_quarter && quarter < 4) {
        logged_quarter = quarter;
        const double s = seconds_since(started_);
        MEMTIDE_LOG(info, "checkpoint: " + std::to_string(25 * quarter) + "% of " + config_.target.string() + " (" +
                              format_bytes(progress_.bytes_written) + " in " + std::to_string(s) + " s); training waited " +
                              std::to_string(progress_.waited_s) + " s so far");
      }
    }
    commit();
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty()) remove_partial();
  std::lock_guard lock(mutex_);
  progress_.elapsed_s = seconds_since(started_);
  if (error.empty()) {
    progress_.committed = true;
    const double rate = progress_.write_s > 0 ? static_cast<double>(progress_.bytes_total) / progress_.write_s : 0;
    MEMTIDE_LOG(info, "checkpoint: saved " + format_bytes(progress_.bytes_total) + " to " + config_.target.string() +
                          " in " + std::to_string(progress_.elapsed_s) + " s (" + format_bytes(static_cast<std::uint64_t>(rate)) +
                          "/s while writing); training waited " + std::to_string(progress_.waited_s) +
                          " s; copy-on-write buffer peak " + format_bytes(progress_.peak_buffer_bytes));
  } else if (stop_ && error == "cancelled") {
    progress_.error = "cancelled";
    MEMTIDE_LOG(info, "checkpoint: the save to " + config_.target.string() + " was cancelled; it is left as it was");
  } else {
    progress_.error = error;
    MEMTIDE_LOG(error, "checkpoint: the save to " + config_.target.string() + " failed (" + error +
                           "); the target is left as it was");
  }
  progress_.done = true;
  // The copies of a failed save are not needed any more; the memory is kept for the next save.
  for (auto& c : copies_) {
    config_.buffers->give(std::move(c.memory));
    c = Copy{};
  }
  buffer_used_ = 0;
  config_.buffers->give(std::move(read_buffer_));
  config_.buffers->idle(peak_held_bytes_);  // what this save needed at most, for the next one
  changed_.notify_all();
}

void StateSnapshot::write_subgroup(std::size_t i, const float* p, const float* m, const float* v, bool live) {
#if MEMTIDE_HAVE_NVME
  const auto t0 = std::chrono::steady_clock::now();
  const auto [first, end] = config_.subgroups[i];
  const std::size_t n = end - first;
  const fs::path data = partial_ / kData;
  XXH3_state_t* hash = XXH3_createState();
  if (hash == nullptr) throw std::bad_alloc();
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> owner(hash, &XXH3_freeState);
  XXH3_64bits_reset(hash);
  const float* arrays[3] = {p, m, v};
  const std::size_t bytes = n * sizeof(float);
  for (std::size_t k = 0; k < 3; ++k) {
    const off_t offset = static_cast<off_t>(offsets_[k] + first * sizeof(float));
    for (std::size_t done = 0; done < bytes; done += kChunk) {
      const std::size_t take = std::min(kChunk, bytes - done);
      if (live && config_.before_chunk) config_.before_chunk(i, k * bytes + done);
      {
        std::lock_guard lock(mutex_);
        if (stop_) throw IoError("cancelled");
        if (inject_errno_ != 0) {
          const int err = std::exchange(inject_errno_, 0);
          throw io_error("writing " + data.string() + " at byte " + std::to_string(offset + done), err);
        }
        if (live && stage_[i] == Stage::copied_rest && copies_[i].from <= k * bytes + done) {
          // The step reached this subgroup and copied what is not written yet: the rest comes
          // from that copy (the same bytes), and the step may change the arrays now.
          const Copy& c = copies_[i];
          arrays[0] = c.p;
          arrays[1] = c.m;
          arrays[2] = c.v;
          live = false;
          stage_[i] = Stage::writing_copy;
          changed_.notify_all();
        } else if (live) {
          write_at_ = k * bytes + done;
        }
      }
      const auto* src = reinterpret_cast<const unsigned char*>(arrays[k]);
      write_piece(src + done, take, offset + static_cast<off_t>(done));
      XXH3_64bits_update(hash, src + done, take);
    }
  }
  const std::uint64_t sum = XXH3_64bits_digest(hash);
  std::lock_guard lock(mutex_);
  checksums_[i] = sum;
  progress_.write_s += seconds_since(t0);
#else
  (void)i, (void)p, (void)m, (void)v;
#endif
}

// Whole blocks with O_DIRECT when the memory lies as the file does (the same offset from a block
// boundary), the edges through the page cache.
void StateSnapshot::write_piece(const unsigned char* src, std::size_t bytes, off_t at) {
  const std::size_t misalign = static_cast<std::size_t>(at) % kBlock;
  if (direct_fd_ < 0 || reinterpret_cast<std::uintptr_t>(src) % kBlock != misalign) {
    write_buffered(src, bytes, at);
    return;
  }
  const std::size_t head = std::min(bytes, (kBlock - misalign) % kBlock);
  const std::size_t body = (bytes - head) / kBlock * kBlock;
  if (head > 0) write_buffered(src, head, at);
  if (body > 0) {
    write_all(direct_fd_, src + head, body, at + static_cast<off_t>(head), partial_ / kData);
    std::lock_guard lock(mutex_);
    progress_.direct_bytes += body;
  }
  if (bytes > head + body) write_buffered(src + head + body, bytes - head - body, at + static_cast<off_t>(head + body));
}

void StateSnapshot::write_buffered(const unsigned char* src, std::size_t bytes, off_t at) {
  const fs::path data = partial_ / kData;
  write_all(fd_, src, bytes, at, data);
  // The disk gets each piece at once and has a few queued; dirty pages stay a few pieces.
  start_writeback(fd_, at, bytes, data);
  in_flight_.emplace_back(at, bytes);
  while (in_flight_.size() > kChunksInFlight) {
    finish_writeback(fd_, in_flight_.front().first, in_flight_.front().second, data);
    in_flight_.erase(in_flight_.begin());
  }
}

void StateSnapshot::commit() {
  const fs::path data = partial_ / kData;
  if (::fdatasync(fd_) != 0) throw io_error("syncing " + data.string(), errno);
  for (const auto& [offset, bytes] : in_flight_) (void)::posix_fadvise(fd_, offset, static_cast<off_t>(bytes), POSIX_FADV_DONTNEED);
  in_flight_.clear();
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) throw io_error("closing " + data.string(), errno);
  if (direct_fd_ >= 0) ::close(std::exchange(direct_fd_, -1));  // its writes are on the disk: fdatasync flushed the device
  put_file(partial_ / kMeta, config_.meta);
  // The manifest last: a folder with one is whole.
  std::ostringstream m;
  m << kFormat << "\nparams " << config_.n << "\narrays " << offsets_[0] << " " << offsets_[1] << " " << offsets_[2]
    << "\nbytes " << file_bytes(config_.n) << "\nsubgroups " << config_.subgroups.size() << "\n";
  for (std::size_t i = 0; i < config_.subgroups.size(); ++i) {
    m << config_.subgroups[i].first << " " << (config_.subgroups[i].second - config_.subgroups[i].first) << " "
      << hex64(checksums_[i]) << "\n";
  }
  m << "end\n";
  put_file(partial_ / kManifest, m.str());
  sync_folder(partial_);
  const fs::path previous = put_in_place(partial_, destination_);
  partial_.clear();
  committed_now();  // a part: in the staging folder (the committer's commit_parts() records again)
  remove_previous(previous);
  if (config_.part) commit_parts();
}

void StateSnapshot::committed_now() {
  std::lock_guard lock(mutex_);
  progress_.committed_s = seconds_since(started_);
}

// Every part is in the staging folder once the last one is: whichever process sees that claims
// the commit (an exclusive create, so one does when two finish together), writes the list of
// parts last, and moves the staging folder onto the target.
void StateSnapshot::commit_parts() {
  const Config::Part& part = *config_.part;
  for (const std::string& name : part.names) {
    if (!is_regular(staging_ / name / kManifest)) return;  // the process of that part commits
  }
  const fs::path claim = staging_ / kClaim;
  const int fd = ::open(claim.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno == EEXIST) return;  // another part's process is committing
    throw io_error("checkpoint: cannot claim the commit of " + staging_.string(), errno);
  }
  ::close(fd);
  std::ostringstream m;
  m << kPartsFormat << "\nid " << part.id << "\nparts " << part.names.size() << "\n";
  for (const std::string& name : part.names) m << name << "\n";
  m << "end\n";
  put_file(staging_ / kParts, m.str());
  sync_folder(staging_);
  const fs::path previous = put_in_place(staging_, config_.target);
  committed_now();
  remove_previous(previous);
  MEMTIDE_LOG(info, "checkpoint: " + config_.target.string() + " holds all " + std::to_string(part.names.size()) + " parts");
}

void StateSnapshot::remove_partial() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  if (direct_fd_ >= 0) ::close(std::exchange(direct_fd_, -1));
  if (partial_.empty()) return;
  std::error_code ec;
  fs::remove_all(partial_, ec);
  if (ec) MEMTIDE_LOG(warn, "checkpoint: could not remove " + partial_.string() + ": " + ec.message());
  partial_.clear();
}

void StateSnapshot::wait() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return progress_.done; });
  if (!progress_.committed) {
    throw IoError("checkpoint: the save to " + config_.target.string() + " did not complete: " + progress_.error);
  }
}

SnapshotProgress StateSnapshot::progress() const {
  std::lock_guard lock(mutex_);
  SnapshotProgress p = progress_;
  if (!p.done) p.elapsed_s = seconds_since(started_);
  return p;
}

// ---- reading -----------------------------------------------------------------------------------

SnapshotManifest StateSnapshot::read_manifest(const fs::path& folder, bool verify) {
  struct stat st {};
  if (::stat(folder.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw no_checkpoint(folder);
  const fs::path manifest = folder / kManifest, data = folder / kData, meta = folder / kMeta;
  std::ifstream in(manifest);
  if (!in && is_regular(folder / kParts)) {
    throw IoError("checkpoint: " + folder.string() + " is a checkpoint saved in parts (" + kParts + "); each part is a folder in it");
  }
  if (!in) {
    throw IoError("checkpoint: " + folder.string() + " is not a complete memtide checkpoint: it has no " + kManifest +
                  " (a save that did not complete, or another folder)");
  }
  auto bad = [&](const std::string& what) {
    return IoError("checkpoint: " + manifest.string() + " is not a memtide manifest: " + what);
  };
  std::string line;
  if (std::getline(in, line) && line == "memtide-state 1") {
    throw bad("it is format 1, written by an earlier memtide, which this one does not read");
  }
  if (line != kFormat) throw bad("it does not start with '" + std::string(kFormat) + "'");
  SnapshotManifest out;
  std::string word;
  std::size_t count = 0;
  if (!(in >> word >> out.params) || word != "params") throw bad("no 'params' line");
  if (!(in >> word >> out.offsets[0] >> out.offsets[1] >> out.offsets[2]) || word != "arrays") throw bad("no 'arrays' line");
  if (!(in >> word >> out.file_bytes) || word != "bytes") throw bad("no 'bytes' line");
  for (std::size_t k = 0; k < 3; ++k) {
    const std::uint64_t end = out.offsets[k] + 4 * out.params;
    if (out.offsets[k] % 4 != 0 || end > out.file_bytes || end < out.offsets[k] || (k < 2 && end > out.offsets[k + 1])) {
      throw bad("array " + std::to_string(k) + " does not lie inside the file, apart from the others");
    }
  }
  if (!(in >> word >> count) || word != "subgroups") throw bad("no 'subgroups' line");
  if (count > out.params + 1) throw bad("more subgroups than params");
  std::size_t expect = 0;
  for (std::size_t i = 0; i < count; ++i) {
    std::size_t first = 0, n = 0;
    std::string sum;
    if (!(in >> first >> n >> sum) || sum.size() != 16) throw bad("subgroup line " + std::to_string(i) + " is malformed");
    if (first != expect || n == 0 || n > out.params - first) throw bad("subgroup " + std::to_string(i) + " does not follow the one before");
    out.subgroups.emplace_back(first, first + n);
    out.checksums.push_back(std::stoull(sum, nullptr, 16));
    expect = first + n;
  }
  if (expect != out.params) throw bad("the subgroups cover " + std::to_string(expect) + " of " + std::to_string(out.params) + " params");
  if (!(in >> word) || word != "end") throw bad("no 'end' line (cut short?)");
  if (::stat(meta.c_str(), &st) != 0) throw IoError("checkpoint: " + folder.string() + " has no " + kMeta);
  if (::stat(data.c_str(), &st) != 0) throw IoError("checkpoint: " + folder.string() + " has no " + kData);
  const std::uint64_t want = out.file_bytes;
  if (static_cast<std::uint64_t>(st.st_size) != want) {
    throw IoError("checkpoint: " + data.string() + " is " + std::to_string(st.st_size) + " bytes, the manifest says " +
                  std::to_string(want) + " (truncated or replaced)");
  }
  if (!verify) return out;
#if MEMTIDE_HAVE_NVME
  const int fd = ::open(data.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw io_error("checkpoint: cannot open " + data.string(), errno);
  std::unique_ptr<unsigned char[]> buf(new unsigned char[kChunk]);
  XXH3_state_t* hash = XXH3_createState();
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> owner(hash, &XXH3_freeState);
  try {
    for (std::size_t i = 0; i < count; ++i) {
      XXH3_64bits_reset(hash);
      const auto [first, end] = out.subgroups[i];
      for (std::size_t k = 0; k < 3; ++k) {
        const std::size_t bytes = (end - first) * sizeof(float);
        const off_t offset = static_cast<off_t>(out.offsets[k] + first * sizeof(float));
        for (std::size_t done = 0; done < bytes;) {
          const ssize_t r = ::pread(fd, buf.get(), std::min(kChunk, bytes - done), offset + static_cast<off_t>(done));
          if (r < 0 && errno == EINTR) continue;
          if (r <= 0) throw io_error("checkpoint: reading " + data.string(), r < 0 ? errno : EIO);
          XXH3_64bits_update(hash, buf.get(), static_cast<std::size_t>(r));
          done += static_cast<std::size_t>(r);
        }
      }
      if (const std::uint64_t sum = XXH3_64bits_digest(hash); sum != out.checksums[i]) {
        throw IoError("checkpoint: " + data.string() + " is corrupt: subgroup " + std::to_string(i) + " (params " +
                      std::to_string(first) + " to " + std::to_string(end) + ") has checksum " + hex64(sum) +
                      ", the manifest says " + hex64(out.checksums[i]));
      }
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
#endif
  return out;
}

std::vector<std::string> StateSnapshot::read_parts(const fs::path& folder) {
  struct stat st {};
  if (::stat(folder.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw no_checkpoint(folder);
  if (is_regular(folder / kManifest)) return {};
  const fs::path file = folder / kParts;
  if (!is_regular(file)) {
    throw IoError("checkpoint: " + folder.string() + " is not a complete memtide checkpoint: it has neither " + kManifest +
                  " nor " + kParts + " (a save that did not complete, or another folder)");
  }
  const std::vector<std::string> lines = read_lines(file);
  auto bad = [&](const std::string& what) {
    return IoError("checkpoint: " + file.string() + " is not a memtide parts list: " + what);
  };
  if (lines.size() < 4 || lines[0] != kPartsFormat) throw bad("it does not start with '" + std::string(kPartsFormat) + "'");
  if (lines[1].rfind("id ", 0) != 0) throw bad("no 'id' line");
  std::size_t count = 0;
  if (std::sscanf(lines[2].c_str(), "parts %zu", &count) != 1 || count == 0 || count != lines.size() - 4) {
    throw bad("its 'parts' line does not count the names that follow");
  }
  if (lines.back() != "end") throw bad("no 'end' line (cut short?)");
  std::vector<std::string> parts(lines.begin() + 3, lines.end() - 1);
  for (const std::string& part : parts) {
    if (!is_plain_name(part)) throw bad("'" + part + "' is not a plain folder name");
    if (!is_regular(folder / part / kManifest)) {
      throw IoError("checkpoint: " + folder.string() + " is missing its part " + part + " (no " + (folder / part / kManifest).string() + ")");
    }
  }
  return parts;
}

}  // namespace memtide::tiering
