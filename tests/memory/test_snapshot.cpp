// The allocator's snapshot, read back by Python's own pickle: its segments and blocks
// agree with the live state, and replaying device_traces reproduces the live blocks
// (tests/memory/check_snapshot.py).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "memory/caching_allocator.h"
#include "memory/cpu_provider.h"
#include "memory/fake_provider.h"
#include "testing/files.h"

namespace tally::memory {
namespace {

namespace fs = std::filesystem;
using namespace tally::testing;

// One line per block, from the C++ side.
std::string canonical(const SnapshotData& s) {
  std::string out;
  for (const SegmentInfo& seg : s.segments) {
    out += "segment " + std::to_string(seg.address) + " " + std::to_string(seg.total_size) + " " +
           std::to_string(seg.allocated_size) + " " + (seg.small ? "small" : "large") + "\n";
    for (const BlockInfo& b : seg.blocks) {
      out += "  block " + std::to_string(b.address) + " " + std::to_string(b.size) + " " +
             block_state_name(b.state) + "\n";
    }
  }
  return out;
}

// The same lines, from Python's pickle.load of the file.
std::string canonical_from_python(const fs::path& file) {
  const std::string py =
      "import pickle,sys\n"
      "d=pickle.load(open(sys.argv[1],'rb'))\n"
      "for s in d['segments']:\n"
      "  print('segment',s['address'],s['total_size'],s['allocated_size'],s['segment_type'])\n"
      "  for b in s['blocks']:\n"
      "    print('  block',b['address'],b['size'],b['state'])\n";
  return run_python(py, file.string());
}

std::string checker() {
  return std::string(TALLY_SOURCE_DIR) + "/tests/memory/check_snapshot.py";
}

void workload(CachingAllocator& alloc, std::vector<void*>& live, uint64_t seed, int steps) {
  std::mt19937_64 rng(seed);
  for (int i = 0; i < steps; ++i) {
    const auto cat = kAllCategories[rng() % 9];
    AllocContextScope ctx(cat, i % 3 ? "layer1.0" : "fc", i % 2 ? "conv2d" : "add",
                          i % 4 ? "forward" : "backward");
    if (live.empty() || rng() % 5 < 3) {
      const size_t n = rng() % 4 == 0 ? (rng() % (24 * kMiB)) + 1 : (rng() % 300000) + 1;
      live.push_back(alloc.allocate(n, rng() % 2));
    } else {
      const size_t k = rng() % live.size();
      if (rng() % 6 == 0) {
        alloc.retag(live[k], Category::activation);
      } else {
        alloc.deallocate(live[k]);
        live[k] = live.back();
        live.pop_back();
      }
    }
    if (i == steps / 2) alloc.empty_cache();
  }
}

TEST(Snapshot, PythonReadsWhatTheAllocatorHolds) {
  CachingAllocator alloc(std::make_unique<CpuProvider>(size_t{2} << 30), AllocatorConfig{});
  alloc.record_memory_history(true, 100000);
  std::vector<void*> live;
  workload(alloc, live, 7, 600);
  const SnapshotData snap = alloc.snapshot();
  const fs::path file = fs::temp_directory_path() / "tally_test_snapshot.pickle";
  write_snapshot_file(snap, file.string());
  EXPECT_EQ(canonical_from_python(file), canonical(snap));
  int status = 0;
  const std::string out = run(std::string(TALLY_PYTHON) + " " + checker() + " " + file.string() +
                                  " --expect-live " + std::to_string(live.size()),
                              &status);
  EXPECT_EQ(status, 0) << out;
  for (void* p : live) alloc.deallocate(p);
}

TEST(Snapshot, RingBufferWindowStillReplays) {
  // A small ring: the trace starts mid-history; blocks allocated before it are "initially
  // allocated" for the replay, as in PyTorch's viewer.
  CachingAllocator alloc(std::make_unique<testing::FakeProvider>(size_t{8} << 30),
                         AllocatorConfig{});
  alloc.record_memory_history(true, 150);
  std::vector<void*> live;
  workload(alloc, live, 11, 800);
  const fs::path file = fs::temp_directory_path() / "tally_test_snapshot_ring.pickle";
  alloc.dump_snapshot(file.string());
  int status = 0;
  const std::string out =
      run(std::string(TALLY_PYTHON) + " " + checker() + " " + file.string(), &status);
  EXPECT_EQ(status, 0) << out;
  for (void* p : live) alloc.deallocate(p);
}

TEST(Snapshot, DumpToBadPathNamesThePath) {
  CachingAllocator alloc(std::make_unique<testing::FakeProvider>(size_t{1} << 30),
                         AllocatorConfig{});
  try {
    alloc.dump_snapshot("/nonexistent-dir/x.pickle");
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/x.pickle"), std::string::npos);
  }
}

}  // namespace
}  // namespace tally::memory
