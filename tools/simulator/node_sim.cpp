// A node of ranks: the host divided among them (share_host) and each rank simulated on its share
// (simulate_node). docs/simulator.md says what is simulated and what is modelled.
#include "memtide/simulator/node_sim.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "memtide/core/error.hpp"
#include "memtide/tiering/kernels/device_ops.hpp"
#include "sim_checks.hpp"

namespace memtide::tiering {
namespace {

using sim::require;

HostSpec paper_testbed() {
  // Deep Optimizer States' JLSE testbed: 2 x Xeon Platinum 8468 (48 cores each), 512 GB DDR5
  // over two NUMA nodes, GPUs 0-1 on node 0 and 2-3 on node 1, each on its own PCIe Gen5 link
  // (~55 GB/s each way), two 1.5 TB Gen4 drives. DRAM: eight DDR5-4800 channels a socket,
  // 307 GB/s peak, taken at ~80%.
  HostSpec h;
  h.name = "4xh100-2s";
  h.sockets.assign(2, HostSocket{48, 83e6, 250e9, 256ULL << 30});
  h.gpus = {{0, -1}, {0, -1}, {1, -1}, {1, -1}};
  return h;
}

HostSpec dgx_like() {
  // A DGX-H100-like node: 2 x 56 cores, 2 TB, four GPUs a socket, two GPUs (and their NICs)
  // behind each PCIe Gen5 switch, whose uplink (x16, ~55 GB/s each way) they share; eight drives.
  HostSpec h;
  h.name = "8xh100-2s-switches";
  h.sockets.assign(2, HostSocket{56, 83e6, 250e9, 1024ULL << 30});
  for (int g = 0; g < 8; ++g) h.gpus.push_back({g / 4, g / 2});
  h.uplink_bytes_per_s.assign(4, 55e9);
  h.nvme_drives = 8;
  h.nvme_drive_bytes = 3'840'000'000'000ULL;
  return h;
}

// One flow of the max-min fair division: a rank's CPU update (params/s), H2D or D2H (bytes/s),
// NVMe read or write (bytes/s). It uses each resource at `use` units per unit of its rate, and
// cannot exceed `nominal` (what it would get alone).
struct Flow {
  int rank = 0;
  enum class Kind { cpu, h2d, d2h, nvme_read, nvme_write } kind = Kind::cpu;
  double nominal = 0;
  std::vector<std::pair<std::size_t, double>> use;  // resource, units per unit of rate
  double rate = 0;
  std::string capped_by;
};

struct Resource {
  std::string name;
  double capacity = 0;
};

// Progressive filling: every unfrozen flow runs at the same fraction t of its nominal rate; t
// rises until a resource fills (its flows freeze there) or a flow reaches its nominal.
void fill(std::vector<Flow>& flows, const std::vector<Resource>& resources) {
  std::vector<double> left(resources.size());
  for (std::size_t j = 0; j < resources.size(); ++j) left[j] = resources[j].capacity;
  std::vector<bool> frozen(flows.size(), false);
  double t = 0;
  for (;;) {
    std::vector<double> pull(resources.size(), 0);  // per unit of t
    bool any = false;
    for (std::size_t f = 0; f < flows.size(); ++f) {
      if (frozen[f]) continue;
      any = true;
      for (const auto& [j, a] : flows[f].use) pull[j] += a * flows[f].nominal;
    }
    if (!any) break;
    double step = 1 - t;
    std::size_t full = resources.size();
    for (std::size_t j = 0; j < resources.size(); ++j) {
      if (pull[j] <= 0) continue;
      const double s = left[j] / pull[j];
      if (s < step) {
        step = s;
        full = j;
      }
    }
    t += step;
    for (std::size_t j = 0; j < resources.size(); ++j) left[j] = std::max(0.0, left[j] - pull[j] * step);
    for (std::size_t f = 0; f < flows.size(); ++f) {
      if (frozen[f]) continue;
      bool stop = full == resources.size();  // reached its nominal rate
      std::string by = "its own limit";
      for (const auto& [j, a] : flows[f].use) {
        if (a > 0 && left[j] <= resources[j].capacity * 1e-12) {
          stop = true;
          by = resources[j].name;
          break;
        }
      }
      if (!stop) continue;
      frozen[f] = true;
      flows[f].rate = t * flows[f].nominal;
      flows[f].capped_by = by;
    }
  }
}

}  // namespace

const std::vector<std::string>& HostSpec::preset_names() {
  static const std::vector<std::string> names = {"4xh100-2s", "8xh100-2s-switches"};
  return names;
}

HostSpec HostSpec::preset(const std::string& name) {
  if (name == "4xh100-2s") return paper_testbed();
  if (name == "8xh100-2s-switches") return dgx_like();
  std::string known;
  for (const std::string& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw InvalidArgument("host \"" + name + "\" is not a known node (" + known + ")");
}

HostSpec HostSpec::two_sockets(int gpus) {
  require(gpus >= 1 && gpus <= 64, "host: gpus must be 1 to 64, got " + std::to_string(gpus));
  HostSpec h = paper_testbed();
  h.name = std::to_string(gpus) + "xh100-2s";
  h.gpus.clear();
  for (int g = 0; g < gpus; ++g) h.gpus.push_back({g < (gpus + 1) / 2 ? 0 : 1, -1});
  return h;
}

HostSpec HostSpec::from_topology(const Topology& topology, const HostSpec& rates) {
  HostSpec h = rates;
  h.name = topology.source();
  h.sockets.clear();
  h.gpus.clear();
  h.uplink_bytes_per_s.clear();
  const HostSocket per_socket = rates.sockets.empty() ? HostSocket{} : rates.sockets.front();
  std::map<int, int> socket_of_node;
  for (const NumaNode& n : topology.numa_nodes()) {
    HostSocket s = per_socket;
    if (!n.cpus.empty()) s.cores = static_cast<int>(n.cpus.size());
    if (n.memory_bytes > 0) s.memory_bytes = n.memory_bytes;
    socket_of_node[n.os_index] = static_cast<int>(h.sockets.size());
    h.sockets.push_back(s);
  }
  const int n = static_cast<int>(topology.gpus().size());
  require(n >= 1, "host: topology " + topology.source() + " has no NVIDIA GPU");
  // GPUs with no host bridge between them (PIX, PXB) sit behind one switch and share its uplink.
  std::vector<int> group(static_cast<std::size_t>(n));
  std::iota(group.begin(), group.end(), 0);
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < a; ++b) {
      const GpuLink l = topology.link(a, b);
      if (l == GpuLink::pix || l == GpuLink::pxb) group[static_cast<std::size_t>(a)] = group[static_cast<std::size_t>(b)];
    }
  }
  std::map<int, int> uplink_of_group;
  for (int g = 0; g < n; ++g) {
    const int members = static_cast<int>(std::count(group.begin(), group.end(), group[static_cast<std::size_t>(g)]));
    int uplink = -1;
    if (members > 1) {
      auto [it, added] = uplink_of_group.try_emplace(group[static_cast<std::size_t>(g)],
                                                     static_cast<int>(h.uplink_bytes_per_s.size()));
      if (added) h.uplink_bytes_per_s.push_back(rates.gpu_link_bytes_per_s);
      uplink = it->second;
    }
    const int node = topology.preferred_node(g);
    const auto s = socket_of_node.find(node);
    h.gpus.push_back({s == socket_of_node.end() ? 0 : s->second, uplink});
  }
  return h;
}

void HostSpec::validate() const {
  require(!sockets.empty() && sockets.size() <= 64, "host " + name + ": must have 1 to 64 sockets, has " +
                                                        std::to_string(sockets.size()));
  require(!gpus.empty() && gpus.size() <= 64, "host " + name + ": must have 1 to 64 GPUs, has " + std::to_string(gpus.size()));
  for (std::size_t s = 0; s < sockets.size(); ++s) {
    const HostSocket& k = sockets[s];
    const std::string where = "host " + name + ": socket " + std::to_string(s) + ": ";
    require(k.cores >= 1 && k.cores <= 4096, where + "cores must be 1 to 4096, got " + std::to_string(k.cores));
    require(k.core_update_params_per_s > 0 && std::isfinite(k.core_update_params_per_s),
            where + "core_update_params_per_s must be a positive rate");
    require(k.dram_bytes_per_s > 0 && std::isfinite(k.dram_bytes_per_s), where + "dram_bytes_per_s must be a positive rate");
  }
  for (std::size_t g = 0; g < gpus.size(); ++g) {
    const std::string where = "host " + name + ": GPU " + std::to_string(g) + ": ";
    require(gpus[g].socket >= 0 && gpus[g].socket < static_cast<int>(sockets.size()),
            where + "socket " + std::to_string(gpus[g].socket) + " does not exist");
    require(gpus[g].uplink >= -1 && gpus[g].uplink < static_cast<int>(uplink_bytes_per_s.size()),
            where + "uplink " + std::to_string(gpus[g].uplink) + " does not exist");
  }
  for (double v : uplink_bytes_per_s) require(v > 0 && std::isfinite(v), "host " + name + ": an uplink rate must be positive");
  const std::pair<const char*, double> rates[] = {{"gpu_link_bytes_per_s", gpu_link_bytes_per_s},
                                                  {"cross_socket_bytes_per_s", cross_socket_bytes_per_s},
                                                  {"nvme_read_bytes_per_s", nvme_read_bytes_per_s},
                                                  {"nvme_write_bytes_per_s", nvme_write_bytes_per_s}};
  for (const auto& [field, v] : rates) {
    require(v > 0 && std::isfinite(v), "host " + name + ": " + field + " must be a positive rate, got " + std::to_string(v));
  }
  require(nvme_drives >= 0 && nvme_drives <= 256, "host " + name + ": nvme_drives must be 0 to 256");
}

const char* to_string(HostPlacement p) noexcept {
  switch (p) {
    case HostPlacement::memtide: return "memtide";
    case HostPlacement::node0: return "node0";
    case HostPlacement::interleave: return "interleave";
    case HostPlacement::first_touch: return "first_touch";
  }
  return "?";
}

HostPlacement host_placement(const std::string& name) {
  for (HostPlacement p : kHostPlacements) {
    if (name == to_string(p)) return p;
  }
  throw InvalidArgument("placement \"" + name + "\" is not one of memtide, node0, interleave, first_touch");
}

std::vector<RankShare> share_host(const HostSpec& host, HostPlacement placement, double cpu_bytes_per_param) {
  host.validate();
  require(cpu_bytes_per_param > 0 && std::isfinite(cpu_bytes_per_param), "share_host: cpu_bytes_per_param must be positive");
  const std::size_t sockets = host.sockets.size();
  const int ranks = static_cast<int>(host.gpus.size());

  // The resources, by index: per socket its cores (params/s of CPU update) and its DRAM; the
  // link between sockets; per GPU its own link each way; per switch uplink each way; the drives.
  std::vector<Resource> res;
  auto add = [&](std::string name, double capacity) {
    res.push_back({std::move(name), capacity});
    return res.size() - 1;
  };
  std::vector<std::size_t> cores(sockets), dram(sockets);
  double all_cores = 0;
  for (std::size_t s = 0; s < sockets; ++s) {
    const HostSocket& k = host.sockets[s];
    cores[s] = add("socket " + std::to_string(s) + " cores", k.cores * k.core_update_params_per_s);
    dram[s] = add("socket " + std::to_string(s) + " DRAM", k.dram_bytes_per_s);
    all_cores += k.cores;
  }
  const std::size_t upi = add("the link between sockets", host.cross_socket_bytes_per_s);
  std::vector<std::size_t> link_in(static_cast<std::size_t>(ranks)), link_out(static_cast<std::size_t>(ranks));
  for (int g = 0; g < ranks; ++g) {
    link_in[static_cast<std::size_t>(g)] = add("GPU " + std::to_string(g) + " PCIe link (H2D)", host.gpu_link_bytes_per_s);
    link_out[static_cast<std::size_t>(g)] = add("GPU " + std::to_string(g) + " PCIe link (D2H)", host.gpu_link_bytes_per_s);
  }
  std::vector<std::size_t> up_in, up_out;
  for (std::size_t u = 0; u < host.uplink_bytes_per_s.size(); ++u) {
    up_in.push_back(add("PCIe switch " + std::to_string(u) + " uplink (H2D)", host.uplink_bytes_per_s[u]));
    up_out.push_back(add("PCIe switch " + std::to_string(u) + " uplink (D2H)", host.uplink_bytes_per_s[u]));
  }
  const double drives = std::max(host.nvme_drives, 0);
  const std::size_t nvme_read = add("the NVMe drives (read)", std::max(drives * host.nvme_read_bytes_per_s, 1.0));
  const std::size_t nvme_write = add("the NVMe drives (write)", std::max(drives * host.nvme_write_bytes_per_s, 1.0));

  // Where each rank's pages live (p) and where its CPU threads run (q), per socket.
  std::vector<Flow> flows;
  std::vector<RankShare> out(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    const HostGpu& gpu = host.gpus[static_cast<std::size_t>(r)];
    const auto home = static_cast<std::size_t>(gpu.socket);
    std::vector<double> p(sockets, 0), q(sockets, 0);
    for (std::size_t s = 0; s < sockets; ++s) q[s] = host.sockets[s].cores / all_cores;  // threads float
    switch (placement) {
      case HostPlacement::memtide:
        p[home] = 1;
        q.assign(sockets, 0);
        q[home] = 1;
        break;
      case HostPlacement::node0: p[0] = 1; break;
      case HostPlacement::interleave: p.assign(sockets, 1.0 / static_cast<double>(sockets)); break;
      case HostPlacement::first_touch: p = q; break;
    }
    RankShare& share = out[static_cast<std::size_t>(r)];
    share.gpu = r;
    share.socket = gpu.socket;

    // The CPU update: cores where its threads run, DRAM where its pages are, the link between
    // sockets for the part whose thread and page differ. Alone it would have the cores it may
    // run on (memtide: its socket's; else all of them).
    Flow cpu;
    cpu.rank = r;
    cpu.kind = Flow::Kind::cpu;
    double reachable = 0, remote = 0;
    for (std::size_t s = 0; s < sockets; ++s) {
      if (q[s] > 0) {
        cpu.use.emplace_back(cores[s], q[s]);
        reachable += host.sockets[s].cores * host.sockets[s].core_update_params_per_s;
      }
      if (p[s] > 0) cpu.use.emplace_back(dram[s], p[s] * cpu_bytes_per_param);
      remote += q[s] * (1 - p[s]);
    }
    if (remote > 0) cpu.use.emplace_back(upi, remote * cpu_bytes_per_param);
    cpu.nominal = reachable;
    flows.push_back(cpu);

    // DMA: the GPU's link, its switch uplink, DRAM where the pages are, the link between
    // sockets for pages away from the GPU's socket.
    for (const Flow::Kind dir : {Flow::Kind::h2d, Flow::Kind::d2h}) {
      Flow dma;
      dma.rank = r;
      dma.kind = dir;
      dma.nominal = host.gpu_link_bytes_per_s;
      dma.use.emplace_back(dir == Flow::Kind::h2d ? link_in[static_cast<std::size_t>(r)] : link_out[static_cast<std::size_t>(r)], 1.0);
      if (gpu.uplink >= 0) {
        dma.use.emplace_back(dir == Flow::Kind::h2d ? up_in[static_cast<std::size_t>(gpu.uplink)] : up_out[static_cast<std::size_t>(gpu.uplink)], 1.0);
      }
      for (std::size_t s = 0; s < sockets; ++s) {
        if (p[s] > 0) dma.use.emplace_back(dram[s], p[s]);
      }
      if (p[home] < 1) dma.use.emplace_back(upi, 1 - p[home]);
      flows.push_back(dma);
    }
    // NVMe: the drives, shared by every rank that spills.
    for (const Flow::Kind dir : {Flow::Kind::nvme_read, Flow::Kind::nvme_write}) {
      Flow nvme;
      nvme.rank = r;
      nvme.kind = dir;
      nvme.nominal = dir == Flow::Kind::nvme_read ? drives * host.nvme_read_bytes_per_s : drives * host.nvme_write_bytes_per_s;
      nvme.use.emplace_back(dir == Flow::Kind::nvme_read ? nvme_read : nvme_write, 1.0);
      if (nvme.nominal > 0) flows.push_back(nvme);
    }
  }
  fill(flows, res);

  // Each rank's host memory traffic: what its flows drive, plus its part of what the sockets
  // holding its pages have left (a phase that does not overlap all of it may use that).
  std::vector<double> dram_used(sockets, 0);
  std::vector<std::vector<double>> rank_dram(static_cast<std::size_t>(ranks), std::vector<double>(sockets, 0));
  for (const Flow& f : flows) {
    RankShare& share = out[static_cast<std::size_t>(f.rank)];
    switch (f.kind) {
      case Flow::Kind::cpu:
        share.cpu_update_params_per_s = f.rate;
        share.busiest = f.capped_by;
        break;
      case Flow::Kind::h2d: share.h2d_bytes_per_s = f.rate; break;
      case Flow::Kind::d2h: share.d2h_bytes_per_s = f.rate; break;
      case Flow::Kind::nvme_read: share.nvme_read_bytes_per_s = f.rate; break;
      case Flow::Kind::nvme_write: share.nvme_write_bytes_per_s = f.rate; break;
    }
    for (const auto& [j, a] : f.use) {
      for (std::size_t s = 0; s < sockets; ++s) {
        if (j == dram[s]) {
          rank_dram[static_cast<std::size_t>(f.rank)][s] += a * f.rate;
          dram_used[s] += a * f.rate;
        }
      }
    }
  }
  for (int r = 0; r < ranks; ++r) {
    RankShare& share = out[static_cast<std::size_t>(r)];
    double traffic = 0;
    for (std::size_t s = 0; s < sockets; ++s) {
      const double mine = rank_dram[static_cast<std::size_t>(r)][s];
      const double spare = std::max(0.0, host.sockets[s].dram_bytes_per_s - dram_used[s]);
      traffic += mine + (dram_used[s] > 0 ? spare * mine / dram_used[s] : 0);
    }
    share.host_dram_bytes_per_s = traffic;
    const HostSocket& k = host.sockets[static_cast<std::size_t>(share.socket)];
    share.cores = share.cpu_update_params_per_s / k.core_update_params_per_s;
  }
  return out;
}

NodeSimulation simulate_node(const ModelShape& model, const NodeSpec& base, const HostSpec& host,
                             const std::vector<HostPlacement>& placements, const std::vector<Contender>& contenders,
                             const SimulationOptions& options) {
  host.validate();
  require(!placements.empty() && !contenders.empty(), "simulate_node: give at least one placement and one contender");
  NodeSpec node = base;
  node.gpus = static_cast<int>(host.gpus.size());
  node.validate();
  NodeSimulation out;
  out.host = host;
  out.nodes = node.nodes;
  const double bytes_per_param = adamw_bytes_per_param(DType::fp32, DType::bf16);
  // Ranks with the same share run the same simulation: each distinct one runs once.
  std::map<std::tuple<int, double, double, double, double, double, double>, IterationResult> done;
  for (HostPlacement placement : placements) {
    const std::vector<RankShare> shares = share_host(host, placement, bytes_per_param);
    for (Contender contender : contenders) {
      NodeRun run;
      run.contender = contender;
      run.placement = placement;
      for (const RankShare& share : shares) {
        const auto key = std::make_tuple(static_cast<int>(contender), share.cpu_update_params_per_s,
                                         share.host_dram_bytes_per_s, share.h2d_bytes_per_s, share.d2h_bytes_per_s,
                                         share.nvme_read_bytes_per_s, share.nvme_write_bytes_per_s);
        auto it = done.find(key);
        if (it == done.end()) {
          NodeSpec rank = node;
          rank.device.cpu_update_params_per_s = share.cpu_update_params_per_s;
          rank.device.host_dram_bytes_per_s = share.host_dram_bytes_per_s;
          rank.device.h2d_bytes_per_s = share.h2d_bytes_per_s;
          rank.device.d2h_bytes_per_s = share.d2h_bytes_per_s;
          if (share.nvme_read_bytes_per_s > 0) rank.nvme_read_bytes_per_s = share.nvme_read_bytes_per_s;
          if (share.nvme_write_bytes_per_s > 0) rank.nvme_write_bytes_per_s = share.nvme_write_bytes_per_s;
          it = done.emplace(key, simulate_iteration(model, rank, contender, options)).first;
        }
        run.ranks.push_back({share, it->second});
      }
      for (std::size_t r = 0; r < run.ranks.size(); ++r) {
        const double t = run.ranks[r].result.simulated.iteration_s;
        if (t > run.iteration_s) {
          run.iteration_s = t;
          run.slowest_rank = static_cast<int>(r);
        }
      }
      out.runs.push_back(std::move(run));
    }
  }
  return out;
}

}  // namespace memtide::tiering
