#include "distributed/bucketing.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <tuple>

namespace tally::distributed {

BucketAssignment compute_bucket_assignment(const std::vector<ParamSpec>& params, size_t cap_bytes,
                                           size_t first_cap_bytes,
                                           const std::vector<size_t>& order_in) {
  if (cap_bytes == 0)
    throw std::invalid_argument("compute_bucket_assignment: bucket cap must be > 0 bytes");
  if (first_cap_bytes == 0) first_cap_bytes = cap_bytes;
  const size_t n = params.size();
  std::vector<size_t> order = order_in;
  if (order.empty()) {
    order.resize(n);
    for (size_t i = 0; i < n; ++i) order[i] = n - 1 - i;
  }
  std::vector<bool> seen(n, false);
  if (order.size() != n)
    throw std::invalid_argument(fmt::format(
        "compute_bucket_assignment: order has {} entries for {} parameters", order.size(), n));
  for (size_t p : order) {
    if (p >= n || seen[p])
      throw std::invalid_argument(fmt::format(
          "compute_bucket_assignment: order is not a permutation (index {} of {})", p, n));
    seen[p] = true;
  }

  // One open bucket per (dtype, device); a bucket's position is fixed when it opens, so the
  // buckets come out in the order their first parameter was visited.
  struct Open {
    size_t index;  // in `out.buckets`
    size_t bytes;
    size_t cap;
  };
  using Key = std::tuple<int, int, int>;
  std::map<Key, Open> open;
  std::map<Key, bool> had_bucket;
  BucketAssignment out;
  out.bucket_of.assign(n, 0);
  for (size_t p : order) {
    const ParamSpec& s = params[p];
    const Key key{static_cast<int>(s.dtype), static_cast<int>(s.device.type), s.device.index};
    const size_t bytes = s.nbytes();
    auto it = open.find(key);
    if (it != open.end() && it->second.bytes + bytes > it->second.cap) {
      open.erase(it);  // would overflow: close it, this parameter starts the next
      it = open.end();
    }
    if (it == open.end()) {
      const size_t cap = had_bucket[key] ? cap_bytes : first_cap_bytes;
      had_bucket[key] = true;
      out.buckets.emplace_back();
      it = open.emplace(key, Open{out.buckets.size() - 1, 0, cap}).first;
    }
    out.buckets[it->second.index].push_back(p);
    out.bucket_of[p] = it->second.index;
    it->second.bytes += bytes;
    if (it->second.bytes >= it->second.cap) open.erase(it);  // full (or one large parameter)
  }
  return out;
}

std::vector<size_t> rebuild_order(const std::vector<size_t>& ready_order, size_t num_params) {
  std::vector<bool> seen(num_params, false);
  std::vector<size_t> order;
  order.reserve(num_params);
  for (size_t p : ready_order) {
    if (p >= num_params)
      throw std::invalid_argument(fmt::format("rebuild_order: parameter {} of {}", p, num_params));
    if (!seen[p]) {
      seen[p] = true;
      order.push_back(p);
    }
  }
  for (size_t i = num_params; i-- > 0;)
    if (!seen[i]) order.push_back(i);
  return order;
}

BucketReadiness::BucketReadiness(const BucketAssignment& assignment) : assignment_(&assignment) {
  reset();
}

void BucketReadiness::reset() {
  if (!assignment_) return;
  ready_.assign(assignment_->bucket_of.size(), false);
  pending_.resize(assignment_->buckets.size());
  for (size_t b = 0; b < pending_.size(); ++b) pending_[b] = assignment_->buckets[b].size();
  next_launch_ = 0;
  ready_order_.clear();
}

std::vector<size_t> BucketReadiness::mark_ready(size_t p) {
  if (!assignment_ || p >= ready_.size())
    throw std::out_of_range(
        fmt::format("BucketReadiness::mark_ready: parameter {} out of range", p));
  if (ready_[p])
    throw std::logic_error(
        fmt::format("Expected to mark a variable ready only once (parameter index {}). This "
                    "happens when a parameter is used "
                    "by several reentrant backward passes, or by backward twice in one iteration "
                    "without no_sync()",
                    p));
  ready_[p] = true;
  ready_order_.push_back(p);
  --pending_[assignment_->bucket_of[p]];
  std::vector<size_t> launch;
  while (next_launch_ < pending_.size() && pending_[next_launch_] == 0)
    launch.push_back(next_launch_++);
  return launch;
}

std::vector<size_t> BucketReadiness::unready_params() const {
  std::vector<size_t> out;
  for (size_t p = 0; p < ready_.size(); ++p)
    if (!ready_[p]) out.push_back(p);
  return out;
}

}  // namespace tally::distributed
