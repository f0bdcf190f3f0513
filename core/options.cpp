#include "memtide/core/options.hpp"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>
#include <algorithm>

#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/log.hpp"

extern char** environ;

namespace memtide {
namespace {

std::string env_name(std::string_view key) {
  std::string name = "MEMTIDE_";
  for (char c : key) name += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

[[noreturn]] void reject(std::string_view key, std::string_view value, std::string_view accepted) {
  throw ConfigError(env_name(key) + "=\"" + std::string(value) + "\" is not accepted: expected " +
                    std::string(accepted));
}

bool parse_bool(std::string_view key, std::string_view v) {
  std::string s(v);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  reject(key, v, "a boolean (1/0, true/false, yes/no, on/off)");
}

std::uint64_t parse_size(std::string_view key, std::string_view v, std::uint64_t min, std::uint64_t max) {
  auto bytes = parse_bytes(v);
  if (!bytes || *bytes < min || *bytes > max) {
    reject(key, v, "a size in bytes from " + format_bytes(min) + " to " + format_bytes(max) +
                       " (e.g. 4096, 512MiB, 8GiB)");
  }
  return *bytes;
}

std::uint64_t parse_count(std::string_view key, std::string_view v, std::uint64_t min, std::uint64_t max) {
  std::uint64_t n = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc{} || end != v.data() + v.size() || n < min || n > max) {
    reject(key, v, "a whole number from " + std::to_string(min) + " to " + std::to_string(max));
  }
  return n;
}

int parse_int(std::string_view key, std::string_view v, int min, int max) {
  int n = 0;
  auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (ec != std::errc{} || end != v.data() + v.size() || n < min || n > max) {
    reject(key, v, "a whole number from " + std::to_string(min) + " to " + std::to_string(max));
  }
  return n;
}

struct Row {
  const char* key;
  const char* accepted;
  const char* help;
  std::function<void(Options&, std::string_view)> parse;
  std::function<std::string(const Options&)> show;
};

const std::vector<Row>& rows() {
  static const std::vector<Row> table = {
      {"device", "auto | cuda | sim", "device backend; auto uses CUDA when a GPU is usable",
       [](Options& o, std::string_view v) {
         if (v != "auto" && v != "cuda" && v != "sim") reject("device", v, "auto, cuda or sim");
         o.device = std::string(v);
       },
       [](const Options& o) { return o.device; }},
      {"log_level", "error | warn | info | debug", "log verbosity (stderr)",
       [](Options& o, std::string_view v) {
         if (v == "error") o.log_level = LogLevel::error;
         else if (v == "warn") o.log_level = LogLevel::warn;
         else if (v == "info") o.log_level = LogLevel::info;
         else if (v == "debug") o.log_level = LogLevel::debug;
         else reject("log_level", v, "error, warn, info or debug");
       },
       [](const Options& o) {
         static const char* names[] = {"error", "warn", "info", "debug"};
         return std::string(names[static_cast<int>(o.log_level)]);
       }},
      {"sim_capacity", "size, 1MiB..1PiB", "SimDevice memory capacity",
       [](Options& o, std::string_view v) { o.sim_capacity = parse_size("sim_capacity", v, 1ULL << 20, 1ULL << 50); },
       [](const Options& o) { return format_bytes(o.sim_capacity); }},
      {"sim_phantom", "boolean", "SimDevice phantom mode: time accounting only, no bytes held",
       [](Options& o, std::string_view v) { o.sim_phantom = parse_bool("sim_phantom", v); },
       [](const Options& o) { return std::string(o.sim_phantom ? "true" : "false"); }},
      {"memory_fraction", "number in (0, 1]", "allocator limit as a fraction of device memory",
       [](Options& o, std::string_view v) {
         double f = 0.0;
         auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), f);
         if (ec != std::errc{} || end != v.data() + v.size() || !(f > 0.0 && f <= 1.0)) {
           reject("memory_fraction", v, "a number in (0, 1]");
         }
         o.memory_fraction = f;
       },
       [](const Options& o) { return std::to_string(o.memory_fraction); }},
      {"max_bytes", "size (0 = no cap)", "allocator byte cap",
       [](Options& o, std::string_view v) { o.max_bytes = parse_size("max_bytes", v, 0, 1ULL << 50); },
       [](const Options& o) { return o.max_bytes ? format_bytes(o.max_bytes) : std::string("none"); }},
      {"record_history", "boolean", "record an allocation trace for snapshots",
       [](Options& o, std::string_view v) { o.record_history = parse_bool("record_history", v); },
       [](const Options& o) { return std::string(o.record_history ? "true" : "false"); }},
      {"expandable_segments", "boolean",
       "large allocations share one segment per stream that grows and shrinks with virtual memory (where the device supports it)",
       [](Options& o, std::string_view v) { o.expandable_segments = parse_bool("expandable_segments", v); },
       [](const Options& o) { return std::string(o.expandable_segments ? "true" : "false"); }},
      {"torch_bridge", "boolean", "use_with_torch() makes memtide torch's own CUDA allocator, and the CPU optimizer step runs on torch's threads (off: the pluggable allocator, and memtide's own pool)",
       [](Options& o, std::string_view v) { o.torch_bridge = parse_bool("torch_bridge", v); },
       [](const Options& o) { return std::string(o.torch_bridge ? "true" : "false"); }},
      {"torch_reads", "boolean", "TieredAdamW reads its params' pointers and versions each step, and hooks their gradients, in C++ where that library was built (off: in Python)",
       [](Options& o, std::string_view v) { o.torch_reads = parse_bool("torch_reads", v); },
       [](const Options& o) { return std::string(o.torch_reads ? "true" : "false"); }},
      {"history_entries", "1..100000000", "trace entries kept (ring buffer)",
       [](Options& o, std::string_view v) { o.history_entries = parse_count("history_entries", v, 1, 100000000); },
       [](const Options& o) { return std::to_string(o.history_entries); }},
      {"headroom_margin", "size", "bytes kept free when lending headroom to tiering",
       [](Options& o, std::string_view v) { o.headroom_margin = parse_size("headroom_margin", v, 0, 1ULL << 50); },
       [](const Options& o) { return format_bytes(o.headroom_margin); }},
      {"phase_history", "1..1000", "iterations of phase watermarks remembered for headroom",
       [](Options& o, std::string_view v) { o.phase_history = parse_count("phase_history", v, 1, 1000); },
       [](const Options& o) { return std::to_string(o.phase_history); }},
      {"preload_log", "file path", "where the LD_PRELOAD observer writes its timeline",
       [](Options& o, std::string_view v) {
         if (v.empty()) reject("preload_log", v, "a non-empty file path");
         o.preload_log = std::string(v);
       },
       [](const Options& o) { return o.preload_log; }},
      {"cpu_isa", "auto | scalar | avx2 | avx512", "vector path of the CPU optimizer kernels; auto = widest supported",
       [](Options& o, std::string_view v) {
         if (v != "auto" && v != "scalar" && v != "avx2" && v != "avx512") reject("cpu_isa", v, "auto, scalar, avx2 or avx512");
         o.cpu_isa = std::string(v);
       },
       [](const Options& o) { return o.cpu_isa; }},
      {"calibration_alpha", "number in (0, 1]",
       "weight of a new measurement in the calibrated rates (exponential moving average; 1 = last one only)",
       [](Options& o, std::string_view v) {
         double a = 0.0;
         auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), a);
         if (ec != std::errc{} || end != v.data() + v.size() || !(a > 0.0 && a <= 1.0)) {
           reject("calibration_alpha", v, "a number in (0, 1]");
         }
         o.calibration_alpha = a;
       },
       [](const Options& o) { return std::to_string(o.calibration_alpha); }},
      {"calibration_history", "1..1000000", "update phases whose predicted-vs-measured error is kept for reports",
       [](Options& o, std::string_view v) { o.calibration_history = parse_count("calibration_history", v, 1, 1000000); },
       [](const Options& o) { return std::to_string(o.calibration_history); }},
      {"subgroup_size", "1..1000000000000", "parameters per optimizer subgroup (the unit of CPU/GPU placement)",
       [](Options& o, std::string_view v) { o.subgroup_size = parse_count("subgroup_size", v, 1, 1000000000000ULL); },
       [](const Options& o) { return std::to_string(o.subgroup_size); }},
      {"nvme_queue_depth", "1..4096", "the NVMe tier's requests in flight per transfer (io_uring queue depth)",
       [](Options& o, std::string_view v) { o.nvme_queue_depth = parse_count("nvme_queue_depth", v, 1, 4096); },
       [](const Options& o) { return std::to_string(o.nvme_queue_depth); }},
      {"nvme_block_size", "size, a multiple of 4KiB up to 1GiB", "bytes per NVMe tier request (direct I/O)",
       [](Options& o, std::string_view v) {
         o.nvme_block_size = parse_size("nvme_block_size", v, 4ULL << 10, 1ULL << 30);
         if (o.nvme_block_size % 4096 != 0) reject("nvme_block_size", v, "a multiple of 4KiB (direct I/O)");
       },
       [](const Options& o) { return format_bytes(o.nvme_block_size); }},
      {"cupti_library", "library file name or path (empty = libcupti.so.13, then libcupti.so)",
       "libcupti the CUPTI tracer loads first (dlopen), before libcupti.so.13 and libcupti.so",
       [](Options& o, std::string_view v) { o.cupti_library = std::string(v); },
       [](const Options& o) { return o.cupti_library.empty() ? std::string("libcupti.so.13, then libcupti.so") : o.cupti_library; }},
      {"topology", "hwloc XML file path (empty = this machine)",
       "GPU/NUMA topology to use instead of discovering this machine (planning for another machine, tests)",
       [](Options& o, std::string_view v) { o.topology = std::string(v); },
       [](const Options& o) { return o.topology.empty() ? std::string("this machine") : o.topology; }},
      {"host_slab_size", "size, 4KiB..1TiB", "size of each pinned host slab (mmap + mbind + touch + one registration)",
       [](Options& o, std::string_view v) { o.host_slab_size = parse_size("host_slab_size", v, 4ULL << 10, 1ULL << 40); },
       [](const Options& o) { return format_bytes(o.host_slab_size); }},
      {"host_max_bytes", "size (0 = no cap)", "cap on pinned host memory per arena",
       [](Options& o, std::string_view v) { o.host_max_bytes = parse_size("host_max_bytes", v, 0, 1ULL << 50); },
       [](const Options& o) { return o.host_max_bytes ? format_bytes(o.host_max_bytes) : std::string("none"); }},
      {"host_node", "-1..4095", "NUMA node for pinned host buffers; -1 = not bound",
       [](Options& o, std::string_view v) { o.host_node = parse_int("host_node", v, -1, 4095); },
       [](const Options& o) { return std::to_string(o.host_node); }},
      {"local_ranks", "0..4096", "ranks of the job on this machine, one per GPU: each GPU's local cpus are split among "
       "the ranks whose GPUs share them; 0 = torchrun's LOCAL_WORLD_SIZE, else 1",
       [](Options& o, std::string_view v) { o.local_ranks = parse_int("local_ranks", v, 0, 4096); },
       [](const Options& o) { return o.local_ranks ? std::to_string(o.local_ranks) : std::string("LOCAL_WORLD_SIZE or 1"); }},
      {"host_node_full", "strict | fallback",
       "when a NUMA node cannot hold a new slab: strict fails, fallback warns and lets it use other nodes",
       [](Options& o, std::string_view v) {
         if (v != "strict" && v != "fallback") reject("host_node_full", v, "strict or fallback");
         o.host_node_full = std::string(v);
       },
       [](const Options& o) { return o.host_node_full; }},
      {"host_huge_pages", "boolean", "ask for transparent huge pages in host slabs (first touch several times faster)",
       [](Options& o, std::string_view v) { o.host_huge_pages = parse_bool("host_huge_pages", v); },
       [](const Options& o) { return std::string(o.host_huge_pages ? "true" : "false"); }},
      {"pinned_heap_backend", "auto | jemalloc | mimalloc",
       "allocator that carves PinnedHeap's slabs; auto = jemalloc, mimalloc when jemalloc cannot be loaded",
       [](Options& o, std::string_view v) {
         if (v != "auto" && v != "jemalloc" && v != "mimalloc") reject("pinned_heap_backend", v, "auto, jemalloc or mimalloc");
         o.pinned_heap_backend = std::string(v);
       },
       [](const Options& o) { return o.pinned_heap_backend; }},
      {"pinned_heap_slab_size", "size, 2MiB..1TiB", "largest slab PinnedHeap asks of its slab source (slabs grow to it; larger requests get their own)",
       [](Options& o, std::string_view v) {
         o.pinned_heap_slab_size = parse_size("pinned_heap_slab_size", v, 2ULL << 20, 1ULL << 40);
       },
       [](const Options& o) { return format_bytes(o.pinned_heap_slab_size); }},
      {"pinned_heap_direct_threshold", "size (0 = never)",
       "PinnedHeap requests of at least this size skip jemalloc/mimalloc size classes and are cut page-exact from slabs",
       [](Options& o, std::string_view v) {
         o.pinned_heap_direct_threshold = parse_size("pinned_heap_direct_threshold", v, 0, 1ULL << 40);
       },
       [](const Options& o) {
         return o.pinned_heap_direct_threshold ? format_bytes(o.pinned_heap_direct_threshold) : std::string("never");
       }},
  };
  return table;
}

struct Global {
  std::mutex mutex;
  std::optional<Options> opts;
};

Global& global() {
  static Global g;
  return g;
}

// Edit distance, for naming the option a misspelt variable meant.
std::size_t distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

// MEMTIDE_* variables that are not options: memtide's own hand-offs between processes (the
// PYTORCH_CUDA_ALLOC_CONF hook), and those of its tests and scripts (*_TEST_*, *_CHECK_*).
bool is_internal_variable(std::string_view name) {
  return name == "MEMTIDE_TORCH_ALLOCATOR" || name.starts_with("MEMTIDE_ALLOC_CONF_") ||
         name.find("_TEST_") != std::string_view::npos || name.find("_CHECK_") != std::string_view::npos;
}

// Says once per process which MEMTIDE_* variables are no option (a typo would otherwise be
// ignored without a word), with the nearest option's name.
void warn_unknown_variables() {
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    if (!name.starts_with("MEMTIDE_") || is_internal_variable(name)) continue;
    std::string nearest;
    std::size_t best = SIZE_MAX;
    bool known = false;
    const std::string_view suffix = name.substr(8);  // after MEMTIDE_
    for (const OptionInfo& row : option_table()) {
      if (row.env == name) known = true;
      const std::size_t d = distance(suffix, std::string_view(row.env).substr(8));
      if (d < best) best = d, nearest = row.env;
    }
    if (known) continue;
    // Close enough to be a typo: up to 40% of the name edited (HOST_NUMA_NODE -> HOST_NODE).
    const bool typo = static_cast<double>(best) <= std::max(2.0, 0.4 * static_cast<double>(suffix.size()));
    MEMTIDE_LOG(warn, std::string(name) + " is not a memtide option and is ignored" +
                          (typo ? "; did you mean " + nearest + "?" : std::string()) +
                          " (memtide info lists the options)");
  }
}

}  // namespace

Options Options::from_env(const std::function<const char*(const char*)>& lookup) {
  Options o;
  for (const Row& row : rows()) {
    const std::string name = env_name(row.key);
    if (const char* value = lookup(name.c_str()); value != nullptr) row.parse(o, value);
  }
  return o;
}

void Options::set(std::string_view key, std::string_view value) {
  for (const Row& row : rows()) {
    if (key == row.key) {
      row.parse(*this, value);
      return;
    }
  }
  std::string known;
  for (const Row& row : rows()) known += std::string(known.empty() ? "" : ", ") + row.key;
  throw ConfigError("unknown memtide option \"" + std::string(key) + "\"; known options: " + known);
}

const std::vector<OptionInfo>& option_table() {
  static const std::vector<OptionInfo> info = [] {
    std::vector<OptionInfo> out;
    for (const Row& row : rows()) out.push_back({row.key, env_name(row.key), row.accepted, row.help});
    return out;
  }();
  return info;
}

const Options& options() {
  Global& g = global();
  bool first = false;
  {
    std::lock_guard lock(g.mutex);
    if (!g.opts) {
      g.opts = Options::from_env([](const char* name) { return std::getenv(name); });
      first = true;
    }
  }
  if (first) warn_unknown_variables();  // outside the lock: logging reads the environment itself
  return *g.opts;
}

void set_options(const Options& opts) {
  Global& g = global();
  std::lock_guard lock(g.mutex);
  g.opts = opts;
}

std::map<std::string, std::string> describe(const Options& opts) {
  std::map<std::string, std::string> out;
  for (const Row& row : rows()) out[row.key] = row.show(opts);
  return out;
}

}  // namespace memtide
