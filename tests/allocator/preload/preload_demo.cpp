// A tiny "CUDA program" for the LD_PRELOAD observer test. It is linked against the fake runtime
// (libmemtide_fake_cudart.so) exactly as a real program is linked against libcudart.so, so the
// observer interposes on it the same way.
//
//   preload_demo           the fixed sequence the test checks event by event; prints the pointers
//                          it got as name=0x... so the test can match them against the log
//   preload_demo threads   several threads allocating and freeing concurrently, enough events to
//                          make the observer flush its buffer more than once
//   preload_demo fork      allocates 1 MiB, forks a child that allocates and frees 2 MiB and
//                          exits normally, then frees the 1 MiB block
//
// Exits non-zero when any call fails, e.g. when the observer cannot find the real runtime.

#include <sys/wait.h>
#include <unistd.h>

#include <cinttypes>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

extern "C" {
int cudaMalloc(void** devPtr, std::size_t size);
int cudaFree(void* devPtr);
int cudaMallocAsync(void** devPtr, std::size_t size, void* stream);
int cudaFreeAsync(void* devPtr, void* stream);
int cudaMallocManaged(void** devPtr, std::size_t size, unsigned int flags);
}

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

bool check(int rc, const char* what) {
  if (rc != 0) std::fprintf(stderr, "preload_demo: %s returned %d\n", what, rc);
  return rc == 0;
}

void show(const char* name, void* ptr) {
  std::printf("%s=0x%" PRIxPTR "\n", name, reinterpret_cast<std::uintptr_t>(ptr));
}

int basic() {
  bool ok = true;
  // The context-creation idiom: a no-op the observer must not log.
  ok &= check(cudaFree(nullptr), "cudaFree(nullptr)");

  void* a = nullptr;
  void* b = nullptr;
  void* c = nullptr;
  ok &= check(cudaMalloc(&a, 1 * kMiB), "cudaMalloc(a)");
  ok &= check(cudaMalloc(&b, 4 * kMiB), "cudaMalloc(b)");
  ok &= check(cudaMalloc(&c, 2 * kMiB), "cudaMalloc(c)");
  if (!ok) return 1;
  show("a", a);
  show("b", b);
  show("c", c);
  // Touch the blocks so a sanitizer build notices if they are not what was asked for.
  std::memset(a, 1, 1 * kMiB);
  std::memset(b, 2, 4 * kMiB);
  std::memset(c, 3, 2 * kMiB);
  ok &= check(cudaFree(b), "cudaFree(b)");

  void* const stream = reinterpret_cast<void*>(std::uintptr_t{0x5eed});
  void* d = nullptr;
  ok &= check(cudaMallocAsync(&d, 3 * kMiB, stream), "cudaMallocAsync(d)");
  if (!ok) return 1;
  show("d", d);
  std::memset(d, 4, 3 * kMiB);
  ok &= check(cudaFreeAsync(d, stream), "cudaFreeAsync(d)");

  // Allocated through an entry point the observer does not interpose: its free is unknown.
  void* m = nullptr;
  ok &= check(cudaMallocManaged(&m, 64 * 1024, 1), "cudaMallocManaged(m)");
  if (!ok) return 1;
  show("m", m);
  ok &= check(cudaFree(m), "cudaFree(m)");

  ok &= check(cudaFree(a), "cudaFree(a)");
  ok &= check(cudaFree(c), "cudaFree(c)");
  return ok ? 0 : 1;
}

int threads() {
  constexpr int kThreads = 4;
  constexpr int kIterations = 1500;
  std::vector<std::thread> pool;
  std::vector<int> failures(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([t, &failures] {
      for (int i = 0; i < kIterations; ++i) {
        void* p = nullptr;
        const auto size = static_cast<std::size_t>(4096 * (1 + (i + t) % 8));
        if (cudaMalloc(&p, size) != 0 || cudaFree(p) != 0) ++failures[static_cast<std::size_t>(t)];
      }
    });
  }
  for (auto& th : pool) th.join();
  int failed = 0;
  for (int f : failures) failed += f;
  if (failed != 0) std::fprintf(stderr, "preload_demo: %d failed calls\n", failed);
  return failed == 0 ? 0 : 1;
}

int forked() {
  void* a = nullptr;
  if (!check(cudaMalloc(&a, 1 * kMiB), "cudaMalloc(a)")) return 1;
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid < 0) {
    std::perror("preload_demo: fork");
    return 1;
  }
  if (pid == 0) {
    void* b = nullptr;
    bool ok = check(cudaMalloc(&b, 2 * kMiB), "child cudaMalloc(b)");
    ok &= check(cudaFree(b), "child cudaFree(b)");
    std::exit(ok ? 0 : 1);  // a normal exit, so the observer's exit flush runs in the child
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "preload_demo: child failed\n");
    return 1;
  }
  return check(cudaFree(a), "cudaFree(a)") ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "threads") == 0) return threads();
  if (argc > 1 && std::strcmp(argv[1], "fork") == 0) return forked();
  return basic();
}
