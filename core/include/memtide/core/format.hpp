#pragma once
/// @file
/// Human-readable sizes and durations for logs and error messages, and their parsers.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace memtide {

/// "1.50 GiB", "512 B": binary units up to TiB, `decimals` (0-9) after the point.
std::string format_bytes(std::uint64_t bytes, int decimals = 2);
/// "2.50 s", "12.34 ms", "4.2 us", "850 ns".
std::string format_duration_ns(double ns);
/// "1.31B", "5.92M", "350.00k", "12": parameter and operation counts in ML notation.
std::string format_count(double n);
/// Parses "4096", "512MiB", "8GiB", "1.5GB", "64G", "1e9" (case-insensitive units B, K/KB/KiB,
/// M/MB/MiB, G/GB/GiB, T/TB/TiB; the SI ones and the bare letters are powers of 1000), rounded to
/// the nearest byte. Returns nullopt for anything else: negative, not finite, 2^64 or more. The
/// one size parser: the options table, the Python API and the `memtide` CLI all use it.
std::optional<std::uint64_t> parse_bytes(std::string_view text);

}  // namespace memtide
