#include "nn/data/dataloader.h"

#include <fmt/format.h>

#include <numeric>
#include <stdexcept>

#include "base/check_arg.h"
#include "memory/context.h"
#include "memory/memory.h"
#include "tensor/pinned.h"

namespace tally::data {

std::vector<int64_t> randperm(int64_t n, Generator& gen) {
  base::check_at_least(n, 0, "randperm: n");
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), int64_t{0});
  const PhiloxState s = gen.reserve(static_cast<uint64_t>(n));
  for (int64_t i = n - 1; i > 0; --i) {
    // Value k of the reserved range: word k % 4 of Philox block offset + k / 4.
    const auto k = static_cast<uint64_t>(i);
    const uint32_t r = philox4x32(s.offset + k / 4, 0, s.seed)[k % 4];
    const auto j =
        static_cast<int64_t>((static_cast<uint64_t>(r) * static_cast<uint64_t>(i + 1)) >> 32);
    std::swap(p[static_cast<size_t>(i)], p[static_cast<size_t>(j)]);
  }
  return p;
}

DataLoader::DataLoader(const Dataset& dataset, DataLoaderOptions options)
    : dataset_(dataset), options_(options) {
  base::check_at_least(options_.batch_size, 1, "DataLoader: batch_size");
  base::check_at_least(options_.prefetch, 1, "DataLoader: prefetch");
  if (options_.sampler && options_.shuffle)
    throw std::invalid_argument(
        "DataLoader: sampler option is mutually exclusive with shuffle (the sampler shuffles)");
  if (options_.sampler && options_.sampler->dataset_size() != dataset_.size())
    throw std::invalid_argument(
        fmt::format("DataLoader: the sampler covers {} samples but the dataset has {}",
                    options_.sampler->dataset_size(), dataset_.size()));
  if (options_.device.type == DeviceType::cuda)
    memory::get_allocator(options_.device);  // throws now for a device that does not exist
}

DataLoader::~DataLoader() {
  stop();
}

int64_t DataLoader::len() const {
  const int64_t n = options_.sampler ? options_.sampler->num_samples() : dataset_.size(),
                b = options_.batch_size;
  return options_.drop_last ? n / b : (n + b - 1) / b;
}

bool DataLoader::pinned() const {
  return options_.pin_memory && options_.device.type == DeviceType::cuda &&
         memory::pinned_memory_available();
}

std::vector<int64_t> DataLoader::epoch_order(int64_t e) const {
  if (options_.sampler) {  // this rank's shard of epoch e
    DistributedSampler s = *options_.sampler;
    s.set_epoch(e);
    return s.indices();
  }
  const int64_t n = dataset_.size();
  if (!options_.shuffle) {
    std::vector<int64_t> p(static_cast<size_t>(n));
    std::iota(p.begin(), p.end(), int64_t{0});
    return p;
  }
  // One generator seeded with `seed` that reserves n values per epoch: epoch e starts at
  // the offset e epochs of draws leave it at.
  Generator gen(options_.seed);
  gen.set_state(
      PhiloxState{options_.seed, static_cast<uint64_t>(e) * ((static_cast<uint64_t>(n) + 3) / 4)});
  return randperm(n, gen);
}

void DataLoader::stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  std::deque<Item> drop;
  {
    std::lock_guard lock(mu_);
    drop.swap(queue_);
    done_ = true;
  }
  // `drop` frees the assembled batches here, outside the lock.
}

DataLoader::Iterator DataLoader::begin() {
  stop();
  const int64_t e = next_epoch_++;
  std::vector<int64_t> order = epoch_order(e);
  uint64_t gen;
  {
    std::lock_guard lock(mu_);
    stop_ = false;
    done_ = false;
    gen = ++generation_;
  }
  worker_ = std::thread(&DataLoader::worker_main, this, std::move(order), e);
  return Iterator(this, gen);
}

void DataLoader::worker_main(std::vector<int64_t> order, int64_t epoch) {
  // The allocation context is per thread: this thread's batches are `input` too.
  memory::AllocContextScope context(memory::Category::input, {}, "DataLoader");
  const bool pin = pinned();
  const int64_t batches = len(), b = options_.batch_size, n = static_cast<int64_t>(order.size());
  for (int64_t k = 0; k < batches; ++k) {
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock,
               [&] { return stop_ || static_cast<int64_t>(queue_.size()) < options_.prefetch; });
      if (stop_) return;
    }
    const int64_t lo = k * b, hi = std::min(n, lo + b);
    std::vector<int64_t> idx(order.begin() + lo, order.begin() + hi);
    Item item;
    try {
      item.batch = dataset_.get_batch(idx, pin);
    } catch (const std::exception& ex) {
      item.error = fmt::format(
          "DataLoader: worker failed on batch {} of {} of epoch {} (dataset "
          "indices {}{}): {}",
          k, batches, epoch, idx.empty() ? -1 : idx.front(),
          idx.size() > 1 ? fmt::format(" .. {}", idx.back()) : "", ex.what());
    } catch (...) {
      item.error = fmt::format(
          "DataLoader: worker failed on batch {} of {} of epoch {}: unknown "
          "exception",
          k, batches, epoch);
    }
    const bool failed = !item.error.empty();
    {
      std::lock_guard lock(mu_);
      if (stop_) return;
      queue_.push_back(std::move(item));
      if (failed) done_ = true;
    }
    cv_.notify_all();
    if (failed) return;
  }
  {
    std::lock_guard lock(mu_);
    done_ = true;
  }
  cv_.notify_all();
}

bool DataLoader::next(uint64_t gen, Example& out) {
  Item item;
  {
    std::unique_lock lock(mu_);
    if (gen != generation_)
      throw std::logic_error(
          "DataLoader: this iterator's epoch was ended by a later begin() or stop()");
    cv_.wait(lock, [&] { return !queue_.empty() || done_; });
    if (queue_.empty()) return false;
    item = std::move(queue_.front());
    queue_.pop_front();
    if (!item.error.empty()) done_ = true;
  }
  cv_.notify_all();
  if (!item.error.empty()) {
    stop();
    throw std::runtime_error(item.error);
  }
  if (options_.device.type == DeviceType::cpu) {
    out = std::move(item.batch);
  } else {
    out.input = ops::to_device_async(item.batch.input, options_.device, memory::Category::input);
    out.target = ops::to_device_async(item.batch.target, options_.device, memory::Category::input);
    // The pinned host batch is released here; its blocks stay out of reuse until the
    // copies that read them have completed (record_stream in to_device_async).
  }
  return true;
}

DataLoader::Iterator::Iterator(DataLoader* loader, uint64_t generation)
    : loader_(loader), generation_(generation) {
  ++*this;
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  current_ = Example{};  // release the previous batch before the next arrives
  done_ = !loader_->next(generation_, current_);
  return *this;
}

}  // namespace tally::data
