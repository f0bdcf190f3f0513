#pragma once
/// @file
/// The layer window's size (STRONGHOLD, SC22, Section III-C): how many transformer blocks keep
/// their parameters on the GPU while the rest live in host memory and are prefetched one block
/// ahead of the computation, forward and then backward.
///
/// With a window of m blocks, the block just outside it is copied in while the m blocks inside
/// compute; its buffer is the one the block that just finished leaves (m + 1 buffers in all, used
/// round robin). STRONGHOLD's constraints, for every position of the window:
/// - P1 (forward): copying the next block in takes no longer than computing the m blocks before
///   it needs to start (each block also pays the hooks' overhead, 2 x async);
/// - P2 (backward): the same in the backward direction, where the block leaving also sends its
///   gradients to the host (the copy engines run both directions at once; 3 x async per block);
/// - memory: the m blocks inside and the one coming in fit the memory available.

#include <cstdint>
#include <string>
#include <vector>

namespace memtide::tiering {

/// What sizing needs to know of one block: measured (or modelled) times and device bytes.
struct BlockProfile {
  double forward_ns = 0;   ///< its forward on the GPU
  double backward_ns = 0;  ///< its backward on the GPU (recomputation included, with checkpointing)
  double h2d_ns = 0;       ///< its parameters host -> device
  double d2h_ns = 0;       ///< its gradients device -> host
  std::uint64_t bytes = 0; ///< device memory it holds while in the window (parameters and gradients)
};

/// A window size and what it means.
struct WindowSize {
  int blocks = 0;                ///< m; the number of blocks when everything fits (no window needed)
  bool hides_transfers = false;  ///< P1 and P2 hold at every position: no copy stalls the GPU
  std::uint64_t peak_bytes = 0;  ///< the most device memory the window and its prefetch hold at once
  std::string why;               ///< how it was chosen, in words with numbers
};

/// The knee of pass time against window size: the smallest m that fits `available` and whose
/// modelled pass (window_pass_ns: P1's and P2's conditions at every position, plus the copy
/// engines' queues, which per-layer constraints miss) is within 1% of the best window that fits.
/// `hides_transfers` says whether that pass has no stall at all; `why` gives the numbers. All
/// blocks, when they fit. Throws InvalidArgument for no blocks, a negative time, and when even one
/// block plus the prefetch of the next does not fit `available` (the numbers named).
WindowSize choose_window(const std::vector<BlockProfile>& blocks, std::uint64_t available, double async_ns = 0);

/// The device memory a window of m blocks needs: the most that m consecutive blocks and the one
/// after them hold (all blocks when m >= their number).
std::uint64_t window_bytes(const std::vector<BlockProfile>& blocks, int m);

/// The time of one forward and backward pass with a window of m blocks, on one compute stream and
/// one copy engine per direction: a block starts when the block before it is done and its own
/// parameters have arrived; each block's prefetch is issued as the block m before it starts. The
/// first m blocks are resident when forward begins (the update phase fetched them), the last m
/// when backward begins. m >= the number of blocks: no copies at all.
double window_pass_ns(const std::vector<BlockProfile>& blocks, int m, double async_ns = 0);

}  // namespace memtide::tiering
