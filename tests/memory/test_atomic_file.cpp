// write_file_atomic: a write cut short (a file-size limit standing in for a full disk, or an
// exception in the writer) leaves the previous file intact byte for byte and no temporary
// file behind; errors name the path and the errno text; permissions and symbolic links are
// kept; concurrent writers never interleave.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>
#include <vector>

#include "base/atomic_file.h"
#include "memory/snapshot.h"
#include "testing/file_limit.h"
#include "testing/files.h"

namespace tally::memory {
namespace {

namespace fs = std::filesystem;

using namespace tally::testing;

// A fresh, empty folder per test.
fs::path fresh_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path d = fs::temp_directory_path() / ("tally_atomic_" + std::to_string(::getpid())) /
                     (std::string(info->test_suite_name()) + "." + info->name());
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::set<std::string> names_in(const fs::path& d) {
  std::set<std::string> s;
  for (const auto& e : fs::directory_iterator(d)) s.insert(e.path().filename().string());
  return s;
}

// `n` bytes that differ from position to position (a shifted copy would not compare equal).
std::string pattern(size_t n, char seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(seed + i * 7 + i / 251);
  return s;
}

TEST(AtomicFile, WritesThenReplaces) {
  const fs::path d = fresh_dir();
  const fs::path f = d / "out.bin";
  base::write_file_atomic(f.string(), pattern(100000, 'a'), "test");
  EXPECT_EQ(read_file(f), pattern(100000, 'a'));
  // A shorter second version replaces the first completely (no tail of the old one).
  base::write_file_atomic(
      f.string(), [](std::ostream& out) { out << "short"; }, "test");
  EXPECT_EQ(read_file(f), "short");
  base::write_file_atomic(f.string(), std::string_view(), "test");  // empty files are files too
  EXPECT_TRUE(fs::exists(f));
  EXPECT_EQ(fs::file_size(f), 0u);
  EXPECT_EQ(names_in(d), std::set<std::string>{"out.bin"});
}

TEST(AtomicFile, FileSizeLimitLeavesPreviousFileIntact) {
  const fs::path d = fresh_dir();
  const fs::path f = d / "weights.bin";
  const std::string good = pattern(3000, 'g');
  base::write_file_atomic(f.string(), good, "test");

  // Streamed in small pieces, as the pickle and trace writers do, and as one block of bytes;
  // both pass the 8 KiB limit part way.
  const std::string big = pattern(200000, 'b');
  const testing::LimitedRun streamed = testing::run_with_file_size_limit(8192, [&] {
    base::write_file_atomic(
        f.string(),
        [&](std::ostream& out) {
          for (size_t i = 0; i < big.size(); i += 100) out.write(big.data() + i, 100);
        },
        "streamed_writer");
  });
  const testing::LimitedRun block = testing::run_with_file_size_limit(
      8192, [&] { base::write_file_atomic(f.string(), big, "block_writer"); });

  for (const auto* r : {&streamed, &block}) {
    ASSERT_TRUE(r->threw) << "status " << r->status << ": " << r->what;
    EXPECT_TRUE(contains(r->what, "'" + f.string() + "'")) << r->what;
    EXPECT_TRUE(contains(r->what, std::strerror(EFBIG))) << r->what;
    EXPECT_TRUE(contains(r->what, "is unchanged")) << r->what;
  }
  EXPECT_TRUE(contains(streamed.what, "streamed_writer: cannot write")) << streamed.what;
  EXPECT_TRUE(contains(block.what, "block_writer: cannot write")) << block.what;
  EXPECT_EQ(read_file(f), good);
  EXPECT_EQ(names_in(d), std::set<std::string>{"weights.bin"});

  // The same limit with a write that fits succeeds: the limit is what failed above.
  const testing::LimitedRun fits = testing::run_with_file_size_limit(
      8192, [&] { base::write_file_atomic(f.string(), pattern(4000, 'c'), "test"); });
  EXPECT_TRUE(WIFEXITED(fits.status) && WEXITSTATUS(fits.status) == 0) << fits.what;
  EXPECT_EQ(read_file(f), pattern(4000, 'c'));
}

TEST(AtomicFile, WriterThatThrowsLeavesPreviousFileIntact) {
  const fs::path d = fresh_dir();
  const fs::path f = d / "report.html";
  base::write_file_atomic(f.string(), "<html>good</html>", "test");
  try {
    base::write_file_atomic(
        f.string(),
        [](std::ostream& out) {
          out << pattern(150000, 'x');  // past the stream's buffer: bytes reach the temp file
          throw std::logic_error("halfway");
        },
        "test");
    FAIL() << "no exception";
  } catch (const std::logic_error& e) {  // the writer's own exception, unchanged
    EXPECT_STREQ(e.what(), "halfway");
  }
  EXPECT_EQ(read_file(f), "<html>good</html>");
  EXPECT_EQ(names_in(d), std::set<std::string>{"report.html"});

  // Without a previous file there is nothing afterwards, not an empty or partial file.
  const fs::path g = d / "new.bin";
  EXPECT_THROW(base::write_file_atomic(
                   g.string(), [](std::ostream&) { throw std::runtime_error("no"); }, "test"),
               std::runtime_error);
  EXPECT_FALSE(fs::exists(g));
  EXPECT_EQ(names_in(d), std::set<std::string>{"report.html"});
}

TEST(AtomicFile, ErrorsNameThePathAndTheReason) {
  const fs::path d = fresh_dir();
  const std::string missing = (d / "no-such-folder" / "x.pickle").string();
  try {
    base::write_file_atomic(missing, "x", "dump_snapshot");
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    const std::string w = e.what();
    EXPECT_TRUE(contains(w, "dump_snapshot: cannot write '" + missing + "'")) << w;
    EXPECT_TRUE(contains(w, std::strerror(ENOENT))) << w;
  }
  try {
    base::write_file_atomic(d.string(), "x", "test");
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), d.string()) && contains(e.what(), std::strerror(EISDIR)))
        << e.what();
  }
  EXPECT_THROW(base::write_file_atomic("", "x", "test"), std::invalid_argument);
  EXPECT_TRUE(names_in(d).empty());
}

TEST(AtomicFile, KeepsPermissionsAndFollowsSymlinks) {
  const fs::path d = fresh_dir();
  const fs::path f = d / "w.safetensors";
  base::write_file_atomic(f.string(), "one", "test");
  const mode_t mask = ::umask(0);
  ::umask(mask);
  EXPECT_EQ(fs::status(f).permissions(), static_cast<fs::perms>(0666 & ~mask));

  fs::permissions(f, static_cast<fs::perms>(0640));
  base::write_file_atomic(f.string(), "two", "test");
  EXPECT_EQ(read_file(f), "two");
  EXPECT_EQ(fs::status(f).permissions(), static_cast<fs::perms>(0640));

  // latest -> w.safetensors (relative): the file behind the link is replaced, the link stays.
  const fs::path link = d / "latest";
  fs::create_symlink("w.safetensors", link);
  base::write_file_atomic(link.string(), "three", "test");
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(read_file(f), "three");
  // A dangling link names the file to create, as an ordinary open would.
  fs::create_symlink(d / "target.bin", d / "dangling");
  base::write_file_atomic((d / "dangling").string(), "four", "test");
  EXPECT_TRUE(fs::is_symlink(d / "dangling"));
  EXPECT_EQ(read_file(d / "target.bin"), "four");
  EXPECT_EQ(names_in(d),
            (std::set<std::string>{"dangling", "latest", "target.bin", "w.safetensors"}));
}

TEST(AtomicFile, DeviceTargetIsWrittenInPlace) {
  // /dev/null cannot be replaced by a rename (and must not be): it is written in place.
  EXPECT_NO_THROW(base::write_file_atomic("/dev/null", pattern(100000, 'n'), "test"));
}

TEST(AtomicFile, ConcurrentWritersNeverInterleave) {
  const fs::path d = fresh_dir();
  const fs::path f = d / "trace.json";
  std::vector<std::string> versions;
  for (char c = 'a'; c < 'a' + 4; ++c) versions.push_back(pattern(300000, c));
  std::vector<std::thread> threads;
  for (const std::string& v : versions)
    threads.emplace_back([&f, &v] {
      for (int i = 0; i < 5; ++i) base::write_file_atomic(f.string(), v, "test");
    });
  for (auto& t : threads) t.join();
  const std::string got = read_file(f);
  EXPECT_NE(std::find(versions.begin(), versions.end(), got), versions.end())
      << "the file is a mix of versions (" << got.size() << " bytes)";
  EXPECT_EQ(names_in(d), std::set<std::string>{"trace.json"});
}

// The snapshot writer through the helper: a cut-short dump keeps the previous snapshot.
TEST(AtomicFile, SnapshotWriteCutShortKeepsPreviousSnapshot) {
  const fs::path d = fresh_dir();
  const fs::path f = d / "snap.pickle";
  SnapshotData small;
  write_snapshot_file(small, f.string());
  const std::string good = read_file(f);
  ASSERT_GT(good.size(), 16u);

  SnapshotData big;  // many segments: a pickle far past the limit below
  for (int i = 0; i < 2000; ++i) {
    SegmentInfo s;
    s.address = 0x10000000u + static_cast<uint64_t>(i) * 0x200000u;
    s.total_size = 0x200000;
    s.blocks.push_back(BlockInfo{});
    s.blocks.back().address = s.address;
    s.blocks.back().size = s.total_size;
    big.segments.push_back(s);
  }
  const testing::LimitedRun r = testing::run_with_file_size_limit(
      static_cast<rlim_t>(good.size()) + 64, [&] { write_snapshot_file(big, f.string()); });
  ASSERT_TRUE(r.threw) << "status " << r.status << ": " << r.what;
  EXPECT_TRUE(contains(r.what, f.string()) && contains(r.what, std::strerror(EFBIG))) << r.what;
  EXPECT_EQ(read_file(f), good);
  EXPECT_EQ(names_in(d), std::set<std::string>{"snap.pickle"});
}

// Issue 54: a save killed half-way left its "<target>.tmpXXXXXX" behind for good. The next
// write of the target removes the temporary files no live writer holds (their flock), and
// keeps a live writer's, in this process or another.
TEST(AtomicFile, StaleTemporaryFilesAreRemovedAtTheNextWrite) {
  const fs::path d = fresh_dir();
  const fs::path f = d / "w.safetensors";
  auto spit = [](const fs::path& p, const std::string& s) { std::ofstream(p) << s; };
  spit(d / "w.safetensors.tmpAb12Cd", "left by a killed save");
  spit(d / ".tally-tmpXy34Zw", "left by a killed save of a long name");
  spit(d / "w.safetensors.tmpToolong1", "not a temporary name");
  spit(d / "other.bin.tmpAb12Cd", "another target's");
  // A live writer's file: locked through another open file description.
  spit(d / "w.safetensors.tmpLive00", "being written");
  const int live = ::open((d / "w.safetensors.tmpLive00").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(live, 0);
  ASSERT_EQ(::flock(live, LOCK_EX | LOCK_NB), 0);
  base::write_file_atomic(f.string(), pattern(1000, 'w'), "test");
  EXPECT_EQ(names_in(d), (std::set<std::string>{"w.safetensors", "w.safetensors.tmpToolong1",
                                                "other.bin.tmpAb12Cd", "w.safetensors.tmpLive00"}));
  ::close(live);  // the writer is gone: the next write removes its file
  base::write_file_atomic(f.string(), pattern(1000, 'v'), "test");
  EXPECT_EQ(names_in(d), (std::set<std::string>{"w.safetensors", "w.safetensors.tmpToolong1",
                                                "other.bin.tmpAb12Cd"}));
  EXPECT_EQ(read_file(f), pattern(1000, 'v'));
}

// A writer process in the middle of its write keeps its temporary file while another process
// writes the same target; killed with SIGKILL, its file goes at the next write.
TEST(AtomicFile, KilledWritersTemporaryFileGoesAtTheNextWrite) {
  const fs::path d = fresh_dir();
  const fs::path f = d / "big.bin";
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    try {
      base::write_file_atomic(
          f.string(),
          [](std::ostream& out) {
            out << "half";
            out.flush();
            for (;;) ::pause();  // killed here, half-way
          },
          "test");
    } catch (...) {
    }
    ::_exit(1);
  }
  auto temps = [&] {
    std::set<std::string> t;
    for (const std::string& n : names_in(d))
      if (n.starts_with("big.bin.tmp")) t.insert(n);
    return t;
  };
  // Wait until the child has written into its file: it holds the file's lock by then (a file
  // seen before the lock may be taken by a cleanup, and its writer picks another name).
  auto written = [&] {
    for (const std::string& n : temps()) {
      std::error_code ec;
      if (fs::file_size(d / n, ec) >= 4 && !ec) return true;
    }
    return false;
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!written() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const std::set<std::string> writing = temps();
  ASSERT_EQ(writing.size(), 1u);
  base::write_file_atomic(f.string(), pattern(100, 'a'), "test");  // a concurrent write
  EXPECT_EQ(temps(), writing) << "a live writer's temporary file was removed";
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_EQ(temps(), writing);  // left behind by the kill
  base::write_file_atomic(f.string(), pattern(100, 'b'), "test");
  EXPECT_TRUE(temps().empty());
  EXPECT_EQ(names_in(d), std::set<std::string>{"big.bin"});
  EXPECT_EQ(read_file(f), pattern(100, 'b'));
}

// The check before a run of a target written in place: /dev/full fails when written (issue 54:
// it passed a look at its permissions and failed after training).
TEST(AtomicFile, InPlaceTargetsAreProbedByWriting) {
  EXPECT_EQ(base::probe_in_place_write("/dev/null"), 0);
  if (fs::exists("/dev/full")) EXPECT_EQ(base::probe_in_place_write("/dev/full"), ENOSPC);
  EXPECT_EQ(base::probe_in_place_write("/nonexistent/x"), ENOENT);
  const fs::path fifo = fresh_dir() / "fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(base::probe_in_place_write(fifo.string()), 0);  // no reader yet: it may come
}

}  // namespace
}  // namespace tally::memory
