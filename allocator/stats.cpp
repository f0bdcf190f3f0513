#include "memtide/allocator/stats.hpp"

namespace memtide {

std::map<std::string, std::int64_t> flatten(const AllocatorStats& s) {
  std::map<std::string, std::int64_t> out;
  static const char* pools[] = {"all", "small_pool", "large_pool"};
  auto put = [&](const char* name, const StatArray& a) {
    for (int i = 0; i < 3; ++i) {
      const std::string prefix = std::string(name) + "." + pools[i] + ".";
      out[prefix + "current"] = a[i].current;
      out[prefix + "peak"] = a[i].peak;
      out[prefix + "allocated"] = a[i].allocated;
      out[prefix + "freed"] = a[i].freed;
    }
  };
  s.for_each_array(put);
  out["num_alloc_retries"] = s.num_alloc_retries;
  out["num_ooms"] = s.num_ooms;
  out["num_sync_all_streams"] = s.num_sync_all_streams;
  out["num_device_alloc"] = s.num_device_alloc;
  out["num_device_free"] = s.num_device_free;
  out["num_invalid_frees"] = s.num_invalid_frees;
  out["num_cross_stream_reuse"] = s.num_cross_stream_reuse;
  return out;
}

}  // namespace memtide
