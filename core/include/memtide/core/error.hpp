#pragma once
/// @file
/// memtide's exception hierarchy. C++ code throws these; the C ABI catches them at the boundary,
/// stores the message as the thread's last error and returns an error code or null.

#include <cstddef>
#include <stdexcept>
#include <string>

namespace memtide {

/// Base of every memtide error.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A device or host allocation could not be satisfied, even after releasing cached memory.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

/// A CUDA runtime call failed; `code()` is the cudaError_t value.
class CudaError : public Error {
 public:
  CudaError(int code, const std::string& what) : Error(what), code_(code) {}
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

/// A configuration key had a value memtide does not accept.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A caller passed something invalid: a pointer memtide does not own, a freed pointer, a bad size.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// A file or device I/O failed.
class IoError : public Error {
 public:
  using Error::Error;
};

}  // namespace memtide
