// DDP at world size 1 on CUDA: the wrapper's loss curve and gradients equal the plain
// model's over a few SGD steps, and the bucket buffers show up in the allocator history
// under `communication` (module `ddp`, op `allreduce_bucket`).
#include <gtest/gtest.h>

#include "ddp_testing.h"
#include "memory/memory.h"
#include "testing/cuda_testing.h"

namespace tally {
namespace {

TEST(DDPCuda, WorldSizeOneMatchesThePlainModel) {
  REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  auto plain = testing::make_mlp(7, dev);
  auto wrapped = testing::make_mlp(7, dev);
  auto pg = distributed::init_process_group(dev, distributed::DistEnv{});
  distributed::DistributedDataParallel ddp(wrapped, pg,
                                           {.bucket_cap_mb = 0.002, .first_bucket_cap_mb = 0.0005});
  ASSERT_GT(ddp.num_buckets(), 2u);
  const auto a = testing::train(*plain, nullptr, 5, dev);
  const auto b = testing::train(*wrapped, &ddp, 5, dev);
  for (size_t s = 0; s < a.losses.size(); ++s) {
    EXPECT_EQ(a.losses[s], b.losses[s]) << "step " << s;
    EXPECT_EQ(a.grads[s], b.grads[s]) << "step " << s;
  }
  EXPECT_LT(b.losses.back(), b.losses.front());
}

TEST(DDPCuda, BucketsInTheHistoryAsCommunication) {
  REQUIRE_GPU();
  const Device dev = Device::cuda(0);
  memory::CachingAllocator& alloc = memory::get_allocator(dev);
  alloc.record_memory_history(true, 100000);
  auto model = testing::make_mlp(3, dev);
  auto pg = distributed::init_process_group(dev, distributed::DistEnv{});
  size_t comm_bytes = 0;
  {
    distributed::DistributedDataParallel ddp(model, pg, {.bucket_cap_mb = 0.004});
    testing::train(*model, &ddp, 2, dev);
    EXPECT_GE(alloc.stats().cat_bytes(memory::Category::communication).peak,
              static_cast<int64_t>(ddp.bucket_bytes()));
    for (const memory::TraceEntry& e : alloc.history())
      if (e.action == memory::TraceAction::alloc &&
          e.tag.category == memory::Category::communication) {
        EXPECT_EQ(memory::interned(e.tag.module), "ddp");
        EXPECT_EQ(memory::interned(e.tag.op), "allreduce_bucket");
        comm_bytes += e.size;
      }
  }
  alloc.record_memory_history(false);
  size_t param_bytes = 0;
  for (const Tensor& p : model->parameters()) param_bytes += p.nbytes();
  // Allocated once at construction and once more at the rebuild.
  EXPECT_GE(comm_bytes, 2 * param_bytes);
  EXPECT_NE(memory::memory_summary(dev).find("communication"), std::string::npos);
}

}  // namespace
}  // namespace tally
