// DataLoader: batches of a Dataset, shuffled per epoch by a seeded Generator, assembled
// ahead of time by a background thread and handed out as a range:
//
//   data::DataLoader loader(dataset, {.batch_size = 64, .shuffle = true, .seed = 1,
//                                     .device = Device::cuda(0)});
//   for (const data::Example& batch : loader) step(batch.input, batch.target);
//
// With `.sampler = data::DistributedSampler(dataset.size(), world, rank, {...})` each rank
// iterates its own shard (same number of batches on every rank).
// The worker, pinned memory, epochs and errors: docs/notes.md §27.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "nn/data/dataset.h"
#include "nn/data/distributed_sampler.h"
#include "tensor/random.h"

namespace tally::data {

struct DataLoaderOptions {
  int64_t batch_size = 1;
  bool shuffle = false;
  uint64_t seed = 0;
  // The last batch of an epoch has n % batch_size examples when that is not 0: kept (a short
  // batch) without drop_last, dropped with it. So a batch larger than the dataset gives one
  // short batch per epoch without drop_last and no batch at all with it; an empty dataset
  // gives no batch either way. An epoch without a batch is len() == 0 and a loop over the
  // loader that ends at once: a caller that loops until a number of steps must check len().
  bool drop_last = false;
  Device device = Device::cpu();
  // Assemble batches in pinned host memory when `device` is CUDA (ignored otherwise).
  bool pin_memory = true;
  // Batches the worker keeps ready ahead of the consumer (>= 1).
  int64_t prefetch = 2;
  // Data parallel: visit only this rank's shard (PyTorch's DataLoader(sampler=...)). The
  // loader's epoch e uses the sampler's epoch e (no separate set_epoch call needed); the
  // sampler shuffles, so `shuffle` must stay false; its dataset size must be the dataset's.
  std::optional<DistributedSampler> sampler = std::nullopt;
};

// A uniform random permutation of [0, n) (Fisher-Yates over `gen`'s Philox stream),
// torch.randperm. Consumes n values of `gen`.
std::vector<int64_t> randperm(int64_t n, Generator& gen);

class DataLoader {
 public:
  // `dataset` must outlive the loader; it is read from the worker thread.
  DataLoader(const Dataset& dataset, DataLoaderOptions options = {});
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Number of batches in an epoch.
  int64_t len() const;
  int64_t size() const { return len(); }
  const DataLoaderOptions& options() const { return options_; }
  // The epoch the next begin() starts (0 first); set_epoch replays or skips epochs.
  int64_t epoch() const { return next_epoch_; }
  void set_epoch(int64_t epoch) { next_epoch_ = epoch; }
  // The order in which epoch `e` visits the dataset (identity without shuffle).
  std::vector<int64_t> epoch_order(int64_t e) const;
  // Whether batches are assembled in pinned host memory.
  bool pinned() const;

  struct Sentinel {};
  class Iterator {
   public:
    using value_type = Example;
    using difference_type = std::ptrdiff_t;
    const Example& operator*() const { return current_; }
    const Example* operator->() const { return &current_; }
    Iterator& operator++();
    bool operator==(Sentinel) const { return done_; }

   private:
    friend class DataLoader;
    Iterator(DataLoader* loader, uint64_t generation);
    DataLoader* loader_;
    uint64_t generation_;
    Example current_;
    bool done_ = false;
  };
  // Starts the next epoch (stopping an unfinished one) and returns its first batch.
  Iterator begin();
  Sentinel end() const { return {}; }

  // Stops the worker of the current epoch and frees the batches it assembled.
  void stop();

 private:
  struct Item {
    Example batch;
    std::string error;  // non-empty: the worker failed on this batch
  };

  void worker_main(std::vector<int64_t> order, int64_t epoch);
  // The next batch of generation `gen`, on the target device; false at the end.
  bool next(uint64_t gen, Example& out);

  const Dataset& dataset_;
  DataLoaderOptions options_;
  int64_t next_epoch_ = 0;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stop_ = false;
  bool done_ = false;
  uint64_t generation_ = 0;
  std::thread worker_;
};

}  // namespace tally::data
