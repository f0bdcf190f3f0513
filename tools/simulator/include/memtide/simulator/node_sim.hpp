#pragma once
/// @file
/// A whole node of ranks: every GPU's rank simulated with the host it actually gets when the
/// node's other ranks run beside it, and many such nodes joined by a modelled network.
///
/// The host is built from a topology (an hwloc XML file, or a named preset): sockets with their
/// cores, DRAM bandwidth and memory, the link between sockets, each GPU's own PCIe link and the
/// switch uplinks GPUs share, and the NVMe drives. A placement says where each rank's optimizer
/// state lives and where its CPU threads run: memtide's (both on the GPU's socket, the socket's
/// cores split among its ranks) or a NUMA-oblivious one. share_host() divides every shared
/// resource among the ranks running at once (max-min fair, each rank's CPU update, H2D and D2H
/// raised together until a resource fills), and each rank is then simulated in full
/// (simulate_iteration) on a device whose rates are its share: its engine calibrates and plans
/// from what it measures there. The slowest rank sets the node's iteration.
///
/// What is simulated and what is modelled is written in docs/simulator.md ("A node of ranks").

#include <cstdint>
#include <string>
#include <vector>

#include "memtide/device/topology.hpp"
#include "memtide/simulator/iteration_sim.hpp"

namespace memtide::tiering {

/// One CPU socket (a NUMA node) of the host.
struct HostSocket {
  int cores = 48;
  /// The CPU optimizer step one core sustains when DRAM keeps up: the paper's host updates
  /// ~8 G params/s with 96 cores (192 threads), 83 M params/s a core.
  double core_update_params_per_s = 83e6;
  /// Achievable DRAM bandwidth of the socket, both directions together.
  double dram_bytes_per_s = 250e9;
  std::uint64_t memory_bytes = 256ULL << 30;
};

/// One GPU: the socket its PCIe root port hangs off, and the switch uplink it shares (-1: none,
/// its own root port).
struct HostGpu {
  int socket = 0;
  int uplink = -1;
};

/// The node's host as the ranks share it.
struct HostSpec {
  std::string name = "custom";
  std::vector<HostSocket> sockets;
  std::vector<HostGpu> gpus;
  std::vector<double> uplink_bytes_per_s;  ///< per PCIe switch uplink, each way
  double gpu_link_bytes_per_s = 55e9;      ///< each GPU's own PCIe link, each way (paper: ~55 GB/s)
  double cross_socket_bytes_per_s = 120e9;  ///< the link between sockets, both directions together
  int nvme_drives = 2;
  double nvme_read_bytes_per_s = 6e9;   ///< per drive
  double nvme_write_bytes_per_s = 4e9;  ///< per drive
  std::uint64_t nvme_drive_bytes = 1'500'000'000'000ULL;

  /// The named hosts: "4xh100-2s" (the paper's testbed: 2 x 48 cores, GPUs 0-1 on socket 0 and
  /// 2-3 on socket 1, each on its own root port, 512 GB, two 1.5 TB drives) and "8xh100-2s-switches"
  /// (a DGX-H100-like node: 2 x 56 cores, four GPUs a socket, two GPUs behind each PCIe switch,
  /// 2 TB, eight drives). Throws InvalidArgument naming the known ones.
  static HostSpec preset(const std::string& name);
  static const std::vector<std::string>& preset_names();
  /// `gpus` GPUs on the paper's two sockets, split evenly (the first half on socket 0), each on its
  /// own root port: for sweeps of GPUs per node.
  static HostSpec two_sockets(int gpus);
  /// The sockets and GPUs of a topology (an hwloc XML file: Topology::from_xml): one socket per
  /// NUMA node with its cores and memory, each GPU on its preferred node, and GPUs whose PCIe
  /// paths share a switch below the root port behind one uplink. What a topology does not say
  /// (bandwidths, per-core rates, drives) comes from `rates`.
  static HostSpec from_topology(const Topology& topology, const HostSpec& rates);
  /// Throws InvalidArgument naming the first value out of range.
  void validate() const;
};

/// Where each rank's optimizer state lives and where its CPU threads run.
enum class HostPlacement {
  memtide,      ///< state and threads on the GPU's socket, the socket's cores split among its ranks
  node0,        ///< every rank's state on socket 0; threads wherever the scheduler puts them
  interleave,   ///< pages spread over all sockets (numactl --interleave=all); threads anywhere
  first_touch,  ///< pages where the touching thread ran: spread as the threads are
};
/// "memtide", "node0", "interleave", "first_touch".
const char* to_string(HostPlacement p) noexcept;
/// The placement named `name`; throws InvalidArgument naming the known ones.
HostPlacement host_placement(const std::string& name);
inline constexpr HostPlacement kHostPlacements[] = {HostPlacement::memtide, HostPlacement::node0,
                                                    HostPlacement::interleave, HostPlacement::first_touch};

/// What one rank gets of the host while every rank runs at once.
struct RankShare {
  int gpu = 0;
  int socket = 0;
  double cores = 0;                    ///< cores its CPU update runs on, in effect
  double cpu_update_params_per_s = 0;  ///< its CPU optimizer step
  double host_dram_bytes_per_s = 0;    ///< host memory traffic it can drive (CPU and DMA)
  double h2d_bytes_per_s = 0;
  double d2h_bytes_per_s = 0;
  double nvme_read_bytes_per_s = 0;
  double nvme_write_bytes_per_s = 0;
  std::string busiest;  ///< the resource that capped its CPU update first
};

/// Divides the host among its GPUs' ranks under `placement`. `cpu_bytes_per_param` is the DRAM
/// traffic of one CPU-updated param (adamw_bytes_per_param). Deterministic.
std::vector<RankShare> share_host(const HostSpec& host, HostPlacement placement, double cpu_bytes_per_param);

/// One rank's iteration in the node.
struct RankRun {
  RankShare share;
  IterationResult result;
};

/// One contender on the node under one placement.
struct NodeRun {
  Contender contender = Contender::memtide;
  HostPlacement placement = HostPlacement::memtide;
  std::vector<RankRun> ranks;
  double iteration_s = 0;  ///< the slowest rank's
  int slowest_rank = 0;
};

struct NodeSimulation {
  HostSpec host;
  int nodes = 1;
  std::vector<NodeRun> runs;  ///< per placement, per contender
};

/// Simulates every rank of one node of `base` (gpus = the host's GPUs, nodes as given) for each
/// contender and placement: each rank on a device with its share_host() rates. Ranks with the
/// same share are simulated once. Throws InvalidArgument for bad inputs, OutOfMemory when a
/// rank does not fit its device.
NodeSimulation simulate_node(const ModelShape& model, const NodeSpec& base, const HostSpec& host,
                             const std::vector<HostPlacement>& placements,
                             const std::vector<Contender>& contenders, const SimulationOptions& options = {});

}  // namespace memtide::tiering
