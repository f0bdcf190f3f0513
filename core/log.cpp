#include "memtide/core/log.hpp"

#include "memtide/core/job.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace memtide {
namespace {

// -1 means "not read yet". The level is read straight from the environment, not through
// options(), so that logging a bad option never recurses into option parsing.
std::atomic<int> g_level{-1};

int read_level() noexcept {
  const char* v = std::getenv("MEMTIDE_LOG_LEVEL");
  if (v == nullptr) return static_cast<int>(LogLevel::warn);
  if (std::strcmp(v, "error") == 0) return 0;
  if (std::strcmp(v, "info") == 0) return 2;
  if (std::strcmp(v, "debug") == 0) return 3;
  return static_cast<int>(LogLevel::warn);
}

}  // namespace

bool log_enabled(LogLevel level) noexcept {
  int current = g_level.load(std::memory_order_relaxed);
  if (current < 0) {
    current = read_level();
    g_level.store(current, std::memory_order_relaxed);
  }
  return static_cast<int>(level) <= current;
}

void set_log_level(LogLevel level) noexcept { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }

void log_message(LogLevel level, const std::string& message) noexcept {
  static const char* names[] = {"error", "warn", "info", "debug"};
  // The ranks of a job share one terminal: each line says whose it is.
  if (const std::optional<int> rank = job_rank()) {
    std::fprintf(stderr, "memtide [%s] rank %d: %s\n", names[static_cast<int>(level)], *rank, message.c_str());
  } else {
    std::fprintf(stderr, "memtide [%s] %s\n", names[static_cast<int>(level)], message.c_str());
  }
}

}  // namespace memtide
