// libmemtide_preload.so: an LD_PRELOAD observer for unmodified CUDA programs.
//
// It interposes the four segment-level CUDA runtime entry points (cudaMalloc, cudaFree,
// cudaMallocAsync, cudaFreeAsync), forwards every call to the real runtime found with
// dlsym(RTLD_NEXT), and records a timeline of the successful ones with current and peak bytes.
// The timeline is written as JSON Lines to $MEMTIDE_PRELOAD_LOG (default memtide_preload.jsonl).
//
// The library is deliberately standalone: no CUDA headers (it must load on machines without
// CUDA and must not bind to a particular runtime version), no memtide core (the observer must
// not drag a second allocator runtime into the host process). Only libc, libdl and pthreads.
//
// It only sees calls that go through the dynamic symbol table: a program linked against
// cudart_static (nvcc's default) resolves cudaMalloc inside itself and is not observable.

#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "memtide/core/files.hpp"

// The CUDA runtime ABI as this library needs it: cudaError_t is a C enum (int-sized) and
// cudaStream_t an opaque pointer.
using cudaError_t = int;
using cudaStream_t = void*;

#define MEMTIDE_PRELOAD_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// What a wrapper returns when there is no real runtime to forward to; the value of
// cudaErrorInitializationError, so callers see an ordinary CUDA failure.
constexpr cudaError_t kNoRealRuntime = 3;

// Every event is written at once, as whole lines in one write(): what write() took survives an
// abort or an _exit, which no user-space buffer does. cudaMalloc/cudaFree cost far more than a
// write of one line, and caching allocators (torch's) call them rarely.
constexpr std::size_t kFlushEvents = 1;

constexpr const char* kDefaultLogPath = "memtide_preload.jsonl";

enum class Op : std::uint8_t { malloc, malloc_async, free, free_async };

const char* op_name(Op op) noexcept {
  switch (op) {
    case Op::malloc: return "malloc";
    case Op::malloc_async: return "malloc_async";
    case Op::free: return "free";
    case Op::free_async: return "free_async";
  }
  return "?";
}

struct Event {
  std::uint64_t t_ns;
  Op op;
  std::uintptr_t ptr;
  std::size_t size;
  std::uintptr_t stream;
  std::size_t current;
  std::size_t peak;
};

// GNU strerror_r returns the message, XSI strerror_r fills the buffer; accept either so the
// code does not depend on which feature macros the toolchain defines.


class Recorder {
 public:
  Recorder() noexcept : epoch_(std::chrono::steady_clock::now()) {}

  void on_malloc(Op op, void* ptr, std::size_t size, void* stream) noexcept {
    // A successful zero-byte request hands back a null pointer: no segment exists to track.
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    try {
      auto [it, inserted] = live_.try_emplace(ptr, size);
      if (!inserted) {
        // The runtime handed out an address we still think is live, so its earlier segment was
        // released through a path we do not see; retire it so current stays honest.
        current_ -= it->second;
        it->second = size;
      }
      current_ += size;
      if (current_ > peak_) peak_ = current_;
      ++mallocs_;
      push(op, ptr, size, stream);
    } catch (...) {
      // Out of host memory while bookkeeping: lose this event rather than the host program.
    }
  }

  void on_free(Op op, void* ptr, void* stream) noexcept {
    // cudaFree(nullptr) is the documented no-op (and the usual context-creation idiom), not the
    // release of a segment, so it is neither an event nor an unknown free.
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    try {
      std::size_t size = 0;
      if (auto it = live_.find(ptr); it != live_.end()) {
        size = it->second;
        current_ -= size;
        live_.erase(it);
      } else {
        // Allocated before we could see it or by an entry point we do not interpose
        // (cudaMallocManaged, cudaMallocPitch, ...): count it, log it with size 0.
        ++unknown_frees_;
      }
      ++frees_;
      push(op, ptr, size, stream);
    } catch (...) {
    }
  }

  // Writes whatever is buffered plus the summary. Runs from the library destructor, after the
  // program's own static destructors; calls that still arrive later are written straight
  // through, each followed by a fresh summary, so the last line of a section stays the summary.
  void finish() noexcept {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = true;
    flush_locked(/*with_summary=*/true);
  }

  // fork() support: the child must not write the parent's buffered events a second time, and
  // the mutex may have been held by another parent thread at the moment of the fork.
  void before_fork() noexcept { mu_.lock(); }
  void after_fork_parent() noexcept { mu_.unlock(); }
  void after_fork_child() noexcept {
    buffer_.clear();
    live_.clear();
    current_ = peak_ = events_ = mallocs_ = frees_ = unknown_frees_ = 0;
    // The child starts its own header/summary section in the same (append-mode) file.
    header_written_ = false;
    finished_ = false;
    mu_.unlock();
  }

 private:
  void push(Op op, void* ptr, std::size_t size, void* stream) {
    // Taken under the lock so that file order is also time order.
    const auto now = std::chrono::steady_clock::now() - epoch_;
    const auto t_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now).count();
    if (buffer_.capacity() == 0) buffer_.reserve(kFlushEvents);
    buffer_.push_back(Event{static_cast<std::uint64_t>(t_ns), op, reinterpret_cast<std::uintptr_t>(ptr),
                            size, reinterpret_cast<std::uintptr_t>(stream), current_, peak_});
    ++events_;
    if (finished_) {
      flush_locked(/*with_summary=*/true);
    } else if (buffer_.size() >= kFlushEvents) {
      flush_locked(/*with_summary=*/false);
    }
  }

  void flush_locked(bool with_summary) noexcept {
    // A process that never allocated (a shell or tool sharing the LD_PRELOAD) leaves no trace.
    if (events_ == 0) return;
    try {
      std::string out;
      out.reserve((buffer_.size() + 2) * 160);
      char line[320];
      if (!header_written_) {
        std::snprintf(line, sizeof line, "{\"type\":\"header\",\"pid\":%ld,\"version\":1}\n",
                      static_cast<long>(getpid()));
        out += line;
      }
      // Every line names its process: with each event written at once, the lines of a forked
      // child and its parent interleave in the shared file.
      const long pid = static_cast<long>(getpid());
      for (const Event& e : buffer_) {
        std::snprintf(line, sizeof line,
                      "{\"type\":\"event\",\"pid\":%ld,\"t_ns\":%" PRIu64 ",\"op\":\"%s\",\"ptr\":\"0x%" PRIxPTR
                      "\",\"size\":%zu,\"stream\":\"0x%" PRIxPTR "\",\"current\":%zu,\"peak\":%zu}\n",
                      pid, e.t_ns, op_name(e.op), e.ptr, e.size, e.stream, e.current, e.peak);
        out += line;
      }
      if (with_summary) {
        std::snprintf(line, sizeof line,
                      "{\"type\":\"summary\",\"pid\":%ld,\"events\":%" PRIu64 ",\"peak_bytes\":%zu,\"current_bytes\":%zu"
                      ",\"unknown_frees\":%" PRIu64 ",\"mallocs\":%" PRIu64 ",\"frees\":%" PRIu64 "}\n",
                      pid, events_, peak_, current_, unknown_frees_, mallocs_, frees_);
        out += line;
      }
      buffer_.clear();
      if (write_out(out)) header_written_ = true;
    } catch (...) {
      // Out of host memory while formatting: drop this batch, keep the host program running.
      buffer_.clear();
    }
  }

  // Appends `text` with a single write() where the kernel allows it, so lines from a forked
  // child sharing the file are never torn. Returns false when nothing could be written.
  bool write_out(const std::string& text) noexcept {
    if (!open_log()) return false;
    const char* p = text.data();
    std::size_t left = text.size();
    while (left > 0) {
      const ssize_t n = ::write(fd_, p, left);
      if (n < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        std::fprintf(stderr, "memtide [error] preload: cannot write '%s': %s; logging stops\n",
                     path_.c_str(), memtide::files::errno_text(err).c_str());
        ::close(fd_);
        fd_ = -1;
        log_failed_ = true;
        return false;
      }
      p += n;
      left -= static_cast<std::size_t>(n);
    }
    return true;
  }

  bool open_log() noexcept {
    if (fd_ >= 0) return true;
    if (log_failed_) return false;
    try {
      // Read here, not at load time, so a program may still set the variable before its first
      // allocation. An empty value means the default: the observer never fails the host program.
      const char* env = std::getenv("MEMTIDE_PRELOAD_LOG");
      path_ = (env != nullptr && *env != '\0') ? env : kDefaultLogPath;
    } catch (...) {
      log_failed_ = true;
      return false;
    }
    // A raw descriptor rather than FILE*: stdio may already be torn down when the library
    // destructor runs, and O_APPEND keeps concurrent writers from overwriting each other.
    // Never through a symlink, never anything but a regular file, 0600 (memtide/core/files.hpp).
    std::string why;
    fd_ = memtide::files::open_for_append(path_, &why);
    if (fd_ < 0) {
      std::fprintf(stderr,
                   "memtide [error] preload: cannot open log file '%s': %s; CUDA calls are passed "
                   "through but not recorded\n",
                   path_.c_str(), why.c_str());
      log_failed_ = true;
      return false;
    }
    return true;
  }

  std::mutex mu_;
  const std::chrono::steady_clock::time_point epoch_;
  std::unordered_map<void*, std::size_t> live_;
  std::vector<Event> buffer_;
  std::size_t current_ = 0;
  std::size_t peak_ = 0;
  std::uint64_t events_ = 0;
  std::uint64_t mallocs_ = 0;
  std::uint64_t frees_ = 0;
  std::uint64_t unknown_frees_ = 0;
  std::string path_;
  int fd_ = -1;
  bool log_failed_ = false;
  bool header_written_ = false;
  bool finished_ = false;
};

// Built in static storage and never destroyed: CUDA calls can arrive from other libraries'
// static constructors before ours and from static destructors after ours, and a destroyed
// recorder would be a use-after-free. Reachable from a global, so leak checkers stay quiet.
Recorder& recorder() noexcept {
  alignas(Recorder) static unsigned char storage[sizeof(Recorder)];
  static Recorder* const instance = new (storage) Recorder();
  return *instance;
}

__attribute__((constructor)) void on_load() noexcept {
  // Starts the clock at load time rather than at the first call.
  (void)recorder();
  pthread_atfork([] { recorder().before_fork(); }, [] { recorder().after_fork_parent(); },
                 [] { recorder().after_fork_child(); });
}

__attribute__((destructor)) void on_unload() noexcept { recorder().finish(); }

// Fallback when RTLD_NEXT misses: RTLD_NEXT searches only the global scope, so a libcudart
// pulled in by a library that was dlopen()ed RTLD_LOCAL is invisible to it even though that
// library's calls still land here. Such a runtime is already loaded, so look it up by name.
struct CudartPath {
  char path[4096];
};

int find_cudart(dl_phdr_info* info, std::size_t, void* out) noexcept {
  const char* name = info->dlpi_name;
  if (name == nullptr) return 0;
  const char* slash = std::strrchr(name, '/');
  const char* base = slash != nullptr ? slash + 1 : name;
  if (std::strncmp(base, "libcudart.so", 12) != 0) return 0;
  auto* found = static_cast<CudartPath*>(out);
  if (std::strlen(name) >= sizeof found->path) return 0;
  std::strcpy(found->path, name);
  return 1;
}

template <typename Fn>
Fn resolve(const char* name) noexcept {
  void* sym = dlsym(RTLD_NEXT, name);
  if (sym == nullptr) {
    CudartPath found{};
    // dlopen only after the iteration: dl_iterate_phdr holds a loader lock during callbacks.
    dl_iterate_phdr(find_cudart, &found);
    if (found.path[0] != '\0') {
      // Kept open for the life of the process: we keep calling into it.
      if (void* handle = dlopen(found.path, RTLD_LAZY | RTLD_NOLOAD)) sym = dlsym(handle, name);
    }
  }
  Fn fn = nullptr;
  static_assert(sizeof fn == sizeof sym);
  std::memcpy(&fn, &sym, sizeof fn);  // object-to-function pointer without a pedantic cast
  return fn;
}

using MallocFn = cudaError_t (*)(void**, std::size_t);
using FreeFn = cudaError_t (*)(void*);
using MallocAsyncFn = cudaError_t (*)(void**, std::size_t, cudaStream_t);
using FreeAsyncFn = cudaError_t (*)(void*, cudaStream_t);

}  // namespace

MEMTIDE_PRELOAD_EXPORT cudaError_t cudaMalloc(void** devPtr, std::size_t size) noexcept {
  static const MallocFn real = resolve<MallocFn>("cudaMalloc");
  if (real == nullptr) return kNoRealRuntime;
  const cudaError_t rc = real(devPtr, size);
  if (rc == 0 && devPtr != nullptr) recorder().on_malloc(Op::malloc, *devPtr, size, nullptr);
  return rc;
}

MEMTIDE_PRELOAD_EXPORT cudaError_t cudaFree(void* devPtr) noexcept {
  static const FreeFn real = resolve<FreeFn>("cudaFree");
  if (real == nullptr) return kNoRealRuntime;
  const cudaError_t rc = real(devPtr);
  if (rc == 0) recorder().on_free(Op::free, devPtr, nullptr);
  return rc;
}

MEMTIDE_PRELOAD_EXPORT cudaError_t cudaMallocAsync(void** devPtr, std::size_t size,
                                                   cudaStream_t hStream) noexcept {
  static const MallocAsyncFn real = resolve<MallocAsyncFn>("cudaMallocAsync");
  if (real == nullptr) return kNoRealRuntime;
  const cudaError_t rc = real(devPtr, size, hStream);
  if (rc == 0 && devPtr != nullptr) recorder().on_malloc(Op::malloc_async, *devPtr, size, hStream);
  return rc;
}

MEMTIDE_PRELOAD_EXPORT cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t hStream) noexcept {
  static const FreeAsyncFn real = resolve<FreeAsyncFn>("cudaFreeAsync");
  if (real == nullptr) return kNoRealRuntime;
  const cudaError_t rc = real(devPtr, hStream);
  if (rc == 0) recorder().on_free(Op::free_async, devPtr, hStream);
  return rc;
}
