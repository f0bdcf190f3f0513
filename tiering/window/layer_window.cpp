#include "memtide/tiering/window/layer_window.hpp"

#include <algorithm>
#include <cmath>

#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"

namespace memtide::tiering {
namespace {

void check(const std::vector<BlockProfile>& blocks, double async_ns) {
  if (blocks.empty()) throw InvalidArgument("layer window: no blocks");
  if (!(async_ns >= 0)) throw InvalidArgument("layer window: async_ns must be >= 0");
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const BlockProfile& b = blocks[i];
    if (!(b.forward_ns >= 0) || !(b.backward_ns >= 0) || !(b.h2d_ns >= 0) || !(b.d2h_ns >= 0)) {
      throw InvalidArgument("layer window: block " + std::to_string(i) + " has a negative or NaN time");
    }
  }
}

// The pass with no copy ever waited for: compute, the hooks' overhead, and the gradients of the
// last block of backward (block 0) still on their way out.
double unstalled_ns(const std::vector<BlockProfile>& b, double async_ns) {
  double t = 0;
  for (const BlockProfile& x : b) t += x.forward_ns + x.backward_ns + 5 * async_ns;
  return t + b.front().d2h_ns;
}

}  // namespace

std::uint64_t window_bytes(const std::vector<BlockProfile>& blocks, int m) {
  const int n = static_cast<int>(blocks.size());
  if (m <= 0) throw InvalidArgument("layer window: a window holds at least one block, got " + std::to_string(m));
  if (m >= n) {
    std::uint64_t all = 0;
    for (const BlockProfile& b : blocks) all += b.bytes;
    return all;
  }
  std::uint64_t most = 0;
  for (int i = 0; i + m < n; ++i) {  // m blocks and the one coming in
    std::uint64_t sum = 0;
    for (int k = i; k <= i + m; ++k) sum += blocks[k].bytes;
    most = std::max(most, sum);
  }
  return most;
}

WindowSize choose_window(const std::vector<BlockProfile>& blocks, std::uint64_t available, double async_ns) {
  check(blocks, async_ns);
  const int n = static_cast<int>(blocks.size());
  WindowSize out;
  if (window_bytes(blocks, n) <= available) {
    out.blocks = n;
    out.hides_transfers = true;
    out.peak_bytes = window_bytes(blocks, n);
    out.why = "all " + std::to_string(n) + " blocks fit (" + format_bytes(out.peak_bytes) + " of " +
              format_bytes(available) + "): no window needed";
    return out;
  }
  if (n == 1 || window_bytes(blocks, 1) > available) {
    const std::uint64_t need = n == 1 ? blocks[0].bytes : window_bytes(blocks, 1);
    throw InvalidArgument(std::string("layer window: ") +
                          (n == 1 ? "the one block needs " : "one block and the prefetch of the next need ") +
                          format_bytes(need) +
                          " of device memory, but only " + format_bytes(available) +
                          " is available; use smaller blocks, a smaller batch, or free device memory");
  }
  // The model's pass time judges each window: it has P1's and P2's conditions at every position
  // (a block waits for its copy) and also the copy engines' queues, which STRONGHOLD's per-layer
  // constraints leave out (copies that each fit their window can still pile up behind each other).
  int fits = 1;
  while (fits + 1 < n && window_bytes(blocks, fits + 1) <= available) ++fits;
  std::vector<double> pass(static_cast<std::size_t>(fits) + 1, 0.0);
  double best = INFINITY;
  for (int m = 1; m <= fits; ++m) best = std::min(best, pass[m] = window_pass_ns(blocks, m, async_ns));
  int knee = fits;
  for (int m = 1; m <= fits; ++m) {
    if (pass[m] <= best * 1.01) {  // within 1% of the best window that fits: the plateau's start
      knee = m;
      break;
    }
  }
  const double ideal = unstalled_ns(blocks, async_ns);
  out.blocks = knee;
  out.peak_bytes = window_bytes(blocks, knee);
  out.hides_transfers = pass[knee] <= ideal * 1.001;
  out.why = std::to_string(knee) + " of " + std::to_string(n) + " blocks (" + format_bytes(out.peak_bytes) + " of " +
            format_bytes(available) + "): ";
  if (out.hides_transfers) {
    out.why += "the smallest window whose compute covers every copy";
  } else {
    out.why += "copies stall the GPU for " + format_duration_ns(pass[knee] - ideal) + " per pass (" +
               format_duration_ns(pass[knee]) + " against " + format_duration_ns(ideal) + " of compute); " +
               (knee < fits ? "a larger window would not help" : "the largest window that fits");
  }
  return out;
}

double window_pass_ns(const std::vector<BlockProfile>& b, int m, double async_ns) {
  check(b, async_ns);
  if (m <= 0) throw InvalidArgument("layer window: a window holds at least one block, got " + std::to_string(m));
  const int n = static_cast<int>(b.size());
  if (m >= n) {
    double t = 0;
    for (const BlockProfile& x : b) t += x.forward_ns + x.backward_ns;
    return t;
  }
  std::vector<double> arrival(static_cast<std::size_t>(n), 0.0);
  double t = 0;
  double h2d_free = 0;
  for (int i = 0; i < n; ++i) {  // forward: blocks 0 .. m-1 are resident
    if (const int j = i + m; j < n) {
      arrival[j] = std::max(t, h2d_free) + b[j].h2d_ns;  // into the buffer block i-1 just left
      h2d_free = arrival[j];
    }
    t = std::max(t, arrival[i]) + 2 * async_ns + b[i].forward_ns;
  }
  // Backward: blocks n-m .. n-1 are resident; block j comes in once the block leaving its buffer
  // has sent its gradients out.
  std::fill(arrival.begin(), arrival.end(), t);
  std::vector<double> sent(static_cast<std::size_t>(n), t);
  double d2h_free = t;
  for (int i = n - 1; i >= 0; --i) {
    if (const int j = i - m; j >= 0) {
      const double buffer_free = i + 1 < n ? sent[i + 1] : t;
      arrival[j] = std::max({t, h2d_free, buffer_free}) + b[j].h2d_ns;
      h2d_free = arrival[j];
    }
    t = std::max(t, arrival[i]) + 3 * async_ns + b[i].backward_ns;
    sent[i] = std::max(t, d2h_free) + b[i].d2h_ns;
    d2h_free = sent[i];
  }
  return std::max(t, d2h_free);
}

}  // namespace memtide::tiering
