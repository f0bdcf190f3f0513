// NvmeStore and SpillDir on a real file system with real io_uring: the round trip bit for bit,
// each injected fault (EIO, ENOSPC, a short write) as a clear error that loses nothing, a corrupt
// or truncated extent caught on read, the spill directory's permissions and its cleanup.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>

#include "memtide/core/error.hpp"
#include "memtide/tiering/nvme/nvme_store.hpp"

using namespace memtide;
using namespace memtide::tiering;
namespace fs = std::filesystem;

namespace {

struct Aligned {
  explicit Aligned(std::size_t n) : bytes(n) {
    void* p = nullptr;
    if (posix_memalign(&p, NvmeStore::kAlign, (n + NvmeStore::kAlign - 1) / NvmeStore::kAlign * NvmeStore::kAlign) != 0) {
      throw std::bad_alloc();
    }
    ptr.reset(static_cast<unsigned char*>(p));
  }
  struct Free {
    void operator()(unsigned char* p) const { std::free(p); }
  };
  std::unique_ptr<unsigned char, Free> ptr;
  std::size_t bytes;
  unsigned char* data() const { return ptr.get(); }
};

void fill(Aligned& a, std::uint32_t seed) {
  std::mt19937 rng(seed);
  for (std::size_t i = 0; i < a.bytes; ++i) a.data()[i] = static_cast<unsigned char>(rng());
}

struct NvmeTest : ::testing::Test {
  void SetUp() override {
    char templ[] = "/tmp/memtide-nvme-test-XXXXXX";
    ASSERT_NE(::mkdtemp(templ), nullptr);
    parent = templ;
    // Direct I/O is what the tier is for; a file system without it (tmpfs) cannot host the test.
    const fs::path probe = parent / "direct";
    const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT, 0600);
    if (fd < 0) GTEST_SKIP() << parent << " does not support O_DIRECT (tmpfs?)";
    ::close(fd);
    fs::remove(probe);
  }
  void TearDown() override { fs::remove_all(parent); }
  fs::path parent;
};

}  // namespace

TEST_F(NvmeTest, EverySubgroupSurvivesTheRoundTripBitForBit) {
  SpillDir dir(parent);
  const std::vector<std::uint64_t> sizes{(3 << 20) + 12, 4096, 5 << 20, 17};
  NvmeConfig config;
  config.block_bytes = 1 << 20;
  config.queue_depth = 4;
  NvmeStore store(dir, sizes, config);
  std::vector<Aligned> src;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    src.emplace_back(sizes[i]);
    fill(src.back(), static_cast<std::uint32_t>(i + 1));
    store.write(i, src.back().data(), sizes[i]);
  }
  for (std::size_t i = sizes.size(); i-- > 0;) {  // in another order than written
    Aligned back(sizes[i]);
    store.read(i, back.data());
    EXPECT_EQ(std::memcmp(back.data(), src[i].data(), sizes[i]), 0) << "subgroup " << i;
  }
  EXPECT_EQ(store.counters().bytes_read, store.counters().bytes_written);
}

TEST_F(NvmeTest, TheSpillDirectoryIsPrivateAndGoesAwayWithTheStore) {
  fs::path where, file;
  {
    SpillDir dir(parent);
    where = dir.path();
    EXPECT_EQ(fs::status(where).permissions() & fs::perms::all, fs::perms::owner_all);  // 0700
    NvmeStore store(dir, {1 << 20});
    file = store.file();
    struct stat st {};
    ASSERT_EQ(::stat(file.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600U);
    EXPECT_GE(static_cast<std::uint64_t>(st.st_size), 1U << 20);  // reserved up front
  }
  EXPECT_FALSE(fs::exists(file));
  EXPECT_FALSE(fs::exists(where));
}

TEST_F(NvmeTest, APlantedLinkIsNotFollowed) {
  SpillDir dir(parent);
  const fs::path victim = parent / "victim";
  std::ofstream(victim) << "precious";
  fs::create_symlink(victim, dir.path() / "state.spill");
  try {
    NvmeStore store(dir, {1 << 20});
    FAIL() << "wrote through a planted link";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("state.spill"), std::string::npos) << e.what();
  }
  std::ifstream in(victim);
  std::string text;
  in >> text;
  EXPECT_EQ(text, "precious");
}

TEST_F(NvmeTest, EachInjectedWriteFaultIsNamedAndLosesNothing) {
  SpillDir dir(parent);
  NvmeStore store(dir, {2 << 20, 2 << 20});
  Aligned good(2 << 20), next(2 << 20);
  fill(good, 7);
  fill(next, 8);
  store.write(0, good.data(), good.bytes);
  struct Case {
    NvmeFaults faults;
    const char* words;
  };
  NvmeFaults eio, enospc, shortw;
  eio.fail_write_errno = EIO;
  enospc.fail_write_errno = ENOSPC;
  shortw.short_write = true;
  for (const Case& c : {Case{eio, "Input/output error"}, Case{enospc, "No space left"}, Case{shortw, "short write"}}) {
    store.inject(c.faults);
    Aligned copy(next.bytes);
    std::memcpy(copy.data(), next.data(), next.bytes);
    try {
      store.write(1, next.data(), next.bytes);
      FAIL() << "the fault '" << c.words << "' was not reported";
    } catch (const IoError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(c.words), std::string::npos) << what;
      EXPECT_NE(what.find("subgroup 1"), std::string::npos) << what;
      EXPECT_NE(what.find(store.file().string()), std::string::npos) << what;
    }
    EXPECT_EQ(std::memcmp(copy.data(), next.data(), next.bytes), 0);  // the caller's copy is intact
    Aligned dst(next.bytes);
    EXPECT_THROW(store.read(1, dst.data()), InvalidArgument);  // a failed write is not readable
  }
  // Subgroup 0 is still what was written, and subgroup 1 can be written again.
  Aligned back(good.bytes);
  store.read(0, back.data());
  EXPECT_EQ(std::memcmp(back.data(), good.data(), good.bytes), 0);
  store.write(1, next.data(), next.bytes);
  store.read(1, back.data());
  EXPECT_EQ(std::memcmp(back.data(), next.data(), next.bytes), 0);
}

TEST_F(NvmeTest, ACorruptExtentAnIoErrorAndATruncatedFileAreCaughtOnRead) {
  SpillDir dir(parent);
  NvmeStore store(dir, {1 << 20, 1 << 20});
  Aligned a(1 << 20);
  fill(a, 3);
  store.write(0, a.data(), a.bytes);
  store.write(1, a.data(), a.bytes);
  Aligned dst(1 << 20);
  // Someone flips a byte of subgroup 0 on disk.
  {
    const int fd = ::open(store.file().c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    const unsigned char x = static_cast<unsigned char>(a.data()[4000] ^ 0xff);
    ASSERT_EQ(::pwrite(fd, &x, 1, 4000), 1);
    ::close(fd);
  }
  try {
    store.read(0, dst.data());
    FAIL() << "a corrupt extent was read as good";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("subgroup 0"), std::string::npos) << e.what();
  }
  NvmeFaults eio;
  eio.fail_read_errno = EIO;
  store.inject(eio);
  EXPECT_THROW(store.read(1, dst.data()), IoError);
  // Someone truncates the file while training.
  ASSERT_EQ(::truncate(store.file().c_str(), (1 << 20) + 4096), 0);
  try {
    store.read(1, dst.data());
    FAIL() << "a truncated extent was read";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
}

TEST_F(NvmeTest, SetupErrorsNameThePathAndTheBytes) {
  try {
    SpillDir missing(parent / "nope");
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("nope"), std::string::npos) << e.what();
  }
  std::ofstream(parent / "file") << "x";
  EXPECT_THROW(SpillDir(parent / "file"), IoError);
  SpillDir dir(parent);
  // Far more than any disk here: fallocate fails at setup, naming the bytes.
  try {
    NvmeStore store(dir, {std::uint64_t{1} << 60});
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(std::uint64_t{1} << 60)), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_empty(dir.path()));  // nothing left behind
  NvmeConfig bad;
  bad.block_bytes = 1000;
  EXPECT_THROW(NvmeStore(dir, {4096}, bad), InvalidArgument);
}

// The exit path that skips destructors (Python's interpreter with the optimizer still referenced,
// a re-raised SIGINT): the folders go, and a store still in use keeps its open file.
TEST_F(NvmeTest, RemoveAllLiveTakesTheFoldersAndLeavesTheOpenFileUsable) {
  SpillDir dir(parent);
  NvmeStore store(dir, {1 << 20});
  Aligned src(1 << 20);
  fill(src, 5);
  store.write(0, src.data(), src.bytes);
  EXPECT_GE(SpillDir::remove_all_live(), 1U);
  EXPECT_FALSE(fs::exists(dir.path()));
  EXPECT_FALSE(fs::exists(store.file()));
  EXPECT_EQ(SpillDir::remove_all_live(), 0U) << "nothing left to remove";
  Aligned back(1 << 20);
  store.read(0, back.data());
  EXPECT_EQ(std::memcmp(back.data(), src.data(), src.bytes), 0);
  store.write(0, src.data(), src.bytes);
}

TEST_F(NvmeTest, AForkedChildLeavesItsParentsFolderAlone) {
  SpillDir dir(parent);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const std::size_t removed = SpillDir::remove_all_live();
    dir.remove();
    ::_exit(removed == 0 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child counted its parent's folder as its own";
  EXPECT_TRUE(fs::exists(dir.path()));
}

TEST_F(NvmeTest, StaleSpillsOfDeadProcessesAreFound) {
  // A directory named for a process that cannot exist, with a file in it.
  const fs::path stale = parent / "memtide-spill-999999999-abcdef";
  fs::create_directory(stale);
  std::ofstream(stale / "state.spill") << std::string(12345, 'x');
  SpillDir mine(parent);  // alive: not stale
  const auto found = SpillDir::find_stale(parent);
  ASSERT_EQ(found.size(), 1U);
  EXPECT_EQ(found[0].path, stale);
  EXPECT_EQ(found[0].bytes, 12345U);
}

// The ranks of a torchrun job spill side by side: each folder says whose it is, and a dead
// rank's is still found by its pid.
TEST_F(NvmeTest, SpillFoldersAreNamedByRankAndStillFoundByPid) {
  ASSERT_EQ(::setenv("RANK", "3", 1), 0);
  {
    SpillDir mine(parent);
    const std::string name = fs::path(mine.path()).filename().string();
    EXPECT_EQ(name.rfind("memtide-spill-" + std::to_string(::getpid()) + "-rank3-", 0), 0U) << name;
    EXPECT_TRUE(SpillDir::find_stale(parent).empty()) << "alive: not stale";
  }
  ASSERT_EQ(::setenv("RANK", "not-a-rank", 1), 0);
  {
    SpillDir mine(parent);  // a bad RANK is taken as unset
    const std::string name = fs::path(mine.path()).filename().string();
    EXPECT_EQ(name.find("rank"), std::string::npos) << name;
  }
  ::unsetenv("RANK");
  const fs::path stale = parent / "memtide-spill-999999999-rank7-abcdef";
  fs::create_directory(stale);
  const auto found = SpillDir::find_stale(parent);
  ASSERT_EQ(found.size(), 1U);
  EXPECT_EQ(found[0].path, stale);
}
