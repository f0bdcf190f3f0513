#pragma once
/// @file
/// A C entry into tiering::StepProtocol::grad_ready, for a front end in another library that does
/// not link the engine: TieredAdamW's gradient hooks in C++ (torch_bridge/gradient_hooks.cpp),
/// which autograd calls on its own threads without the GIL. The Python module hands them this
/// function's address and the protocol's (StepProtocol.grad_entry); the two libraries then agree
/// on plain C types only.

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/** A gradient's element type. */
enum memtide_grad_dtype { MEMTIDE_GRAD_FP32 = 0, MEMTIDE_GRAD_FP16 = 1, MEMTIDE_GRAD_BF16 = 2 };

/** How a gradient reaches the engine: tiering::GradRoute's values. */
enum memtide_grad_route { MEMTIDE_GRAD_DEVICE_PATH = 0, MEMTIDE_GRAD_HOST_COPY = 1, MEMTIDE_GRAD_IN_PLACE = 2 };

/**
 * StepProtocol::grad_ready(param, {data, dtype, n, route, stream}) on the protocol at `protocol`,
 * not speculating (no update during backward starts from here). Returns 0; or -1 with the reason,
 * NUL-terminated, in `error` (at most `error_size` bytes): a param out of range, a size that is
 * not the param's, a bad dtype or route. Never throws.
 */
typedef int (*memtide_grad_ready_fn)(void* protocol, size_t param, const void* data, int dtype, size_t n,
                                      int route, void* stream, char* error, size_t error_size);

int memtide_step_protocol_grad_ready(void* protocol, size_t param, const void* data, int dtype, size_t n,
                                     int route, void* stream, char* error, size_t error_size);

#ifdef __cplusplus
}
#endif
