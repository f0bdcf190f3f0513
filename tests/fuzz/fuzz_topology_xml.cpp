// libFuzzer target: the hwloc XML topology loader. Any bytes must load or throw memtide::Error
// naming the file; nothing else, no crash.

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/device/topology.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const int fd = ::memfd_create("memtide-fuzz-topology", MFD_CLOEXEC);
  if (fd < 0) std::abort();
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size)) std::abort();
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  try {
    const memtide::Topology t = memtide::Topology::from_xml(path);
    for (const memtide::GpuInfo& g : t.gpus()) (void)t.preferred_node(g.index);  // what a loaded one answers
  } catch (const memtide::Error& e) {
    if (std::string(e.what()).find(path) == std::string::npos) std::abort();
  }
  return 0;
}
