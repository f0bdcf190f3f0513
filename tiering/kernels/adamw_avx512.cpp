// The avx512 path of the fused AdamW step (see adamw_impl.hpp).
#define MEMTIDE_ADAMW_SUFFIX avx512
#define MEMTIDE_ADAMW_AVX512 1
#include "adamw_impl.hpp"
