#pragma once
/// @file
/// Where the GPUs sit relative to the CPUs and memory: NUMA nodes, each NVIDIA GPU's PCI bus id,
/// its local NUMA nodes and cores, and how two GPUs are connected over PCIe (the classes of
/// `nvidia-smi topo -m`). Tiering uses it to put a GPU's pinned host buffers on its local node
/// and to bind that GPU's CPU worker pool to its local cores.
///
/// Sources, in order: the `topology` option (MEMTIDE_TOPOLOGY, an hwloc XML file, so that
/// multi-socket, multi-GPU layouts can be planned and tested on any machine), hwloc on the live
/// machine, and a sysfs reader when memtide was built without hwloc or hwloc fails.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "memtide/core/thread_pool.hpp"

namespace memtide {

/// One NUMA node (memory domain).
struct NumaNode {
  int os_index = 0;               ///< the kernel's node number (numactl's)
  std::uint64_t memory_bytes = 0; ///< memory local to the node; 0 when unknown
  std::vector<int> cpus;          ///< logical cpus (OS numbering) of the node, ascending; may be empty
};

/// One NVIDIA GPU (PCI display or 3D controller of vendor 0x10de).
struct GpuInfo {
  int index = 0;                ///< position in PCI bus id order, or the CUDA ordinal when CUDA is usable
  std::string pci_bus_id;       ///< "0000:1b:00.0" (lower case, 4-digit domain)
  std::vector<int> numa_nodes;  ///< local NUMA nodes, ascending; empty when the locality is unknown
  std::vector<int> cpus;        ///< local cpus as the source reports them (all cpus when unknown)
  bool locality_known = false;  ///< false: firmware gave no affinity (sysfs numa_node = -1 on several nodes)
  std::string name;             ///< model name when the source knows it, else "NVIDIA [10de:DEVICE]"
  /// The PCI path from the host bridge down: "pci0000:17" (domain:root bus), then each PCI bridge's
  /// bus id, ending with the GPU's own. The host bridge entry is "" when the source does not know it.
  std::vector<std::string> pci_path;
};

/// How two GPUs reach each other, best to worst, as `nvidia-smi topo -m` names them.
enum class GpuLink {
  self,  ///< "X": the same GPU
  pix,   ///< "PIX": at most one PCIe switch between them
  pxb,   ///< "PXB": several PCIe bridges, no host bridge
  phb,   ///< "PHB": through one PCIe host bridge
  node,  ///< "NODE": between host bridges of one NUMA node
  sys,   ///< "SYS": across NUMA nodes (the SMP interconnect), or locality unknown
};

/// "X", "PIX", "PXB", "PHB", "NODE" or "SYS".
const char* link_name(GpuLink link) noexcept;

/// A machine's (or a described machine's) GPU/NUMA topology. A plain value: copy freely.
class Topology {
 public:
  /// Builds a topology from parts. GPUs are re-indexed in PCI bus id order and NUMA nodes sorted
  /// by os_index. Throws InvalidArgument when `nodes` is empty or two GPUs share a bus id.
  Topology(std::string source, std::vector<NumaNode> nodes, std::vector<GpuInfo> gpus);

  /// This process's topology: the `topology` option's XML file when set, else the live machine
  /// through hwloc, else through sysfs. On the live machine with CUDA usable, GPUs are indexed by
  /// CUDA ordinal (matched through cudaDeviceGetPCIBusId) and only GPUs CUDA can see are listed.
  /// Throws ConfigError for a bad MEMTIDE_TOPOLOGY file.
  static Topology discover();

  /// Loads an hwloc 2.x XML topology (as written by `lstopo --of xml`). Throws IoError when the
  /// file cannot be read and ConfigError when hwloc rejects it or memtide was built without hwloc.
  static Topology from_xml(const std::string& path);

  /// Reads a Linux sysfs tree rooted at `root` ("/sys" for this machine; another directory in tests):
  /// devices/system/node/node*/{cpulist,meminfo} and bus/pci/devices/*/{vendor,device,class,
  /// numa_node,local_cpulist}. Throws IoError when `root` has no PCI device directory.
  static Topology from_sysfs(const std::string& root = "/sys");

  /// "hwloc", "hwloc-xml:<file>", "sysfs" or "sysfs:<root>" (a root other than /sys).
  [[nodiscard]] const std::string& source() const noexcept { return source_; }
  [[nodiscard]] const std::vector<NumaNode>& numa_nodes() const noexcept { return nodes_; }
  [[nodiscard]] const std::vector<GpuInfo>& gpus() const noexcept { return gpus_; }
  /// GPU `index`; throws InvalidArgument naming the index and the GPU count.
  [[nodiscard]] const GpuInfo& gpu(int index) const;
  [[nodiscard]] bool has_node(int os_index) const noexcept;

  /// The cores worker threads for `gpu` should run on: the GPU's local cpus, or when its locality
  /// is unknown, the cpus of preferred_node(gpu), so that threads and memory agree.
  [[nodiscard]] std::vector<int> local_cpus(int gpu) const;

  /// `gpu`'s share of its local cpus when GPUs 0 .. `ranks_on_node` - 1 each have a rank of the
  /// job on this machine (torchrun's LOCAL_WORLD_SIZE; a rank uses the GPU of its LOCAL_RANK):
  /// the ranks whose GPUs have the same local cpus split them in GPU order, in contiguous runs
  /// of the ascending list, the first ones one cpu more when they do not divide. A GPU whose
  /// group has more ranks than cpus shares one cpu. 1 (or less): all local cpus.
  [[nodiscard]] std::vector<int> cpu_share(int gpu, int ranks_on_node) const;

  /// The NUMA node for `gpu`'s host buffers: its first local node. When the locality is unknown,
  /// the node with the most memory (lowest os_index on a tie), with a warning logged once per GPU.
  [[nodiscard]] int preferred_node(int gpu) const;

  /// How GPUs `a` and `b` are connected. Unknown locality counts as SYS.
  [[nodiscard]] GpuLink link(int a, int b) const;

 private:
  friend Topology order_like_cuda(const Topology& topo, const std::vector<std::string>& bus_ids,
                                  const std::vector<std::string>& names);
  void check_gpu(int index) const;

  std::string source_;
  std::vector<NumaNode> nodes_;
  std::vector<GpuInfo> gpus_;
};

/// True when memtide was built with hwloc (live discovery through hwloc, XML topologies).
bool hwloc_available() noexcept;

/// Re-indexes `topo`'s GPUs to follow CUDA: GPU i is the one whose bus id is `bus_ids[i]`, named
/// `names[i]` when that is not empty. GPUs CUDA does not list are dropped; a CUDA device missing
/// from `topo` is added with unknown locality. Used by discover(); public for tests.
Topology order_like_cuda(const Topology& topo, const std::vector<std::string>& bus_ids,
                         const std::vector<std::string>& names);

/// "0000:1B:00.0", "00000000:1b:00.0" or "1b:00.0" -> "0000:1b:00.0". Throws InvalidArgument
/// naming the text when it is not a PCI bus id.
std::string normalize_pci_bus_id(std::string_view text);

/// Parses a kernel cpu list ("0-3,8,10-11"; empty or blank = none) into ascending unique cpus.
/// Throws InvalidArgument naming the text.
std::vector<int> parse_cpu_list(std::string_view text);

/// The inverse of parse_cpu_list: "0-3,8,10-11" ("" for none).
std::string format_cpu_list(const std::vector<int>& cpus);

/// The cpus of `wanted` this thread may run on (its sched_getaffinity mask), in `wanted`'s order.
std::vector<int> allowed_cpus(const std::vector<int>& wanted);

/// A ThreadPool whose workers are bound to `gpu`'s share of its local cpus (Topology::cpu_share
/// with `ranks_on_node`) that this process may use. When none of them may be used (a topology of another machine, a taskset or
/// cgroup that excludes them), the pool is not bound and a warning is logged. `threads` = 0 means
/// one participant per bound cpu (hardware_concurrency when unbound). The calling thread is
/// participant 0 and is never re-pinned. Throws InvalidArgument for a bad `gpu`.
std::unique_ptr<ThreadPool> make_gpu_pool(const Topology& topo, int gpu, std::size_t threads = 0,
                                          int ranks_on_node = 1);

}  // namespace memtide
