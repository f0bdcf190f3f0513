#include "memtide/device/topology.hpp"

#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <iterator>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/core/options.hpp"
#include "memtide/device/device.hpp"

using namespace memtide;
namespace fs = std::filesystem;

namespace {

const std::string kData = MEMTIDE_TEST_DATA_DIR "/topology/";

#define REQUIRE_HWLOC() \
  if (!hwloc_available()) GTEST_SKIP() << "memtide was built without hwloc: XML topologies cannot be loaded"

std::vector<int> range(int lo, int hi) {  // [lo, hi]
  std::vector<int> v;
  for (int i = lo; i <= hi; ++i) v.push_back(i);
  return v;
}

std::vector<std::string> bus_ids(const Topology& t) {
  std::vector<std::string> ids;
  for (const GpuInfo& g : t.gpus()) ids.push_back(g.pci_bus_id);
  return ids;
}

std::string link_matrix_row(const Topology& t, int a) {
  std::string row;
  for (int b = 0; b < static_cast<int>(t.gpus().size()); ++b) row += std::string(b ? " " : "") + link_name(t.link(a, b));
  return row;
}

// A scratch directory removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "memtide_topo_XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  [[nodiscard]] const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void write(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text << "\n";
}

// A fake sysfs tree: NUMA nodes and PCI devices (path under devices/, e.g.
// "pci0000:00/0000:00:01.0/0000:01:00.0") with their attribute files, plus the bus/pci/devices links.
struct FakeSysfs {
  TempDir dir;
  void node(int index, const std::string& cpulist, std::uint64_t mem_kb) {
    const fs::path d = dir.path() / "devices/system/node" / ("node" + std::to_string(index));
    write(d / "cpulist", cpulist);
    write(d / "meminfo", "Node " + std::to_string(index) + " MemTotal:       " + std::to_string(mem_kb) +
                             " kB\nNode " + std::to_string(index) + " MemFree:        1000 kB");
  }
  void device(const std::string& path, const std::map<std::string, std::string>& files) {
    const fs::path d = dir.path() / "devices" / path;
    fs::create_directories(d);
    for (const auto& [name, text] : files) write(d / name, text);
    const fs::path link = dir.path() / "bus/pci/devices" / d.filename();
    fs::create_directories(link.parent_path());
    fs::create_symlink(fs::path("../../..") / "devices" / path, link);
  }
  void gpu(const std::string& path, int numa, const std::string& cpulist) {
    device(path, {{"vendor", "0x10de"}, {"device", "0x2330"}, {"class", "0x030200"},
                  {"numa_node", std::to_string(numa)}, {"local_cpulist", cpulist}});
  }
  [[nodiscard]] std::string root() const { return dir.path().string(); }
};

}  // namespace

// ---- helpers --------------------------------------------------------------------------------

TEST(Topology, CpuListsRoundTrip) {
  EXPECT_EQ(parse_cpu_list("0-3,8,10-11\n"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(parse_cpu_list("5,1,1-2"), (std::vector<int>{1, 2, 5}));
  EXPECT_TRUE(parse_cpu_list(" \n").empty());
  EXPECT_EQ(format_cpu_list({11, 0, 1, 2, 3, 8, 10}), "0-3,8,10-11");
  EXPECT_EQ(format_cpu_list({}), "");
  for (const char* bad : {"3-1", "a", "1,,2", "1,", "-1"}) {
    EXPECT_THROW(parse_cpu_list(bad), InvalidArgument) << bad;
  }
}

TEST(Topology, BusIdsAreNormalized) {
  EXPECT_EQ(normalize_pci_bus_id("0000:1B:00.0"), "0000:1b:00.0");
  EXPECT_EQ(normalize_pci_bus_id("00000000:1B:00.0"), "0000:1b:00.0");
  EXPECT_EQ(normalize_pci_bus_id("c1:00.1"), "0000:c1:00.1");
  for (const char* bad : {"", "1b:00", "0000:1g:00.0", "0000:100:00.0", "0000:1b:00.9"}) {
    try {
      normalize_pci_bus_id(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("\"") + bad + "\""), std::string::npos) << e.what();
    }
  }
}

// ---- hwloc XML fixtures ---------------------------------------------------------------------

TEST(Topology, TwoSocketsFourGpus) {
  REQUIRE_HWLOC();
  const std::string file = kData + "two_socket_4gpu.xml";
  const Topology t = Topology::from_xml(file);
  EXPECT_EQ(t.source(), "hwloc-xml:" + file);
  ASSERT_EQ(t.numa_nodes().size(), 2U);
  EXPECT_EQ(t.numa_nodes()[0].os_index, 0);
  EXPECT_EQ(t.numa_nodes()[0].memory_bytes, 64ULL << 30);
  EXPECT_EQ(t.numa_nodes()[0].cpus, range(0, 3));
  EXPECT_EQ(t.numa_nodes()[1].memory_bytes, 32ULL << 30);
  EXPECT_EQ(t.numa_nodes()[1].cpus, range(4, 7));
  EXPECT_TRUE(t.has_node(1));
  EXPECT_FALSE(t.has_node(2));
  // Bus id order, not document order (4b is listed before 18); the ASPEED VGA and the NIC are not GPUs.
  EXPECT_EQ(bus_ids(t), (std::vector<std::string>{"0000:18:00.0", "0000:4b:00.0", "0000:99:00.0", "0000:b1:00.0"}));
  const std::vector<std::vector<int>> nodes = {{0}, {0}, {1}, {1}};
  for (int i = 0; i < 4; ++i) {
    const GpuInfo& g = t.gpu(i);
    EXPECT_EQ(g.index, i);
    EXPECT_TRUE(g.locality_known) << i;
    EXPECT_EQ(g.numa_nodes, nodes[static_cast<std::size_t>(i)]) << i;
    EXPECT_EQ(g.cpus, i < 2 ? range(0, 3) : range(4, 7)) << i;
    EXPECT_EQ(t.local_cpus(i), g.cpus);
    EXPECT_EQ(t.preferred_node(i), nodes[static_cast<std::size_t>(i)][0]);
    EXPECT_EQ(g.name, "NVIDIA A100 80GB PCIe");
  }
  EXPECT_EQ(t.gpu(1).pci_path, (std::vector<std::string>{"pci0000:4a", "0000:4a:01.0", "0000:4b:00.0"}));
  EXPECT_EQ(link_matrix_row(t, 0), "X NODE SYS SYS");
  EXPECT_EQ(link_matrix_row(t, 3), "SYS SYS NODE X");
}

TEST(Topology, EightGpusBehindSwitches) {
  REQUIRE_HWLOC();
  const Topology t = Topology::from_xml(kData + "two_socket_8gpu_switches.xml");
  EXPECT_EQ(bus_ids(t), (std::vector<std::string>{"0000:15:00.0", "0000:16:00.0", "0000:19:00.0", "0000:1a:00.0",
                                                   "0000:83:00.0", "0000:84:00.0", "0000:85:00.0", "0000:91:00.0"}));
  const std::vector<int> socket0 = {0, 1, 2, 3, 8, 9, 10, 11};
  const std::vector<int> socket1 = {4, 5, 6, 7, 12, 13, 14, 15};
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(t.gpu(i).numa_nodes, std::vector<int>{i < 4 ? 0 : 1}) << i;
    EXPECT_EQ(t.gpu(i).cpus, i < 4 ? socket0 : socket1) << i;
  }
  // The matrix nvidia-smi topo -m would print for this machine.
  const std::vector<std::string> expected = {
      "X PIX PXB PXB SYS SYS SYS SYS",     "PIX X PXB PXB SYS SYS SYS SYS",     "PXB PXB X PIX SYS SYS SYS SYS",
      "PXB PXB PIX X SYS SYS SYS SYS",     "SYS SYS SYS SYS X PIX PHB NODE",    "SYS SYS SYS SYS PIX X PHB NODE",
      "SYS SYS SYS SYS PHB PHB X NODE",    "SYS SYS SYS SYS NODE NODE NODE X"};
  for (int a = 0; a < 8; ++a) {
    EXPECT_EQ(link_matrix_row(t, a), expected[static_cast<std::size_t>(a)]) << "GPU" << a;
    for (int b = 0; b < 8; ++b) EXPECT_EQ(t.link(a, b), t.link(b, a)) << a << " " << b;
  }
}

// Ranks on one machine, one per GPU: the ranks whose GPUs share a socket split its cpus, so that
// 8 ranks on 2 sockets do not all bind their workers to the same 8 cpus.
TEST(Topology, RanksSharingASocketSplitItsCpus) {
  REQUIRE_HWLOC();
  const Topology t = Topology::from_xml(kData + "two_socket_8gpu_switches.xml");
  const std::vector<std::vector<int>> eight = {{0, 1}, {2, 3}, {8, 9}, {10, 11}, {4, 5}, {6, 7}, {12, 13}, {14, 15}};
  for (int g = 0; g < 8; ++g) {
    EXPECT_EQ(t.cpu_share(g, 8), eight[static_cast<std::size_t>(g)]) << g;
    EXPECT_EQ(t.preferred_node(g), g < 4 ? 0 : 1) << g;  // its arena's node: the socket its cpus are on
    EXPECT_EQ(t.cpu_share(g, 1), t.local_cpus(g)) << g;  // one rank: all of them
  }
  // Two ranks on GPUs 0 and 1 (socket 0) split socket 0 between them.
  EXPECT_EQ(t.cpu_share(0, 2), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(t.cpu_share(1, 2), (std::vector<int>{8, 9, 10, 11}));
  // Three ranks on a socket of 8 cpus: 3, 3 and 2.
  EXPECT_EQ(t.cpu_share(0, 3), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(t.cpu_share(2, 3), (std::vector<int>{10, 11}));
  // More ranks than cpus: one cpu each, shared round the group.
  const Topology small = Topology("test", {NumaNode{0, 0, {0, 1}}},
                                  {GpuInfo{0, "0000:01:00.0", {0}, {0, 1}, true, "a", {}},
                                   GpuInfo{1, "0000:02:00.0", {0}, {0, 1}, true, "b", {}},
                                   GpuInfo{2, "0000:03:00.0", {0}, {0, 1}, true, "c", {}}});
  EXPECT_EQ(small.cpu_share(2, 3), std::vector<int>{0});
  EXPECT_EQ(small.cpu_share(1, 3), std::vector<int>{1});
}

TEST(GpuPool, EachRankOfTheNodeBindsToItsShare) {
  REQUIRE_HWLOC();
  const Topology t = Topology::from_xml(kData + "two_socket_8gpu_switches.xml");
  for (int gpu : {0, 5}) {
    auto pool = make_gpu_pool(t, gpu, 2, 8);
    EXPECT_EQ(pool->cpus(), allowed_cpus(t.cpu_share(gpu, 8))) << gpu;
  }
}

TEST(Topology, UnknownLocalityFallsBackToTheLargestNode) {
  REQUIRE_HWLOC();
  const Topology t = Topology::from_xml(kData + "unknown_locality.xml");
  ASSERT_EQ(t.gpus().size(), 2U);
  // GPU 0 hangs under a group of cores 0-1, below node 0: found through its larger locality.
  EXPECT_TRUE(t.gpu(0).locality_known);
  EXPECT_EQ(t.gpu(0).numa_nodes, std::vector<int>{0});
  EXPECT_EQ(t.gpu(0).cpus, range(0, 1));
  EXPECT_EQ(t.preferred_node(0), 0);
  const GpuInfo& lost = t.gpu(1);
  EXPECT_EQ(lost.pci_bus_id, "0000:65:00.0");
  EXPECT_FALSE(lost.locality_known);
  EXPECT_TRUE(lost.numa_nodes.empty());
  EXPECT_EQ(lost.cpus, range(0, 7));  // hwloc's answer: the whole machine
  // Node 1 has 64 GiB, node 0 32 GiB; threads follow memory.
  EXPECT_EQ(t.preferred_node(1), 1);
  EXPECT_EQ(t.preferred_node(1), 1);  // the warning is logged once; the answer stays
  EXPECT_EQ(t.local_cpus(1), range(4, 7));
  EXPECT_EQ(t.link(0, 1), GpuLink::sys);
}

TEST(Topology, BadFilesAreNamed) {
  const std::string missing = kData + "no_such_machine.xml";
  try {
    (void)Topology::from_xml(missing);
    ADD_FAILURE() << "a missing file was accepted";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  TempDir dir;
  const std::string junk = (dir.path() / "junk.xml").string();
  write(junk, "<topology><object type=\"Nonsense\"");
  try {
    (void)Topology::from_xml(junk);
    ADD_FAILURE() << "a broken file was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(junk), std::string::npos) << e.what();
  }
}

// hwloc would wrap os_index="-1" and truncate "1.5": every such number is refused first, naming
// the attribute, its line and the file.
TEST(Topology, NumbersInTheXmlAreCheckedBeforeHwlocReadsThem) {
  REQUIRE_HWLOC();
  std::ifstream in(kData + "two_socket_4gpu.xml");
  const std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_NE(good.find("local_memory=\"68719476736\""), std::string::npos);
  struct Case {
    const char* from;
    const char* to;
    const char* named;
  };
  const Case cases[] = {
      {"<object type=\"NUMANode\" os_index=\"0\"", "<object type=\"NUMANode\" os_index=\"-1\"", "os_index=\"-1\""},
      {"<object type=\"NUMANode\" os_index=\"0\"", "<object type=\"NUMANode\" os_index=\"1.5\"", "os_index=\"1.5\""},
      {"<object type=\"NUMANode\" os_index=\"0\"", "<object type=\"NUMANode\" os_index=\"4294967296\"",
       "out of range"},
      {"<object type=\"NUMANode\" os_index=\"0\"", "<object type=\"NUMANode\" os_index = '+3'", "os_index=\"+3\""},
      {"local_memory=\"68719476736\"", "local_memory=\"-68719476736\"", "local_memory"},
      {"local_memory=\"68719476736\"", "local_memory=\"99999999999999999999999\"", "out of range"},
      {"local_memory=\"68719476736\"", "local_memory=\"\"", "local_memory=\"\""},
      {"pci_link_speed=\"31.507692\"", "pci_link_speed=\"-31.5\"", "pci_link_speed"},
      {"pci_link_speed=\"31.507692\"", "pci_link_speed=\"nan\"", "pci_link_speed"},
  };
  const std::string dir = ::testing::TempDir();
  for (const Case& c : cases) {
    std::string text = good;
    const std::size_t at = text.find(c.from);
    ASSERT_NE(at, std::string::npos) << c.from;
    text.replace(at, std::strlen(c.from), c.to);
    const std::size_t line = 1 + static_cast<std::size_t>(std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(at), '\n'));
    const std::string path = dir + "/bad_numbers.xml";
    std::ofstream(path) << text;
    try {
      (void)Topology::from_xml(path);
      ADD_FAILURE() << "loaded a file with " << c.to;
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(path), std::string::npos) << what;
      EXPECT_NE(what.find(c.named), std::string::npos) << what;
      EXPECT_NE(what.find("line " + std::to_string(line) + ":"), std::string::npos) << what;
    }
  }
  // The same numbers inside a comment or an info value are text, not numbers: the file loads.
  std::string text = good;
  text.replace(text.find("<topology version"), 0, "<!-- os_index=\"-1\" -->\n");
  const std::string path = dir + "/commented.xml";
  std::ofstream(path) << text;
  EXPECT_EQ(Topology::from_xml(path).gpus().size(), Topology::from_xml(kData + "two_socket_4gpu.xml").gpus().size());
}

TEST(Topology, GpuIndexOutOfRange) {
  const Topology t("test", {NumaNode{0, 1 << 30, {0}}}, {});
  for (int bad : {-1, 0, 5}) {
    try {
      (void)t.gpu(bad);
      ADD_FAILURE() << bad;
    } catch (const InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("GPU index " + std::to_string(bad)), std::string::npos) << what;
      EXPECT_NE(what.find("0 GPU(s)"), std::string::npos) << what;
    }
  }
  EXPECT_THROW((void)t.link(0, 0), InvalidArgument);
  EXPECT_THROW((void)t.preferred_node(0), InvalidArgument);
  EXPECT_THROW(Topology("test", {}, {}), InvalidArgument);
}

TEST(Topology, OptionSelectsAnXmlFile) {
  REQUIRE_HWLOC();
  const Options saved = options();
  Options o = saved;
  o.topology = kData + "two_socket_4gpu.xml";
  set_options(o);
  const Topology t = Topology::discover();
  EXPECT_EQ(t.source(), "hwloc-xml:" + o.topology);
  EXPECT_EQ(t.gpus().size(), 4U);
  o.topology = kData + "missing.xml";
  set_options(o);
  try {
    (void)Topology::discover();
    ADD_FAILURE() << "a missing MEMTIDE_TOPOLOGY file was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("MEMTIDE_TOPOLOGY"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("missing.xml"), std::string::npos) << e.what();
  }
  set_options(saved);
}

// ---- sysfs ----------------------------------------------------------------------------------

TEST(Topology, SysfsFallbackParsesAFakeTree) {
  FakeSysfs fs;
  fs.node(0, "0-3", 32ULL << 20);
  fs.node(1, "4-7", 64ULL << 20);
  fs.gpu("pci0000:00/0000:00:01.0/0000:01:00.0", 0, "0-3");
  fs.device("pci0000:00/0000:00:01.0/0000:01:00.1", {{"vendor", "0x10de"}, {"class", "0x040300"}});  // HDMI audio
  fs.device("pci0000:00/0000:00:03.0", {{"vendor", "0x8086"}, {"class", "0x020000"}});              // NIC
  fs.device("pci0000:00/0000:00:04.0", {{"vendor", "0x1a03"}, {"class", "0x030000"}});              // BMC VGA
  fs.gpu("pci0000:00/0000:00:02.0/0000:02:00.0", 0, "0-3");
  fs.gpu("pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:01.0/0000:84:00.0", 1, "4-7");
  fs.gpu("pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:00.0/0000:83:00.0", 1, "4-7");
  fs.gpu("pci0000:c0/0000:c0:01.0/0000:c1:00.0", -1, "0-7");

  const Topology t = Topology::from_sysfs(fs.root());
  EXPECT_EQ(t.source(), "sysfs:" + fs.root());
  ASSERT_EQ(t.numa_nodes().size(), 2U);
  EXPECT_EQ(t.numa_nodes()[1].os_index, 1);
  EXPECT_EQ(t.numa_nodes()[1].memory_bytes, 64ULL << 30);
  EXPECT_EQ(t.numa_nodes()[1].cpus, range(4, 7));
  EXPECT_EQ(bus_ids(t),
            (std::vector<std::string>{"0000:01:00.0", "0000:02:00.0", "0000:83:00.0", "0000:84:00.0", "0000:c1:00.0"}));
  EXPECT_EQ(t.gpu(0).numa_nodes, std::vector<int>{0});
  EXPECT_EQ(t.gpu(0).cpus, range(0, 3));
  EXPECT_EQ(t.gpu(0).name, "NVIDIA [10de:2330]");
  EXPECT_EQ(t.gpu(2).numa_nodes, std::vector<int>{1});
  EXPECT_EQ(t.gpu(2).pci_path,
            (std::vector<std::string>{"pci0000:80", "0000:80:01.0", "0000:81:00.0", "0000:82:00.0", "0000:83:00.0"}));
  EXPECT_FALSE(t.gpu(4).locality_known);
  EXPECT_EQ(t.preferred_node(4), 1);
  EXPECT_EQ(t.local_cpus(4), range(4, 7));
  EXPECT_EQ(link_matrix_row(t, 0), "X PHB SYS SYS SYS");
  EXPECT_EQ(link_matrix_row(t, 2), "SYS SYS X PIX SYS");
}

TEST(Topology, SysfsSingleNodeMeansKnownLocality) {
  FakeSysfs fs;
  fs.node(0, "0-1", 4ULL << 20);
  fs.gpu("pci0000:00/0000:00:05.0", -1, "0-1");
  const Topology t = Topology::from_sysfs(fs.root());
  ASSERT_EQ(t.gpus().size(), 1U);
  EXPECT_TRUE(t.gpu(0).locality_known);
  EXPECT_EQ(t.gpu(0).numa_nodes, std::vector<int>{0});
}

TEST(Topology, SysfsRootWithoutPciIsAnError) {
  TempDir dir;
  try {
    (void)Topology::from_sysfs(dir.path().string());
    ADD_FAILURE() << "an empty directory was accepted";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.path().string()), std::string::npos) << e.what();
  }
}

TEST(Topology, CudaOrderReindexesByBusId) {
  auto gpu = [](const std::string& bus, int node) {
    GpuInfo g;
    g.pci_bus_id = bus;
    g.numa_nodes = {node};
    g.cpus = {node};
    g.locality_known = true;
    g.name = "NVIDIA [10de:2330]";
    g.pci_path = {"", bus};
    return g;
  };
  const Topology t("test", {NumaNode{0, 1 << 30, {0}}, NumaNode{1, 1 << 30, {1}}},
                   {gpu("0000:b1:00.0", 1), gpu("0000:18:00.0", 0), gpu("0000:99:00.0", 1)});
  EXPECT_EQ(bus_ids(t), (std::vector<std::string>{"0000:18:00.0", "0000:99:00.0", "0000:b1:00.0"}));
  // CUDA sees three GPUs in its own order (fastest first, or CUDA_VISIBLE_DEVICES): b1 is hidden,
  // and e1 is one the topology does not know.
  const Topology c = order_like_cuda(t, {"0000:99:00.0", "00000000:18:00.0", "0000:E1:00.0"}, {"H100-X", "", "H200"});
  ASSERT_EQ(c.gpus().size(), 3U);
  EXPECT_EQ(bus_ids(c), (std::vector<std::string>{"0000:99:00.0", "0000:18:00.0", "0000:e1:00.0"}));
  for (int i = 0; i < 3; ++i) EXPECT_EQ(c.gpu(i).index, i);
  EXPECT_EQ(c.gpu(0).numa_nodes, std::vector<int>{1});
  EXPECT_EQ(c.gpu(0).name, "H100-X");
  EXPECT_EQ(c.gpu(1).name, "NVIDIA [10de:2330]");
  EXPECT_EQ(c.gpu(1).numa_nodes, std::vector<int>{0});
  EXPECT_FALSE(c.gpu(2).locality_known);
  EXPECT_EQ(c.gpu(2).name, "H200");
  EXPECT_EQ(c.link(0, 1), GpuLink::sys);
  EXPECT_THROW(order_like_cuda(t, {"not a bus id"}, {""}), InvalidArgument);
}

// ---- this machine ---------------------------------------------------------------------------

TEST(Topology, DiscoversThisMachine) {
  const Topology t = Topology::discover();
  EXPECT_TRUE(t.source() == "hwloc" || t.source() == "sysfs" || t.source() == "none") << t.source();
  ASSERT_FALSE(t.numa_nodes().empty());
  const CudaStatus st = cuda_status();
  if (st.usable) {
    EXPECT_EQ(static_cast<int>(t.gpus().size()), st.device_count);
  }
  // hwloc reads the same kernel files: both views must agree on the nodes and their cpus.
  if (t.source() == "hwloc" && fs::is_directory("/sys/bus/pci/devices")) {
    const Topology s = Topology::from_sysfs("/sys");
    EXPECT_EQ(s.source(), "sysfs");
    ASSERT_EQ(s.numa_nodes().size(), t.numa_nodes().size());
    for (std::size_t i = 0; i < s.numa_nodes().size(); ++i) {
      EXPECT_EQ(s.numa_nodes()[i].os_index, t.numa_nodes()[i].os_index);
      EXPECT_EQ(s.numa_nodes()[i].cpus, t.numa_nodes()[i].cpus);
    }
    if (!st.usable) {
      EXPECT_EQ(bus_ids(s), bus_ids(t));
    }
  }
  for (const GpuInfo& g : t.gpus()) EXPECT_GE(t.preferred_node(g.index), 0);
}

// ---- GPU-local thread pools -----------------------------------------------------------------

namespace {

std::vector<int> affinity_of_this_thread() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

Topology one_gpu_on(const std::vector<int>& cpus) {
  GpuInfo g;
  g.pci_bus_id = "0000:01:00.0";
  g.numa_nodes = {0};
  g.cpus = cpus;
  g.locality_known = true;
  g.pci_path = {"pci0000:00", g.pci_bus_id};
  return Topology("test", {NumaNode{0, 1 << 30, cpus}}, {g});
}

}  // namespace

TEST(GpuPool, WorkersRunOnTheGpuLocalCpus) {
  const std::vector<int> mine = affinity_of_this_thread();
  ASSERT_FALSE(mine.empty());
  EXPECT_EQ(allowed_cpus(mine), mine);
  // The GPU's local cpus: this machine's last cpu, plus one that does not exist here.
  const int target = mine.back();
  const Topology t = one_gpu_on({target, CPU_SETSIZE + 7});
  auto pool = make_gpu_pool(t, 0, 4);
  ASSERT_EQ(pool->size(), 4U);
  EXPECT_EQ(pool->cpus(), std::vector<int>{target});

  const auto caller = std::this_thread::get_id();
  std::mutex m;
  std::vector<int> worker_cpus;
  std::vector<std::vector<int>> worker_masks;
  pool->parallel_for(4, [&](std::size_t) {
    if (std::this_thread::get_id() == caller) return;
    const int cpu = sched_getcpu();
    const std::vector<int> mask = affinity_of_this_thread();
    std::lock_guard lock(m);
    worker_cpus.push_back(cpu);
    worker_masks.push_back(mask);
  });
  ASSERT_EQ(worker_cpus.size(), 3U);
  for (std::size_t i = 0; i < worker_cpus.size(); ++i) {
    EXPECT_EQ(worker_cpus[i], target);
    EXPECT_EQ(worker_masks[i], std::vector<int>{target});
  }
}

TEST(GpuPool, ThreadsDefaultToTheBoundCpus) {
  const std::vector<int> mine = affinity_of_this_thread();
  const Topology t = one_gpu_on(mine);
  auto pool = make_gpu_pool(t, 0);
  EXPECT_EQ(pool->size(), mine.size());
  EXPECT_EQ(pool->cpus(), mine);
}

TEST(GpuPool, CpusOutsideTheMaskAreNotBound) {
  const std::vector<int> mine = affinity_of_this_thread();
  std::vector<int> absent;
  for (int c = 0; c < CPU_SETSIZE && absent.size() < 2; ++c) {
    if (std::find(mine.begin(), mine.end(), c) == mine.end()) absent.push_back(c);
  }
  ASSERT_FALSE(absent.empty());
  const Topology t = one_gpu_on(absent);
  auto pool = make_gpu_pool(t, 0, 2);
  EXPECT_TRUE(pool->cpus().empty());
  std::atomic<int> ran{0};
  pool->parallel_for(2, [&](std::size_t) { ran.fetch_add(1); });
  EXPECT_EQ(ran.load(), 2);
  EXPECT_THROW(make_gpu_pool(t, 1), InvalidArgument);
}

TEST(GpuPool, XmlTopologyBindsOnlyCpusThatExistHere) {
  REQUIRE_HWLOC();
  const Topology t = Topology::from_xml(kData + "two_socket_4gpu.xml");
  for (int gpu : {0, 3}) {
    auto pool = make_gpu_pool(t, gpu, 2);
    EXPECT_EQ(pool->cpus(), allowed_cpus(t.local_cpus(gpu))) << gpu;
    for (int c : pool->cpus()) EXPECT_EQ(allowed_cpus({c}), std::vector<int>{c});
  }
}

// hwloc 2.9 dereferences null on some corrupt XML files (this one was found by
// tests/fuzz/fuzz_topology_xml.cpp): loading it must be an error naming the file, not a dead process.
TEST(Topology, AFileThatCrashesHwlocIsAnErrorNotACrash) {
  if (!hwloc_available()) GTEST_SKIP() << "built without hwloc";
  const std::string path = std::string(MEMTIDE_TEST_DATA_DIR) + "/topology/corrupt_crashes_hwloc.xml";
  try {
    (void)Topology::from_xml(path);
    FAIL() << "a corrupt file loaded";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

// Every input that made hwloc crash under the fuzzer before the loader forked (kept as found).
TEST(Topology, EveryFileTheFuzzerFoundCrashingHwlocIsAnError) {
  if (!hwloc_available()) GTEST_SKIP() << "built without hwloc";
  std::size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(MEMTIDE_TEST_DATA_DIR) + "/topology_crashers")) {
    const std::string path = entry.path().string();
    ++files;
    try {
      (void)Topology::from_xml(path);
      ADD_FAILURE() << path << " loaded";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  }
  EXPECT_GE(files, 20u);
}
