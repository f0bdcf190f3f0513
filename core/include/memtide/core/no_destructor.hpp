#pragma once
/// @file
/// Storage for process-lifetime singletons whose destructor must never run. memtide's global
/// allocators own device memory; destroying them during static destruction would call CUDA after
/// the driver may already be torn down, so they are deliberately never destroyed.

#include <new>
#include <utility>

namespace memtide {

template <typename T>
class NoDestructor {
 public:
  template <typename... Args>
  explicit NoDestructor(Args&&... args) {
    new (storage_) T(std::forward<Args>(args)...);
  }
  NoDestructor(const NoDestructor&) = delete;
  NoDestructor& operator=(const NoDestructor&) = delete;
  ~NoDestructor() = default;

  T& operator*() noexcept { return *get(); }
  T* operator->() noexcept { return get(); }
  T* get() noexcept { return std::launder(reinterpret_cast<T*>(storage_)); }

 private:
  alignas(T) unsigned char storage_[sizeof(T)];
};

}  // namespace memtide
