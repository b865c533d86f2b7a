// Out of memory on the CPU under a memory fraction: the oom_snapshot post-mortem is written
// with history off and named by the error, and the same process then trains a smaller batch
// (tests/memory/oom_recovery.h; the CUDA twin is in tests/memory/test_allocator_cuda.cpp).
#include <gtest/gtest.h>

#include "memory/oom_recovery.h"

namespace tally {
namespace {

TEST(OutOfMemory, CpuSnapshotThenSmallerBatchTrains) {
  // GPT "tiny" at 64 x 64 tokens peaks near 56 MiB reserved, at 4 x 64 under 16 MiB.
  testing::expect_oom_then_recovery(Device::cpu(), 32 * memory::kMiB, 64, 4);
}

}  // namespace
}  // namespace tally
