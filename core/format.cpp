#include "memtide/core/format.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <utility>

namespace memtide {

std::string format_bytes(std::uint64_t bytes, int decimals) {
  static constexpr std::array<const char*, 5> units{"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  std::size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < units.size()) {
    value /= 1024.0;
    ++unit;
  }
  char buf[48];
  if (unit == 0) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.*f %s", std::clamp(decimals, 0, 9), value, units[unit]);
  }
  return buf;
}

std::string format_duration_ns(double ns) {
  char buf[48];
  if (ns < 1e3) {
    std::snprintf(buf, sizeof buf, "%.0f ns", ns);
  } else if (ns < 1e6) {
    std::snprintf(buf, sizeof buf, "%.1f us", ns / 1e3);
  } else if (ns < 1e9) {
    // Two decimals: predicted and measured update phases of a few ms are compared in them.
    std::snprintf(buf, sizeof buf, "%.2f ms", ns / 1e6);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f s", ns / 1e9);
  }
  return buf;
}

std::string format_count(double n) {
  static constexpr std::array<std::pair<const char*, double>, 3> scales{{{"B", 1e9}, {"M", 1e6}, {"k", 1e3}}};
  char buf[48];
  for (const auto& [suffix, scale] : scales) {
    if (n >= scale) {
      std::snprintf(buf, sizeof buf, "%.2f%s", n / scale, suffix);
      return buf;
    }
  }
  std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}

std::optional<std::uint64_t> parse_bytes(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  if (text.empty()) return std::nullopt;
  double number = 0.0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), number);
  if (ec != std::errc{} || !std::isfinite(number) || number < 0.0) return std::nullopt;
  std::string unit(end, text.data() + text.size());
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.front()))) unit.erase(0, 1);
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double scale = 1.0;
  if (unit.empty() || unit == "b") {
    scale = 1.0;
  } else if (unit == "k" || unit == "kb") {
    scale = 1e3;
  } else if (unit == "kib") {
    scale = 1024.0;
  } else if (unit == "m" || unit == "mb") {
    scale = 1e6;
  } else if (unit == "mib") {
    scale = 1024.0 * 1024.0;
  } else if (unit == "g" || unit == "gb") {
    scale = 1e9;
  } else if (unit == "gib") {
    scale = 1024.0 * 1024.0 * 1024.0;
  } else if (unit == "t" || unit == "tb") {
    scale = 1e12;
  } else if (unit == "tib") {
    scale = 1024.0 * 1024.0 * 1024.0 * 1024.0;
  } else {
    return std::nullopt;
  }
  const double bytes = number * scale;
  if (bytes >= 1.8e19) return std::nullopt;
  return static_cast<std::uint64_t>(std::llround(bytes));
}

}  // namespace memtide
