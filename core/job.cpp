#include "memtide/core/job.hpp"

#include <atomic>
#include <cstdlib>
#include <string>

#include "memtide/core/log.hpp"

namespace memtide {
namespace {

// Read on every call: a process may set them after start-up (torch.multiprocessing, tests).
// A bad value is warned about once: the warning's own line asks for the rank again (log.cpp).
std::optional<int> read_count(const char* name, long lo, long hi, const char* what, std::atomic<bool>& warned) noexcept {
  const char* text = std::getenv(name);
  if (text == nullptr) return std::nullopt;
  char* end = nullptr;
  const long n = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || n < lo || n > hi) {
    if (!warned.exchange(true)) {
      MEMTIDE_LOG(warn, std::string(name) + "=\"" + text + "\" is not " + what + " (" + std::to_string(lo) + " to " +
                            std::to_string(hi) + "): taken as unset");
    }
    return std::nullopt;
  }
  return static_cast<int>(n);
}

std::atomic<bool> g_rank_warned{false};
std::atomic<bool> g_world_warned{false};
std::atomic<bool> g_local_warned{false};

}  // namespace

std::optional<int> job_rank() noexcept { return read_count("RANK", 0, (1L << 20) - 1, "a rank", g_rank_warned); }

std::optional<int> job_world_size() noexcept {
  return read_count("WORLD_SIZE", 1, 1L << 20, "a rank count", g_world_warned);
}

std::optional<int> job_local_world_size() noexcept {
  return read_count("LOCAL_WORLD_SIZE", 1, 4096, "a rank count", g_local_warned);
}

}  // namespace memtide
