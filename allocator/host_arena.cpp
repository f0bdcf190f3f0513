#include "memtide/allocator/host_arena.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "memtide/core/os.hpp"
#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/log.hpp"
#include "memtide/core/options.hpp"
#include "memtide/core/thread_pool.hpp"
#include "memtide/device/device.hpp"

#ifdef MEMTIDE_HAVE_NUMA
#include <numa.h>
#endif

namespace memtide {
namespace {

// Set by an exit handler that each arena installs right after its first registration with the
// device. The device runtime (cudart) installs its own teardown when it is initialized, which is
// at or before that registration, so this handler runs first; and it runs before the destructor
// of any arena constructed before the registration, a static one included.
std::atomic<bool> g_process_exiting{false};
void mark_exiting() noexcept { g_process_exiting.store(true, std::memory_order_relaxed); }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

bool is_pow2(std::size_t v) { return v != 0 && (v & (v - 1)) == 0; }

/// Rounds up to a power-of-two multiple; false on overflow.
bool round_up(std::size_t v, std::size_t multiple, std::size_t& out) {
  if (v > std::numeric_limits<std::size_t>::max() - (multiple - 1)) return false;
  out = (v + multiple - 1) & ~(multiple - 1);
  return true;
}

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

std::string node_name(int node) { return node < 0 ? std::string("unbound") : "node " + std::to_string(node); }

std::string join(const std::vector<int>& v) {
  std::string out;
  for (int n : v) out += (out.empty() ? "" : ", ") + std::to_string(n);
  return out.empty() ? std::string("none") : out;
}

/// "0-1,3" -> {0, 1, 3}, as sysfs writes node lists.
std::vector<int> parse_list(const std::string& text) {
  std::vector<int> out;
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, ',')) {
    if (part.empty() || part == "\n") continue;
    const auto dash = part.find('-');
    try {
      const int lo = std::stoi(part.substr(0, dash));
      const int hi = dash == std::string::npos ? lo : std::stoi(part.substr(dash + 1));
      for (int n = lo; n <= hi && n - lo < 65536; ++n) out.push_back(n);
    } catch (const std::exception&) {
      return {};
    }
  }
  return out;
}

/// A value in kB from a meminfo-style file ("MemAvailable:  123 kB" or "Node 0 MemFree:  123 kB").
std::uint64_t meminfo_kb(const std::string& path, const std::string& key, bool& found) {
  std::ifstream in(path);
  std::string line;
  found = false;
  std::uint64_t total = 0;
  while (std::getline(in, line)) {
    const auto pos = line.find(key + ":");
    if (pos == std::string::npos) continue;
    if (pos != 0 && line[pos - 1] != ' ') continue;  // "Inactive(file)" must not match "Active(file)"
    total += std::strtoull(line.c_str() + pos + key.size() + 1, nullptr, 10);
    found = true;
  }
  return total;
}

/// Bytes a new pinned slab can take without pushing the kernel into the OOM killer: free memory
/// plus reclaimable page cache and slab. `node` -1 = the whole machine.
std::uint64_t available_bytes(int node, std::uint64_t fallback) {
  bool found = false;
  if (node < 0) {
    const std::uint64_t kb = meminfo_kb("/proc/meminfo", "MemAvailable", found);
    return found ? kb << 10 : fallback;
  }
  const std::string path = "/sys/devices/system/node/node" + std::to_string(node) + "/meminfo";
  std::uint64_t kb = meminfo_kb(path, "MemFree", found);
  if (!found) return fallback;
  bool f = false;
  kb += meminfo_kb(path, "Active(file)", f);
  kb += meminfo_kb(path, "Inactive(file)", f);
  kb += meminfo_kb(path, "SReclaimable", f);
  return kb << 10;
}

void warn_unbound_once(int node, const char* why) {
  static std::once_flag once;
  std::call_once(once, [&] {
    MEMTIDE_LOG(warn, std::string("HostArena: ") + why + ": slabs for NUMA node " + std::to_string(node) +
                          " are not bound; the kernel places their pages (first touch); placement is reported as unknown");
  });
}

}  // namespace

NodeFullPolicy parse_node_full_policy(const std::string& name) {
  if (name == "strict") return NodeFullPolicy::strict;
  if (name == "fallback") return NodeFullPolicy::fallback;
  throw ConfigError("host_node_full \"" + name + "\" is not accepted: expected strict or fallback");
}

HostArenaConfig HostArenaConfig::from_options() {
  const Options& o = options();
  HostArenaConfig c;
  c.slab_bytes = static_cast<std::size_t>(o.host_slab_size);
  c.max_bytes = o.host_max_bytes;
  c.on_node_full = parse_node_full_policy(o.host_node_full);
  c.huge_pages = o.host_huge_pages;
  return c;
}

// ---- placement --------------------------------------------------------------------------------

bool PlacementReport::on_wanted_node() const {
  if (!known || pages_sampled == 0 || pages_not_present != 0) return false;
  if (wanted_node < 0) return true;
  const auto it = pages_per_node.find(wanted_node);
  return it != pages_per_node.end() && it->second == pages_sampled;
}

std::string PlacementReport::describe() const {
  if (!known) return "placement unknown (" + reason + ")";
  std::string s = std::to_string(pages_sampled) + " pages sampled:";
  for (const auto& [node, pages] : pages_per_node) s += " node " + std::to_string(node) + ": " + std::to_string(pages) + ";";
  if (pages_not_present != 0) s += " not present: " + std::to_string(pages_not_present) + ";";
  if (wanted_node < 0) return s + " (not bound)";
  return s + (on_wanted_node() ? " (all on node " : " (NOT all on node ") + std::to_string(wanted_node) + ")";
}

bool HostArena::numa_supported() {
#ifdef MEMTIDE_HAVE_NUMA
  static const bool ok = numa_available() >= 0;
  return ok;
#else
  return false;
#endif
}

std::vector<int> HostArena::valid_numa_nodes() {
  std::vector<int> out;
#ifdef MEMTIDE_HAVE_NUMA
  if (numa_supported()) {
    // libnuma accepts a node that does not exist (mbind then fails with only a printed warning),
    // so a node must be in the allowed set and have memory.
    const int max_node = numa_max_node();
    for (int n = 0; n <= max_node; ++n) {
      if (numa_bitmask_isbitset(numa_all_nodes_ptr, static_cast<unsigned>(n)) && numa_node_size64(n, nullptr) > 0) {
        out.push_back(n);
      }
    }
    return out;
  }
#endif
  std::ifstream in("/sys/devices/system/node/has_memory");
  std::string text;
  std::getline(in, text);
  out = parse_list(text);
  if (out.empty()) out.push_back(0);  // no NUMA information: the machine is one node
  return out;
}

PlacementReport HostArena::verify_placement(const void* p, std::size_t bytes, std::size_t max_samples) const {
  if (p == nullptr || bytes == 0) {
    throw InvalidArgument("HostArena::verify_placement: empty range (pointer " + hex(p) + ", " + std::to_string(bytes) +
                          " bytes)");
  }
  PlacementReport r;
  r.wanted_node = config_.numa_node;
#ifdef MEMTIDE_HAVE_NUMA
  if (!numa_supported()) {
    r.reason = "the kernel reports no NUMA support";
    return r;
  }
  const auto first = reinterpret_cast<std::uintptr_t>(p) & ~(page_bytes_ - 1);
  const auto last = (reinterpret_cast<std::uintptr_t>(p) + bytes - 1) & ~(page_bytes_ - 1);
  const std::size_t pages = (last - first) / page_bytes_ + 1;
  const std::size_t samples = std::max<std::size_t>(1, std::min(pages, max_samples));
  std::vector<void*> addrs(samples);
  std::vector<int> status(samples, 0);
  for (std::size_t i = 0; i < samples; ++i) {
    const std::size_t page = samples == 1 ? 0 : (pages - 1) * i / (samples - 1);
    addrs[i] = reinterpret_cast<void*>(first + page * page_bytes_);
  }
  if (const int err = os::page_nodes(addrs.data(), samples, status.data()); err != 0) {
    r.reason = std::string("move_pages failed: ") + std::strerror(err);
    return r;
  }
  r.known = true;
  r.pages_sampled = samples;
  for (int s : status) {
    if (s >= 0) ++r.pages_per_node[s];
    else ++r.pages_not_present;  // -ENOENT: never touched; -EFAULT: not mapped
  }
#else
  (void)max_samples;
  r.reason = "memtide was built without libnuma";
#endif
  return r;
}

// ---- construction -----------------------------------------------------------------------------

HostArena::HostArena(HostArenaConfig config)
    : config_(config),
      page_bytes_(static_cast<std::size_t>(sysconf(_SC_PAGESIZE))),
      physical_bytes_(static_cast<std::uint64_t>(sysconf(_SC_PHYS_PAGES)) * page_bytes_),
      bind_(false) {
  if (!is_pow2(config_.alignment) || config_.alignment > (std::size_t{1} << 30)) {
    throw InvalidArgument("HostArena: alignment " + std::to_string(config_.alignment) +
                          " is not accepted: expected a power of two from 1 to 1 GiB");
  }
  if (config_.slab_bytes == 0 || config_.slab_bytes > physical_bytes_) {
    throw InvalidArgument("HostArena: slab size " + std::to_string(config_.slab_bytes) +
                          " bytes is not accepted: expected 1 byte to the machine's memory (" +
                          format_bytes(physical_bytes_) + ")");
  }
  if (config_.numa_node < -1) {
    throw InvalidArgument("HostArena: NUMA node " + std::to_string(config_.numa_node) +
                          " is not accepted: expected -1 (not bound) or one of " + join(valid_numa_nodes()));
  }
  if (config_.numa_node >= 0) {
    const std::vector<int> valid = valid_numa_nodes();
    if (std::find(valid.begin(), valid.end(), config_.numa_node) == valid.end()) {
      throw InvalidArgument("HostArena: NUMA node " + std::to_string(config_.numa_node) +
                            " does not exist or has no memory here; valid nodes: " + join(valid) + " (or -1 for not bound)");
    }
#ifdef MEMTIDE_HAVE_NUMA
    if (numa_supported()) bind_ = true;
    else warn_unbound_once(config_.numa_node, "the kernel reports no NUMA support");
#else
    warn_unbound_once(config_.numa_node, "memtide was built without libnuma");
#endif
  }
}

HostArena::~HostArena() {
  if (g_process_exiting.load(std::memory_order_relaxed)) return;  // the OS reclaims everything
  std::vector<Slab> all;
  {
    std::lock_guard lock(mutex_);
    if (stats_.allocations != 0 || stats_.whole_slabs != 0) {
      MEMTIDE_LOG(warn, "HostArena destroyed with " + std::to_string(stats_.allocations) + " live buffer(s) (" +
                            format_bytes(stats_.allocated_bytes) + ") and " + std::to_string(stats_.whole_slabs) +
                            " whole slab(s) still handed out; unmapping them");
    }
    for (auto& [addr, slab] : slabs_) all.push_back(slab);
    slabs_.clear();
    blocks_.clear();
    free_.clear();
  }
  for (const Slab& s : all) destroy_slab(s);
}

// ---- slabs ------------------------------------------------------------------------------------

std::size_t HostArena::round_request(std::size_t bytes, const char* what) const {
  if (bytes == 0) throw InvalidArgument(std::string("HostArena::") + what + ": zero bytes requested");
  std::size_t out = 0;
  if (!round_up(bytes, config_.alignment, out)) {
    throw InvalidArgument(std::string("HostArena::") + what + ": " + std::to_string(bytes) +
                          " bytes overflow when rounded up to the alignment (" + std::to_string(config_.alignment) + ")");
  }
  return out;
}

void HostArena::check_capacity_locked(std::size_t bytes, std::size_t requested) const {
  const std::string head = "HostArena (" + node_name(config_.numa_node) + "): cannot allocate " +
                           format_bytes(requested) + " (new slab of " + format_bytes(bytes) + "): ";
  if (config_.max_bytes != 0 && stats_.reserved_bytes + bytes > config_.max_bytes) {
    throw OutOfMemory(head + "the arena's cap host_max_bytes is " + format_bytes(config_.max_bytes) + "; " + describe_locked());
  }
  if (bytes > physical_bytes_) {
    throw OutOfMemory(head + "larger than the machine's physical memory (" + format_bytes(physical_bytes_) + "); " +
                      describe_locked());
  }
  if (!bind_) {
    // Pinned pages cannot be swapped: a slab larger than what is available would end in the OOM killer.
    const std::uint64_t avail = available_bytes(-1, physical_bytes_);
    if (bytes > avail) {
      throw OutOfMemory(head + "only " + format_bytes(avail) + " of the machine's " + format_bytes(physical_bytes_) +
                        " is available; " + describe_locked());
    }
  }
}

HostArena::Slab HostArena::make_slab(std::size_t bytes, std::size_t alignment) {
  Slab s;
  s.bytes = bytes;
  auto t0 = std::chrono::steady_clock::now();

  int mode = -1;  // no mbind
  if (bind_) {
    mode = 0;  // MPOL_BIND
#ifdef MEMTIDE_HAVE_NUMA
    long long free_bytes = 0;
    const long long total = numa_node_size64(config_.numa_node, &free_bytes);
    const std::uint64_t avail = available_bytes(config_.numa_node, static_cast<std::uint64_t>(std::max(0LL, free_bytes)));
    if (bytes > avail) {
      const std::string what = "NUMA node " + std::to_string(config_.numa_node) + " has " + format_bytes(avail) +
                               " available (of " + format_bytes(static_cast<std::uint64_t>(std::max(0LL, total))) +
                               "); a slab of " + format_bytes(bytes) + " does not fit";
      if (config_.on_node_full == NodeFullPolicy::strict) {
        throw OutOfMemory("HostArena: " + what + " (host_node_full=strict; fallback places it on other nodes instead)");
      }
      const std::uint64_t machine = available_bytes(-1, physical_bytes_);
      if (bytes > machine) {
        throw OutOfMemory("HostArena: " + what + ", and the machine has only " + format_bytes(machine) + " available");
      }
      MEMTIDE_LOG(warn, "HostArena: " + what + "; host_node_full=fallback: this slab prefers node " +
                            std::to_string(config_.numa_node) + " and may land on other nodes");
      mode = 1;  // MPOL_PREFERRED
    }
#endif
  }

  // Huge pages need 2 MiB-aligned ranges to be used end to end.
  constexpr std::size_t kHugePage = std::size_t{2} << 20;
  if (config_.huge_pages && bytes >= kHugePage) alignment = std::max(alignment, kHugePage);
  int err = 0;
  s.base = static_cast<char*>(os::map(bytes, alignment, false, err));
  if (s.base == nullptr) {
    throw OutOfMemory("HostArena: mmap of " + format_bytes(bytes) + " failed: " + std::strerror(err));
  }
  // Advice only: EINVAL where the kernel has no THP, and the pages are then 4 KiB.
  if (config_.huge_pages && bytes >= kHugePage) (void)os::advise_huge_pages(s.base, bytes);

  if (mode >= 0) {
    // Strict binding fails rather than keep pages elsewhere (none exist yet on a fresh mapping).
    if (const int e = os::bind_to_node(s.base, bytes, config_.numa_node, mode == 0); e != 0) {
      (void)os::unmap(s.base, bytes);
      throw Error("HostArena: mbind of " + format_bytes(bytes) + " to NUMA node " + std::to_string(config_.numa_node) +
                  " failed: " + std::strerror(e));
    }
    s.node = mode == 0 ? config_.numa_node : -1;
    s.fallback = mode == 1;
  }
  const double map_s = seconds_since(t0);

  // First touch: a write per page faults it in under the mbind policy. Reads would map the
  // shared zero page and allocate nothing.
  t0 = std::chrono::steady_clock::now();
  const std::size_t pages = bytes / page_bytes_;
  char* base = s.base;
  const std::size_t page = page_bytes_;
  auto touch = [base, page](std::size_t from, std::size_t to) {
    for (std::size_t i = from; i < to; ++i) static_cast<volatile char*>(base)[i * page] = 0;
  };
  if (config_.toucher != nullptr && config_.toucher->size() > 1 && pages > 1) {
    const std::size_t chunks = std::min(pages, config_.toucher->size());
    config_.toucher->parallel_for(chunks, [&](std::size_t c) { touch(pages * c / chunks, pages * (c + 1) / chunks); });
  } else {
    touch(0, pages);
  }
  const double touch_s = seconds_since(t0);

  t0 = std::chrono::steady_clock::now();
  if (config_.device != nullptr) {
    try {
      config_.device->host_register(s.base, bytes);
    } catch (...) {
      (void)os::unmap(s.base, bytes);
      throw;
    }
    s.registered = true;
  }
  const double register_s = seconds_since(t0);

  {
    std::lock_guard lock(mutex_);
    stats_.map_bind_seconds += map_s;
    stats_.touch_seconds += touch_s;
    stats_.register_seconds += register_s;
    if (s.registered && !exit_guard_installed_) {
      exit_guard_installed_ = std::atexit(mark_exiting) == 0;
    }
  }
  if (log_enabled(LogLevel::debug)) {
    log_message(LogLevel::debug, "HostArena: slab of " + format_bytes(bytes) + " at " + hex(s.base) + " (" +
                                     node_name(s.node) + (s.fallback ? ", fallback" : "") + "): map+bind " +
                                     format_duration_ns(map_s * 1e9) + ", touch " + format_duration_ns(touch_s * 1e9) +
                                     ", register " + format_duration_ns(register_s * 1e9) + "; " +
                                     verify_placement(s.base, bytes).describe());
  }
  return s;
}

void HostArena::destroy_slab(const Slab& slab) noexcept {
  if (slab.registered && config_.device != nullptr) {
    try {
      config_.device->host_unregister(slab.base);  // before munmap: the driver holds the pages
    } catch (const std::exception& e) {
      MEMTIDE_LOG(error, std::string("HostArena: unregistering a slab failed: ") + e.what());
    }
  }
  if (const int err = os::unmap(slab.base, slab.bytes); err != 0) {
    MEMTIDE_LOG(error, "HostArena: munmap of " + format_bytes(slab.bytes) + " at " + hex(slab.base) +
                           " failed: " + std::strerror(err));
  }
}

// ---- sub-allocation ---------------------------------------------------------------------------

HostArena::Nodes HostArena::Nodes::make(bool block, bool free) {
  Nodes n;
  if (block) {
    BlockMap m;
    m.emplace(0, Block{});
    n.block = m.extract(m.begin());
  }
  if (free) {
    FreeSet f;
    f.insert({0, 0});
    n.free = f.extract(f.begin());
  }
  return n;
}

HostArena::BlockMap::iterator HostArena::find_fit_locked(std::size_t bytes) {
  const auto f = free_.lower_bound({bytes, 0});
  if (f == free_.end()) return blocks_.end();
  return blocks_.find(f->second);
}

void* HostArena::take_block_locked(BlockMap::iterator it, std::size_t bytes, Nodes& nodes) noexcept {
  Block& b = it->second;
  free_.erase({b.size, it->first});
  if (b.size > bytes) {  // sizes are multiples of the alignment, so the rest is aligned too
    nodes.block.key() = it->first + bytes;
    nodes.block.mapped() = Block{b.size - bytes, b.slab, true};
    blocks_.insert(std::move(nodes.block));
    nodes.free.value() = {b.size - bytes, it->first + bytes};
    free_.insert(std::move(nodes.free));
    b.size = bytes;
  }
  b.free = false;
  ++b.slab->live;
  ++stats_.allocations;
  stats_.allocated_bytes += bytes;
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  return reinterpret_cast<void*>(it->first);
}

HostArena::SlabNode HostArena::adopt_slab(const Slab& made, std::unique_lock<std::mutex>& lock) {
  try {
    decltype(slabs_) one;
    one.emplace(reinterpret_cast<std::uintptr_t>(made.base), made);
    SlabNode node = one.extract(one.begin());
    lock = std::unique_lock(mutex_);
    stats_.bytes_per_node.try_emplace(made.node, 0);
    return node;
  } catch (...) {
    if (lock.owns_lock()) lock.unlock();
    destroy_slab(made);
    throw;
  }
}

void HostArena::count_slab_locked(const Slab& s) noexcept {
  ++stats_.slabs;
  stats_.reserved_bytes += s.bytes;
  stats_.bytes_per_node[s.node] += s.bytes;  // the key exists (see the callers)
  if (s.registered) ++stats_.registered_slabs;
  if (s.fallback) ++stats_.fallback_slabs;
}

void* HostArena::allocate(std::size_t bytes) {
  const std::size_t need = round_request(bytes, "allocate");
  Nodes split = Nodes::make(true, true);  // before anything changes
  {
    std::lock_guard lock(mutex_);
    if (auto it = find_fit_locked(need); it != blocks_.end()) return take_block_locked(it, need, split);
  }
  std::lock_guard grow(grow_);
  const std::size_t unit = std::max(page_bytes_, config_.alignment);
  std::size_t slab_bytes = 0;
  {
    std::lock_guard lock(mutex_);
    // Another thread may have mapped a slab while this one waited.
    if (auto it = find_fit_locked(need); it != blocks_.end()) return take_block_locked(it, need, split);
    std::size_t minimal = 0;
    if (!round_up(need, unit, minimal)) {
      throw InvalidArgument("HostArena::allocate: " + std::to_string(bytes) + " bytes overflow when rounded up to a page");
    }
    round_up(std::max(config_.slab_bytes, minimal), unit, slab_bytes);
    // Near the cap, a smaller slab that holds just this buffer is better than failing.
    if (config_.max_bytes != 0 && stats_.reserved_bytes + slab_bytes > config_.max_bytes) slab_bytes = minimal;
    check_capacity_locked(slab_bytes, need);
  }
  Nodes whole = Nodes::make(true, true);  // the new slab's block and free entry
  std::unique_lock<std::mutex> lock;
  SlabNode slab_node = adopt_slab(make_slab(slab_bytes, unit), lock);
  Slab* slab = &slab_node.mapped();  // node storage: stays put when inserted
  const std::uintptr_t base = slab_node.key();
  const Slab made = *slab;
  slabs_.insert(std::move(slab_node));
  count_slab_locked(made);
  whole.block.key() = base;
  whole.block.mapped() = Block{made.bytes, slab, true};
  auto bit = blocks_.insert(std::move(whole.block)).position;
  whole.free.value() = {made.bytes, base};
  free_.insert(std::move(whole.free));
  return take_block_locked(bit, need, split);
}

void HostArena::deallocate(void* ptr) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  Nodes entry = Nodes::make(false, true);  // the free entry, before anything changes
  std::lock_guard lock(mutex_);
  auto it = blocks_.find(addr);
  if (it == blocks_.end() || it->second.free) {
    throw InvalidArgument("HostArena::deallocate: " + hex(ptr) +
                          " is not a live buffer of this arena (allocated elsewhere, or freed already)");
  }
  Block& b = it->second;
  b.free = true;
  --b.slab->live;
  --stats_.allocations;
  stats_.allocated_bytes -= b.size;
  // Coalesce with free neighbours of the same slab (two slabs may be adjacent in memory).
  if (auto next = std::next(it); next != blocks_.end() && next->second.free && next->second.slab == b.slab &&
                                 addr + b.size == next->first) {
    free_.erase({next->second.size, next->first});
    b.size += next->second.size;
    blocks_.erase(next);
  }
  if (it != blocks_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.free && prev->second.slab == b.slab && prev->first + prev->second.size == addr) {
      free_.erase({prev->second.size, prev->first});
      prev->second.size += b.size;
      blocks_.erase(it);
      it = prev;
    }
  }
  entry.free.value() = {it->second.size, it->first};
  free_.insert(std::move(entry.free));
}

std::size_t HostArena::allocation_size(const void* ptr) const {
  std::lock_guard lock(mutex_);
  const auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(ptr));
  return it == blocks_.end() || it->second.free ? 0 : it->second.size;
}

std::size_t HostArena::release_free_slabs() {
  std::vector<Slab> gone;
  {
    std::lock_guard lock(mutex_);
    gone.reserve(slabs_.size());  // the one allocation, before anything changes
    for (auto it = slabs_.begin(); it != slabs_.end();) {
      const Slab& s = it->second;
      if (s.whole || s.live != 0) {
        ++it;
        continue;
      }
      // No live buffer: coalescing has left one free block spanning the slab.
      free_.erase({s.bytes, it->first});
      blocks_.erase(it->first);
      --stats_.slabs;
      ++stats_.slabs_released;
      stats_.reserved_bytes -= s.bytes;
      stats_.bytes_per_node[s.node] -= s.bytes;
      if (s.registered) --stats_.registered_slabs;
      if (s.fallback) --stats_.fallback_slabs;
      gone.push_back(s);
      it = slabs_.erase(it);
    }
  }
  std::size_t bytes = 0;
  for (const Slab& s : gone) {
    bytes += s.bytes;
    destroy_slab(s);
  }
  return bytes;
}

// ---- whole slabs (SlabSource) -----------------------------------------------------------------

HostSlab HostArena::do_map_slab(std::size_t bytes, std::size_t alignment) {
  if (bytes == 0) throw InvalidArgument("HostArena::map_slab: zero bytes requested");
  if (!is_pow2(alignment) || alignment > (std::size_t{1} << 30)) {
    throw InvalidArgument("HostArena::map_slab: alignment " + std::to_string(alignment) +
                          " is not accepted: expected a power of two from 1 to 1 GiB");
  }
  const std::size_t unit = std::max(page_bytes_, alignment);
  std::size_t size = 0;
  if (!round_up(bytes, unit, size)) {
    throw InvalidArgument("HostArena::map_slab: " + std::to_string(bytes) + " bytes overflow when rounded up to " +
                          std::to_string(unit));
  }
  std::lock_guard grow(grow_);
  {
    std::lock_guard lock(mutex_);
    check_capacity_locked(size, bytes);
  }
  Slab made = make_slab(size, unit);
  made.whole = true;
  std::unique_lock<std::mutex> lock;
  SlabNode slab_node = adopt_slab(made, lock);
  slabs_.insert(std::move(slab_node));
  count_slab_locked(made);
  ++stats_.whole_slabs;
  return HostSlab{made.base, made.bytes, made.node, made.registered};
}

void HostArena::do_unmap_slab(const HostSlab& slab) {
  Slab s;
  {
    std::lock_guard lock(mutex_);
    auto it = slabs_.find(reinterpret_cast<std::uintptr_t>(slab.ptr));
    if (it == slabs_.end() || !it->second.whole || it->second.bytes != slab.bytes) {
      throw InvalidArgument("HostArena::unmap_slab: " + hex(slab.ptr) + " (" + std::to_string(slab.bytes) +
                            " bytes) is not a slab handed out by this arena's map_slab");
    }
    s = it->second;
    slabs_.erase(it);
    --stats_.slabs;
    --stats_.whole_slabs;
    stats_.reserved_bytes -= s.bytes;
    stats_.bytes_per_node[s.node] -= s.bytes;
    if (s.registered) --stats_.registered_slabs;
    if (s.fallback) --stats_.fallback_slabs;
  }
  destroy_slab(s);
}

// ---- reporting --------------------------------------------------------------------------------

HostArenaStats HostArena::stats() const {
  std::lock_guard lock(mutex_);
  HostArenaStats s = stats_;
  for (auto it = s.bytes_per_node.begin(); it != s.bytes_per_node.end();) {
    it = it->second == 0 ? s.bytes_per_node.erase(it) : std::next(it);
  }
  return s;
}

std::vector<HostSlab> HostArena::slabs() const {
  std::lock_guard lock(mutex_);
  std::vector<HostSlab> out;
  for (const auto& [addr, s] : slabs_) out.push_back(HostSlab{s.base, s.bytes, s.node, s.registered});
  return out;
}

std::string HostArena::describe_locked() const {
  std::size_t largest = free_.empty() ? 0 : free_.rbegin()->first;
  return "reserved " + format_bytes(stats_.reserved_bytes) + " in " + std::to_string(stats_.slabs) + " slab(s), allocated " +
         format_bytes(stats_.allocated_bytes) + ", largest free block " + format_bytes(largest);
}

}  // namespace memtide
