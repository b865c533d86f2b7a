// DistributedSampler (torch.utils.data.distributed.DistributedSampler): the indices of a
// dataset that one rank of a data-parallel job visits in an epoch. Every rank gets the
// same number of samples: without drop_last the shuffled order is padded by repeating its
// first indices up to a multiple of the world size; with drop_last the tail is dropped.
// Rank r takes positions r, r + R, r + 2R, ... of that order, so the shards are disjoint
// (apart from the padding) and together cover the dataset. The shuffle depends only on
// seed + epoch (set_epoch), so all ranks agree without communicating.
//
//   data::DistributedSampler sampler(dataset.size(), world, rank, {.shuffle = true, .seed = 1});
//   sampler.set_epoch(epoch);
//   for (int64_t i : sampler.indices()) ...
#pragma once

#include <cstdint>
#include <vector>

namespace tally::data {

struct DistributedSamplerOptions {
  bool shuffle = true;
  uint64_t seed = 0;
  bool drop_last = false;
};

class DistributedSampler {
 public:
  // Throws std::invalid_argument when rank is outside [0, num_replicas) or a size is negative.
  DistributedSampler(int64_t dataset_size, int num_replicas, int rank,
                     DistributedSamplerOptions options = {});

  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }
  // Samples this rank visits per epoch, and over all ranks (num_samples * num_replicas).
  int64_t num_samples() const { return num_samples_; }
  int64_t total_size() const { return num_samples_ * num_replicas_; }
  int64_t size() const { return num_samples_; }
  int64_t dataset_size() const { return dataset_size_; }
  // This rank's indices for the current epoch, in visiting order.
  std::vector<int64_t> indices() const;

 private:
  int64_t dataset_size_;
  int num_replicas_;
  int rank_;
  DistributedSamplerOptions options_;
  int64_t epoch_ = 0;
  int64_t num_samples_ = 0;
};

}  // namespace tally::data
