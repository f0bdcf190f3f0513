#pragma once
/// @file
/// The one options table. Every knob memtide has is a row here, read from the environment as
/// `MEMTIDE_<KEY>` (upper case). A bad value fails fast with a ConfigError that names the
/// variable, the value and what is accepted.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace memtide {

enum class LogLevel { error = 0, warn = 1, info = 2, debug = 3 };

/// Every knob, with its default. Field names are the keys of the options table.
struct Options {
  std::string device = "auto";              ///< auto | cuda | sim
  LogLevel log_level = LogLevel::warn;      ///< error | warn | info | debug
  std::uint64_t sim_capacity = 80ULL << 30; ///< SimDevice memory (default: an 80 GiB H100)
  bool sim_phantom = false;                 ///< SimDevice accounts time only, holds no bytes
  double memory_fraction = 1.0;             ///< allocator limit as a fraction of device memory
  std::uint64_t max_bytes = 0;              ///< allocator byte cap; 0 = none
  bool record_history = false;              ///< keep an allocation trace for snapshots
  std::uint64_t history_entries = 100000;   ///< trace ring-buffer length
  std::uint64_t headroom_margin = 256ULL << 20;  ///< kept free when lending headroom
  std::uint64_t phase_history = 4;          ///< iterations remembered for headroom
  std::string preload_log = "memtide_preload.jsonl";  ///< LD_PRELOAD observer output file
  bool expandable_segments = true;          ///< grow large-pool segments with virtual memory where the device can
  bool torch_bridge = true;                 ///< memtide.use_with_torch(): the bridge when built, else pluggable
  bool torch_reads = true;                  ///< TieredAdamW's per-step reads and gradient hooks in C++ (libmemtide_torch_reads.so) when built
  std::string cpu_isa = "auto";             ///< auto | scalar | avx2 | avx512 (CPU optimizer kernels)
  double calibration_alpha = 0.3;           ///< EWMA weight of a new rate measurement
  std::uint64_t calibration_history = 100;  ///< update-phase prediction errors kept for reports
  std::uint64_t subgroup_size = 100000000;  ///< params per optimizer subgroup (paper: 100M)
  std::string topology;                     ///< hwloc XML file to use instead of this machine; empty = this machine
  std::uint64_t host_slab_size = 256ULL << 20;  ///< pinned host slab size (HostArena)
  std::uint64_t host_max_bytes = 0;         ///< cap on pinned host bytes per arena; 0 = none
  int host_node = -1;                       ///< NUMA node for host buffers; -1 = not bound (until topology decides)
  int local_ranks = 0;                      ///< ranks on this machine sharing its GPUs' cpus; 0 = LOCAL_WORLD_SIZE or 1
  std::string host_node_full = "strict";    ///< strict | fallback: when the node cannot hold a slab
  bool host_huge_pages = true;              ///< transparent huge pages for host slabs (faster first touch)
  std::string pinned_heap_backend = "auto"; ///< auto | jemalloc | mimalloc (PinnedHeap)
  std::uint64_t pinned_heap_slab_size = 256ULL << 20;  ///< largest slab PinnedHeap asks for (except for larger requests)
  std::uint64_t pinned_heap_direct_threshold = 64ULL << 10;  ///< requests >= this bypass the backend; 0 = never
  std::uint64_t nvme_queue_depth = 32;       ///< NVMe tier: requests in flight (bench_nvme.py --sweep chose it)
  std::uint64_t nvme_block_size = 1ULL << 20;  ///< NVMe tier: bytes per request
  std::string cupti_library;                 ///< libcupti the tracer loads first; empty = libcupti.so.13, then libcupti.so

  /// Reads the table from `lookup` (the environment by default). Throws ConfigError.
  static Options from_env(const std::function<const char*(const char*)>& lookup);

  /// Applies one `key=value` (key as in the table, lower case). Throws ConfigError.
  void set(std::string_view key, std::string_view value);
};

/// One row of the table, for `memtide info` and docs.
struct OptionInfo {
  std::string key;       ///< table key, e.g. "memory_fraction"
  std::string env;       ///< environment variable, e.g. "MEMTIDE_MEMORY_FRACTION"
  std::string accepted;  ///< what values are accepted
  std::string help;
};

/// The rows of the options table.
const std::vector<OptionInfo>& option_table();

/// The process-wide options, read from the environment on first use.
/// Throws ConfigError on a bad value (and again on every later call, so it is never ignored).
const Options& options();

/// Replaces the process-wide options (tests, Python `memtide.configure`).
void set_options(const Options& opts);

/// Current values as strings, keyed by table key.
std::map<std::string, std::string> describe(const Options& opts);

}  // namespace memtide
