// A node of ranks: the host divided among them (share_host), each rank simulated on its share
// (simulate_node), and collectives across nodes. Small shapes.

#include <gtest/gtest.h>

#include <string>

#include "memtide/core/error.hpp"
#include "memtide/simulator/node_sim.hpp"
#include "sim_fixtures.hpp"

using namespace memtide;
using namespace memtide::tiering;

namespace {

constexpr double kCpuBytes = 30;  // adamw_bytes_per_param(fp32 grad, bf16 params)

ModelShape small() { return test::small_model(4); }
using test::small_node;

// Three GPUs: two on socket 0, one alone on socket 1.
HostSpec lopsided() {
  HostSpec h = HostSpec::two_sockets(2);
  h.gpus = {{0, -1}, {0, -1}, {1, -1}};
  return h;
}

TEST(ShareHost, RanksThatShareASocketGetLessCpuAndDramThanARankAloneOnOne) {
  const auto shares = share_host(lopsided(), HostPlacement::memtide, kCpuBytes);
  ASSERT_EQ(shares.size(), 3U);
  EXPECT_DOUBLE_EQ(shares[0].cpu_update_params_per_s, shares[1].cpu_update_params_per_s);
  EXPECT_LT(shares[0].cpu_update_params_per_s, shares[2].cpu_update_params_per_s);
  EXPECT_LT(shares[0].host_dram_bytes_per_s, shares[2].host_dram_bytes_per_s);
  EXPECT_LT(shares[0].cores, shares[2].cores);
  // The socket's cores, split between its two ranks, are all used.
  EXPECT_NEAR(shares[0].cores + shares[1].cores, 48, 48 * 1e-9);
  for (const RankShare& s : shares) EXPECT_FALSE(s.busiest.empty());
}

TEST(ShareHost, AGpuBehindASharedSwitchSeesTheSharedUplink) {
  HostSpec host = HostSpec::preset("8xh100-2s-switches");
  // DRAM to spare, so that the PCIe side is what divides (on the preset DRAM binds first).
  for (HostSocket& s : host.sockets) s.dram_bytes_per_s = 4e12;
  const auto shares = share_host(host, HostPlacement::memtide, kCpuBytes);
  ASSERT_EQ(shares.size(), 8U);
  for (const RankShare& s : shares) {
    // Two GPUs behind each 55 GB/s uplink: half of it each way, well under the GPU's own link.
    EXPECT_NEAR(s.h2d_bytes_per_s, host.uplink_bytes_per_s[0] / 2, 1e3);
    EXPECT_NEAR(s.d2h_bytes_per_s, host.uplink_bytes_per_s[0] / 2, 1e3);
  }
  HostSpec own_ports = host;
  for (HostGpu& g : own_ports.gpus) g.uplink = -1;
  const auto alone = share_host(own_ports, HostPlacement::memtide, kCpuBytes);
  EXPECT_GT(alone[0].h2d_bytes_per_s, shares[0].h2d_bytes_per_s * 1.5);
}

TEST(ShareHost, ObliviousPlacementsCrossSocketsAndLoadSocketZero) {
  const HostSpec host = HostSpec::preset("4xh100-2s");
  const auto mine = share_host(host, HostPlacement::memtide, kCpuBytes);
  const auto node0 = share_host(host, HostPlacement::node0, kCpuBytes);
  double mine_cpu = 0, node0_cpu = 0;
  for (std::size_t r = 0; r < mine.size(); ++r) {
    mine_cpu += mine[r].cpu_update_params_per_s;
    node0_cpu += node0[r].cpu_update_params_per_s;
    // A GPU on socket 1 reading socket 0's memory: its DMA crosses the link between sockets.
    EXPECT_LE(node0[r].h2d_bytes_per_s, mine[r].h2d_bytes_per_s * (1 + 1e-12)) << r;
  }
  EXPECT_LT(node0_cpu, mine_cpu);
  // What limits a socket-1 rank whose pages are all on socket 0 is not on its own socket.
  EXPECT_EQ(node0[3].busiest.find("socket 1"), std::string::npos) << node0[3].busiest;
  EXPECT_EQ(mine[3].busiest.find("socket 1"), 0U) << mine[3].busiest;
}

// The 8-GPU, 2-socket fixture: GPUs 0-3 behind one switch tree (PIX/PXB), 4-5 behind another,
// 6 and 7 on root ports of their own; sockets from its two NUMA nodes.
TEST(ShareHost, AHostFromAnHwlocXmlFile) {
  if (!hwloc_available()) GTEST_SKIP() << "built without hwloc";
  const Topology topo = Topology::from_xml(MEMTIDE_TEST_DATA_DIR "/topology/two_socket_8gpu_switches.xml");
  const HostSpec host = HostSpec::from_topology(topo, HostSpec::preset("4xh100-2s"));
  ASSERT_EQ(host.sockets.size(), 2U);
  EXPECT_EQ(host.sockets[0].cores, 8);
  ASSERT_EQ(host.gpus.size(), 8U);
  ASSERT_EQ(host.uplink_bytes_per_s.size(), 2U);
  for (int g = 0; g < 8; ++g) EXPECT_EQ(host.gpus[static_cast<std::size_t>(g)].socket, g < 4 ? 0 : 1) << g;
  for (int g = 1; g < 4; ++g) EXPECT_EQ(host.gpus[static_cast<std::size_t>(g)].uplink, host.gpus[0].uplink) << g;
  EXPECT_EQ(host.gpus[5].uplink, host.gpus[4].uplink);
  EXPECT_NE(host.gpus[4].uplink, host.gpus[0].uplink);
  EXPECT_EQ(host.gpus[6].uplink, -1);
  EXPECT_EQ(host.gpus[7].uplink, -1);
  // Four GPUs on one uplink get less each way than the two on the other, and those less than
  // GPU 7 on a port of its own (DRAM to spare, so the PCIe side divides).
  HostSpec roomy = host;
  for (HostSocket& s : roomy.sockets) s.dram_bytes_per_s = 4e12;
  roomy.cross_socket_bytes_per_s = 4e12;
  const auto shares = share_host(roomy, HostPlacement::memtide, kCpuBytes);
  EXPECT_LT(shares[0].h2d_bytes_per_s, shares[4].h2d_bytes_per_s);
  EXPECT_LT(shares[4].h2d_bytes_per_s, shares[7].h2d_bytes_per_s);
}

TEST(ShareHost, BadHostsAreNamed) {
  HostSpec h = HostSpec::two_sockets(2);
  h.gpus[1].socket = 5;
  EXPECT_THROW((void)share_host(h, HostPlacement::memtide, kCpuBytes), InvalidArgument);
  h = HostSpec::two_sockets(2);
  h.sockets[0].dram_bytes_per_s = -1;
  try {
    (void)share_host(h, HostPlacement::memtide, kCpuBytes);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("socket 0: dram_bytes_per_s"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)HostSpec::preset("16xb200"), InvalidArgument);
  EXPECT_THROW((void)host_placement("numa"), InvalidArgument);
}

// A model whose state does not fit the 1 GiB device: every rank's update goes through the host
// (the path the placement changes), for memtide's plan as for ZeRO-3's.
TEST(SimulateNode, ObliviousPlacementIsNeverFasterThanMemtidesOnTwoSockets) {
  ModelShape medium = small();
  medium.layers = 8;
  medium.hidden = 2048;
  medium.heads = 16;
  NodeSpec node = small_node();
  node.subgroup_params = 10'000'000;
  node.device.capacity = 1ULL << 30;
  for (const std::string& name : HostSpec::preset_names()) {
    const HostSpec host = HostSpec::preset(name);
    const NodeSimulation sim = simulate_node(medium, node, host, {kHostPlacements, kHostPlacements + 4},
                                             {Contender::zero3_offload, Contender::memtide});
    ASSERT_EQ(sim.runs.size(), 8U);
    for (std::size_t c = 0; c < 2; ++c) {
      const NodeRun& mine = sim.runs[c];
      ASSERT_EQ(mine.placement, HostPlacement::memtide);
      ASSERT_EQ(mine.ranks.size(), host.gpus.size());
      const Plan& plan = mine.ranks[0].result.plan;
      EXPECT_LT(plan.static_residents, plan.placement.size()) << "the host path must run";
      for (std::size_t p = 1; p < 4; ++p) {
        const NodeRun& other = sim.runs[2 * p + c];
        ASSERT_EQ(other.contender, mine.contender);
        EXPECT_GT(other.iteration_s, mine.iteration_s * 1.05) << name << " " << to_string(other.placement) << " "
                                                              << to_string(other.contender);
      }
    }
  }
}

TEST(SimulateNode, TheSameInputsGiveTheSameResult) {
  const HostSpec host = lopsided();
  const std::vector<HostPlacement> placements = {HostPlacement::memtide, HostPlacement::node0};
  const NodeSimulation a = simulate_node(small(), small_node(), host, placements, {Contender::memtide, Contender::zero3_offload});
  const NodeSimulation b = simulate_node(small(), small_node(), host, placements, {Contender::memtide, Contender::zero3_offload});
  ASSERT_EQ(a.runs.size(), b.runs.size());
  for (std::size_t i = 0; i < a.runs.size(); ++i) {
    EXPECT_EQ(a.runs[i].iteration_s, b.runs[i].iteration_s);
    for (std::size_t r = 0; r < a.runs[i].ranks.size(); ++r) {
      EXPECT_EQ(a.runs[i].ranks[r].result.simulated.update_s, b.runs[i].ranks[r].result.simulated.update_s);
    }
  }
  // The rank alone on its socket is not the slowest: the two sharing socket 0 are.
  EXPECT_NE(a.runs[0].slowest_rank, 2);
}

TEST(SimulateNode, CollectivesAcrossNodesCostWhatTheRingsSay) {
  NodeSpec one = small_node();
  one.gpus = 4;
  NodeSpec many = one;
  many.nodes = 8;
  const IterationResult a = simulate_iteration(small(), one, Contender::memtide);
  const IterationResult b = simulate_iteration(small(), many, Contender::memtide);
  EXPECT_GT(a.collective_s, 0);
  EXPECT_GT(b.collective_s, a.collective_s);
  // Eight times the ranks: each holds an eighth of the state, so its update is shorter.
  EXPECT_LT(b.simulated.update_s, a.simulated.update_s);
  // Latency only: a network of infinite bandwidth still pays (M - 1) hops per collective.
  NodeSpec fast = many;
  fast.inter_node_bytes_per_s = 1e30;
  fast.inter_node_latency_s = 1e-3;
  const IterationResult c = simulate_iteration(small(), fast, Contender::memtide);
  const int collectives = 3 * (small().layers + 1);  // forward and backward gathers, reduce-scatters
  EXPECT_NEAR(c.collective_s - a.collective_s, collectives * 7 * 1e-3, 1e-6);
}

}  // namespace
