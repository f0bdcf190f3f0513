/**
 * @file
 * memtide's one public C header: the ABI that PyTorch, LD_PRELOAD users and any other framework
 * call. No function here throws or aborts; failures return null or a negative code, and
 * memtide_last_error() gives the message (per thread).
 *
 * PyTorch:
 *   alloc = torch.cuda.memory.CUDAPluggableAllocator("libmemtide.so", "memtide_malloc", "memtide_free")
 *   torch.cuda.memory.change_current_allocator(alloc)   # before the first CUDA allocation
 */
#ifndef MEMTIDE_MEMTIDE_H
#define MEMTIDE_MEMTIDE_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define MEMTIDE_API __attribute__((visibility("default")))
#else
#define MEMTIDE_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The same type as cudaStream_t, without requiring the CUDA headers. */
struct CUstream_st;
typedef struct CUstream_st* memtide_stream_t;

/** Return codes. */
enum {
  MEMTIDE_OK = 0,
  MEMTIDE_ERROR = -1,          /**< see memtide_last_error() */
  MEMTIDE_OUT_OF_MEMORY = -2,
  MEMTIDE_INVALID_ARGUMENT = -3,
  MEMTIDE_CONFIG_ERROR = -4,
  MEMTIDE_IO_ERROR = -5        /**< a file could not be read or written (memtide_dump_snapshot) */
};

/** Training phases, for memtide_phase_mark. */
typedef enum {
  MEMTIDE_PHASE_FORWARD = 0,
  MEMTIDE_PHASE_BACKWARD = 1,
  MEMTIDE_PHASE_UPDATE = 2,
  MEMTIDE_PHASE_OTHER = 3,
  /* Widens the enum to int so a C caller's out-of-range value can be checked, not undefined. */
  MEMTIDE_PHASE_MAX_ENUM = 0x7fffffff
} memtide_phase_t;

/* ---- PyTorch CUDAPluggableAllocator -------------------------------------------------------- */

/** Allocates `size` bytes on `device`, ordered on `stream`. Null on failure (the message says
 *  why: requested, limit, allocated, reserved, free, phase, last iteration's peaks). */
MEMTIDE_API void* memtide_malloc(size_t size, int device, memtide_stream_t stream);
/** Frees memory from memtide_malloc. An unknown or double free is logged and counted, never
 *  corrupts state. `size` and `stream` are those of the allocation (as torch passes them). */
MEMTIDE_API void memtide_free(void* ptr, size_t size, int device, memtide_stream_t stream);
/** torch's init hook: called once with the device count. */
MEMTIDE_API void memtide_init(int device_count);
/** torch's reset hook (torch.cuda.empty_cache): returns cached segments of every device. */
MEMTIDE_API void memtide_empty_cache(void);
/** torch's memory-fraction hook: limit = fraction * device memory. */
MEMTIDE_API void memtide_set_memory_fraction(double fraction, int device);
/** torch's record-stream hook: `ptr` is also used on `stream`. */
MEMTIDE_API void memtide_record_stream(void* ptr, memtide_stream_t stream);

/* ---- Phases and headroom ------------------------------------------------------------------- */

/** Enters a training phase on every device. */
MEMTIDE_API int memtide_phase_mark(memtide_phase_t phase);
/** The same, by name: "forward", "backward", "update" or "other". */
MEMTIDE_API int memtide_phase_mark_name(const char* name);
/** Bytes that can be borrowed on `device` now and kept until `until` begins. */
MEMTIDE_API int memtide_headroom(int device, memtide_phase_t until, uint64_t* bytes_out);

/* ---- Stats and snapshots ------------------------------------------------------------------- */

/** One statistic by PyTorch's name, e.g. "allocated_bytes.all.peak" or "num_ooms". */
MEMTIDE_API int memtide_stat(int device, const char* name, int64_t* value_out);
/** Resets the peaks of every statistic on `device`. */
MEMTIDE_API int memtide_reset_peak_stats(int device);
/** Turns the allocation trace on or off (also MEMTIDE_RECORD_HISTORY). */
MEMTIDE_API int memtide_record_history(int enabled);
/** Writes every device's segments and trace to `path` as a pickle that
 *  pytorch.org/memory_viz and torch.cuda._memory_viz read. */
MEMTIDE_API int memtide_dump_snapshot(const char* path);

/* ---- CPU optimizer kernels ----------------------------------------------------------------- */

/** Element types of optimizer buffers. */
typedef enum {
  MEMTIDE_DTYPE_NONE = 0, /**< no buffer (param_out only) */
  MEMTIDE_DTYPE_FP32 = 1,
  MEMTIDE_DTYPE_FP16 = 2,
  MEMTIDE_DTYPE_BF16 = 3,
  MEMTIDE_DTYPE_MAX_ENUM = 0x7fffffff /* see MEMTIDE_PHASE_MAX_ENUM */
} memtide_dtype_t;

/** One fused AdamW/Adam step over `n` elements (torch.optim.AdamW's arithmetic, in fp32):
 *  g = (grad * grad_scale) * clip; AdamW: param *= 1 - lr*weight_decay, or with l2 != 0:
 *  g += weight_decay * param; then the Adam moments, bias correction with `step` (1-based) and the
 *  param update. `param_out`, when not null, receives the new params as fp16 or bf16 (round to
 *  nearest even) in the same pass. No alignment is required. Zero-initialize, then fill. */
typedef struct memtide_adamw_args {
  float* param;          /**< fp32, in/out */
  float* exp_avg;        /**< fp32, in/out */
  float* exp_avg_sq;     /**< fp32, in/out */
  const void* grad;      /**< grad_dtype */
  void* param_out;       /**< null or param_out_dtype */
  size_t n;
  memtide_dtype_t grad_dtype;      /**< FP32, FP16 or BF16 */
  memtide_dtype_t param_out_dtype; /**< NONE, FP16 or BF16 */
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;
  double grad_scale;     /**< multiplier: 1 / loss_scale (use 1.0 for none) */
  double clip;           /**< multiplier: the clipping coefficient (use 1.0 for none) */
  int l2;                /**< 0: decoupled weight decay (AdamW); 1: L2 term added to the gradient (Adam) */
  int skip_if_nonfinite; /**< 1: check every scaled gradient first; on NaN/Inf leave all state untouched */
} memtide_adamw_args_t;

/** Runs the step on the process-wide CPU thread pool. `*nonfinite_out` (may be null) is set to 1 if
 *  any scaled gradient was NaN or Inf (the step was then skipped when skip_if_nonfinite), else 0.
 *  Dynamic loss scaling: set skip_if_nonfinite, and on 1 lower the scale and skip the iteration. */
MEMTIDE_API int memtide_adamw_step_cpu(const memtide_adamw_args_t* args, int* nonfinite_out);
/** `*finite_out` = 1 if every grad[i] * grad_scale * clip is finite, else 0. */
MEMTIDE_API int memtide_grads_finite_cpu(const void* grad, memtide_dtype_t dtype, size_t n, double grad_scale,
                                         double clip, int* finite_out);
/** The vector path the CPU kernels use: "scalar", "avx2" or "avx512" (MEMTIDE_CPU_ISA resolved);
 *  null on a bad MEMTIDE_CPU_ISA. */
MEMTIDE_API const char* memtide_cpu_isa(void);

/* ---- Pinned host memory ------------------------------------------------------------------- */

/** `bytes` of pinned (page-locked, registered with `device`) host memory, aligned to 256 bytes,
 *  from the device's host arena: large slabs bound to the NUMA node nearest the device
 *  (MEMTIDE_HOST_NODE overrides; -1 = not bound), cut best fit. Null on failure (zero size,
 *  bad device, MEMTIDE_HOST_MAX_BYTES reached, not enough memory); memtide_last_error() says why. */
MEMTIDE_API void* memtide_host_alloc(size_t bytes, int device);
/** Returns memory from memtide_host_alloc. Null is a no-op (MEMTIDE_OK); a pointer memtide did
 *  not hand out, or one freed already, is MEMTIDE_INVALID_ARGUMENT. */
MEMTIDE_API int memtide_host_free(void* ptr);

/* ---- Misc ---------------------------------------------------------------------------------- */

/** The last error message on this thread ("" if none). Valid until the next memtide call. */
MEMTIDE_API const char* memtide_last_error(void);
/** "0.1.0". */
MEMTIDE_API const char* memtide_version(void);
/** "cuda" or "sim": the backend the global allocators use (resolves MEMTIDE_DEVICE=auto). */
MEMTIDE_API const char* memtide_backend(void);

#ifdef __cplusplus
}
#endif

#endif /* MEMTIDE_MEMTIDE_H */
