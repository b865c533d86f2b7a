// DDP's bucket bookkeeping without devices: assignment (reverse order, caps, one dtype and
// device a bucket, large parameters alone), launch order as gradients become ready, and
// the rebuild order when a gradient is missing.
#include <gtest/gtest.h>

#include <numeric>

#include "distributed/bucketing.h"

namespace tally::distributed {
namespace {

ParamSpec f32(int64_t numel) {
  return {numel, DType::float32, Device::cpu()};
}

size_t bucket_bytes(const std::vector<ParamSpec>& p, const std::vector<size_t>& members) {
  size_t n = 0;
  for (size_t i : members) n += p[i].nbytes();
  return n;
}

TEST(Bucketing, ReverseOrderAndCapRespected) {
  // Ten parameters of 100 floats (400 bytes); cap 1000 bytes: two parameters a bucket.
  std::vector<ParamSpec> p(10, f32(100));
  const BucketAssignment a = compute_bucket_assignment(p, 1000);
  ASSERT_EQ(a.buckets.size(), 5u);
  EXPECT_EQ(a.buckets[0], (std::vector<size_t>{9, 8}));  // the last layers first
  EXPECT_EQ(a.buckets[4], (std::vector<size_t>{1, 0}));
  for (const auto& b : a.buckets) EXPECT_LE(bucket_bytes(p, b), 1000u);
  for (size_t i = 0; i < p.size(); ++i) {
    const auto& b = a.buckets[a.bucket_of[i]];
    EXPECT_NE(std::find(b.begin(), b.end(), i), b.end());
  }
}

TEST(Bucketing, ExactFitClosesTheBucket) {
  std::vector<ParamSpec> p(4, f32(250));  // 1000 bytes each
  const BucketAssignment a = compute_bucket_assignment(p, 2000);
  ASSERT_EQ(a.buckets.size(), 2u);
  EXPECT_EQ(a.buckets[0], (std::vector<size_t>{3, 2}));
  EXPECT_EQ(a.buckets[1], (std::vector<size_t>{1, 0}));
}

TEST(Bucketing, ParameterLargerThanCapGetsItsOwnBucket) {
  std::vector<ParamSpec> p = {f32(10), f32(10), f32(1000), f32(10), f32(10)};  // 4000-byte giant
  const BucketAssignment a = compute_bucket_assignment(p, 100);
  ASSERT_EQ(a.buckets.size(), 3u);
  EXPECT_EQ(a.buckets[0], (std::vector<size_t>{4, 3}));
  EXPECT_EQ(a.buckets[1], (std::vector<size_t>{2}));
  EXPECT_EQ(a.buckets[2], (std::vector<size_t>{1, 0}));
}

TEST(Bucketing, DtypesAndDevicesNeverMix) {
  std::vector<ParamSpec> p = {f32(10),
                              {10, DType::float16, Device::cpu()},
                              f32(10),
                              {10, DType::float16, Device::cpu()},
                              {10, DType::float32, Device::cuda(0)}};
  const BucketAssignment a = compute_bucket_assignment(p, 1 << 20);
  ASSERT_EQ(a.buckets.size(), 3u);
  for (const auto& b : a.buckets)
    for (size_t i : b) {
      EXPECT_EQ(p[i].dtype, p[b.front()].dtype);
      EXPECT_EQ(p[i].device, p[b.front()].device);
    }
  // Buckets come in the order their first (reverse-order) parameter was met.
  EXPECT_EQ(a.buckets[0], (std::vector<size_t>{4}));
  EXPECT_EQ(a.buckets[1], (std::vector<size_t>{3, 1}));
  EXPECT_EQ(a.buckets[2], (std::vector<size_t>{2, 0}));
}

TEST(Bucketing, FirstBucketCap) {
  std::vector<ParamSpec> p(6, f32(100));  // 400 bytes each
  const BucketAssignment a = compute_bucket_assignment(p, 1200, 400);
  ASSERT_EQ(a.buckets.size(), 3u);
  EXPECT_EQ(a.buckets[0], (std::vector<size_t>{5}));
  EXPECT_EQ(a.buckets[1], (std::vector<size_t>{4, 3, 2}));
  EXPECT_EQ(a.buckets[2], (std::vector<size_t>{1, 0}));
}

TEST(Bucketing, ExplicitOrderAndErrors) {
  std::vector<ParamSpec> p(3, f32(100));
  const BucketAssignment a = compute_bucket_assignment(p, 800, 0, {1, 0, 2});
  ASSERT_EQ(a.buckets.size(), 2u);
  EXPECT_EQ(a.buckets[0], (std::vector<size_t>{1, 0}));
  EXPECT_EQ(a.buckets[1], (std::vector<size_t>{2}));
  EXPECT_THROW(compute_bucket_assignment(p, 800, 0, {1, 1, 2}), std::invalid_argument);
  EXPECT_THROW(compute_bucket_assignment(p, 800, 0, {0, 1}), std::invalid_argument);
  EXPECT_THROW(compute_bucket_assignment(p, 0), std::invalid_argument);
}

TEST(BucketReadiness, LaunchesInBucketOrderOnly) {
  std::vector<ParamSpec> p(6, f32(100));
  const BucketAssignment a = compute_bucket_assignment(p, 800);  // {5,4} {3,2} {1,0}
  BucketReadiness r(a);
  EXPECT_TRUE(r.mark_ready(3).empty());
  EXPECT_TRUE(r.mark_ready(2).empty());  // bucket 1 full, but bucket 0 has not launched
  EXPECT_TRUE(r.mark_ready(5).empty());
  EXPECT_EQ(r.mark_ready(4), (std::vector<size_t>{0, 1}));  // both, in order
  EXPECT_EQ(r.launched(), 2u);
  EXPECT_TRUE(r.mark_ready(0).empty());
  EXPECT_EQ(r.unready_params(), (std::vector<size_t>{1}));
  EXPECT_EQ(r.mark_ready(1), (std::vector<size_t>{2}));
  EXPECT_TRUE(r.all_launched());
  EXPECT_EQ(r.ready_order(), (std::vector<size_t>{3, 2, 5, 4, 0, 1}));
  EXPECT_THROW(r.mark_ready(1), std::logic_error);  // twice in one iteration
  r.reset();
  EXPECT_EQ(r.launched(), 0u);
  EXPECT_EQ(r.unready_params().size(), 6u);
  EXPECT_TRUE(r.ready_order().empty());
}

TEST(BucketReadiness, RebuildFollowsReadyOrderMissingLast) {
  // Parameter 2 got no gradient: it goes after the ready ones; the rest keep ready order.
  const std::vector<size_t> order = rebuild_order({5, 4, 3, 1, 0}, 6);
  EXPECT_EQ(order, (std::vector<size_t>{5, 4, 3, 1, 0, 2}));
  EXPECT_EQ(rebuild_order({}, 3), (std::vector<size_t>{2, 1, 0}));
  EXPECT_EQ(rebuild_order({0, 0, 2}, 3), (std::vector<size_t>{0, 2, 1}));
  EXPECT_THROW(rebuild_order({7}, 3), std::invalid_argument);

  std::vector<ParamSpec> p(6, f32(100));
  const BucketAssignment a = compute_bucket_assignment(p, 800, 0, order);
  EXPECT_EQ(a.buckets[0], (std::vector<size_t>{5, 4}));
  EXPECT_EQ(a.buckets[1], (std::vector<size_t>{3, 1}));
  EXPECT_EQ(a.buckets[2], (std::vector<size_t>{0, 2}));
}

TEST(Bucketing, SizesAddUp) {
  std::vector<ParamSpec> p;
  for (int i = 1; i <= 50; ++i) p.push_back(f32(i * 37 % 211 + 1));
  const size_t cap = 1500;
  const BucketAssignment a = compute_bucket_assignment(p, cap);
  size_t total = 0, count = 0;
  for (const auto& b : a.buckets) {
    const size_t bytes = bucket_bytes(p, b);
    if (b.size() > 1) {
      EXPECT_LE(bytes, cap);
    }
    total += bytes;
    count += b.size();
  }
  EXPECT_EQ(count, p.size());
  size_t expect = 0;
  for (const auto& s : p) expect += s.nbytes();
  EXPECT_EQ(total, expect);
}

}  // namespace
}  // namespace tally::distributed
