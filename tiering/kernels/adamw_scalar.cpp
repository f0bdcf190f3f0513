// The scalar path of the fused AdamW step (see adamw_impl.hpp).
#define MEMTIDE_ADAMW_SUFFIX scalar
#include "adamw_impl.hpp"
