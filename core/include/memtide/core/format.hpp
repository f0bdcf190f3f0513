#pragma once
/// @file
/// Human-readable sizes and durations for logs and error messages, and their parsers.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace memtide {

/// "1.50 GiB", "512 B". Binary units, two decimals.
std::string format_bytes(std::uint64_t bytes);
/// "12.3 ms", "850 ns".
std::string format_duration_ns(double ns);
/// Parses "4096", "512MiB", "8GiB", "1.5GB", "1e9" (case-insensitive units B, KB/KiB, MB/MiB,
/// GB/GiB, TB/TiB; the SI ones are powers of 1000). Returns nullopt for anything else.
std::optional<std::uint64_t> parse_bytes(std::string_view text);

}  // namespace memtide
