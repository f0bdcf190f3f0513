// End-to-end test of libmemtide_preload.so without a GPU: runs preload_demo (linked against the
// fake CUDA runtime) in a child process with LD_PRELOAD set, then parses the JSON Lines log and
// checks the timeline against the sequence the demo performs. The paths of the three build
// products come from the environment that CTest sets (see CMakeLists.txt), so the test runner
// itself never has the observer loaded.

#include <gtest/gtest.h>
#include <fcntl.h>
#include <link.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace {

namespace fs = std::filesystem;

constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

// One JSON object of the log: flat, string or unsigned integer values only. Parsing is strict so
// that a malformed line fails the test instead of being skipped.
using Line = std::map<std::string, std::string>;

bool parse_line(const std::string& text, Line& out) {
  std::size_t i = 0;
  auto skip_ws = [&] {
    while (i < text.size() && (text[i] == ' ' || text[i] == '\t')) ++i;
  };
  auto expect = [&](char c) {
    skip_ws();
    if (i >= text.size() || text[i] != c) return false;
    ++i;
    return true;
  };
  auto read_string = [&](std::string& s) {
    if (!expect('"')) return false;
    s.clear();
    while (i < text.size() && text[i] != '"') {
      if (text[i] == '\\') return false;  // the observer never needs escapes
      s += text[i++];
    }
    return expect('"');
  };
  out.clear();
  if (!expect('{')) return false;
  do {
    std::string key;
    std::string value;
    if (!read_string(key) || !expect(':')) return false;
    skip_ws();
    if (i < text.size() && text[i] == '"') {
      if (!read_string(value)) return false;
    } else {
      while (i < text.size() && text[i] >= '0' && text[i] <= '9') value += text[i++];
      if (value.empty()) return false;
    }
    if (!out.emplace(key, value).second) return false;  // duplicate key
  } while (expect(','));
  if (!expect('}')) return false;
  skip_ws();
  return i == text.size();
}

std::uint64_t num(const Line& line, const std::string& key) {
  auto it = line.find(key);
  if (it == line.end()) {
    ADD_FAILURE() << "missing key " << key;
    return 0;
  }
  return std::stoull(it->second);
}

std::string str(const Line& line, const std::string& key) {
  auto it = line.find(key);
  if (it == line.end()) {
    ADD_FAILURE() << "missing key " << key;
    return {};
  }
  return it->second;
}

std::vector<Line> read_log(const fs::path& path) {
  std::vector<Line> lines;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "no log written at " << path << " (was the observer preloaded?)";
  std::string text;
  while (std::getline(in, text)) {
    Line line;
    EXPECT_TRUE(parse_line(text, line)) << "malformed line: " << text;
    lines.push_back(std::move(line));
  }
  return lines;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The path of the shared ASan runtime when this process has one loaded, else empty.
int find_asan(dl_phdr_info* info, std::size_t, void* out) {
  const char* name = info->dlpi_name;
  if (name == nullptr || *name == '\0') return 0;
  const std::string base = fs::path(name).filename().string();
  if (base.rfind("libasan.so", 0) != 0) return 0;
  *static_cast<std::string*>(out) = name;
  return 1;
}

struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

class PreloadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    lib_ = env_or_empty("MEMTIDE_PRELOAD_TEST_LIB");
    demo_ = env_or_empty("MEMTIDE_PRELOAD_TEST_DEMO");
    ASSERT_FALSE(lib_.empty()) << "MEMTIDE_PRELOAD_TEST_LIB is not set (run through ctest)";
    ASSERT_FALSE(demo_.empty()) << "MEMTIDE_PRELOAD_TEST_DEMO is not set (run through ctest)";
    ASSERT_TRUE(fs::exists(lib_)) << lib_;
    ASSERT_TRUE(fs::exists(demo_)) << demo_;
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("memtide_preload_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    log_ = dir_ / "timeline.jsonl";
  }

  void TearDown() override {
    std::error_code ec;
    if (!HasFailure()) fs::remove_all(dir_, ec);  // kept on failure for a post-mortem
  }

  // Runs the demo with `args`; preloads the observer unless `preload` is false.
  RunResult run_demo(const std::vector<std::string>& args, bool preload, const fs::path& log) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv = *e;
      if (kv.rfind("LD_PRELOAD=", 0) == 0 || kv.rfind("MEMTIDE_PRELOAD_LOG=", 0) == 0) continue;
      env.push_back(kv);
    }
    if (preload) {
      // Under the asan preset the demo's ASan runtime insists on being the first object in the
      // initial library list, and a plain LD_PRELOAD of the observer would put the observer
      // first ("ASan runtime does not come first"). Preloading the very runtime this process
      // uses ahead of the observer satisfies that check instead of switching it off with
      // verify_asan_link_order=0. Outside sanitizer builds nothing is found and nothing is added.
      std::string asan;
      dl_iterate_phdr(find_asan, &asan);
      env.push_back("LD_PRELOAD=" + (asan.empty() ? lib_ : asan + ":" + lib_));
    }
    env.push_back("MEMTIDE_PRELOAD_LOG=" + log.string());
    std::vector<char*> envp;
    for (auto& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);

    std::vector<std::string> argv_s{demo_};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);

    const fs::path out = dir_ / "stdout.txt";
    const fs::path err = dir_ / "stderr.txt";
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&actions, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, demo_.c_str(), &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    RunResult result;
    if (rc != 0) {
      ADD_FAILURE() << "posix_spawn " << demo_ << ": " << std::strerror(rc);
      return result;
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    result.out = read_text(out);
    result.err = read_text(err);
    return result;
  }

  std::string lib_;
  std::string demo_;
  fs::path dir_;
  fs::path log_;
};

// The demo prints name=0x... for each block it got; returns name -> "0x...".
std::map<std::string, std::string> demo_pointers(const std::string& out) {
  std::map<std::string, std::string> ptrs;
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) ptrs[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return ptrs;
}

// Checks that every event's current/peak agree with a replay of the events before it, that time
// never runs backwards, and that the section is header, events..., summary.
void check_section_consistency(const std::vector<Line>& lines) {
  ASSERT_GE(lines.size(), 2u);
  EXPECT_EQ(str(lines.front(), "type"), "header");
  EXPECT_EQ(str(lines.back(), "type"), "summary");
  std::map<std::string, std::uint64_t> live;
  std::uint64_t current = 0;
  std::uint64_t peak = 0;
  std::uint64_t last_t = 0;
  for (std::size_t i = 1; i + 1 < lines.size(); ++i) {
    const Line& e = lines[i];
    ASSERT_EQ(str(e, "type"), "event") << "line " << i + 1;
    const std::string op = str(e, "op");
    const std::uint64_t size = num(e, "size");
    if (op == "malloc" || op == "malloc_async") {
      live[str(e, "ptr")] = size;
      current += size;
      peak = std::max(peak, current);
    } else {
      ASSERT_TRUE(op == "free" || op == "free_async") << op;
      auto it = live.find(str(e, "ptr"));
      EXPECT_EQ(size, it != live.end() ? it->second : 0) << "line " << i + 1;
      if (it != live.end()) {
        current -= it->second;
        live.erase(it);
      }
    }
    EXPECT_EQ(num(e, "current"), current) << "line " << i + 1;
    EXPECT_EQ(num(e, "peak"), peak) << "line " << i + 1;
    const std::uint64_t t = num(e, "t_ns");
    EXPECT_GE(t, last_t) << "line " << i + 1;
    last_t = t;
  }
  EXPECT_EQ(num(lines.back(), "events"), lines.size() - 2);
  EXPECT_EQ(num(lines.back(), "peak_bytes"), peak);
  EXPECT_EQ(num(lines.back(), "current_bytes"), current);
}

TEST_F(PreloadTest, RecordsTheDemoSequence) {
  const RunResult r = run_demo({}, true, log_);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  const auto ptrs = demo_pointers(r.out);
  ASSERT_EQ(ptrs.size(), 5u) << r.out;

  const std::vector<Line> lines = read_log(log_);
  // cudaFree(nullptr) is not an event; the cudaMallocManaged block is only seen when freed.
  struct Expected {
    const char* op;
    const char* name;
    std::uint64_t size;
    std::uint64_t current;
    std::uint64_t peak;
  };
  // Running totals in MiB: 1, 1+4=5, 5+2=7 (the peak), 7-4=3, 3+3=6, 6-3=3, unknown free keeps 3,
  // 3-1=2, 2-2=0. The async block does not raise the peak, so peak != sum of all mallocs (10).
  const std::vector<Expected> expected{
      {"malloc", "a", 1 * kMiB, 1 * kMiB, 1 * kMiB},
      {"malloc", "b", 4 * kMiB, 5 * kMiB, 5 * kMiB},
      {"malloc", "c", 2 * kMiB, 7 * kMiB, 7 * kMiB},
      {"free", "b", 4 * kMiB, 3 * kMiB, 7 * kMiB},
      {"malloc_async", "d", 3 * kMiB, 6 * kMiB, 7 * kMiB},
      {"free_async", "d", 3 * kMiB, 3 * kMiB, 7 * kMiB},
      {"free", "m", 0, 3 * kMiB, 7 * kMiB},
      {"free", "a", 1 * kMiB, 2 * kMiB, 7 * kMiB},
      {"free", "c", 2 * kMiB, 0, 7 * kMiB},
  };
  ASSERT_EQ(lines.size(), expected.size() + 2) << read_text(log_);

  EXPECT_EQ(str(lines[0], "type"), "header");
  EXPECT_GT(num(lines[0], "pid"), 0u);
  EXPECT_EQ(num(lines[0], "version"), 1u);

  for (std::size_t i = 0; i < expected.size(); ++i) {
    const Line& e = lines[i + 1];
    const Expected& x = expected[i];
    SCOPED_TRACE("event " + std::to_string(i) + " (" + x.op + " " + x.name + ")");
    EXPECT_EQ(str(e, "type"), "event");
    EXPECT_EQ(str(e, "op"), x.op);
    EXPECT_EQ(str(e, "ptr"), ptrs.at(x.name));
    EXPECT_EQ(num(e, "size"), x.size);
    EXPECT_EQ(num(e, "current"), x.current);
    EXPECT_EQ(num(e, "peak"), x.peak);
    const bool async = std::strstr(x.op, "async") != nullptr;
    EXPECT_EQ(str(e, "stream"), async ? "0x5eed" : "0x0");
  }

  const Line& s = lines.back();
  EXPECT_EQ(str(s, "type"), "summary");
  EXPECT_EQ(num(s, "events"), 9u);
  EXPECT_EQ(num(s, "peak_bytes"), 7 * kMiB);
  EXPECT_EQ(num(s, "current_bytes"), 0u);
  EXPECT_EQ(num(s, "unknown_frees"), 1u);
  EXPECT_EQ(num(s, "mallocs"), 4u);
  EXPECT_EQ(num(s, "frees"), 5u);
  check_section_consistency(lines);
}

TEST_F(PreloadTest, ThreadsAndBufferFlushesKeepOneOrderedSection) {
  const RunResult r = run_demo({"threads"}, true, log_);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");  // sanitizer builds report races and leaks here
  const std::vector<Line> lines = read_log(log_);
  // 4 threads x 1500 malloc/free pairs: 12000 events, about three buffer flushes before exit.
  ASSERT_EQ(lines.size(), 12000u + 2u);
  std::size_t headers = 0;
  std::size_t summaries = 0;
  for (const Line& l : lines) {
    headers += str(l, "type") == "header" ? 1 : 0;
    summaries += str(l, "type") == "summary" ? 1 : 0;
  }
  EXPECT_EQ(headers, 1u);
  EXPECT_EQ(summaries, 1u);
  const Line& s = lines.back();
  EXPECT_EQ(num(s, "events"), 12000u);
  EXPECT_EQ(num(s, "mallocs"), 6000u);
  EXPECT_EQ(num(s, "frees"), 6000u);
  EXPECT_EQ(num(s, "unknown_frees"), 0u);
  EXPECT_EQ(num(s, "current_bytes"), 0u);
  // At most one live block per thread, each at most 32 KiB.
  EXPECT_GE(num(s, "peak_bytes"), 4096u);
  EXPECT_LE(num(s, "peak_bytes"), 4u * 32768u);
  check_section_consistency(lines);
}

TEST_F(PreloadTest, AppendsOneSectionPerRun) {
  ASSERT_EQ(run_demo({}, true, log_).exit_code, 0);
  ASSERT_EQ(run_demo({}, true, log_).exit_code, 0);
  const std::vector<Line> lines = read_log(log_);
  ASSERT_EQ(lines.size(), 2u * 11u);
  const std::vector<Line> first(lines.begin(), lines.begin() + 11);
  const std::vector<Line> second(lines.begin() + 11, lines.end());
  check_section_consistency(first);
  check_section_consistency(second);
}

// A child that exits normally writes its own events and summary and must not repeat the events
// the parent wrote before the fork.
TEST_F(PreloadTest, ForkedChildWritesOnlyItsOwnEvents) {
  const RunResult r = run_demo({"fork"}, true, log_);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  const std::vector<Line> lines = read_log(log_);
  ASSERT_EQ(lines.size(), 2u * 4u) << read_text(log_);
  // Each event is written at once, so the two processes' lines interleave: split them by pid.
  std::map<std::uint64_t, std::vector<Line>> by_pid;
  std::vector<std::uint64_t> order;
  for (const Line& l : lines) {
    const std::uint64_t pid = num(l, "pid");
    if (by_pid.find(pid) == by_pid.end()) order.push_back(pid);
    by_pid[pid].push_back(l);
  }
  ASSERT_EQ(order.size(), 2u) << read_text(log_);
  // The parent allocated 1 MiB before the fork; the child allocates 2 MiB.
  std::vector<Line> child = by_pid[order[0]], parent = by_pid[order[1]];
  if (num(child[1], "size") != 2 * kMiB) std::swap(child, parent);
  ASSERT_EQ(child.size(), 4u);
  ASSERT_EQ(parent.size(), 4u);
  check_section_consistency(child);
  check_section_consistency(parent);
  EXPECT_NE(num(child[0], "pid"), num(parent[0], "pid"));
  EXPECT_EQ(num(child[1], "size"), 2 * kMiB);
  EXPECT_EQ(str(child[2], "op"), "free");
  EXPECT_EQ(num(child[3], "peak_bytes"), 2 * kMiB);
  EXPECT_EQ(num(parent[1], "size"), 1 * kMiB);
  EXPECT_EQ(str(parent[2], "op"), "free");
  EXPECT_EQ(num(parent[3], "peak_bytes"), 1 * kMiB);
}

// Proves the harness: the log really comes from the preloaded observer, not from the demo.
TEST_F(PreloadTest, WithoutPreloadNothingIsRecorded) {
  const RunResult r = run_demo({}, false, log_);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(log_));
}

TEST_F(PreloadTest, UnopenableLogIsReportedAndCallsStillPassThrough) {
  const fs::path bad = dir_ / "no_such_dir" / "timeline.jsonl";
  const RunResult r = run_demo({}, true, bad);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(bad));
  EXPECT_NE(r.err.find(bad.string()), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(std::strerror(ENOENT)), std::string::npos) << r.err;
  // Reported once, not once per flush.
  EXPECT_EQ(r.err.find("cannot open"), r.err.rfind("cannot open")) << r.err;
}

TEST_F(PreloadTest, ExportsOnlyTheFourEntryPoints) {
  const std::string nm = env_or_empty("MEMTIDE_PRELOAD_TEST_NM");
  if (nm.empty()) GTEST_SKIP() << "no nm known to CMake";
  const std::string cmd = "'" + nm + "' -D --defined-only '" + lib_ + "'";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr) << cmd;
  std::set<std::string> symbols;
  char buf[512];
  while (std::fgets(buf, sizeof buf, pipe) != nullptr) {
    std::istringstream fields(buf);
    std::string addr;
    std::string type;
    std::string name;
    if (!(fields >> addr >> type >> name)) continue;
    if (type == "A") continue;  // version-node markers, not code
    symbols.insert(name.substr(0, name.find('@')));
  }
  ASSERT_EQ(::pclose(pipe), 0) << cmd;
  const std::set<std::string> expected{"cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync"};
  EXPECT_EQ(symbols, expected);
}

}  // namespace
