// Out of memory in the middle of training, and the same process training on: what the CPU
// test (tests/nn/test_out_of_memory.cpp) and the CUDA one (tests/memory/test_allocator_cuda.cpp)
// share. The device's allocator is capped with set_memory_fraction, oom_snapshot is set and
// history is off; a batch too large runs out, a smaller one then trains.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "autograd/ops.h"
#include "memory/invariants.h"
#include "memory/memory.h"
#include "nn/models/gpt.h"
#include "optim/adam.h"
#include "testing/files.h"

namespace tally::testing {

// Two AdamW steps of GPT "tiny" on `d` with batches of `batch` x 64 tokens; the last loss.
inline double train_tiny_gpt(Device d, int64_t batch) {
  manual_seed(0);
  auto model = std::make_shared<nn::GPT>(nn::GPTConfig::preset("tiny"));
  model->to(d);
  optim::AdamW opt(model->parameters(), optim::AdamOptions{.lr = 1e-3});
  Tensor x, y;
  {
    memory::CategoryScope input(memory::Category::input);
    x = ops::randint(0, 256, {batch, 64}, DType::int64, d);
    y = ops::randint(0, 256, {batch, 64}, DType::int64, d);
  }
  double loss_value = 0;
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad(true);
    Tensor loss;
    {
      memory::PhaseScope phase("forward");
      loss = (*model)(x, y).second;
    }
    {
      memory::PhaseScope phase("backward");
      loss.backward();
    }
    opt.step();
    loss_value = loss.item();
  }
  return loss_value;
}

// Caps `d` at what its allocator holds now plus `headroom`; `big` must run out there, with
// the oom_snapshot file written (history off) and named by the error; then `small` trains in
// the same process. The cap and the settings are put back.
inline void expect_oom_then_recovery(Device d, size_t headroom, int64_t big, int64_t small) {
  namespace fs = std::filesystem;
  memory::CachingAllocator& alloc = memory::get_allocator(d);
  const fs::path snap = fs::temp_directory_path() /
                        ("tally_oom_" + d.str() + "_" + std::to_string(::getpid()) + ".pickle");
  fs::remove(snap);
  memory::AllocatorConfig conf = alloc.config();
  conf.oom_snapshot_path = snap.string();
  alloc.set_config(conf);
  alloc.record_memory_history(false);
  alloc.empty_cache();
  const size_t total = alloc.provider().total_memory();
  const size_t cap = alloc.memory_reserved() + headroom;
  alloc.set_memory_fraction(static_cast<double>(cap) / static_cast<double>(total));

  std::string message;
  try {
    train_tiny_gpt(d, big);
    ADD_FAILURE() << "batch " << big << " trained under a cap of " << cap << " bytes";
  } catch (const memory::OutOfMemoryError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("Snapshot written to " + snap.string()), std::string::npos) << message;
  EXPECT_EQ(alloc.fragmentation().last_oom.requested > 0, true);
  memory::testing::expect_consistent(alloc);

  // The snapshot: the viewer's format, no trace, the live blocks with their tags.
  EXPECT_TRUE(fs::exists(snap));
  int status = 0;
  const std::string python = TALLY_PYTHON;
  std::string out =
      run(python + " " + TALLY_SOURCE_DIR + "/tests/memory/check_snapshot.py " + snap.string(),
          &status);
  EXPECT_EQ(status, 0) << out;
  out = run(python +
                " -c \"import pickle,sys; d=pickle.load(open(sys.argv[1],'rb')); "
                "assert all(t==[] for t in d['device_traces']); "
                "print(sorted({f['filename'] for s in d['segments'] for b in s['blocks'] "
                "if b['state']=='active_allocated' for f in b['frames'] "
                "if f['filename'].startswith('category=')}))\" " +
                snap.string(),
            &status);
  EXPECT_EQ(status, 0) << out;
  for (const char* category : {"'category=parameter'", "'category=activation'"})
    EXPECT_NE(out.find(category), std::string::npos) << out;

  // The same process trains on with a smaller batch, under the same cap.
  double loss = 0;
  EXPECT_NO_THROW(loss = train_tiny_gpt(d, small));
  EXPECT_TRUE(std::isfinite(loss) && loss > 0) << loss;
  EXPECT_LE(alloc.memory_reserved(), cap);
  memory::testing::expect_consistent(alloc);

  alloc.set_memory_fraction(1.0);
  alloc.set_config(memory::AllocatorConfig::from_env());
  alloc.empty_cache();
  fs::remove(snap);
}

}  // namespace tally::testing
