#include "memtide/runtime.hpp"

#include "memtide/core/error.hpp"
#include "memtide/core/log.hpp"
#include "memtide/core/no_destructor.hpp"
#include "memtide/core/options.hpp"

namespace memtide {

Runtime& Runtime::get() {
  static NoDestructor<Runtime> runtime;
  return *runtime;
}

Runtime::Runtime() : backend_(resolve_backend(parse_backend(options().device))) {
  const int n = memtide::device_count(backend_);
  for (int i = 0; i < n; ++i) slots_.push_back(std::make_unique<Slot>());
  MEMTIDE_LOG(info, std::string("runtime: backend ") + (backend_ == Backend::cuda ? "cuda" : "sim") + ", " +
                        std::to_string(n) + " device(s)");
}

CachingAllocator& Runtime::allocator(int device) {
  if (device < 0 || device >= device_count()) {
    throw InvalidArgument("device index " + std::to_string(device) + " out of range: " +
                          std::to_string(device_count()) + " device(s)");
  }
  Slot& slot = *slots_[static_cast<std::size_t>(device)];
  std::call_once(slot.once, [&] {
    slot.device = open_device(backend_, device);
    slot.allocator = std::make_unique<CachingAllocator>(*slot.device, AllocatorConfig::from_options());
    slot.ready.store(slot.allocator.get(), std::memory_order_release);
  });
  return *slot.allocator;
}

std::vector<CachingAllocator*> Runtime::opened() {
  std::vector<CachingAllocator*> out;
  for (auto& slot : slots_) out.push_back(slot->ready.load(std::memory_order_acquire));
  return out;
}

}  // namespace memtide
