// libmemtide_fake_cudart.so: a stand-in CUDA runtime for testing the LD_PRELOAD observer on
// machines without a GPU. It exports the interposed entry points (plus cudaMallocManaged, which
// the observer deliberately does not interpose) with the real runtime's C signatures, backed by
// host malloc/free. Every call succeeds, as the real runtime does for valid arguments.

#include <cstddef>
#include <cstdlib>

#define FAKE_CUDART_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

int host_alloc(void** ptr, std::size_t size) noexcept {
  if (ptr == nullptr) return 1;  // cudaErrorInvalidValue
  *ptr = size == 0 ? nullptr : std::malloc(size);
  return (size != 0 && *ptr == nullptr) ? 2 : 0;  // cudaErrorMemoryAllocation
}

}  // namespace

FAKE_CUDART_EXPORT int cudaMalloc(void** devPtr, std::size_t size) noexcept { return host_alloc(devPtr, size); }

FAKE_CUDART_EXPORT int cudaMallocAsync(void** devPtr, std::size_t size, void* /*stream*/) noexcept {
  return host_alloc(devPtr, size);
}

// Gives the demo a pointer that the observer never saw allocated, as a real program gets from
// cudaMallocManaged and later releases with cudaFree.
FAKE_CUDART_EXPORT int cudaMallocManaged(void** devPtr, std::size_t size, unsigned int /*flags*/) noexcept {
  return host_alloc(devPtr, size);
}

FAKE_CUDART_EXPORT int cudaFree(void* devPtr) noexcept {
  std::free(devPtr);
  return 0;
}

FAKE_CUDART_EXPORT int cudaFreeAsync(void* devPtr, void* /*stream*/) noexcept {
  std::free(devPtr);
  return 0;
}
