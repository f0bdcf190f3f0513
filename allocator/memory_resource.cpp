#include "memtide/allocator/memory_resource.hpp"

namespace memtide {

void* DirectResource::do_allocate(std::size_t bytes, Stream /*stream*/) { return device_.allocate(bytes); }
void DirectResource::do_deallocate(void* ptr, Stream /*stream*/) { device_.deallocate(ptr, 0); }

}  // namespace memtide
