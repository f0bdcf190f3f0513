#pragma once
/// \file
/// Where this process stands in a training job launched by torchrun (or any launcher that sets
/// torch.distributed's environment variables): the one place memtide reads RANK, WORLD_SIZE and
/// LOCAL_WORLD_SIZE.

#include <optional>

namespace memtide {

/// torch.distributed's RANK of this process (0 to 2^20 - 1), or nullopt when it is not set: a
/// single-process run. A value that is not a rank is treated as unset, with one warning.
[[nodiscard]] std::optional<int> job_rank() noexcept;

/// torch.distributed's WORLD_SIZE (the ranks of the job, 1 to 2^20), or nullopt when unset or not
/// a rank count (one warning).
[[nodiscard]] std::optional<int> job_world_size() noexcept;

/// torchrun's LOCAL_WORLD_SIZE (the ranks on this machine, 1 to 4096), or nullopt when unset or
/// not a rank count (one warning).
[[nodiscard]] std::optional<int> job_local_world_size() noexcept;

}  // namespace memtide
