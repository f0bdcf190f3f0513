#pragma once
/// @file
/// Minimal leveled logging to stderr. Cheap when the level is off: the message is only formatted
/// after the level check.

#include <string>

#include "memtide/core/options.hpp"

namespace memtide {

/// True when messages at `level` are printed.
bool log_enabled(LogLevel level) noexcept;
/// Overrides the level read from MEMTIDE_LOG_LEVEL.
void set_log_level(LogLevel level) noexcept;
/// Prints "memtide [level] message" to stderr. Never throws.
void log_message(LogLevel level, const std::string& message) noexcept;

}  // namespace memtide

#define MEMTIDE_LOG(level, expr)                                        \
  do {                                                                  \
    if (::memtide::log_enabled(::memtide::LogLevel::level)) {           \
      ::memtide::log_message(::memtide::LogLevel::level, (expr));       \
    }                                                                   \
  } while (0)
