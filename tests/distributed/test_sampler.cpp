// DistributedSampler: shards are disjoint apart from the padding, cover the dataset, have
// equal lengths, and reshuffle per epoch identically on every rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "nn/data/distributed_sampler.h"

namespace tally::data {
namespace {

std::vector<std::vector<int64_t>> shards(int64_t n, int world, DistributedSamplerOptions o,
                                         int64_t epoch = 0) {
  std::vector<std::vector<int64_t>> out;
  for (int r = 0; r < world; ++r) {
    DistributedSampler s(n, world, r, o);
    s.set_epoch(epoch);
    out.push_back(s.indices());
  }
  return out;
}

TEST(DistributedSampler, DisjointAndCoveringWhenDivisible) {
  const auto sh = shards(12, 4, {.shuffle = true, .seed = 5});
  std::set<int64_t> all;
  for (const auto& s : sh) {
    EXPECT_EQ(s.size(), 3u);
    for (int64_t i : s) EXPECT_TRUE(all.insert(i).second) << "index " << i << " on two ranks";
  }
  EXPECT_EQ(all.size(), 12u);
  EXPECT_EQ(*all.begin(), 0);
  EXPECT_EQ(*all.rbegin(), 11);
}

TEST(DistributedSampler, PaddedToEqualLength) {
  // 10 samples, 4 ranks: 3 each, 12 in all, the first two of the order repeated.
  const auto sh = shards(10, 4, {.shuffle = false});
  EXPECT_EQ(sh[0], (std::vector<int64_t>{0, 4, 8}));
  EXPECT_EQ(sh[1], (std::vector<int64_t>{1, 5, 9}));
  EXPECT_EQ(sh[2], (std::vector<int64_t>{2, 6, 0}));
  EXPECT_EQ(sh[3], (std::vector<int64_t>{3, 7, 1}));
  DistributedSampler s(10, 4, 0, {});
  EXPECT_EQ(s.num_samples(), 3);
  EXPECT_EQ(s.total_size(), 12);
  // Tiny dataset, many ranks: padding wraps around repeatedly.
  const auto tiny = shards(2, 5, {.shuffle = false});
  for (const auto& x : tiny) EXPECT_EQ(x.size(), 1u);
  EXPECT_EQ(tiny[4], (std::vector<int64_t>{0}));
}

TEST(DistributedSampler, DropLastDropsTheTail) {
  const auto sh = shards(10, 4, {.shuffle = false, .drop_last = true});
  std::set<int64_t> all;
  for (const auto& s : sh) {
    EXPECT_EQ(s.size(), 2u);
    for (int64_t i : s) EXPECT_TRUE(all.insert(i).second);
  }
  EXPECT_EQ(all.size(), 8u);
}

TEST(DistributedSampler, ShufflePerEpochSameOnAllRanks) {
  const DistributedSamplerOptions o{.shuffle = true, .seed = 42};
  const auto e0 = shards(100, 3, o, 0);
  const auto e0_again = shards(100, 3, o, 0);
  const auto e1 = shards(100, 3, o, 1);
  EXPECT_EQ(e0, e0_again);  // every rank computes the same permutation independently
  EXPECT_NE(e0, e1);        // set_epoch reshuffles
  std::set<int64_t> cover;
  for (const auto& s : e1) cover.insert(s.begin(), s.end());
  EXPECT_EQ(cover.size(), 100u);
  // Not the identity order.
  std::vector<int64_t> r0 = e0[0];
  EXPECT_FALSE(std::is_sorted(r0.begin(), r0.end()));
  // A different seed, a different order.
  EXPECT_NE(shards(100, 3, {.shuffle = true, .seed = 43}, 0), e0);
}

TEST(DistributedSampler, BadArgumentsAreErrors) {
  EXPECT_THROW(DistributedSampler(10, 2, 2), std::invalid_argument);
  EXPECT_THROW(DistributedSampler(10, 0, 0), std::invalid_argument);
  EXPECT_THROW(DistributedSampler(-1, 2, 0), std::invalid_argument);
}

}  // namespace
}  // namespace tally::data
