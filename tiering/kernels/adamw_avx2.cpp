// The avx2 path of the fused AdamW step (see adamw_impl.hpp).
#define MEMTIDE_ADAMW_SUFFIX avx2
#define MEMTIDE_ADAMW_AVX2 1
#include "adamw_impl.hpp"
