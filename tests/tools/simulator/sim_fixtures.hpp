#pragma once
// The small model and node the simulator's tests share: a few dozen subgroups a rank, fast to
// simulate.

#include "memtide/simulator/iteration_sim.hpp"

namespace memtide::tiering::test {

inline ModelShape small_model(int layers = 6) {
  ModelShape m;
  m.name = "small";
  m.layers = layers;
  m.hidden = 1024;
  m.heads = 8;
  m.seq = 512;
  m.vocab = 8192;
  return m;
}

inline NodeSpec small_node() {
  NodeSpec n;
  n.subgroup_params = 2'000'000;  // a few dozen subgroups for a small model
  n.device.capacity = 8ULL << 30;
  return n;
}

}  // namespace memtide::tiering::test
