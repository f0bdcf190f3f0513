#include "memtide/allocator/transformer_trace.hpp"

#include <chrono>

#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"

namespace memtide {
namespace {

class TraceBuilder {
 public:
  std::uint32_t alloc(std::uint64_t bytes) {
    ops_.push_back({TraceOp::Kind::alloc, Phase::other, next_id_, bytes});
    return next_id_++;
  }
  void free(std::uint32_t id) { ops_.push_back({TraceOp::Kind::free, Phase::other, id, 0}); }
  void phase(Phase p) { ops_.push_back({TraceOp::Kind::phase, p, 0, 0}); }
  std::vector<TraceOp> take() { return std::move(ops_); }

 private:
  std::vector<TraceOp> ops_;
  std::uint32_t next_id_ = 0;
};

}  // namespace

std::uint64_t TransformerShape::parameters() const {
  const auto h = static_cast<std::uint64_t>(hidden);
  const std::uint64_t per_layer = 12 * h * h + 13 * h;  // qkv, proj, 4h MLP, biases, 2 layernorms
  return static_cast<std::uint64_t>(layers) * per_layer + static_cast<std::uint64_t>(vocab) * h;
}

std::string TransformerShape::describe() const {
  return std::to_string(layers) + " layers, hidden " + std::to_string(hidden) + ", seq " + std::to_string(seq) +
         ", batch " + std::to_string(batch) + ", " + std::to_string(parameters() / 1000000) + "M params";
}

std::vector<TraceOp> make_transformer_trace(const TransformerShape& s) {
  for (auto [name, v] : {std::pair{"layers", s.layers}, {"hidden", s.hidden}, {"heads", s.heads}, {"seq", s.seq},
                         {"batch", s.batch}, {"vocab", s.vocab}, {"bytes_per_element", s.bytes_per_element},
                         {"iterations", s.iterations}}) {
    if (v <= 0) throw InvalidArgument(std::string("transformer shape: ") + name + " must be positive, got " + std::to_string(v));
  }
  if (s.hidden % s.heads != 0) {
    throw InvalidArgument("transformer shape: hidden " + std::to_string(s.hidden) + " is not a multiple of heads " +
                          std::to_string(s.heads) + " (each head gets hidden / heads dimensions)");
  }
  const auto e = static_cast<std::uint64_t>(s.bytes_per_element);
  const auto h = static_cast<std::uint64_t>(s.hidden);
  const std::uint64_t bsh = static_cast<std::uint64_t>(s.batch) * static_cast<std::uint64_t>(s.seq) * h;
  const std::uint64_t bs = static_cast<std::uint64_t>(s.batch) * static_cast<std::uint64_t>(s.seq);
  const std::uint64_t lse = bs * static_cast<std::uint64_t>(s.heads) * 4;  // fp32 log-sum-exp
  // Parameter tensors of one block, in elements.
  const std::vector<std::uint64_t> block_params = {3 * h * h, 3 * h, h * h, h, 4 * h * h, 4 * h, 4 * h * h, h, h, h, h, h};

  TraceBuilder t;
  t.phase(Phase::other);
  std::vector<std::uint32_t> params;  // model weights, live for the whole run
  std::vector<std::uint64_t> param_elems;
  param_elems.push_back(static_cast<std::uint64_t>(s.vocab) * h);
  for (int l = 0; l < s.layers; ++l) param_elems.insert(param_elems.end(), block_params.begin(), block_params.end());
  for (std::uint64_t n : param_elems) params.push_back(t.alloc(n * e));

  std::vector<std::uint32_t> optimizer_state;
  for (int iter = 0; iter < s.iterations; ++iter) {
    t.phase(Phase::forward);
    std::vector<std::vector<std::uint32_t>> saved(static_cast<std::size_t>(s.layers));
    std::uint32_t x = t.alloc(bsh * e);  // embedding output
    for (int l = 0; l < s.layers; ++l) {
      auto& keep = saved[static_cast<std::size_t>(l)];
      keep.push_back(x);                        // block input (for the residual and ln1)
      keep.push_back(t.alloc(bsh * e));         // ln1 output
      keep.push_back(t.alloc(3 * bsh * e));     // q, k, v
      keep.push_back(t.alloc(bsh * e));         // attention output
      keep.push_back(t.alloc(lse));             // softmax statistics (flash attention)
      const std::uint32_t workspace = t.alloc(2 * bsh * e);
      t.free(workspace);
      keep.push_back(t.alloc(bsh * e));         // after projection + residual
      keep.push_back(t.alloc(bsh * e));         // ln2 output
      keep.push_back(t.alloc(4 * bsh * e));     // MLP up
      keep.push_back(t.alloc(4 * bsh * e));     // GELU output
      x = t.alloc(bsh * e);                     // block output
    }
    const std::uint32_t logits = t.alloc(bs * static_cast<std::uint64_t>(s.vocab) * e);
    const std::uint32_t loss = t.alloc(512);

    t.phase(Phase::backward);
    std::vector<std::uint32_t> grads;
    std::uint32_t dlogits = t.alloc(bs * static_cast<std::uint64_t>(s.vocab) * e);
    t.free(logits);
    t.free(loss);
    std::uint32_t dx = t.alloc(bsh * e);
    t.free(dlogits);
    t.free(x);
    for (int l = s.layers - 1; l >= 0; --l) {
      const std::uint32_t dmlp = t.alloc(4 * bsh * e);  // gradient through the MLP
      for (std::uint64_t n : block_params) grads.push_back(t.alloc(n * e));
      const std::uint32_t dattn = t.alloc(3 * bsh * e);  // gradient of q, k, v
      t.free(dmlp);
      const std::uint32_t dnext = t.alloc(bsh * e);
      t.free(dattn);
      t.free(dx);
      dx = dnext;
      for (std::uint32_t id : saved[static_cast<std::size_t>(l)]) t.free(id);
    }
    grads.push_back(t.alloc(param_elems.front() * e));  // embedding gradient
    t.free(dx);

    t.phase(Phase::update);
    if (optimizer_state.empty()) {
      const std::uint64_t state_bytes = s.fp32_master ? 12 : 2 * e;  // master + m + v, or m + v
      for (std::uint64_t n : param_elems) optimizer_state.push_back(t.alloc(n * state_bytes));
    }
    for (std::uint64_t n : param_elems) {  // multi-tensor apply temporaries
      const std::uint32_t tmp = t.alloc(n * 4);
      t.free(tmp);
    }
    for (std::uint32_t g : grads) t.free(g);
  }
  t.phase(Phase::forward);  // closes the last iteration's record
  for (std::uint32_t id : optimizer_state) t.free(id);
  for (std::uint32_t id : params) t.free(id);
  t.phase(Phase::other);
  return t.take();
}

ReplayResult replay(CachingAllocator& allocator, const std::vector<TraceOp>& trace, Stream stream) {
  std::uint32_t max_id = 0;
  for (const TraceOp& op : trace) max_id = std::max(max_id, op.id);
  std::vector<void*> live(static_cast<std::size_t>(max_id) + 1, nullptr);
  ReplayResult r;
  allocator.reset_peak_stats();
  const auto start = std::chrono::steady_clock::now();
  std::size_t updates_seen = 0;
  std::size_t updates_total = 0;
  for (const TraceOp& op : trace) updates_total += op.kind == TraceOp::Kind::phase && op.phase == Phase::update;
  try {
    for (const TraceOp& op : trace) {
      switch (op.kind) {
        case TraceOp::Kind::alloc:
          live[op.id] = allocator.allocate(op.bytes, stream);
          break;
        case TraceOp::Kind::free:
          allocator.deallocate(live[op.id], stream);
          live[op.id] = nullptr;
          break;
        case TraceOp::Kind::phase:
          allocator.mark_phase(op.phase);
          if (op.phase == Phase::update && ++updates_seen == updates_total) {
            r.update_headroom = allocator.headroom(Phase::forward);
          }
          break;
      }
      ++r.ops;
    }
  } catch (...) {
    for (void* p : live) allocator.deallocate(p, stream);
    throw;
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const AllocatorStats st = allocator.stats();
  r.peak_allocated = static_cast<std::uint64_t>(st.allocated_bytes[0].peak);
  r.peak_reserved = static_cast<std::uint64_t>(st.reserved_bytes[0].peak);
  r.reserved_over_allocated = r.peak_allocated ? static_cast<double>(r.peak_reserved) / static_cast<double>(r.peak_allocated) : 0;
  r.phases = allocator.phase_report();
  return r;
}

}  // namespace memtide
