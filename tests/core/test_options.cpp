#include <gtest/gtest.h>

#include <map>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/core/format.hpp"
#include "memtide/core/options.hpp"

using namespace memtide;

namespace {
Options from(const std::map<std::string, std::string>& env) {
  return Options::from_env([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}
}  // namespace

TEST(Format, ParsesSizesWithUnits) {
  EXPECT_EQ(parse_bytes("4096"), 4096u);
  EXPECT_EQ(parse_bytes("512MiB"), 512ull << 20);
  EXPECT_EQ(parse_bytes(" 8 GiB "), 8ull << 30);
  EXPECT_EQ(parse_bytes("1.5GB"), 1500000000ull);
  EXPECT_EQ(parse_bytes("1e9"), 1000000000ull);
  EXPECT_EQ(parse_bytes("64G"), 64000000000ull);
  EXPECT_EQ(parse_bytes("2k"), 2000u);
  EXPECT_FALSE(parse_bytes("12 parsecs"));
  EXPECT_FALSE(parse_bytes("-3"));
  EXPECT_FALSE(parse_bytes(""));
}

TEST(Format, PrintsBinaryUnits) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(3ull << 29), "1.50 GiB");
  EXPECT_EQ(format_bytes(3ull << 29, 1), "1.5 GiB");
  EXPECT_EQ(format_bytes(3ull << 39), "1.50 TiB");
  EXPECT_EQ(format_bytes(1023), "1023 B");
}

TEST(Format, PrintsDurations) {
  EXPECT_EQ(format_duration_ns(2.5e9), "2.50 s");
  EXPECT_EQ(format_duration_ns(12.3e6), "12.30 ms");
  EXPECT_EQ(format_duration_ns(4.2e3), "4.2 us");
  EXPECT_EQ(format_duration_ns(850), "850 ns");
}

TEST(Format, PrintsCountsInMlNotation) {
  EXPECT_EQ(format_count(1.31e9), "1.31B");
  EXPECT_EQ(format_count(5.92e6), "5.92M");
  EXPECT_EQ(format_count(350e3), "350.00k");
  EXPECT_EQ(format_count(12), "12");
}

TEST(Options, DefaultsWhenUnset) {
  const Options o = from({});
  EXPECT_EQ(o.device, "auto");
  EXPECT_DOUBLE_EQ(o.memory_fraction, 1.0);
  EXPECT_EQ(o.max_bytes, 0u);
}

TEST(Options, ReadsEveryKindOfValue) {
  const Options o = from({{"MEMTIDE_DEVICE", "sim"},
                          {"MEMTIDE_SIM_CAPACITY", "2GiB"},
                          {"MEMTIDE_SIM_PHANTOM", "yes"},
                          {"MEMTIDE_MEMORY_FRACTION", "0.5"},
                          {"MEMTIDE_PHASE_HISTORY", "7"},
                          {"MEMTIDE_LOG_LEVEL", "debug"}});
  EXPECT_EQ(o.device, "sim");
  EXPECT_EQ(o.sim_capacity, 2ull << 30);
  EXPECT_TRUE(o.sim_phantom);
  EXPECT_DOUBLE_EQ(o.memory_fraction, 0.5);
  EXPECT_EQ(o.phase_history, 7u);
  EXPECT_EQ(o.log_level, LogLevel::debug);
}

TEST(Options, BadValueNamesVariableValueAndAccepted) {
  struct Case {
    const char* env;
    const char* value;
    const char* accepted;
  };
  for (const Case& c : {Case{"MEMTIDE_DEVICE", "tpu", "auto, cuda or sim"},
                        Case{"MEMTIDE_MEMORY_FRACTION", "1.5", "(0, 1]"},
                        Case{"MEMTIDE_MEMORY_FRACTION", "half", "(0, 1]"},
                        Case{"MEMTIDE_SIM_CAPACITY", "lots", "size in bytes"},
                        Case{"MEMTIDE_RECORD_HISTORY", "maybe", "boolean"},
                        Case{"MEMTIDE_PHASE_HISTORY", "0", "whole number"}}) {
    try {
      from({{c.env, c.value}});
      ADD_FAILURE() << c.env << "=" << c.value << " was accepted";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(c.env), std::string::npos) << what;
      EXPECT_NE(what.find(c.value), std::string::npos) << what;
      EXPECT_NE(what.find(c.accepted), std::string::npos) << what;
    }
  }
}

TEST(Options, SetRejectsUnknownKeyAndListsKnownOnes) {
  Options o;
  o.set("max_bytes", "1GiB");
  EXPECT_EQ(o.max_bytes, 1ull << 30);
  try {
    o.set("max_byte", "1");
    FAIL() << "unknown key accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("max_bytes"), std::string::npos);
  }
}

TEST(Options, TableDescribesEveryKey) {
  const auto shown = describe(Options{});
  EXPECT_EQ(shown.size(), option_table().size());
  for (const OptionInfo& row : option_table()) {
    EXPECT_EQ(row.env.rfind("MEMTIDE_", 0), 0u);
    EXPECT_TRUE(shown.count(row.key)) << row.key;
  }
}

// MEMTIDE_CUPTI_LIBRARY is read by the CUPTI tracer: it is a row of the table (shown by memtide info,
// checked like the rest), not a variable named as "not a memtide option".
TEST(Options, CuptiLibraryIsAnOption) {
  EXPECT_EQ(from({}).cupti_library, "");
  EXPECT_EQ(from({{"MEMTIDE_CUPTI_LIBRARY", "/opt/cuda/lib64/libcupti.so.12"}}).cupti_library,
            "/opt/cuda/lib64/libcupti.so.12");
  bool listed = false;
  for (const OptionInfo& row : option_table()) listed = listed || row.env == "MEMTIDE_CUPTI_LIBRARY";
  EXPECT_TRUE(listed);
  Options o;
  o.set("cupti_library", "libcupti.so.12");
  EXPECT_EQ(describe(o).at("cupti_library"), "libcupti.so.12");
}
