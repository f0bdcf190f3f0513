// libFuzzer target: the options table. Any key and value (split at the first '=') and any
// environment must either set an option or throw ConfigError naming it; nothing else, no crash.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "memtide/core/error.hpp"
#include "memtide/core/options.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const std::size_t eq = input.find('=');
  const std::string_view key = input.substr(0, eq);
  const std::string_view value = eq == std::string_view::npos ? std::string_view{} : input.substr(eq + 1);
  memtide::Options o;
  try {
    o.set(key, value);
  } catch (const memtide::ConfigError& e) {
    if (std::string_view(e.what()).empty()) std::abort();  // an error must say what is wrong
  }
  // The same value for every variable of the table at once, as a hostile environment would.
  const std::string v(value);
  try {
    (void)memtide::Options::from_env([&](const char*) { return v.c_str(); });
  } catch (const memtide::ConfigError& e) {
    if (std::string_view(e.what()).find("MEMTIDE_") == std::string_view::npos) std::abort();  // names the variable
  }
  return 0;
}
