#include "memtide/device/topology.hpp"

#include <sched.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include "memtide/core/error.hpp"
#include "memtide/core/log.hpp"
#include "memtide/core/options.hpp"
#include "memtide/device/device.hpp"

#ifdef MEMTIDE_HAVE_HWLOC
#include <dlfcn.h>
#include <hwloc.h>
#endif

namespace memtide {

#ifdef MEMTIDE_HAVE_CUDA
// cuda_topology.cpp: bus id and name of every CUDA ordinal; false when CUDA cannot say.
bool cuda_pci_devices(std::vector<std::string>& bus_ids, std::vector<std::string>& names);
#endif

namespace fs = std::filesystem;

namespace {

constexpr unsigned kNvidiaVendor = 0x10de;

bool is_gpu_class(unsigned class_id) { return class_id == 0x0300 || class_id == 0x0302; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::optional<unsigned long> parse_hex(std::string_view s) {
  s = trim(s);
  if (s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) s.remove_prefix(2);
  unsigned long v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 16);
  if (s.empty() || ec != std::errc{} || end != s.data() + s.size()) return std::nullopt;
  return v;
}

std::string hex4(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%04x", v);
  return buf;
}

std::string fallback_name(unsigned device_id) { return "NVIDIA [10de:" + hex4(device_id) + "]"; }

std::optional<std::string> read_text(const fs::path& p) {
  std::ifstream in(p);
  if (!in) return std::nullopt;
  std::ostringstream ss;
  ss << in.rdbuf();
  return std::string(trim(ss.str()));
}

// The node with the most memory, lowest os_index on a tie (nodes are sorted by os_index).
const NumaNode& largest_node(const std::vector<NumaNode>& nodes) {
  const NumaNode* best = &nodes.front();
  for (const NumaNode& n : nodes) {
    if (n.memory_bytes > best->memory_bytes) best = &n;
  }
  return *best;
}

// ---- sysfs ----------------------------------------------------------------------------------

std::uint64_t node_memory(const fs::path& node_dir) {
  // "Node 0 MemTotal:       24683108 kB"
  std::ifstream in(node_dir / "meminfo");
  std::string line;
  while (std::getline(in, line)) {
    const auto at = line.find("MemTotal:");
    if (at == std::string::npos) continue;
    std::istringstream rest(line.substr(at + 9));
    std::uint64_t kb = 0;
    if (rest >> kb) return kb * 1024;
  }
  return 0;
}

std::vector<NumaNode> sysfs_nodes(const fs::path& root) {
  std::vector<NumaNode> nodes;
  const fs::path dir = root / "devices/system/node";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() < 5 || name.compare(0, 4, "node") != 0) continue;
    int index = 0;
    auto [end, perr] = std::from_chars(name.data() + 4, name.data() + name.size(), index);
    if (perr != std::errc{} || end != name.data() + name.size()) continue;
    NumaNode node;
    node.os_index = index;
    if (auto text = read_text(entry.path() / "cpulist")) node.cpus = parse_cpu_list(*text);
    node.memory_bytes = node_memory(entry.path());
    nodes.push_back(std::move(node));
  }
  if (nodes.empty()) {
    // A kernel without NUMA support: one node holding every online cpu.
    NumaNode node;
    if (auto text = read_text(root / "devices/system/cpu/online")) node.cpus = parse_cpu_list(*text);
    nodes.push_back(std::move(node));
  }
  return nodes;
}

// bus/pci/devices/<id> links to devices/pci0000:00/0000:00:01.0/0000:01:00.0: the "pci..." part
// is the host bridge, the rest the bridges down to the device.
std::vector<std::string> sysfs_pci_path(const fs::path& device_link, const std::string& bus_id) {
  std::error_code ec;
  const fs::path real = fs::canonical(device_link, ec);
  std::vector<std::string> path;
  if (!ec) {
    for (const fs::path& part : real) {
      const std::string s = part.string();
      if (s.size() > 3 && s.compare(0, 3, "pci") == 0) {
        path.assign(1, s);
      } else if (!path.empty()) {
        try {
          path.push_back(normalize_pci_bus_id(s));
        } catch (const InvalidArgument&) {
          path.clear();  // not a PCI hierarchy after all
        }
      }
    }
  }
  if (path.size() < 2 || path.back() != bus_id) path = {"", bus_id};
  return path;
}

// ---- hwloc ----------------------------------------------------------------------------------

#ifdef MEMTIDE_HAVE_HWLOC
// hwloc's plugins (libxml2 XML import, libpciaccess, ...) look up libhwloc's symbols globally. When
// libmemtide.so and with it libhwloc were dlopened RTLD_LOCAL, as Python loads extensions, every
// plugin fails with "undefined symbol" and XML files fall back to hwloc's minimal parser. Promoting
// the already loaded libhwloc to RTLD_GLOBAL lets them load.
void make_hwloc_plugins_loadable() {
  static std::once_flag once;
  std::call_once(once, [] {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&hwloc_topology_init), &info) != 0 && info.dli_fname != nullptr) {
      (void)dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);  // kept open for the process
    }
  });
}

struct HwlocTopology {
  hwloc_topology_t t = nullptr;
  HwlocTopology() {
    make_hwloc_plugins_loadable();
    if (hwloc_topology_init(&t) != 0) throw Error("hwloc_topology_init failed");
  }
  ~HwlocTopology() { hwloc_topology_destroy(t); }
  HwlocTopology(const HwlocTopology&) = delete;
  HwlocTopology& operator=(const HwlocTopology&) = delete;
};

std::vector<int> bitmap_cpus(hwloc_const_bitmap_t set) {
  std::vector<int> cpus;
  if (set == nullptr) return cpus;
  for (int i = hwloc_bitmap_first(set); i >= 0; i = hwloc_bitmap_next(set, i)) cpus.push_back(i);
  return cpus;
}

std::string hwloc_bus_id(const hwloc_obj_attr_u::hwloc_pcidev_attr_s& a) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%04x:%02x:%02x.%x", static_cast<unsigned>(a.domain), static_cast<unsigned>(a.bus),
                static_cast<unsigned>(a.dev), static_cast<unsigned>(a.func));
  return buf;
}

std::vector<std::string> hwloc_pci_path(hwloc_obj_t dev, const std::string& bus_id) {
  std::vector<std::string> up{bus_id};
  bool host_found = false;
  for (hwloc_obj_t o = dev->parent; o != nullptr && o->type == HWLOC_OBJ_BRIDGE; o = o->parent) {
    const auto& b = o->attr->bridge;
    // hwloc stores the integer an XML file gives, in range or not; reading it as the enum would
    // be undefined for a hostile file (found by the topology fuzzer), so read the integer.
    int upstream = 0;
    static_assert(sizeof upstream == sizeof b.upstream_type);
    std::memcpy(&upstream, &b.upstream_type, sizeof upstream);
    if (upstream == static_cast<int>(HWLOC_OBJ_BRIDGE_HOST)) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "pci%04x:%02x", static_cast<unsigned>(b.downstream.pci.domain),
                    static_cast<unsigned>(b.downstream.pci.secondary_bus));
      up.emplace_back(buf);
      host_found = true;
      break;
    }
    up.push_back(hwloc_bus_id(b.upstream.pci));
  }
  if (!host_found) up.emplace_back();
  return {up.rbegin(), up.rend()};
}

std::string hwloc_gpu_name(hwloc_obj_t dev) {
  if (const char* n = hwloc_obj_get_info_by_name(dev, "PCIDevice"); n != nullptr && *n != '\0') return n;
  // The CUDA, NVML and OpenCL backends put the model on the GPU's OS device.
  for (hwloc_obj_t c = dev->io_first_child; c != nullptr; c = c->next_sibling) {
    if (const char* n = hwloc_obj_get_info_by_name(c, "GPUModel"); n != nullptr && *n != '\0') return n;
  }
  return fallback_name(dev->attr->pcidev.device_id);
}

Topology read_hwloc(hwloc_topology_t t, std::string source) {
  std::vector<NumaNode> nodes;
  for (hwloc_obj_t n = hwloc_get_next_obj_by_type(t, HWLOC_OBJ_NUMANODE, nullptr); n != nullptr;
       n = hwloc_get_next_obj_by_type(t, HWLOC_OBJ_NUMANODE, n)) {
    NumaNode node;
    node.os_index = static_cast<int>(n->os_index);
    node.memory_bytes = n->attr != nullptr ? n->attr->numanode.local_memory : 0;
    node.cpus = bitmap_cpus(n->cpuset);
    nodes.push_back(std::move(node));
  }
  const hwloc_obj_t root = hwloc_get_root_obj(t);
  std::vector<GpuInfo> gpus;
  for (hwloc_obj_t d = hwloc_get_next_obj_by_type(t, HWLOC_OBJ_PCI_DEVICE, nullptr); d != nullptr;
       d = hwloc_get_next_obj_by_type(t, HWLOC_OBJ_PCI_DEVICE, d)) {
    const auto& a = d->attr->pcidev;
    if (a.vendor_id != kNvidiaVendor || !is_gpu_class(a.class_id)) continue;
    GpuInfo g;
    g.pci_bus_id = hwloc_bus_id(a);
    g.name = hwloc_gpu_name(d);
    g.pci_path = hwloc_pci_path(d, g.pci_bus_id);
    const hwloc_obj_t anc = hwloc_get_non_io_ancestor_obj(t, d);
    g.cpus = bitmap_cpus(anc->cpuset);
    // hwloc hangs a device whose firmware gave no affinity under the root. With one node that
    // still says where it is; with several it says nothing.
    g.locality_known = anc != root || nodes.size() == 1;
    if (g.locality_known) {
      hwloc_location loc{};
      loc.type = HWLOC_LOCATION_TYPE_CPUSET;
      loc.location.cpuset = anc->cpuset;
      // SMALLER_LOCALITY first: with sub-NUMA clustering the nodes sit below the GPU's package.
      // LARGER_LOCALITY when that finds none: the GPU hangs below its node (under a die or cache).
      for (unsigned long flag : {HWLOC_LOCAL_NUMANODE_FLAG_SMALLER_LOCALITY, HWLOC_LOCAL_NUMANODE_FLAG_LARGER_LOCALITY}) {
        unsigned nr = static_cast<unsigned>(nodes.size());
        std::vector<hwloc_obj_t> local(nr);
        if (hwloc_get_local_numanode_objs(t, &loc, &nr, local.data(), flag) == 0) {
          for (unsigned i = 0; i < nr && i < local.size(); ++i) g.numa_nodes.push_back(static_cast<int>(local[i]->os_index));
        }
        if (!g.numa_nodes.empty()) break;
      }
      std::sort(g.numa_nodes.begin(), g.numa_nodes.end());
      g.locality_known = !g.numa_nodes.empty();
    }
    gpus.push_back(std::move(g));
  }
  return Topology(std::move(source), std::move(nodes), std::move(gpus));
}

Topology hwloc_live() {
  HwlocTopology h;
  // Important I/O only: GPUs, NICs, storage and the bridges above them.
  hwloc_topology_set_io_types_filter(h.t, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  // Linux's own backend reads the PCI tree from sysfs; the libpciaccess component would only add
  // model names (CUDA gives better ones), reads config space, and leaks in pci_system_init.
  (void)hwloc_topology_set_components(h.t, HWLOC_TOPOLOGY_COMPONENTS_FLAG_BLACKLIST, "pci");
  if (hwloc_topology_load(h.t) != 0) throw Error("hwloc_topology_load failed on this machine");
  return read_hwloc(h.t, "hwloc");
}
#endif

Topology live_topology() {
#ifdef MEMTIDE_HAVE_HWLOC
  try {
    return hwloc_live();
  } catch (const Error& e) {
    MEMTIDE_LOG(warn, std::string("topology: ") + e.what() + "; reading sysfs instead");
  }
#endif
  try {
    return Topology::from_sysfs("/sys");
  } catch (const Error& e) {
    MEMTIDE_LOG(warn, std::string("topology: ") + e.what() + "; assuming one NUMA node and no GPU");
  }
  NumaNode node;
  node.cpus = allowed_cpus([] {
    std::vector<int> all(CPU_SETSIZE);
    for (int i = 0; i < CPU_SETSIZE; ++i) all[static_cast<std::size_t>(i)] = i;
    return all;
  }());
  return Topology("none", {node}, {});
}

// hwloc reads the numbers of its XML with strtoul and friends: os_index="-1" wraps to 4294967295
// and "1.5" reads as 1, so such a file would load with numbers it does not hold. The attributes
// of hwloc's XML format that hold counts, indices and sizes are checked here first, each named
// with its line and the file. (Numbers in element text, distance matrices, are not checked:
// memtide does not read them.)
[[maybe_unused]] void check_xml_numbers(const std::string& path) {
  constexpr std::uintmax_t kMaxFileBytes = 256ULL << 20;  // lstopo writes a few MiB for the largest machines
  std::error_code ec;
  if (const std::uintmax_t size = fs::file_size(path, ec); !ec && size > kMaxFileBytes) {
    throw ConfigError("topology file \"" + path + "\" is " + std::to_string(size) +
                      " bytes; an hwloc XML topology is at most a few MiB");
  }
  std::ifstream in(path, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  struct Rule {
    std::string_view name;
    std::uint64_t max;
  };
  constexpr std::uint64_t kInt = 0x7fffffff;  // indices memtide keeps as int
  constexpr std::uint64_t kU64 = ~std::uint64_t{0};
  static constexpr Rule kRules[] = {{"os_index", kInt}, {"gp_index", kU64}, {"depth", kInt},
                                    {"local_memory", kU64}, {"cache_size", kU64}, {"cache_linesize", kInt},
                                    {"size", kU64}, {"count", kU64}, {"nbobjs", kInt}, {"length", kInt}};
  std::size_t line = 1;
  auto refuse = [&](std::string_view name, std::string_view value, const std::string& why) {
    throw ConfigError("topology file \"" + path + "\" line " + std::to_string(line) + ": " + std::string(name) + "=\"" +
                      std::string(value.substr(0, 40)) + "\" " + why);
  };
  const std::size_t n = text.size();
  for (std::size_t i = 0; i < n; ++i) {
    if (text[i] == '\n') ++line;
    if (text[i] != '<') continue;
    if (i + 1 < n && (text[i + 1] == '!' || text[i + 1] == '?')) {  // a comment, DOCTYPE or declaration
      const std::string_view end = text.compare(i, 4, "<!--") == 0 ? "-->" : ">";
      const std::size_t stop = std::min(text.find(end, i), n);
      line += static_cast<std::size_t>(std::count(text.begin() + static_cast<std::ptrdiff_t>(i),
                                                  text.begin() + static_cast<std::ptrdiff_t>(stop), '\n'));
      i = stop;
      continue;
    }
    // A tag: its attributes, name="value" or name='value', up to the closing '>'.
    std::size_t j = i + 1;
    while (j < n && text[j] != '>') {
      if (text[j] == '\n') ++line;
      if (text[j] != '=') {
        ++j;
        continue;
      }
      std::size_t name_end = j;
      while (name_end > i && std::isspace(static_cast<unsigned char>(text[name_end - 1]))) --name_end;
      std::size_t name_start = name_end;
      while (name_start > i && (std::isalnum(static_cast<unsigned char>(text[name_start - 1])) ||
                                text[name_start - 1] == '_')) {
        --name_start;
      }
      std::size_t q = j + 1;
      while (q < n && std::isspace(static_cast<unsigned char>(text[q]))) ++q;
      if (q >= n || (text[q] != '"' && text[q] != '\'')) {
        j = q;
        continue;
      }
      const std::size_t close = text.find(text[q], q + 1);
      if (close == std::string::npos) break;  // unterminated: hwloc's parser refuses the file
      const std::string_view name(text.data() + name_start, name_end - name_start);
      const std::string_view value(text.data() + q + 1, close - q - 1);
      for (const Rule& rule : kRules) {
        if (name != rule.name) continue;
        std::uint64_t v = 0;
        const auto [end, err] = std::from_chars(value.data(), value.data() + value.size(), v);
        if (value.empty() || !std::isdigit(static_cast<unsigned char>(value.front())) ||
            end != value.data() + value.size()) {
          refuse(name, value, "is not a whole number of 0 or more");
        }
        if (err != std::errc{} || v > rule.max) refuse(name, value, "is out of range (at most " + std::to_string(rule.max) + ")");
      }
      if (name == "pci_link_speed") {
        double v = 0;
        const auto [end, err] = std::from_chars(value.data(), value.data() + value.size(), v);
        if (value.empty() || err != std::errc{} || end != value.data() + value.size() || !std::isfinite(v) || v < 0) {
          refuse(name, value, "is not a link speed in GB/s of 0 or more");
        }
      }
      line += static_cast<std::size_t>(std::count(text.begin() + static_cast<std::ptrdiff_t>(j),
                                                  text.begin() + static_cast<std::ptrdiff_t>(close), '\n'));
      j = close + 1;
    }
    i = j;
  }
}

}  // namespace

bool hwloc_available() noexcept {
#ifdef MEMTIDE_HAVE_HWLOC
  return true;
#else
  return false;
#endif
}

const char* link_name(GpuLink link) noexcept {
  switch (link) {
    case GpuLink::self: return "X";
    case GpuLink::pix: return "PIX";
    case GpuLink::pxb: return "PXB";
    case GpuLink::phb: return "PHB";
    case GpuLink::node: return "NODE";
    case GpuLink::sys: return "SYS";
  }
  return "SYS";
}

std::string normalize_pci_bus_id(std::string_view text) {
  const std::string_view t = trim(text);
  auto bad = [&]() -> InvalidArgument {
    return InvalidArgument("\"" + std::string(text) + "\" is not a PCI bus id: expected DOMAIN:BUS:DEVICE.FUNCTION in hex, e.g. 0000:1b:00.0");
  };
  const auto dot = t.rfind('.');
  const auto c2 = t.rfind(':');
  if (dot == std::string_view::npos || c2 == std::string_view::npos || dot < c2) throw bad();
  const auto c1 = t.rfind(':', c2 == 0 ? 0 : c2 - 1);
  std::optional<unsigned long> domain = 0UL;
  std::string_view bus_text;
  if (c1 == std::string_view::npos || c1 == c2) {
    bus_text = t.substr(0, c2);
  } else {
    domain = parse_hex(t.substr(0, c1));
    bus_text = t.substr(c1 + 1, c2 - c1 - 1);
  }
  const auto bus = parse_hex(bus_text);
  const auto dev = parse_hex(t.substr(c2 + 1, dot - c2 - 1));
  const auto fn = parse_hex(t.substr(dot + 1));
  if (!domain || !bus || !dev || !fn || *domain > 0xffffffffUL || *bus > 0xff || *dev > 0x1f || *fn > 7) throw bad();
  char buf[40];
  std::snprintf(buf, sizeof buf, "%04lx:%02lx:%02lx.%lx", *domain, *bus, *dev, *fn);
  return buf;
}

std::vector<int> parse_cpu_list(std::string_view text) {
  std::set<int> cpus;
  const std::string_view all = trim(text);
  auto bad = [&]() -> InvalidArgument {
    return InvalidArgument("\"" + std::string(text) + "\" is not a cpu list: expected e.g. 0-3,8,10-11");
  };
  auto number = [&](std::string_view s) {
    s = trim(s);
    int v = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || ec != std::errc{} || end != s.data() + s.size() || v < 0) throw bad();
    return v;
  };
  std::size_t pos = 0;
  while (pos < all.size()) {
    std::size_t comma = all.find(',', pos);
    if (comma == std::string_view::npos) comma = all.size();
    const std::string_view item = all.substr(pos, comma - pos);
    const std::size_t dash = item.find('-');
    if (dash == std::string_view::npos) {
      cpus.insert(number(item));
    } else {
      const int lo = number(item.substr(0, dash)), hi = number(item.substr(dash + 1));
      if (hi < lo || hi - lo > (1 << 20)) throw bad();
      for (int c = lo; c <= hi; ++c) cpus.insert(c);
    }
    pos = comma + 1;
    if (comma + 1 == all.size()) throw bad();  // trailing comma
  }
  return {cpus.begin(), cpus.end()};
}

std::string format_cpu_list(const std::vector<int>& cpus_in) {
  std::vector<int> cpus = cpus_in;
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  std::string out;
  for (std::size_t i = 0; i < cpus.size();) {
    std::size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

Topology::Topology(std::string source, std::vector<NumaNode> nodes, std::vector<GpuInfo> gpus)
    : source_(std::move(source)), nodes_(std::move(nodes)), gpus_(std::move(gpus)) {
  if (nodes_.empty()) throw InvalidArgument("Topology (" + source_ + "): at least one NUMA node is required, got none");
  std::sort(nodes_.begin(), nodes_.end(), [](const NumaNode& a, const NumaNode& b) { return a.os_index < b.os_index; });
  // Normalized bus ids compare as text in bus order: CUDA_DEVICE_ORDER=PCI_BUS_ID.
  std::sort(gpus_.begin(), gpus_.end(), [](const GpuInfo& a, const GpuInfo& b) { return a.pci_bus_id < b.pci_bus_id; });
  for (std::size_t i = 0; i < gpus_.size(); ++i) {
    gpus_[i].index = static_cast<int>(i);
    if (i > 0 && gpus_[i].pci_bus_id == gpus_[i - 1].pci_bus_id) {
      throw InvalidArgument("Topology (" + source_ + "): two GPUs have PCI bus id " + gpus_[i].pci_bus_id);
    }
  }
}

Topology Topology::from_sysfs(const std::string& root_text) {
  const fs::path root(root_text);
  const fs::path pci = root / "bus/pci/devices";
  std::error_code ec;
  if (!fs::is_directory(pci, ec)) {
    throw IoError("sysfs topology: " + pci.string() + " is not a directory; expected the root of a sysfs tree (/sys)");
  }
  std::vector<NumaNode> nodes = sysfs_nodes(root);
  std::vector<GpuInfo> gpus;
  for (const auto& entry : fs::directory_iterator(pci, ec)) {
    const auto vendor = read_text(entry.path() / "vendor");
    const auto cls = read_text(entry.path() / "class");
    if (!vendor || !cls) continue;
    const auto vendor_id = parse_hex(*vendor);
    const auto class_code = parse_hex(*cls);  // 0xCCSSPP: class, subclass, programming interface
    if (!vendor_id || !class_code || *vendor_id != kNvidiaVendor || !is_gpu_class(static_cast<unsigned>(*class_code >> 8))) continue;
    GpuInfo g;
    try {
      g.pci_bus_id = normalize_pci_bus_id(entry.path().filename().string());
    } catch (const InvalidArgument&) {
      continue;
    }
    const auto device_id = parse_hex(read_text(entry.path() / "device").value_or(""));
    g.name = fallback_name(static_cast<unsigned>(device_id.value_or(0)));
    g.pci_path = sysfs_pci_path(entry.path(), g.pci_bus_id);
    int numa = -1;
    if (auto text = read_text(entry.path() / "numa_node")) {
      auto [end, perr] = std::from_chars(text->data(), text->data() + text->size(), numa);
      if (perr != std::errc{} || end != text->data() + text->size()) numa = -1;
    }
    if (auto text = read_text(entry.path() / "local_cpulist")) g.cpus = parse_cpu_list(*text);
    if (numa >= 0) {
      g.numa_nodes = {numa};
    } else if (nodes.size() == 1) {
      g.numa_nodes = {nodes.front().os_index};  // one node: the only place it can be
    }
    g.locality_known = !g.numa_nodes.empty();
    if (g.cpus.empty() && g.locality_known) {
      for (const NumaNode& n : nodes) {
        if (n.os_index == g.numa_nodes.front()) g.cpus = n.cpus;
      }
    }
    gpus.push_back(std::move(g));
  }
  const std::string source = fs::path(root_text).lexically_normal() == fs::path("/sys") ? "sysfs" : "sysfs:" + root_text;
  return Topology(source, std::move(nodes), std::move(gpus));
}

Topology Topology::from_xml(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    throw IoError("topology file \"" + path + "\" " + (fs::exists(path, ec) ? "is not a regular file" : "does not exist") +
                  "; expected an hwloc XML file (lstopo --of xml)");
  }
  if (std::ifstream probe(path); !probe) throw IoError("topology file \"" + path + "\" cannot be opened for reading");
#ifdef MEMTIDE_HAVE_HWLOC
  check_xml_numbers(path);
  auto load = [&](HwlocTopology& h) {
    // I/O objects are filtered out by default, from XML too: keep them all, they are the point.
    hwloc_topology_set_io_types_filter(h.t, HWLOC_TYPE_FILTER_KEEP_ALL);
    return hwloc_topology_set_xml(h.t, path.c_str()) == 0 && hwloc_topology_load(h.t) == 0;
  };
  // hwloc 2.9 dereferences null on some corrupt files (found by tests/fuzz): a user's file is
  // loaded in a child first, so a file that crashes hwloc is an error here, not a dead process.
  if (const pid_t child = ::fork(); child == 0) {
    // The child may die by design: not through the parent's fatal-signal handlers (Python's
    // faulthandler, a sanitizer's or a fuzzer's would report a crash that is not one), and not
    // with hwloc's complaints on the user's terminal (the parent says what went wrong).
    for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL}) ::signal(sig, SIG_DFL);
    if (const int devnull = ::open("/dev/null", O_WRONLY); devnull >= 0) ::dup2(devnull, STDERR_FILENO);
    HwlocTopology h;
    ::_exit(load(h) ? 0 : 1);
  } else if (child > 0) {
    int status = 0;
    while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
    }
    if (WIFSIGNALED(status)) {
      throw ConfigError("topology file \"" + path + "\" made hwloc crash (signal " + std::to_string(WTERMSIG(status)) +
                        ") while loading it: the file is corrupt; expected an hwloc 2.x XML file (lstopo --of xml)");
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {  // a plain refusal, or a crash a sanitizer turned into exit 1
      throw ConfigError("topology file \"" + path +
                        "\" is not a topology hwloc can load; expected an hwloc 2.x XML file (lstopo --of xml)");
    }
  }  // loaded in the child (or fork failed): load it here
  HwlocTopology h;
  if (!load(h)) {
    throw ConfigError("topology file \"" + path + "\" is not a topology hwloc can load; expected an hwloc 2.x XML file (lstopo --of xml)");
  }
  return read_hwloc(h.t, "hwloc-xml:" + path);
#else
  throw ConfigError("topology file \"" + path +
                    "\" cannot be loaded: memtide was built without hwloc (pkg-config module hwloc not found); "
                    "install libhwloc-dev and rebuild, or unset MEMTIDE_TOPOLOGY");
#endif
}

Topology Topology::discover() {
  const std::string& file = options().topology;
  if (!file.empty()) {
    try {
      return from_xml(file);
    } catch (const Error& e) {
      throw ConfigError("MEMTIDE_TOPOLOGY=\"" + file + "\": " + e.what());
    }
  }
  Topology topo = live_topology();
#ifdef MEMTIDE_HAVE_CUDA
  if (cuda_status().usable) {
    std::vector<std::string> bus_ids, names;
    if (cuda_pci_devices(bus_ids, names)) topo = order_like_cuda(topo, bus_ids, names);
  }
#endif
  return topo;
}

Topology order_like_cuda(const Topology& topo, const std::vector<std::string>& bus_ids,
                         const std::vector<std::string>& names) {
  Topology out = topo;
  out.gpus_.clear();
  for (std::size_t i = 0; i < bus_ids.size(); ++i) {
    const std::string id = normalize_pci_bus_id(bus_ids[i]);
    const auto it = std::find_if(topo.gpus_.begin(), topo.gpus_.end(), [&](const GpuInfo& g) { return g.pci_bus_id == id; });
    GpuInfo g;
    if (it != topo.gpus_.end()) {
      g = *it;
    } else {
      MEMTIDE_LOG(warn, "topology (" + topo.source_ + "): CUDA device " + std::to_string(i) + " at " + id +
                            " is not in the topology; its locality is unknown");
      g.pci_bus_id = id;
      g.pci_path = {"", id};
    }
    g.index = static_cast<int>(i);
    if (i < names.size() && !names[i].empty()) g.name = names[i];
    out.gpus_.push_back(std::move(g));
  }
  if (out.gpus_.size() < topo.gpus_.size()) {
    MEMTIDE_LOG(info, "topology: " + std::to_string(topo.gpus_.size() - out.gpus_.size()) +
                          " NVIDIA GPU(s) are not visible to CUDA (CUDA_VISIBLE_DEVICES?) and are left out");
  }
  return out;
}

void Topology::check_gpu(int index) const {
  if (index < 0 || static_cast<std::size_t>(index) >= gpus_.size()) {
    throw InvalidArgument("GPU index " + std::to_string(index) + " out of range: the topology (" + source_ + ") has " +
                          std::to_string(gpus_.size()) + " GPU(s)");
  }
}

const GpuInfo& Topology::gpu(int index) const {
  check_gpu(index);
  return gpus_[static_cast<std::size_t>(index)];
}

bool Topology::has_node(int os_index) const noexcept {
  return std::any_of(nodes_.begin(), nodes_.end(), [&](const NumaNode& n) { return n.os_index == os_index; });
}

int Topology::preferred_node(int index) const {
  const GpuInfo& g = gpu(index);
  if (g.locality_known && !g.numa_nodes.empty()) return g.numa_nodes.front();
  const NumaNode& node = largest_node(nodes_);
  static std::mutex mutex;
  static std::set<std::string> warned;
  bool first = false;
  {
    std::lock_guard lock(mutex);
    first = warned.insert(source_ + " " + g.pci_bus_id).second;
  }
  if (first) {
    MEMTIDE_LOG(warn, "topology (" + source_ + "): the NUMA locality of GPU " + std::to_string(index) + " (" + g.pci_bus_id +
                          ") is unknown; using node " + std::to_string(node.os_index) + ", the one with the most memory");
  }
  return node.os_index;
}

std::vector<int> Topology::local_cpus(int index) const {
  const GpuInfo& g = gpu(index);
  if (g.locality_known) return g.cpus;
  const int node = preferred_node(index);
  for (const NumaNode& n : nodes_) {
    if (n.os_index == node) return n.cpus;
  }
  return {};
}

std::vector<int> Topology::cpu_share(int gpu, int ranks_on_node) const {
  const std::vector<int> mine = local_cpus(gpu);
  if (ranks_on_node <= 1 || mine.empty()) return mine;
  std::vector<int> sharing;  // the ranks' GPUs with the same local cpus, ascending
  const int gpus = static_cast<int>(gpus_.size());
  for (int g = 0; g < gpus && g < ranks_on_node; ++g) {
    if (g == gpu || local_cpus(g) == mine) sharing.push_back(g);
  }
  if (std::find(sharing.begin(), sharing.end(), gpu) == sharing.end()) sharing.push_back(gpu);
  const std::size_t k = sharing.size();
  const std::size_t at = static_cast<std::size_t>(std::find(sharing.begin(), sharing.end(), gpu) - sharing.begin());
  if (k > mine.size()) return {mine[at % mine.size()]};
  const std::size_t base = mine.size() / k, extra = mine.size() % k;
  const std::size_t from = at * base + std::min(at, extra);
  const std::size_t n = base + (at < extra ? 1 : 0);
  return {mine.begin() + static_cast<std::ptrdiff_t>(from), mine.begin() + static_cast<std::ptrdiff_t>(from + n)};
}

GpuLink Topology::link(int a, int b) const {
  const GpuInfo& ga = gpu(a);
  const GpuInfo& gb = gpu(b);
  if (a == b) return GpuLink::self;
  const auto& pa = ga.pci_path;
  const auto& pb = gb.pci_path;
  const bool same_host_bridge = !pa.empty() && !pb.empty() && !pa.front().empty() && pa.front() == pb.front();
  if (!same_host_bridge) {
    if (!ga.locality_known || !gb.locality_known) return GpuLink::sys;
    for (int n : ga.numa_nodes) {
      if (std::find(gb.numa_nodes.begin(), gb.numa_nodes.end(), n) != gb.numa_nodes.end()) return GpuLink::node;
    }
    return GpuLink::sys;
  }
  // Longest common prefix: its last element is the lowest common ancestor.
  const std::size_t common = static_cast<std::size_t>(std::mismatch(pa.begin(), pa.end(), pb.begin(), pb.end()).first - pa.begin());
  if (common <= 1) return GpuLink::phb;
  if (common >= pa.size() || common >= pb.size()) return GpuLink::pix;  // malformed: one path contains the other
  // Bridges strictly between each GPU and the common ancestor: one each is a single switch
  // (downstream port, upstream port shared); more means cascaded switches.
  const std::size_t below_a = pa.size() - 1 - common;
  const std::size_t below_b = pb.size() - 1 - common;
  return below_a <= 1 && below_b <= 1 ? GpuLink::pix : GpuLink::pxb;
}

std::vector<int> allowed_cpus(const std::vector<int>& wanted) {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof mask, &mask) != 0) return {};
  std::vector<int> out;
  for (int c : wanted) {
    if (c >= 0 && c < CPU_SETSIZE && CPU_ISSET(c, &mask) && std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  }
  return out;
}

std::unique_ptr<ThreadPool> make_gpu_pool(const Topology& topo, int gpu, std::size_t threads, int ranks_on_node) {
  const std::vector<int> local = topo.cpu_share(gpu, ranks_on_node);
  std::vector<int> bind = allowed_cpus(local);
  if (bind.empty()) {
    MEMTIDE_LOG(warn, "GPU " + std::to_string(gpu) + " pool: none of its local cpus [" + format_cpu_list(local) +
                          "] (topology " + topo.source() + ") is in this process's affinity mask; the pool is not bound");
  } else if (bind.size() < local.size()) {
    MEMTIDE_LOG(info, "GPU " + std::to_string(gpu) + " pool: binding to cpus [" + format_cpu_list(bind) + "] of its local [" +
                          format_cpu_list(local) + "]; the rest are outside this process's affinity mask");
  }
  if (threads == 0) threads = bind.empty() ? std::max(1U, std::thread::hardware_concurrency()) : bind.size();
  return std::make_unique<ThreadPool>(threads, std::move(bind));
}

}  // namespace memtide
