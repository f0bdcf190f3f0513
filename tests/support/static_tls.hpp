#pragma once
/// @file
/// A test program that loads jemalloc through PinnedHeap restarts itself once with the glibc
/// tunable jemalloc needs: jemalloc keeps about 2.6 KiB of initial-exec TLS, more than glibc
/// leaves spare for libraries loaded after start-up, and only a start-up tunable enlarges that
/// reserve. Called first thing in main(), so both backends are exercised however the binary is
/// launched.

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace memtide::test {

/// Re-executes the program with glibc.rtld.optional_static_tls added to GLIBC_TUNABLES unless it
/// is there already. Returns only when it is there, or when exec failed (the jemalloc cases then
/// skip with the reason).
inline void restart_with_static_tls_for_jemalloc(char** argv) {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables != nullptr && std::strstr(tunables, "optional_static_tls") != nullptr) return;
  std::string value = "glibc.rtld.optional_static_tls=16384";
  if (tunables != nullptr && *tunables != '\0') value = std::string(tunables) + ":" + value;
  setenv("GLIBC_TUNABLES", value.c_str(), 1);
  execv("/proc/self/exe", argv);
}

}  // namespace memtide::test
