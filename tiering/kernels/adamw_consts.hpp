// What every AdamW path (CPU ISAs and CUDA) shares before the loop: argument checks and the
// per-step scalars, computed once on the host so all paths see the same float constants.
#pragma once

#include "memtide/tiering/kernels/adamw_cpu.hpp"

namespace memtide::tiering::detail {

/// Per-step scalars, rounded to float once (as torch rounds its Python scalars).
struct AdamwConsts {
  float grad_scale, clip, decay, wd, w1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step;
};

/// Throws InvalidArgument naming the bad field.
void validate_adamw_args(const AdamwArgs& a);
/// The step's scalars, computed in double like torch's Python code and rounded to float once.
AdamwConsts adamw_consts(const AdamwArgs& a);

}  // namespace memtide::tiering::detail
