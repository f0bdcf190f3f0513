// The C ABI. Every entry point catches everything: an exception crossing into torch or a C
// program would terminate the process.

#include <cstring>
#include <sstream>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/core/files.hpp"
#include "memtide/core/log.hpp"
#include "memtide/memtide.h"
#include "memtide/runtime/runtime.hpp"
#include "memtide/tiering/kernels/adamw_cpu.hpp"
#include "memtide/core/thread_pool.hpp"

using namespace memtide;

namespace {

thread_local std::string t_last_error;
// Whether t_last_error holds anything: a trivial thread_local, so the hot path's check needs no
// TLS initialization guard (the string's is paid only when an error is set or read).
thread_local bool t_has_error = false;

int fail(int code, const std::string& message) {
  t_last_error = message;
  t_has_error = true;
  MEMTIDE_LOG(error, message);
  return code;
}

template <typename F>
int guarded(const char* where, F&& body) noexcept {
  try {
    if (t_has_error) {
      t_last_error.clear();
      t_has_error = false;
    }
    body();
    return MEMTIDE_OK;
  } catch (const OutOfMemory& e) {
    return fail(MEMTIDE_OUT_OF_MEMORY, e.what());
  } catch (const InvalidArgument& e) {
    return fail(MEMTIDE_INVALID_ARGUMENT, std::string(where) + ": " + e.what());
  } catch (const ConfigError& e) {
    return fail(MEMTIDE_CONFIG_ERROR, e.what());
  } catch (const IoError& e) {
    return fail(MEMTIDE_IO_ERROR, std::string(where) + ": " + e.what());
  } catch (const std::exception& e) {
    return fail(MEMTIDE_ERROR, std::string(where) + ": " + e.what());
  } catch (...) {
    return fail(MEMTIDE_ERROR, std::string(where) + ": unknown error");
  }
}

Stream to_stream(memtide_stream_t s) { return Stream{static_cast<void*>(s)}; }

tiering::DType to_dtype(memtide_dtype_t d, const char* what) {
  switch (d) {
    case MEMTIDE_DTYPE_NONE: return tiering::DType::none;
    case MEMTIDE_DTYPE_FP32: return tiering::DType::fp32;
    case MEMTIDE_DTYPE_FP16: return tiering::DType::fp16;
    case MEMTIDE_DTYPE_BF16: return tiering::DType::bf16;
    case MEMTIDE_DTYPE_MAX_ENUM: break;
  }
  throw InvalidArgument(std::string(what) + " is not a memtide_dtype_t value: " + std::to_string(static_cast<int>(d)));
}

}  // namespace

extern "C" {

void* memtide_malloc(size_t size, int device, memtide_stream_t stream) {
  void* ptr = nullptr;
  guarded("memtide_malloc", [&] { ptr = Runtime::get().allocator(device).allocate(size, to_stream(stream)); });
  return ptr;
}

void memtide_free(void* ptr, size_t size, int device, memtide_stream_t stream) {
  if (ptr == nullptr) return;
  guarded("memtide_free", [&] { Runtime::get().allocator(device).deallocate(ptr, size, to_stream(stream)); });
}

void memtide_init(int device_count) {
  guarded("memtide_init", [&] {
    const int have = Runtime::get().device_count();
    if (device_count != have) {
      MEMTIDE_LOG(warn, "memtide_init: caller sees " + std::to_string(device_count) + " device(s), memtide sees " +
                            std::to_string(have));
    }
  });
}

void memtide_empty_cache(void) {
  guarded("memtide_empty_cache", [] {
    for (CachingAllocator* a : Runtime::get().opened()) {
      if (a != nullptr) a->empty_cache();
    }
  });
}

void memtide_set_memory_fraction(double fraction, int device) {
  guarded("memtide_set_memory_fraction", [&] { Runtime::get().allocator(device).set_memory_fraction(fraction); });
}

void memtide_record_stream(void* ptr, memtide_stream_t stream) {
  guarded("memtide_record_stream", [&] {
    for (CachingAllocator* a : Runtime::get().opened()) {
      if (a != nullptr && a->allocation_size(ptr)) {
        a->record_stream(ptr, to_stream(stream));
        return;
      }
    }
    throw InvalidArgument("pointer is not allocated by memtide");
  });
}

int memtide_phase_mark(memtide_phase_t phase) {
  if (phase < MEMTIDE_PHASE_FORWARD || phase > MEMTIDE_PHASE_OTHER) {
    return fail(MEMTIDE_INVALID_ARGUMENT, "memtide_phase_mark: phase " + std::to_string(static_cast<int>(phase)) +
                                              " is not one of 0 (forward), 1 (backward), 2 (update), 3 (other)");
  }
  return guarded("memtide_phase_mark", [&] {
    Runtime& rt = Runtime::get();
    for (int d = 0; d < rt.device_count(); ++d) rt.allocator(d).mark_phase(static_cast<Phase>(phase));
  });
}

int memtide_phase_mark_name(const char* name) {
  const auto phase = parse_phase(name == nullptr ? "" : name);
  if (!phase) {
    return fail(MEMTIDE_INVALID_ARGUMENT, std::string("memtide_phase_mark_name: \"") + (name ? name : "(null)") +
                                              "\" is not forward, backward, update or other");
  }
  return memtide_phase_mark(static_cast<memtide_phase_t>(*phase));
}

int memtide_headroom(int device, memtide_phase_t until, uint64_t* bytes_out) {
  if (bytes_out == nullptr) return fail(MEMTIDE_INVALID_ARGUMENT, "memtide_headroom: bytes_out is null");
  if (until < MEMTIDE_PHASE_FORWARD || until > MEMTIDE_PHASE_OTHER) {
    return fail(MEMTIDE_INVALID_ARGUMENT, "memtide_headroom: bad phase " + std::to_string(static_cast<int>(until)));
  }
  return guarded("memtide_headroom",
                 [&] { *bytes_out = Runtime::get().allocator(device).headroom(static_cast<Phase>(until)).bytes; });
}

int memtide_stat(int device, const char* name, int64_t* value_out) {
  if (name == nullptr || value_out == nullptr) return fail(MEMTIDE_INVALID_ARGUMENT, "memtide_stat: null argument");
  return guarded("memtide_stat", [&] {
    const auto flat = flatten(Runtime::get().allocator(device).stats());
    auto it = flat.find(name);
    if (it == flat.end()) throw InvalidArgument(std::string("unknown statistic \"") + name + "\"");
    *value_out = it->second;
  });
}

int memtide_reset_peak_stats(int device) {
  return guarded("memtide_reset_peak_stats", [&] { Runtime::get().allocator(device).reset_peak_stats(); });
}

int memtide_record_history(int enabled) {
  return guarded("memtide_record_history", [&] {
    Runtime& rt = Runtime::get();
    for (int d = 0; d < rt.device_count(); ++d) rt.allocator(d).set_record_history(enabled != 0);
  });
}

int memtide_dump_snapshot(const char* path) {
  if (path == nullptr || *path == '\0') return fail(MEMTIDE_INVALID_ARGUMENT, "memtide_dump_snapshot: empty path");
  return guarded("memtide_dump_snapshot", [&] {
    Snapshot all;
    for (CachingAllocator* a : Runtime::get().opened()) {
      if (a == nullptr) {
        all.device_traces.emplace_back();
        continue;
      }
      Snapshot s = a->snapshot();
      for (auto& seg : s.segments) all.segments.push_back(std::move(seg));
      all.device_traces.push_back(std::move(s.device_traces.front()));
    }
    // Built in memory, then written by the one safe writer: a fresh temp file beside the target,
    // synced and renamed, so a reader never sees half a snapshot and nothing else is touched.
    std::ostringstream out;
    write_memory_viz_pickle(all, out);
    if (const std::string why = files::write_atomically(path, out.str()); !why.empty()) {
      throw IoError(why);
    }
  });
}

int memtide_adamw_step_cpu(const memtide_adamw_args_t* args, int* nonfinite_out) {
  if (nonfinite_out != nullptr) *nonfinite_out = 0;
  if (args == nullptr) return fail(MEMTIDE_INVALID_ARGUMENT, "memtide_adamw_step_cpu: args is null");
  return guarded("memtide_adamw_step_cpu", [&] {
    tiering::AdamwArgs a;
    a.param = args->param;
    a.exp_avg = args->exp_avg;
    a.exp_avg_sq = args->exp_avg_sq;
    a.grad = args->grad;
    a.grad_dtype = to_dtype(args->grad_dtype, "grad_dtype");
    a.param_out = args->param_out;
    a.param_out_dtype = args->param_out == nullptr ? tiering::DType::none : to_dtype(args->param_out_dtype, "param_out_dtype");
    a.n = args->n;
    a.lr = args->lr;
    a.beta1 = args->beta1;
    a.beta2 = args->beta2;
    a.eps = args->eps;
    a.weight_decay = args->weight_decay;
    a.step = args->step;
    a.grad_scale = args->grad_scale;
    a.clip = args->clip;
    a.l2 = args->l2 != 0;
    a.skip_if_nonfinite = args->skip_if_nonfinite != 0;
    const bool bad = tiering::adamw_step(a, &default_pool());
    if (nonfinite_out != nullptr) *nonfinite_out = bad ? 1 : 0;
  });
}

int memtide_grads_finite_cpu(const void* grad, memtide_dtype_t dtype, size_t n, double grad_scale, double clip,
                             int* finite_out) {
  if (finite_out == nullptr) return fail(MEMTIDE_INVALID_ARGUMENT, "memtide_grads_finite_cpu: finite_out is null");
  return guarded("memtide_grads_finite_cpu", [&] {
    *finite_out = tiering::grads_finite(grad, to_dtype(dtype, "dtype"), n, grad_scale, clip, &default_pool()) ? 1 : 0;
  });
}

const char* memtide_cpu_isa(void) {
  const char* name = nullptr;
  guarded("memtide_cpu_isa", [&] { name = tiering::adamw_isa(); });
  return name;
}

void* memtide_host_alloc(size_t bytes, int device) {
  void* ptr = nullptr;
  guarded("memtide_host_alloc", [&] { ptr = Runtime::get().host_arena(device).allocate(bytes); });
  return ptr;
}

int memtide_host_free(void* ptr) {
  if (ptr == nullptr) return MEMTIDE_OK;
  return guarded("memtide_host_free", [&] { Runtime::get().host_free(ptr); });
}

const char* memtide_last_error(void) { return t_last_error.c_str(); }

const char* memtide_version(void) { return MEMTIDE_VERSION_STRING; }

const char* memtide_backend(void) {
  const char* name = "sim";
  guarded("memtide_backend", [&] { name = Runtime::get().backend() == Backend::cuda ? "cuda" : "sim"; });
  return name;
}

}  // extern "C"
