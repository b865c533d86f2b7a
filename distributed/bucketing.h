// Gradient bucketing for DistributedDataParallel, as plain bookkeeping (no tensors, no
// devices touched), so it is testable anywhere:
//   - compute_bucket_assignment: which parameters share an all-reduce bucket. Parameters
//     are visited in `order` (default: the REVERSE of model.parameters(), because backward
//     produces the last layers' gradients first, as PyTorch's Reducer does); a bucket holds
//     one dtype on one device only; it closes before a parameter that would push it past
//     its cap, and a parameter at least as large as the cap gets a bucket of its own. The
//     first bucket of each (dtype, device) may have a smaller cap (PyTorch's 1 MiB
//     first_bucket_cap), so the first all-reduce starts early in backward.
//   - BucketReadiness: which buckets may be launched as gradients become ready. Buckets
//     launch strictly in index order (every rank must issue the same collectives in the
//     same order), a bucket once all its parameters are ready and all earlier buckets
//     have launched. It also records the order in which parameters became ready, from
//     which buckets are rebuilt after the first iteration (rebuild_order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "tensor/tensor.h"

namespace tally::distributed {

struct ParamSpec {
  int64_t numel = 0;
  DType dtype = DType::float32;
  Device device;
  size_t nbytes() const { return static_cast<size_t>(numel) * dtype_size(dtype); }
};

struct BucketAssignment {
  // buckets[b]: the parameter indices of bucket b, in the order they were visited.
  std::vector<std::vector<size_t>> buckets;
  // bucket_of[p]: the bucket holding parameter p.
  std::vector<size_t> bucket_of;
};

// `order`: a permutation of [0, params.size()); empty means reverse parameter order.
// cap_bytes > 0; first_cap_bytes == 0 means "same as cap_bytes".
BucketAssignment compute_bucket_assignment(const std::vector<ParamSpec>& params, size_t cap_bytes,
                                           size_t first_cap_bytes = 0,
                                           const std::vector<size_t>& order = {});

// The visiting order for a rebuild: the parameters in the order they became ready, then
// those that never did (reverse parameter order), each once.
std::vector<size_t> rebuild_order(const std::vector<size_t>& ready_order, size_t num_params);

class BucketReadiness {
 public:
  BucketReadiness() = default;
  explicit BucketReadiness(const BucketAssignment& assignment);

  // Marks parameter p ready; returns the buckets that may launch now, in order. Throws
  // std::logic_error if p was already ready in this iteration.
  std::vector<size_t> mark_ready(size_t p);
  bool is_ready(size_t p) const { return ready_.at(p); }
  // Parameters not yet ready, ascending.
  std::vector<size_t> unready_params() const;
  // Buckets launched so far this iteration.
  size_t launched() const { return next_launch_; }
  bool all_launched() const { return next_launch_ == pending_.size(); }
  // Parameters in the order they became ready this iteration.
  const std::vector<size_t>& ready_order() const { return ready_order_; }
  // A new iteration: nothing ready.
  void reset();

 private:
  const BucketAssignment* assignment_ = nullptr;
  std::vector<bool> ready_;
  std::vector<size_t> pending_;  // per bucket: parameters not yet ready
  size_t next_launch_ = 0;
  std::vector<size_t> ready_order_;
};

}  // namespace tally::distributed
