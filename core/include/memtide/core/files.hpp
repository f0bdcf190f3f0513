#pragma once
/// @file
/// The one home of how memtide creates files (snapshots, logs, traces), so none can be turned
/// against the user: a file is written under a fresh, unpredictable name in the target's folder
/// (created with O_EXCL, never through a symlink), synced, then renamed over the target; a target
/// that exists and is not a regular file (a symlink, a device, a folder) is refused; logs are
/// opened for appending without following a symlink. Files are 0600 unless the caller says
/// otherwise.
///
/// Header-only and free of global state on purpose: the LD_PRELOAD observer uses it too and must
/// not link memtide's runtime. Functions return an error text ("" on success) instead of
/// throwing, for the same reason.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace memtide::files {

inline std::string errno_text(int err) {
  char buf[128];
  // The GNU variant returns the message (maybe not in buf); the XSI one fills buf.
#if defined(__GLIBC__) && defined(_GNU_SOURCE)
  return ::strerror_r(err, buf, sizeof buf);
#else
  return ::strerror_r(err, buf, sizeof buf) == 0 ? std::string(buf) : std::string("error ") + std::to_string(err);
#endif
}

/// Why memtide must not replace or append to `path`: it exists and is not a regular file.
/// "" when it does not exist or is a regular file.
inline std::string refuse_target(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? "" : "cannot inspect " + path + ": " + errno_text(errno);
  }
  if (S_ISREG(st.st_mode)) return "";
  const char* what = S_ISLNK(st.st_mode)   ? "a symbolic link"
                     : S_ISDIR(st.st_mode) ? "a directory"
                     : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device"
                                                                  : "not a regular file";
  return path + " is " + what + "; memtide writes only regular files (remove it or choose another path)";
}

/// Writes `data` to `path` so that no reader sees half of it and nothing but `path` is touched:
/// a new file `.<name>.XXXXXX` beside it (O_EXCL, mode `mode`), written, fsync'ed, renamed over
/// `path`, and the folder fsync'ed. On failure the temporary file is removed and `path` is left
/// as it was. Returns "" or what went wrong, naming the path.
inline std::string write_atomically(const std::string& path, std::string_view data, mode_t mode = 0600) {
  if (path.empty()) return "the path is empty";
  if (std::string why = refuse_target(path); !why.empty()) return why;
  const std::size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  if (name.empty()) return path + " names a directory, not a file";
  std::string tmpl = (dir == "/" ? "/" : dir + "/") + "." + name + ".XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  const int fd = ::mkostemp(buf.data(), O_CLOEXEC);  // O_CREAT | O_EXCL: never through a symlink
  if (fd < 0) return "cannot create a file in " + dir + " for " + path + ": " + errno_text(errno);
  const std::string tmp(buf.data());
  auto fail = [&](const std::string& what) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return what + " " + path + ": " + errno_text(err);
  };
  if (::fchmod(fd, mode) != 0) return fail("cannot set the mode of");
  for (std::size_t done = 0; done < data.size();) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return fail("writing");
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) return fail("syncing");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return "closing " + path + ": " + errno_text(err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return "renaming the new file over " + path + ": " + errno_text(err);
  }
  if (const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    ::fsync(dfd);  // the rename itself survives a crash
    ::close(dfd);
  }
  return "";
}

/// Opens `path` for appending (a log), creating it with `mode`, never through a symlink and
/// never anything but a regular file. Returns the descriptor, or -1 with `*error` saying why (the
/// caller names the path).
inline int open_for_append(const std::string& path, std::string* error, mode_t mode = 0600) {
  if (path.empty()) {
    *error = "the path is empty";
    return -1;
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, mode);
  if (fd < 0) {
    *error = errno == ELOOP ? std::string("it is a symbolic link; memtide writes only regular files")
                            : errno_text(errno);
    return -1;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    *error = "it is not a regular file; memtide writes only regular files";
    return -1;
  }
  // O_NONBLOCK only kept open() from hanging on a FIFO; writes to the file block as usual.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

}  // namespace memtide::files
