// job_rank, job_world_size and job_local_world_size: torchrun's environment read in one place, a bad value taken
// as unset, and the rank on every log line of a job's process.

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "memtide/core/job.hpp"
#include "memtide/core/log.hpp"

namespace memtide {
namespace {

class JobEnv : public ::testing::Test {
 protected:
  void TearDown() override {
    ::unsetenv("RANK");
    ::unsetenv("LOCAL_WORLD_SIZE");
    ::unsetenv("WORLD_SIZE");
  }
};

TEST_F(JobEnv, RankAndLocalWorldSizeAreReadWhenTheyAreNumbers) {
  ::unsetenv("RANK");
  ::unsetenv("LOCAL_WORLD_SIZE");
  EXPECT_FALSE(job_rank().has_value());
  EXPECT_FALSE(job_local_world_size().has_value());
  ::setenv("RANK", "0", 1);
  ::setenv("LOCAL_WORLD_SIZE", "8", 1);
  EXPECT_EQ(job_rank(), 0);
  EXPECT_EQ(job_local_world_size(), 8);
  EXPECT_FALSE(job_world_size().has_value());
  ::setenv("WORLD_SIZE", "16", 1);
  EXPECT_EQ(job_world_size(), 16);
  for (const char* bad : {"", "-1", "1.5", "3x", "99999999999999999999", "1048576"}) {
    ::setenv("RANK", bad, 1);
    EXPECT_FALSE(job_rank().has_value()) << "RANK=" << bad;
  }
  for (const char* bad : {"0", "4097", "two"}) {
    ::setenv("LOCAL_WORLD_SIZE", bad, 1);
    EXPECT_FALSE(job_local_world_size().has_value()) << "LOCAL_WORLD_SIZE=" << bad;
  }
  for (const char* bad : {"0", "-2", "1048577", "many"}) {
    ::setenv("WORLD_SIZE", bad, 1);
    EXPECT_FALSE(job_world_size().has_value()) << "WORLD_SIZE=" << bad;
  }
}

TEST_F(JobEnv, EveryLogLineOfARankSaysWhichRank) {
  ::setenv("RANK", "5", 1);
  ::testing::internal::CaptureStderr();
  log_message(LogLevel::warn, "hello");
  ::setenv("RANK", "junk", 1);  // a bad rank: plain lines, one warning, no recursion
  log_message(LogLevel::warn, "again");
  log_message(LogLevel::warn, "and again");
  ::unsetenv("RANK");
  log_message(LogLevel::warn, "alone");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("memtide [warn] rank 5: hello\n"), std::string::npos) << err;
  EXPECT_NE(err.find("memtide [warn] again\n"), std::string::npos) << err;
  EXPECT_NE(err.find("memtide [warn] alone\n"), std::string::npos) << err;
  // Warned about once per process (an earlier test may have been the once).
  EXPECT_EQ(err.find("RANK=\"junk\""), err.rfind("RANK=\"junk\"")) << "warned more than once:\n" << err;
}

}  // namespace
}  // namespace memtide
