// StateSnapshot: a save of the host state while it changes, with a bounded copy-on-write buffer,
// committed whole or not at all.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "memtide/core/detail/os_testing.hpp"
#include "memtide/core/error.hpp"
#include "memtide/tiering/checkpoint/state_snapshot.hpp"

namespace {

namespace fs = std::filesystem;
using memtide::tiering::StateSnapshot;

struct State {
  std::vector<float> p, m, v;
  explicit State(std::size_t n, float base) : p(n), m(n), v(n) {
    for (std::size_t i = 0; i < n; ++i) {
      p[i] = base + static_cast<float>(i);
      m[i] = base * 0.5F - static_cast<float>(i);
      v[i] = base + 0.25F * static_cast<float>(i);
    }
  }
};

class StateSnapshotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/memtide-snapshot-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  static StateSnapshot::Ranges cut(std::size_t n, std::size_t size) {
    StateSnapshot::Ranges r;
    for (std::size_t s = 0; s < n; s += size) r.emplace_back(s, std::min(n, s + size));
    return r;
  }
  static StateSnapshot::Config config(const fs::path& target, const State& s, std::size_t size,
                                      std::uint64_t buffer = 0) {
    StateSnapshot::Config c;
    c.target = target;
    c.param = s.p.data();
    c.exp_avg = s.m.data();
    c.exp_avg_sq = s.v.data();
    c.n = s.p.size();
    c.subgroups = cut(c.n, size);
    c.buffer_bytes = buffer;
    c.meta = "meta bytes";
    return c;
  }
  // What the checkpoint at `target` holds, after the manifest and every checksum were checked.
  static State read(const fs::path& target) {
    const memtide::tiering::SnapshotManifest m = StateSnapshot::read_manifest(target, /*verify=*/true);
    State s(m.params, 0);
    std::ifstream in(target / StateSnapshot::kData, std::ios::binary);
    std::size_t k = 0;
    for (std::vector<float>* a : {&s.p, &s.m, &s.v}) {
      in.seekg(static_cast<std::streamoff>(m.offsets[k++]));
      in.read(reinterpret_cast<char*>(a->data()), static_cast<std::streamsize>(a->size() * sizeof(float)));
    }
    EXPECT_TRUE(in.good());
    return s;
  }
  std::size_t partials() const {
    std::size_t n = 0;
    for (const auto& e : fs::directory_iterator(dir_)) n += e.path().filename().string().find(".memtide-partial-") != std::string::npos;
    return n;
  }
  fs::path dir_;
};

TEST_F(StateSnapshotTest, SavesTheStateAsItWasAskedForWhileStepsChangeIt) {
  const std::size_t n = 1 << 20, size = 1 << 16;  // 16 subgroups of 768 KiB
  State live(n, 1.0F);
  const State asked = live;
  const std::uint64_t bound = 2 * 3 * sizeof(float) * size;
  auto save = StateSnapshot::start(config(dir_ / "ckpt", live, size, bound));
  // Three "steps" change every subgroup, each protecting it first, as the engine does.
  for (int step = 0; step < 3; ++step) {
    for (std::size_t g = 0; g < n / size; ++g) {
      save->protect(g);
      for (std::size_t i = g * size; i < (g + 1) * size; ++i) {
        live.p[i] += 1.0F;
        live.m[i] -= 2.0F;
        live.v[i] *= 0.5F;
      }
    }
  }
  save->wait();
  const memtide::tiering::SnapshotProgress pr = save->progress();
  EXPECT_TRUE(pr.committed);
  EXPECT_EQ(pr.bytes_written, 3 * sizeof(float) * n);
  EXPECT_LE(pr.peak_buffer_bytes, bound) << "the copy-on-write buffer stays within its bound";
  const State saved = read(dir_ / "ckpt");
  EXPECT_EQ(saved.p, asked.p);
  EXPECT_EQ(saved.m, asked.m);
  EXPECT_EQ(saved.v, asked.v);
  std::ifstream meta(dir_ / "ckpt" / StateSnapshot::kMeta);
  std::string text((std::istreambuf_iterator<char>(meta)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "meta bytes");
  EXPECT_EQ(partials(), 0U);
}

TEST_F(StateSnapshotTest, ASecondSaveReplacesTheFirstWhole) {
  State a(3000, 1.0F), b(3000, 7.0F);
  StateSnapshot::start(config(dir_ / "ckpt", a, 1000))->wait();
  auto second = StateSnapshot::start(config(dir_ / "ckpt", b, 700));
  second->wait();
  // In place before the previous checkpoint was removed: its removal is counted apart.
  EXPECT_GT(second->progress().committed_s, 0.0);
  EXPECT_LE(second->progress().committed_s, second->progress().elapsed_s);
  const State saved = read(dir_ / "ckpt");
  EXPECT_EQ(saved.p, b.p);
  EXPECT_EQ(StateSnapshot::read_manifest(dir_ / "ckpt", false).subgroups.size(), 5U);
  EXPECT_EQ(partials(), 0U) << "the previous checkpoint is removed once replaced";
}

TEST_F(StateSnapshotTest, RefusesTargetsThatAreNotItsOwn) {
  State s(100, 1.0F);
  auto refused = [&](const fs::path& target, const std::string& words) {
    try {
      StateSnapshot::start(config(target, s, 50));
      ADD_FAILURE() << target << " was accepted";
    } catch (const memtide::Error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  std::ofstream(dir_ / "file") << "x";
  refused(dir_ / "file", "not a folder");
  fs::create_directory(dir_ / "theirs");
  std::ofstream(dir_ / "theirs" / "keep.txt") << "x";
  refused(dir_ / "theirs", "not a memtide checkpoint");
  EXPECT_TRUE(fs::exists(dir_ / "theirs" / "keep.txt"));
  fs::create_directory_symlink(dir_ / "theirs", dir_ / "link");
  refused(dir_ / "link", "symbolic link");
  refused(dir_ / "missing" / "ckpt", "does not exist");
  EXPECT_EQ(partials(), 0U);
}

TEST_F(StateSnapshotTest, AFailedWriteLeavesThePreviousCheckpointLoadable) {
  State first(4096, 1.0F), second(4096, 5.0F);
  StateSnapshot::start(config(dir_ / "ckpt", first, 1024))->wait();
  auto save = StateSnapshot::start(config(dir_ / "ckpt", second, 1024));
  save->inject_write_error(ENOSPC);
  // The fault fires at the writer's next write; one may already be done.
  try {
    save->wait();
    // The writer finished before the fault could fire: inject into a fresh save instead.
    save = StateSnapshot::start(config(dir_ / "ckpt2", second, 1024));
  } catch (const memtide::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("did not complete"), std::string::npos) << e.what();
    EXPECT_FALSE(save->progress().committed);
  }
  EXPECT_EQ(read(dir_ / "ckpt").p, first.p) << "the previous checkpoint is untouched";
  EXPECT_EQ(partials(), 0U) << "the failed save's folder is removed";
}

TEST_F(StateSnapshotTest, CorruptTruncatedAndPartialCheckpointsAreRefusedNamingWhatIsWrong) {
  State s(5000, 2.0F);
  StateSnapshot::start(config(dir_ / "ckpt", s, 1000))->wait();
  auto refused = [&](const std::string& words) {
    try {
      (void)StateSnapshot::read_manifest(dir_ / "ckpt", true);
      ADD_FAILURE() << "accepted";
    } catch (const memtide::IoError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  {  // one byte of subgroup 3's exp_avg flipped
    std::fstream f(dir_ / "ckpt" / StateSnapshot::kData, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(StateSnapshot::read_manifest(dir_ / "ckpt", false).offsets[1] + 3500 * sizeof(float)));
    f.put('\x7f');
  }
  refused("subgroup 3");
  fs::resize_file(dir_ / "ckpt" / StateSnapshot::kData, 1000);
  refused("truncated");
  fs::remove(dir_ / "ckpt" / StateSnapshot::kManifest);
  refused("no state.manifest");
  // A save that died before its commit: the target does not exist, the partial folder is named.
  fs::remove_all(dir_ / "ckpt");
  fs::create_directory(dir_ / ".ckpt.memtide-partial-1-dead");
  refused("did not complete");
}

TEST_F(StateSnapshotTest, PartialFoldersOfDeadSavesAreRemovedAndCancelLeavesTheTarget) {
  // pid_max is at most 2^22: this process cannot exist.
  fs::create_directory(dir_ / ".ckpt.memtide-partial-99999999-abc");
  std::ofstream(dir_ / ".ckpt.memtide-partial-99999999-abc" / "state.bin") << "half";
  State s(1 << 18, 3.0F);
  StateSnapshot::start(config(dir_ / "ckpt", s, 1 << 14))->wait();
  EXPECT_FALSE(fs::exists(dir_ / ".ckpt.memtide-partial-99999999-abc"));
  auto save = StateSnapshot::start(config(dir_ / "other", s, 1 << 14));
  save->cancel();
  EXPECT_THROW(save->wait(), memtide::IoError);
  save.reset();
  EXPECT_FALSE(fs::exists(dir_ / "other"));
  EXPECT_EQ(partials(), 0U);
  EXPECT_EQ(read(dir_ / "ckpt").v, s.v);
}

TEST_F(StateSnapshotTest, BadConfigsAreRefused) {
  State s(100, 1.0F);
  StateSnapshot::Config c = config(dir_ / "ckpt", s, 30);
  c.subgroups.pop_back();
  EXPECT_THROW(StateSnapshot::start(c), memtide::InvalidArgument);
  c = config(dir_ / "ckpt", s, 30);
  c.exp_avg = nullptr;
  EXPECT_THROW(StateSnapshot::start(c), memtide::InvalidArgument);
  c = config("", s, 30);
  EXPECT_THROW(StateSnapshot::start(c), memtide::InvalidArgument);
}

// The engine's arrays start on page boundaries: whole blocks go with O_DIRECT straight from them
// (and from the copies), the edges of subgroups that do not fall on a block through the page
// cache, and the file reads back exactly.
TEST_F(StateSnapshotTest, PageAlignedArraysAreWrittenWithDirectIoAndReadBackExactly) {
  const std::size_t n = 100'003;
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> arrays[3];
  for (auto& a : arrays) a.reset(static_cast<float*>(std::aligned_alloc(4096, (n * sizeof(float) + 4095) / 4096 * 4096)));
  for (std::size_t i = 0; i < n; ++i) {
    arrays[0].get()[i] = static_cast<float>(i);
    arrays[1].get()[i] = -static_cast<float>(i);
    arrays[2].get()[i] = 0.5F * static_cast<float>(i);
  }
  State want(n, 0);
  want.p.assign(arrays[0].get(), arrays[0].get() + n);
  want.m.assign(arrays[1].get(), arrays[1].get() + n);
  want.v.assign(arrays[2].get(), arrays[2].get() + n);
  StateSnapshot::Config c = config(dir_ / "ckpt", want, 7777, 2 * 12 * 7777);
  c.param = arrays[0].get();
  c.exp_avg = arrays[1].get();
  c.exp_avg_sq = arrays[2].get();
  auto save = StateSnapshot::start(c);
  for (std::size_t g = 0; g < 3; ++g) {  // a step changes the first subgroups: copied first, or waited for
    save->protect(g);
    for (std::size_t i = g * 7777; i < (g + 1) * 7777; ++i) arrays[0].get()[i] += 1000.0F;
  }
  save->wait();
  const State got = read(dir_ / "ckpt");
  EXPECT_EQ(got.p, want.p);
  EXPECT_EQ(got.m, want.m);
  EXPECT_EQ(got.v, want.v);
  const int probe = ::open((dir_ / "probe").c_str(), O_WRONLY | O_CREAT | O_DIRECT, 0600);
  if (probe >= 0) {
    ::close(probe);
    EXPECT_GT(save->progress().direct_bytes, 12 * n * 3 / 4) << "most of the 12 B/param went with O_DIRECT";
  }
}

// A step that reaches the subgroup the writer is writing does not wait for the rest of it: it
// copies what is not written yet, the writer goes on from that copy, and the step changes the
// arrays at once. The writer is held between two chunks so that the step meets it there.
TEST_F(StateSnapshotTest, ASubgroupBeingWrittenIsNotWaitedForOnlyItsRestIsCopied) {
  const std::size_t size = std::size_t{4} << 20;  // 48 MiB a subgroup: six 8 MiB chunks
  const std::size_t n = 2 * size;
  State live(n, 3.0F);
  const State asked = live;
  std::promise<void> reached;
  std::promise<void> go;
  std::shared_future<void> released = go.get_future().share();
  bool held = false;
  StateSnapshot::Config c = config(dir_ / "ckpt", live, size);
  // The writer starts with the last subgroup (1); it is held before that subgroup's third chunk.
  c.before_chunk = [&](std::size_t g, std::uint64_t at) {
    if (g == 1 && at >= (std::uint64_t{16} << 20) && !held) {
      held = true;
      reached.set_value();
      (void)released.wait_for(std::chrono::seconds(60));
    }
  };
  auto save = StateSnapshot::start(c);
  const std::uint64_t subgroup_bytes = 12 * size;
  if (reached.get_future().wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    go.set_value();
    FAIL() << "the writer never reached subgroup 1's third chunk";
  }
  std::thread step([&] {
    save->protect(1);
    for (std::size_t i = size; i < n; ++i) live.p[i] = live.m[i] = live.v[i] = -1.0F;
  });
  // The step copies the rest of subgroup 1 and waits only for the writer's next chunk.
  bool copied = false;
  for (int k = 0; k < 1000 && !copied; ++k) {
    copied = save->progress().copied_bytes > 0;
    if (!copied) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const std::uint64_t rest = save->progress().copied_bytes;
  go.set_value();
  step.join();
  EXPECT_TRUE(copied) << "the step waited for the writer to finish the subgroup instead of copying its rest";
  EXPECT_LT(rest, subgroup_bytes) << "only what was not written is copied";
  EXPECT_GE(rest, subgroup_bytes - (std::uint64_t{16} << 20));
  save->protect(0);
  for (std::size_t i = 0; i < size; ++i) live.p[i] = live.m[i] = live.v[i] = -2.0F;
  save->wait();
  EXPECT_TRUE(save->progress().committed);
  const State saved = read(dir_ / "ckpt");
  EXPECT_EQ(saved.p, asked.p);
  EXPECT_EQ(saved.m, asked.m);
  EXPECT_EQ(saved.v, asked.v);
}

// The copy-on-write memory outlives a save: the next save's copies go into it, with no new
// mapping (and so no page faults: bench/results/checkpoint/ measured 0.3-1 GB/s into fresh memory
// on a VM, about 10 GB/s into kept memory).
TEST_F(StateSnapshotTest, TheNextSaveCopiesIntoTheMemoryThePreviousOneKept) {
  const std::size_t n = 1 << 20, size = 1 << 16;
  State live(n, 1.0F);
  auto pool = std::make_shared<memtide::tiering::CopyBuffers>();
  for (int save_no = 0; save_no < 2; ++save_no) {
    const State asked = live;
    std::promise<void> go;
    std::shared_future<void> released = go.get_future().share();
    StateSnapshot::Config c = config(dir_ / "ckpt", live, size);
    c.buffers = pool;
    // The writer is held at its first chunk (the last subgroup), so subgroup 0 is still unwritten.
    c.before_chunk = [released](std::size_t, std::uint64_t) { (void)released.wait_for(std::chrono::seconds(60)); };
    memtide::os::testing::reset();
    auto save = StateSnapshot::start(c);
    save->protect(0);  // copied aside at once: the writer is not waited for
    for (std::size_t i = 0; i < size; ++i) live.p[i] += 1.0F;
    const std::size_t mappings = memtide::os::testing::count(memtide::os::testing::Call::map);
    go.set_value();
    save->wait();
    EXPECT_EQ(save->progress().copied_bytes, 12 * size);
    if (save_no == 0) {
      EXPECT_GE(mappings, 1U) << "the first save maps its copy";
    } else {
      EXPECT_EQ(mappings, 0U) << "the second save copies into the memory the first one kept";
    }
    EXPECT_GE(pool->kept_bytes(), 12 * size) << "kept for the next save";
    const State saved = read(dir_ / "ckpt");
    EXPECT_EQ(saved.p, asked.p);
    EXPECT_EQ(saved.v, asked.v);
  }
}

TEST_F(StateSnapshotTest, SubgroupsKeptElsewhereAreReadFromThereAndWrittenWithDirectIo) {
  // Every other subgroup is "on NVMe": the host arrays hold stale values there, and the writer
  // reads the subgroup as the spill tier hands it ([p | m | v] from a block boundary, checksummed).
  const std::size_t n = 100'003;
  const std::size_t size = 9001;  // odd: the arrays' places in the file are skewed every which way
  const State host(n, 1.0F);
  const State spilled(n, 5000.0F);
  StateSnapshot::Config c = config(dir_ / "ckpt", host, size);
  c.elsewhere.assign(c.subgroups.size(), false);
  for (std::size_t g = 0; g < c.subgroups.size(); g += 2) c.elsewhere[g] = true;
  std::size_t reads = 0;
  c.read_elsewhere = [&](std::size_t g, void* dst) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(dst) % 4096, 0U);
    const auto [first, end] = c.subgroups[g];
    auto* out = static_cast<float*>(dst);
    std::size_t at = 0;
    for (const std::vector<float>* a : {&spilled.p, &spilled.m, &spilled.v}) {
      std::copy(a->begin() + static_cast<std::ptrdiff_t>(first), a->begin() + static_cast<std::ptrdiff_t>(end), out + at);
      at += end - first;
    }
    ++reads;
    return XXH3_64bits(dst, at * sizeof(float));
  };
  auto save = StateSnapshot::start(c);
  save->wait();
  EXPECT_EQ(reads, (c.subgroups.size() + 1) / 2);
  const State got = read(dir_ / "ckpt");
  for (std::size_t g = 0; g < c.subgroups.size(); ++g) {
    const State& want = c.elsewhere[g] ? spilled : host;
    for (std::size_t i = c.subgroups[g].first; i < c.subgroups[g].second; ++i) {
      ASSERT_EQ(got.p[i], want.p[i]) << "subgroup " << g << ", element " << i;
      ASSERT_EQ(got.m[i], want.m[i]) << "subgroup " << g << ", element " << i;
      ASSERT_EQ(got.v[i], want.v[i]) << "subgroup " << g << ", element " << i;
    }
  }
  const int probe = ::open((dir_ / "probe").c_str(), O_WRONLY | O_CREAT | O_DIRECT, 0600);
  if (probe >= 0) {
    ::close(probe);
    // The host arrays here are plain vectors (16 B aligned), so only the spilled half can go direct:
    // all of it but each array's two edge blocks (was: whichever arrays the read left in place).
    const std::uint64_t spilled_bytes = 12 * ((c.subgroups.size() + 1) / 2) * size;
    EXPECT_GT(save->progress().direct_bytes, spilled_bytes * 9 / 10) << "the spilled subgroups went with O_DIRECT";
  }
}

// ---- a checkpoint saved in parts (one per process of a sharded state) -----------------------------

StateSnapshot::Config part_of(StateSnapshot::Config c, const std::string& id, std::size_t index, std::size_t parts) {
  StateSnapshot::Config::Part part;
  part.id = id;
  for (std::size_t i = 0; i < parts; ++i) part.names.push_back("shard-" + std::to_string(i));
  part.index = index;
  c.part = part;
  return c;
}

TEST_F(StateSnapshotTest, PartsAppearAtTheTargetOnlyOnceEveryPartIsIn) {
  State a(3000, 1.0F), b(2000, 7.0F), c(1000, 9.0F);
  // Whichever part finishes last commits: here part 1 first, then part 0.
  StateSnapshot::start(part_of(config(dir_ / "ckpt", b, 700), "s1", 1, 2))->wait();
  EXPECT_FALSE(fs::exists(dir_ / "ckpt")) << "one part of two is not a checkpoint";
  StateSnapshot::start(part_of(config(dir_ / "ckpt", a, 700), "s1", 0, 2))->wait();
  EXPECT_EQ(StateSnapshot::read_parts(dir_ / "ckpt"), (std::vector<std::string>{"shard-0", "shard-1"}));
  EXPECT_EQ(read(dir_ / "ckpt" / "shard-0").p, a.p);
  EXPECT_EQ(read(dir_ / "ckpt" / "shard-1").v, b.v);
  EXPECT_THROW((void)StateSnapshot::read_manifest(dir_ / "ckpt", false), memtide::IoError) << "a parts checkpoint has no state of its own";

  // The next save in parts, with both parts running at once: exactly one commit replaces the first.
  auto p0 = StateSnapshot::start(part_of(config(dir_ / "ckpt", c, 300), "s2", 0, 2));
  auto p1 = StateSnapshot::start(part_of(config(dir_ / "ckpt", a, 300), "s2", 1, 2));
  p0->wait();
  p1->wait();
  EXPECT_EQ(read(dir_ / "ckpt" / "shard-0").m, c.m);
  EXPECT_EQ(read(dir_ / "ckpt" / "shard-1").m, a.m);
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().filename(), "ckpt") << "left beside the checkpoint: " << e.path();
  }
  // A whole save may replace a checkpoint in parts, and read_parts says it is whole.
  StateSnapshot::start(config(dir_ / "ckpt", b, 500))->wait();
  EXPECT_TRUE(StateSnapshot::read_parts(dir_ / "ckpt").empty());
  EXPECT_EQ(read(dir_ / "ckpt").p, b.p);
}

TEST_F(StateSnapshotTest, APartThatNeverCommitsLeavesThePreviousCheckpointAndIsNamed) {
  State a(2000, 1.0F), b(2000, 3.0F);
  StateSnapshot::start(part_of(config(dir_ / "ckpt", a, 500), "old", 0, 2))->wait();
  StateSnapshot::start(part_of(config(dir_ / "ckpt", a, 500), "old", 1, 2))->wait();
  // The next save: part 0 completes, part 1's process fails (or is killed) before its part is in.
  StateSnapshot::start(part_of(config(dir_ / "ckpt", b, 500), "new", 0, 2))->wait();
  auto p1 = StateSnapshot::start(part_of(config(dir_ / "ckpt", b, 500), "new", 1, 2));
  p1->cancel();
  EXPECT_THROW(p1->wait(), memtide::IoError);
  EXPECT_EQ(read(dir_ / "ckpt" / "shard-1").p, a.p) << "the previous checkpoint is whole";
  // Without the target, the reader names the part the staging folder lacks.
  fs::rename(dir_ / "ckpt", dir_ / "kept");
  try {
    (void)StateSnapshot::read_parts(dir_ / "ckpt");
    ADD_FAILURE() << "accepted";
  } catch (const memtide::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("did not complete; missing: shard-1"), std::string::npos) << e.what();
  }
  // A part folder removed from a committed checkpoint is named too.
  fs::remove_all(dir_ / "kept" / "shard-0");
  try {
    (void)StateSnapshot::read_parts(dir_ / "kept");
    ADD_FAILURE() << "accepted";
  } catch (const memtide::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("missing its part shard-0"), std::string::npos) << e.what();
  }
  fs::rename(dir_ / "kept", dir_ / "ckpt");
  fs::create_directory(dir_ / "ckpt" / "shard-0");  // so that it is a checkpoint folder again below
  std::ofstream(dir_ / "ckpt" / "shard-0" / StateSnapshot::kManifest) << "x";
  // The next save's part 0 clears the dead staging folder.
  StateSnapshot::start(part_of(config(dir_ / "ckpt", b, 500), "next", 0, 1))->wait();
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().filename(), "ckpt") << "left beside the checkpoint: " << e.path();
  }
  EXPECT_EQ(read(dir_ / "ckpt" / "shard-0").p, b.p);
}

TEST_F(StateSnapshotTest, BadPartsAreRefused) {
  State s(100, 1.0F);
  for (const std::string& id : std::vector<std::string>{"", "a/b", "has space", std::string(65, 'x')}) {
    EXPECT_THROW(StateSnapshot::start(part_of(config(dir_ / "ckpt", s, 30), id, 0, 2)), memtide::InvalidArgument) << id;
  }
  EXPECT_THROW(StateSnapshot::start(part_of(config(dir_ / "ckpt", s, 30), "id", 2, 2)), memtide::InvalidArgument);
  StateSnapshot::Config c = part_of(config(dir_ / "ckpt", s, 30), "id", 0, 2);
  for (const char* name : {"..", ".hidden", "a/b", ""}) {
    c.part->names[1] = name;
    EXPECT_THROW(StateSnapshot::start(c), memtide::InvalidArgument) << name;
  }
  c.part->names[1] = c.part->names[0];
  EXPECT_THROW(StateSnapshot::start(c), memtide::InvalidArgument) << "a name given twice";
}

}  // namespace
