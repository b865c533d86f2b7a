#include "nn/data/distributed_sampler.h"

#include <fmt/format.h>

#include <stdexcept>

#include "base/check_arg.h"
#include "nn/data/dataloader.h"
#include "tensor/random.h"

namespace tally::data {

DistributedSampler::DistributedSampler(int64_t dataset_size, int num_replicas, int rank,
                                       DistributedSamplerOptions options)
    : dataset_size_(dataset_size), num_replicas_(num_replicas), rank_(rank), options_(options) {
  base::check_at_least(num_replicas, 1, "DistributedSampler: num_replicas");
  if (rank < 0 || rank >= num_replicas)
    throw std::invalid_argument(
        fmt::format("DistributedSampler: invalid rank {}, rank should be in the interval [0, {}]",
                    rank, num_replicas - 1));
  if (dataset_size < 0)
    throw std::invalid_argument(
        fmt::format("DistributedSampler: negative dataset size {}", dataset_size));
  if (options_.drop_last && dataset_size % num_replicas != 0) {
    num_samples_ =
        (dataset_size - num_replicas + num_replicas - 1) / num_replicas;  // ceil((N - R) / R)
    if (num_samples_ < 0) num_samples_ = 0;
  } else {
    num_samples_ = (dataset_size + num_replicas - 1) / num_replicas;  // ceil(N / R)
  }
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> order;
  if (options_.shuffle) {
    Generator gen(options_.seed + static_cast<uint64_t>(epoch_));
    order = randperm(dataset_size_, gen);
  } else {
    order.resize(static_cast<size_t>(dataset_size_));
    for (int64_t i = 0; i < dataset_size_; ++i) order[static_cast<size_t>(i)] = i;
  }
  const size_t total = static_cast<size_t>(total_size());
  if (!options_.drop_last) {
    // Pad by repeating the order from its start (several times over if it is short).
    const size_t n = order.size();
    for (size_t i = 0; order.size() < total && n > 0; ++i) order.push_back(order[i % n]);
  } else {
    order.resize(total);
  }
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  for (size_t i = static_cast<size_t>(rank_); i < total; i += static_cast<size_t>(num_replicas_))
    mine.push_back(order[i]);
  return mine;
}

}  // namespace tally::data
