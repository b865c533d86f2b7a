// Tests of PickleWriter and of the snapshot pickle: what C++ writes is read back by the
// real Python unpickler (python3, stdlib only) and compared, and snapshots are checked by
// tests/memory/check_snapshot.py, the same checker other tests run on allocator output.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "memory/pickle.h"
#include "memory/snapshot.h"
#include "testing/files.h"
#include "testing/pickle_tuples.h"

#ifndef TALLY_SOURCE_DIR
#error "define TALLY_SOURCE_DIR as the repository root (tests/memory/*.py live there)"
#endif

namespace tally::memory {
namespace {

namespace fs = std::filesystem;

struct CmdResult {
  int status = -1;
  std::string output;
};

CmdResult run_command(const std::string& cmd) {
  CmdResult r;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string script(const char* name) {
  return shell_quote((fs::path(TALLY_SOURCE_DIR) / "tests" / "memory" / name).string());
}

// The interpreter CMake found (TALLY_PYTHON), else python3 from PATH.
std::string python() {
#ifdef TALLY_PYTHON
  return shell_quote(TALLY_PYTHON);
#else
  return "python3";
#endif
}

bool have_python() {
  static const bool ok =
      run_command(python() + " -c 'import sys; sys.exit(sys.version_info < (3, 8))'").status == 0;
  return ok;
}

using namespace tally::testing;

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("tally_pickle_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

class PickleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_python()) GTEST_SKIP() << "python3 not found";
  }

  // Writes one pickle with `write` and has Python compare it to `expected_py` (code
  // setting `expected`, with the loaded value as `v`).
  void expect_value(const std::function<void(PickleWriter&)>& write,
                    const std::string& expected_py) {
    const fs::path pk = dir_.path() / "value.pickle";
    {
      std::ofstream out(pk, std::ios::binary);
      PickleWriter w(out);
      write(w);
      w.finish();
    }
    compare("value", pk, expected_py);
  }

  void compare(const char* mode, const fs::path& pk, const std::string& expected_py) {
    const fs::path ex = dir_.path() / "expected.py";
    write_file(ex, expected_py);
    const CmdResult r =
        run_command(python() + " " + script("pickle_compare.py") + " " + mode + " " +
                    shell_quote(pk.string()) + " " + shell_quote(ex.string()));
    EXPECT_EQ(r.status, 0) << r.output;
  }

  TempDir dir_;
};

// A string of the bytes of a literal, embedded NULs included.
template <size_t N>
std::string bin(const char (&s)[N]) {
  return std::string(s, N - 1);
}

std::string bytes_of(const std::function<void(PickleWriter&)>& write) {
  std::ostringstream out;
  PickleWriter w(out);
  write(w);
  w.finish();
  return out.str();
}

// ---------------------------------------------------------------- exact bytes, no Python

TEST(PickleBytes, SmallValuesMatchCPythonEncoding) {
  EXPECT_EQ(bytes_of([](PickleWriter& w) { w.integer(1); }), bin("\x80\x02K\x01."));
  EXPECT_EQ(bytes_of([](PickleWriter& w) { w.none(); }), "\x80\x02N.");
  EXPECT_EQ(bytes_of([](PickleWriter& w) {
              w.begin_list();
              w.end_list();
            }),
            "\x80\x02].");
  EXPECT_EQ(bytes_of([](PickleWriter& w) {
              w.begin_list();
              w.integer(1);
              w.end_list();
            }),
            bin("\x80\x02](K\x01"
                "e."));
  // 2^31 needs a fifth byte so the sign bit stays clear; -2^31 - 1 needs one too.
  EXPECT_EQ(bytes_of([](PickleWriter& w) { w.integer(int64_t{1} << 31); }),
            bin("\x80\x02\x8a\x05\x00\x00\x00\x80\x00."));
  EXPECT_EQ(bytes_of([](PickleWriter& w) { w.integer(-(int64_t{1} << 31) - 1); }),
            bin("\x80\x02\x8a\x05\xff\xff\xff\x7f\xff."));
  // memo_string: the second occurrence is a BINGET of memo 0.
  EXPECT_EQ(bytes_of([](PickleWriter& w) {
              w.begin_tuple();
              w.memo_string("ab");
              w.memo_string("ab");
              w.end_tuple();
            }),
            bin("\x80\x02X\x02\x00\x00\x00"
                "abq\x00h\x00\x86."));
}

TEST(PickleBytes, MisuseThrows) {
  std::ostringstream out;
  {
    PickleWriter w(out);
    w.begin_dict();
    EXPECT_THROW(w.integer(1), std::logic_error);  // dict keys must be strings
    EXPECT_THROW(w.end_list(), std::logic_error);
    w.key("k");
    EXPECT_THROW(w.key("again"), std::logic_error);  // a value is expected
    EXPECT_THROW(w.end_dict(), std::logic_error);    // key without value
    w.integer(1);
    EXPECT_THROW(w.finish(), std::logic_error);  // dict still open
    w.end_dict();
    EXPECT_THROW(w.integer(2), std::logic_error);  // second top-level value
    w.finish();
    EXPECT_THROW(w.finish(), std::logic_error);
  }
  PickleWriter w(out);
  EXPECT_THROW(w.integer(std::numeric_limits<uint64_t>::max()), std::out_of_range);
  EXPECT_THROW(w.key("no dict"), std::logic_error);
  w.begin_tuple();
  w.integer(1);
  EXPECT_THROW(w.end_tuple(), std::logic_error);  // only 0 or 2 items
  EXPECT_FALSE(w.write_ref("never memoized"));
  EXPECT_FALSE(w.has_ref("never memoized"));
}

// ---------------------------------------------------------------- read back by Python

TEST_F(PickleTest, IntegersMatchCPythonByteForByte) {
  const std::vector<int64_t> values = {
      0,
      1,
      127,
      128,
      255,
      256,
      65535,
      65536,
      -1,
      -2,
      -128,
      -129,
      -255,
      -256,
      -257,
      -32768,
      -65536,
      -65537,
      (int64_t{1} << 31) - 1,
      int64_t{1} << 31,
      -(int64_t{1} << 31),
      -(int64_t{1} << 31) - 1,
      (int64_t{1} << 32) - 1,
      int64_t{1} << 32,
      int64_t{1} << 40,
      (int64_t{1} << 47) - 4096,
      int64_t{1} << 47,
      0x7f3a12345000,
      (int64_t{1} << 48) - 1,
      int64_t{1} << 48,
      (int64_t{1} << 53) + 1,
      (int64_t{1} << 55),
      std::numeric_limits<int64_t>::max(),
      std::numeric_limits<int64_t>::min(),
      -(int64_t{1} << 55),
      -(int64_t{1} << 40),
      static_cast<int64_t>(std::numeric_limits<size_t>::max())};  // PyTorch's SIZE_MAX: -1
  const fs::path pk = dir_.path() / "ints.pickle";
  std::string expected = "expected = [";
  {
    std::ofstream out(pk, std::ios::binary);
    for (int64_t v : values) {
      PickleWriter w(out);
      w.integer(v);
      w.finish();
      expected += std::to_string(v) + ", ";
    }
  }
  compare("cpython", pk, expected + "]\n");
}

TEST_F(PickleTest, IntegerTypes) {
  expect_value(
      [](PickleWriter& w) {
        w.begin_list();
        w.integer(uint8_t{200});
        w.integer(int8_t{-5});
        w.integer(uint16_t{60000});
        w.integer(int16_t{-30000});
        w.integer(uint32_t{4000000000u});
        w.integer(size_t{1} << 40);
        w.integer(uint64_t{0x7fffffffffffffff});
        w.integer(0);
        w.end_list();
      },
      "expected = [200, -5, 60000, -30000, 4000000000, 1 << 40, (1 << 63) - 1, 0]\n");
}

TEST_F(PickleTest, FloatsMatchCPythonByteForByte) {
  const std::vector<double> values = {0.0,
                                      -0.0,
                                      1.5,
                                      -2.25,
                                      0.1,
                                      0.8,
                                      1e300,
                                      5e-324,
                                      std::numeric_limits<double>::max(),
                                      std::numeric_limits<double>::infinity(),
                                      -std::numeric_limits<double>::infinity()};
  const fs::path pk = dir_.path() / "floats.pickle";
  {
    std::ofstream out(pk, std::ios::binary);
    for (double v : values) {
      PickleWriter w(out);
      w.floating(v);
      w.finish();
    }
  }
  compare("cpython", pk,
          "inf = math.inf\n"
          "expected = [0.0, -0.0, 1.5, -2.25, 0.1, 0.8, 1e300, 5e-324, 1.7976931348623157e308,"
          " inf, -inf]\n");
  // NaN compares by kind (CPython may pickle a different NaN payload).
  expect_value([](PickleWriter& w) { w.floating(std::numeric_limits<double>::quiet_NaN()); },
               "expected = math.nan\n");
}

TEST_F(PickleTest, ScalarsAndStrings) {
  expect_value(
      [](PickleWriter& w) {
        w.begin_list();
        w.none();
        w.boolean(true);
        w.boolean(false);
        w.string("");
        w.string("plain ascii");
        w.string("h\xc3\xa9llo \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x99\x82");  // héllo 日本 🙂
        w.string(std::string_view("nul\0inside", 10));
        w.string("bad \xff utf8 \xc3");  // invalid bytes become U+FFFD
        w.string("overlong \xc0\xaf and surrogate \xed\xa0\x80");
        w.string(std::string(100000, 'x'));
        w.memo_string("quote ' and \" and \\");
        w.end_list();
      },
      "expected = [None, True, False, '', 'plain ascii', 'h\\u00e9llo \\u65e5\\u672c "
      "\\U0001F642',\n"
      "  'nul\\x00inside', 'bad \\ufffd utf8 \\ufffd',\n"
      "  'overlong \\ufffd\\ufffd and surrogate \\ufffd\\ufffd\\ufffd', 'x' * 100000,\n"
      "  'quote \\' and \" and \\\\']\n");
}

TEST_F(PickleTest, LargeNestedListsAndDictsAreBatched) {
  // Python checks every MARK batch holds at most 1000 items (check_snapshot's byte checks).
  expect_value(
      [](PickleWriter& w) {
        w.begin_dict();
        w.key("big_list");
        w.begin_list();
        for (int64_t i = 0; i < 2500; ++i) w.integer(i * 1000003);
        w.end_list();
        w.key("exactly_1000");
        w.begin_list();
        for (int i = 0; i < 1000; ++i) w.integer(i);
        w.end_list();
        w.key("nested");
        w.begin_list();
        for (int i = 0; i < 1201; ++i) {
          w.begin_list();
          for (int j = 0; j < i % 3; ++j) w.integer(j);
          w.end_list();
        }
        w.end_list();
        w.key("big_dict");
        w.begin_dict();
        for (int i = 0; i < 2001; ++i) {
          w.key("k" + std::to_string(i));
          w.begin_dict();
          w.key("i");
          w.integer(i);
          w.key("neg");
          w.integer(-i);
          w.end_dict();
        }
        w.end_dict();
        w.key("empty_list");
        w.begin_list();
        w.end_list();
        w.key("empty_dict");
        w.begin_dict();
        w.end_dict();
        w.end_dict();
      },
      "expected = {\n"
      "  'big_list': [i * 1000003 for i in range(2500)],\n"
      "  'exactly_1000': list(range(1000)),\n"
      "  'nested': [list(range(i % 3)) for i in range(1201)],\n"
      "  'big_dict': {f'k{i}': {'i': i, 'neg': -i} for i in range(2001)},\n"
      "  'empty_list': [], 'empty_dict': {}}\n");
}

TEST_F(PickleTest, Tuples) {
  expect_value(
      [](PickleWriter& w) {
        w.begin_list();
        testing::write_both_tuple_sizes(w);
        w.begin_tuple();
        w.string("a");
        w.begin_list();
        w.begin_tuple();
        w.integer(-1);
        w.floating(2.5);
        w.end_tuple();
        w.end_list();
        w.end_tuple();
        w.end_list();
      },
      "expected = [(), (0, 0), ('a', [(-1, 2.5)])]\n");
}

TEST_F(PickleTest, MemoizedStringsAreSharedAcrossLongMemoIndices) {
  // 300 distinct strings push memo indices past 255 (LONG_BINPUT / LONG_BINGET).
  expect_value(
      [](PickleWriter& w) {
        w.begin_list();
        for (int round = 0; round < 3; ++round) {
          for (int i = 0; i < 300; ++i) w.memo_string("s" + std::to_string(i));
        }
        w.end_list();
        EXPECT_EQ(w.memo_size(), 300u);
      },
      "expected = [f's{i}' for r in range(3) for i in range(300)]\n"
      "assert all(v[i] is v[i + 300] is v[i + 600] for i in range(300))\n");
}

TEST_F(PickleTest, MemoizedCompositesAreShared) {
  expect_value(
      [](PickleWriter& w) {
        w.begin_list();
        for (int i = 0; i < 400; ++i) w.memo_string("pad" + std::to_string(i));  // memo > 255
        for (int i = 0; i < 5; ++i) {
          if (!w.write_ref("frames:a")) {
            EXPECT_EQ(i, 0);
            w.begin_list("frames:a");
            w.begin_dict();
            w.key("name");
            w.memo_string("conv2d");
            w.key("line");
            w.integer(42);
            w.end_dict();
            w.end_list();
          }
          if (!w.write_ref("frames:b")) {
            w.begin_dict("frames:b");
            w.key("x");
            w.integer(i);
            w.end_dict();
          }
          if (!w.write_ref("pool")) {
            w.begin_tuple();
            w.integer(0);
            w.integer(0);
            w.end_tuple("pool");
          }
        }
        EXPECT_TRUE(w.has_ref("frames:a"));
        w.end_list();
      },
      "a = [{'name': 'conv2d', 'line': 42}]\n"
      "expected = [f'pad{i}' for i in range(400)] + [a, {'x': 0}, (0, 0)] * 5\n"
      "assert all(v[400 + 3 * i + k] is v[400 + k] for i in range(5) for k in range(3))\n");
}

TEST_F(PickleTest, LargeOutputIsFlushedCompletely) {
  // More than the writer's internal buffer, to exercise intermediate flushes.
  expect_value(
      [](PickleWriter& w) {
        w.begin_list();
        for (int i = 0; i < 20000; ++i) w.string("item-" + std::to_string(i));
        w.end_list();
        EXPECT_GT(w.bytes_written(), size_t{1} << 16);
      },
      "expected = [f'item-{i}' for i in range(20000)]\n");
}

// ---------------------------------------------------------------- snapshots

constexpr uint64_t kSeg0 = 0x7f3a00000000;  // large segment, 4 MiB
constexpr uint64_t kSeg1 = 0x7f3a40000000;  // small segment, 2 MiB
constexpr uint64_t kSeg2 = 0x7f3a80000000;  // freed before the snapshot
constexpr int64_t kT0 = 1795937033480000;   // µs since the epoch

AllocTag make_tag(Category c, std::string_view module, std::string_view op, std::string_view phase,
                  std::source_location loc = std::source_location::current()) {
  AllocTag t;
  t.category = c;
  t.module = intern(module);
  t.op = intern(op);
  t.phase = intern(phase);
  t.loc = SourceLoc::from(loc);
  return t;
}

class SnapshotBuilder {
 public:
  SnapshotBuilder() { snap.device_traces.resize(1); }

  TraceEntry& event(TraceAction a, uint64_t addr, size_t size, const AllocTag& tag) {
    TraceEntry e;
    e.action = a;
    e.addr = addr;
    e.size = size;
    e.time_us = kT0 + static_cast<int64_t>(snap.device_traces[0].size()) * 10;
    e.tag = tag;
    snap.device_traces[0].push_back(e);
    return snap.device_traces[0].back();
  }

  // Fills the size totals of each segment from its blocks.
  void finish_segments() {
    for (SegmentInfo& s : snap.segments) {
      s.allocated_size = s.active_size = s.requested_size = 0;
      for (const BlockInfo& b : s.blocks) {
        if (b.state == BlockState::inactive) continue;
        s.active_size += b.size;
        s.requested_size += b.requested_size;
        if (b.state == BlockState::active_allocated) s.allocated_size += b.size;
      }
    }
  }

  SnapshotData snap;
};

BlockInfo block(uint64_t addr, size_t size, size_t requested, BlockState st, AllocTag tag = {}) {
  return {addr, size, requested, st, tag};
}

// Two live segments with blocks in every state, and a trace with every action: segment
// alloc/free, alloc, free_requested (pending), free_completed, a free of a block allocated
// before the trace window, a re-tag (also of a block allocated before the window), an OOM
// and a snapshot.
SnapshotData full_snapshot() {
  const AllocTag seg_tag = make_tag(Category::activation, "layer1.0", "conv2d", "forward");
  const AllocTag act = make_tag(Category::activation, "layer1.0", "conv2d", "forward");
  const AllocTag act_saved = make_tag(Category::activation, "layer1.0.relu", "relu", "forward");
  const AllocTag param = make_tag(Category::parameter, "layer1.0", "", "init");
  const AllocTag grad = make_tag(Category::gradient, "fc", "linear_backward", "backward");
  const AllocTag tmp = make_tag(Category::temporary, "", "add", "");
  const AllocTag opt = make_tag(Category::optimizer_state, "", "adam_init", "optimizer");

  SnapshotBuilder sb;
  SnapshotData& s = sb.snap;
  s.config = AllocatorConfig::parse("max_split_size_mb:128,roundup_power2_divisions:[64:8,>:2]");

  const size_t MiB = size_t{1} << 20;
  // Segment 0 (large): ghost param | activation (re-tagged) | pending-free grad | free
  //                    | opt state (retagged ghost) | free
  SegmentInfo s0;
  s0.address = kSeg0;
  s0.total_size = 4 * MiB;
  s0.tag = seg_tag;
  s0.blocks = {
      block(kSeg0, MiB, MiB - 100, BlockState::active_allocated, param),
      block(kSeg0 + MiB, MiB, MiB, BlockState::active_allocated, act_saved),
      block(kSeg0 + 2 * MiB, 512 * 1024, 500 * 1024, BlockState::active_pending_free, grad),
      block(kSeg0 + 2 * MiB + 512 * 1024, 256 * 1024, 0, BlockState::inactive),
      block(kSeg0 + 2 * MiB + 768 * 1024, 256 * 1024, 200000, BlockState::active_allocated, opt),
      block(kSeg0 + 3 * MiB, MiB, MiB, BlockState::inactive)};
  // Segment 1 (small, side stream): temporary | free
  SegmentInfo s1;
  s1.address = kSeg1;
  s1.total_size = 2 * MiB;
  s1.small = true;
  s1.stream = 817153472;
  s1.tag = tmp;
  s1.blocks = {block(kSeg1, 512, 492, BlockState::active_allocated, tmp),
               block(kSeg1 + 512, 2 * MiB - 512, 0, BlockState::inactive)};
  s.segments = {s0, s1};
  sb.finish_segments();

  // The trace starts after seg 0, its parameter block and the optimizer-state block
  // (then still an activation) were made.
  sb.event(TraceAction::free_completed, kSeg0 + 3 * MiB, 4096, tmp);  // allocated before
  sb.event(TraceAction::alloc, kSeg0 + MiB, MiB, act);
  sb.event(TraceAction::alloc, kSeg0 + 2 * MiB, 500 * 1024, grad);
  sb.event(TraceAction::segment_alloc, kSeg1, 2 * MiB, tmp).stream = 817153472;
  TraceEntry& a = sb.event(TraceAction::alloc, kSeg1, 492, tmp);
  a.stream = 817153472;
  sb.event(TraceAction::segment_alloc, kSeg2, 20 * MiB, act);
  sb.event(TraceAction::alloc, kSeg2, 3 * MiB, act);
  sb.event(TraceAction::free_requested, kSeg2, 3 * MiB, act);
  sb.event(TraceAction::free_completed, kSeg2, 3 * MiB, act);
  sb.event(TraceAction::segment_free, kSeg2, 20 * MiB, act);
  TraceEntry& r1 = sb.event(TraceAction::retag, kSeg0 + MiB, MiB, act_saved);
  r1.old_category = Category::activation;  // same category, new module/op
  TraceEntry& r2 = sb.event(TraceAction::retag, kSeg0 + 2 * MiB + 768 * 1024, 200000, opt);
  r2.old_category = Category::activation;  // allocated before the trace window
  sb.event(TraceAction::free_requested, kSeg0 + 2 * MiB, 500 * 1024, grad);
  TraceEntry& oom = sb.event(TraceAction::oom, 0, size_t{1} << 42, act);
  oom.device_free = 149148532736;
  sb.event(TraceAction::snapshot, 0, 4 * MiB, AllocTag{});
  return s;
}

class SnapshotTest : public PickleTest {
 protected:
  fs::path write(const SnapshotData& s, const char* name = "snap.pickle") {
    const fs::path p = dir_.path() / name;
    write_snapshot_file(s, p.string());
    return p;
  }

  CmdResult check(const fs::path& p, const std::string& args = "") {
    return run_command(python() + " " + script("check_snapshot.py") + " " +
                       shell_quote(p.string()) + " " + args);
  }

  // Python code run on the loaded snapshot `s`; fails the test if it raises.
  void python_asserts(const fs::path& p, const std::string& code) {
    const fs::path py = dir_.path() / "asserts.py";
    write_file(py, "import pickle, sys\ns = pickle.load(open(sys.argv[1], 'rb'))\n" + code +
                       "\nprint('ok')\n");
    const CmdResult r =
        run_command(python() + " " + shell_quote(py.string()) + " " + shell_quote(p.string()));
    EXPECT_EQ(r.status, 0) << r.output;
  }
};

TEST(SnapshotNames, BlockStates) {
  EXPECT_STREQ(block_state_name(BlockState::active_allocated), "active_allocated");
  EXPECT_STREQ(block_state_name(BlockState::active_pending_free), "active_pending_free");
  EXPECT_STREQ(block_state_name(BlockState::inactive), "inactive");
}

TEST_F(SnapshotTest, FullSnapshotPassesChecker) {
  const fs::path p = write(full_snapshot());
  const std::string bytes = read_file(p);
  ASSERT_GE(bytes.size(), 2u);
  EXPECT_EQ(bytes.substr(0, 2), bin("\x80\x02"));
  const CmdResult r = check(p, "--expect-live 4");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("check_snapshot: OK"), std::string::npos) << r.output;
  EXPECT_EQ(check(p, "--expect-live 3").status, 1);
}

TEST_F(SnapshotTest, FullSnapshotContent) {
  const fs::path p = write(full_snapshot());
  python_asserts(p, R"PY(
assert list(s) == ['segments', 'device_traces', 'allocator_settings', 'external_annotations']
assert s['external_annotations'] == []
seg0, seg1 = s['segments']
assert list(seg0) == ['device', 'address', 'total_size', 'allocated_size', 'active_size',
                      'requested_size', 'stream', 'segment_type', 'segment_pool_id',
                      'is_expandable', 'frames', 'blocks'], list(seg0)
assert seg0['address'] == 0x7f3a00000000 and seg0['segment_type'] == 'large'
assert seg0['segment_pool_id'] == (0, 0) and type(seg0['segment_pool_id']) is tuple
assert seg0['is_expandable'] is False
assert seg1['segment_type'] == 'small' and seg1['stream'] == 817153472
assert [b['state'] for b in seg0['blocks']] == ['active_allocated', 'active_allocated',
    'active_pending_free', 'inactive', 'active_allocated', 'inactive']
assert list(seg0['blocks'][0]) == ['address', 'size', 'requested_size', 'state', 'frames']
assert seg0['blocks'][3]['frames'] == []

# Frames: op at its C++ call site, module, then category + phase; shared when equal.
f = seg0['blocks'][1]['frames']
assert [x['filename'] for x in f] == ['tests/memory/test_pickle.cpp', 'module', 'category=activation'], f
assert f[0]['name'] == 'relu' and f[0]['line'] > 0
assert f[1] == {'name': 'layer1.0.relu', 'filename': 'module', 'line': 0}
assert f[2] == {'name': 'phase forward', 'filename': 'category=activation', 'line': 0}, f
p = seg0['blocks'][0]['frames']  # parameter: no op -> the C++ function, phase init
assert 'make_tag' in p[0]['name'] or 'full_snapshot' in p[0]['name'], p[0]
t = seg1['blocks'][0]['frames']  # temporary: no module, no phase
assert [x['filename'] for x in t][1:] == ['category=temporary'] and t[1]['name'] == 'phase none'
assert seg1['frames'] is t

tr = s['device_traces']
assert len(tr) == 1
acts = [e['action'] for e in tr[0]]
assert acts == ['free_completed', 'alloc', 'alloc', 'segment_alloc', 'alloc', 'segment_alloc',
                'alloc', 'free_requested', 'free_completed', 'segment_free',
                'free_requested', 'free_completed', 'alloc',
                'free_requested', 'free_completed', 'alloc',
                'free_requested', 'oom', 'snapshot'], acts
e = tr[0][1]
assert list(e) == ['action', 'addr', 'size', 'stream', 'time_us', 'compile_context',
                   'user_metadata', 'frames', 'category'], list(e)
assert e['compile_context'] == 'N/A' and e['category'] == 'activation'
assert e['user_metadata'] == 'category=activation module=layer1.0 op=conv2d phase=forward'
assert e['time_us'] == 1795937033480010
# Segment events are 'unknown'; their frames still say which request made the segment.
sa = tr[0][3]
assert sa['category'] == 'unknown' and sa['stream'] == 817153472
assert sa['user_metadata'] == 'category=unknown module= op=add phase='
assert sa['frames'][-1]['filename'] == 'category=temporary'
# Re-tags: free_requested + free_completed (old category) + alloc (new tag), same addr,
# size and time.
fr, fc, al = tr[0][13], tr[0][14], tr[0][15]
assert fr['addr'] == fc['addr'] == al['addr'] == 0x7f3a00000000 + (2 << 20) + 768 * 1024
assert fr['size'] == fc['size'] == al['size'] == 200000
assert fr['time_us'] == fc['time_us'] == al['time_us']
assert fr['category'] == fc['category'] == 'activation' and al['category'] == 'optimizer_state'
assert al['frames'] is seg0['blocks'][4]['frames']
oom = tr[0][17]
assert 'addr' not in oom and oom['device_free'] == 149148532736 and oom['size'] == 1 << 42
assert list(oom)[:3] == ['action', 'device_free', 'size']
snap = tr[0][18]
assert snap['addr'] == 0 and snap['frames'][-1]['filename'] == 'category=unknown'

st = s['allocator_settings']
assert st['PYTORCH_CUDA_ALLOC_CONF'] == 'max_split_size_mb:128,roundup_power2_divisions:[64:8,>:2]'
assert st['max_split_size'] == 128 << 20
assert type(st['garbage_collection_threshold']) is float
assert st['expandable_segments'] is False and st['pinned_num_register_threads'] == 1
r = st['roundup_power2_divisions']
assert list(r) == [str(1 << i) for i in range(16)]
assert r['1'] == 8 and r['32'] == 8 and r['64'] == 8 and r['128'] == 2 and r['32768'] == 2, r
)PY");
}

TEST_F(SnapshotTest, DefaultSettingsAndEmptyTrace) {
  SnapshotData s;
  s.device_traces.resize(2);
  SegmentInfo seg;
  seg.device = 1;
  seg.address = kSeg0;
  seg.total_size = 2 << 20;
  seg.blocks = {block(kSeg0, 2 << 20, 0, BlockState::inactive)};
  s.segments = {seg};
  const fs::path p = write(s);
  const CmdResult r = check(p, "--expect-live 0");
  EXPECT_EQ(r.status, 0) << r.output;
  python_asserts(p, R"PY(
assert s['device_traces'] == [[], []]
st = s['allocator_settings']
assert st['max_split_size'] == -1 and st['garbage_collection_threshold'] == 0.0
assert st['PYTORCH_CUDA_ALLOC_CONF'] == ''
assert set(st['roundup_power2_divisions'].values()) == {0}
)PY");
}

TEST_F(SnapshotTest, UnknownEntryAddedWhenNoEntryIsUnknown) {
  SnapshotBuilder sb;
  const AllocTag act = make_tag(Category::activation, "m", "op", "forward");
  SegmentInfo seg;
  seg.address = kSeg0;
  seg.total_size = 2 << 20;
  seg.blocks = {block(kSeg0, 1024, 1000, BlockState::active_allocated, act),
                block(kSeg0 + 1024, (2 << 20) - 1024, 0, BlockState::inactive)};
  sb.snap.segments = {seg};
  sb.finish_segments();
  sb.event(TraceAction::alloc, kSeg0, 1000, act);
  const fs::path p = write(sb.snap);
  const CmdResult r = check(p, "--expect-live 1");
  EXPECT_EQ(r.status, 0) << r.output;
  python_asserts(p, R"PY(
t = s['device_traces'][0]
assert [e['action'] for e in t] == ['alloc', 'snapshot'], t
assert t[1]['category'] == 'unknown' and t[1]['addr'] == 0 and t[1]['size'] == 1024
assert t[1]['time_us'] == t[0]['time_us']
)PY");
}

TEST_F(SnapshotTest, ManyEntriesShareFramesAndStringsAndStayBatched) {
  SnapshotBuilder sb;
  const AllocTag tags[3] = {make_tag(Category::activation, "blk.0", "matmul", "forward"),
                            make_tag(Category::gradient, "blk.0", "matmul_bw", "backward"),
                            make_tag(Category::workspace, "", "gemm", "backward")};
  const size_t n = 3000;
  const size_t bs = 512;
  SegmentInfo seg;
  seg.address = kSeg0;
  seg.total_size = n * bs;
  sb.event(TraceAction::segment_alloc, kSeg0, n * bs, tags[0]);
  for (size_t i = 0; i < n; ++i) {
    const bool live = i % 2 == 0;
    const AllocTag& tag = tags[i % 3];
    seg.blocks.push_back(block(kSeg0 + i * bs, bs, live ? 500 : 0,
                               live ? BlockState::active_allocated : BlockState::inactive, tag));
    sb.event(TraceAction::alloc, kSeg0 + i * bs, 500, tag);
    if (!live) {
      sb.event(TraceAction::free_requested, kSeg0 + i * bs, 500, tag);
      sb.event(TraceAction::free_completed, kSeg0 + i * bs, 500, tag);
    }
  }
  sb.snap.segments = {seg};
  sb.finish_segments();
  const fs::path p = write(sb.snap);
  const CmdResult r = check(p, "--expect-live 1500");
  EXPECT_EQ(r.status, 0) << r.output;
  // 7500 entries and 3000 blocks, each a dict of 5-9 keys: memo references keep this to a
  // few bytes per value.
  EXPECT_LT(fs::file_size(p), size_t{600} * 1024);
}

TEST_F(SnapshotTest, CheckerRejectsInconsistentSnapshots) {
  {  // blocks do not tile the segment
    SnapshotData s = full_snapshot();
    s.segments[1].blocks[1].size -= 512;
    const CmdResult r = check(write(s, "bad1.pickle"));
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("tile"), std::string::npos) << r.output;
  }
  {  // allocated in the trace, never freed, but the block is inactive
    SnapshotData s = full_snapshot();
    s.segments[1].blocks[0].state = BlockState::inactive;
    s.segments[1].blocks[0].requested_size = 0;
    s.segments[1].allocated_size = s.segments[1].active_size = s.segments[1].requested_size = 0;
    const CmdResult r = check(write(s, "bad2.pickle"));
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("never freed"), std::string::npos) << r.output;
  }
  {  // segment sizes that disagree with the blocks
    SnapshotData s = full_snapshot();
    s.segments[0].allocated_size += 512;
    const CmdResult r = check(write(s, "bad3.pickle"));
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("allocated_size"), std::string::npos) << r.output;
  }
  {  // a free_requested of an address that is not live (viewer pitfall 3)
    SnapshotData s = full_snapshot();
    TraceEntry e = s.device_traces[0].back();
    e.action = TraceAction::free_requested;
    e.addr = kSeg1 + 4096;
    e.size = 10;
    s.device_traces[0].push_back(e);
    const CmdResult r = check(write(s, "bad4.pickle"));
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("pitfall 3"), std::string::npos) << r.output;
  }
}

TEST(SnapshotFile, UnwritablePathThrowsNamingIt) {
  const std::string path = "/nonexistent-dir-for-tally-test/snap.pickle";
  try {
    write_snapshot_file(SnapshotData{}, path);
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tally::memory
