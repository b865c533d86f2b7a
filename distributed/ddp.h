// DistributedDataParallel: data parallelism over a ProcessGroup, after torch's
// nn.parallel.DistributedDataParallel.
//
//   auto pg = distributed::init_process_group(Device::cuda(env.local_rank));
//   distributed::DistributedDataParallel ddp(model, pg, {.bucket_cap_mb = 25});
//   Tensor loss = loss_fn(ddp(x), y);       // forward = the model's forward
//   loss.backward();                        // grads all-reduced (averaged) in buckets
//   opt.step();
// Use, buckets, hooks, memory tags and errors: docs/notes.md §8.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "distributed/bucketing.h"
#include "distributed/process_group.h"
#include "nn/module.h"

namespace tally::distributed {

struct DDPOptions {
  double bucket_cap_mb = 25.0;
  double first_bucket_cap_mb = 1.0;  // 0: same as bucket_cap_mb
  bool broadcast_buffers = true;     // rank 0's buffers to all ranks before each forward
  bool find_unused_parameters = false;
  bool rebuild_buckets = true;  // once, after the first iteration, in ready order
};

class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> pg,
                          DDPOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // The module's forward (with buffer broadcast first).
  Tensor operator()(const Tensor& x) {
    return forward([&] { return (*module_)(x); });
  }
  // For modules with another signature: runs fn() as the forward,
  //   auto [logits, loss] = ddp.forward([&] { return gpt(idx, targets); });
  template <typename Fn>
  auto forward(Fn&& fn) -> decltype(fn()) {
    prepare_forward();
    return fn();
  }

  nn::Module& module() { return *module_; }
  const std::shared_ptr<nn::Module>& module_ptr() const { return module_; }
  ProcessGroup& process_group() { return *pg_; }

  // RAII: while alive, backward does not communicate (gradient accumulation).
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DistributedDataParallel& ddp) : ddp_(ddp), prev_(ddp.sync_) {
      ddp_.sync_ = false;
    }
    ~NoSyncGuard() { ddp_.sync_ = prev_; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool prev_;
  };
  NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  // ---- introspection (tests, reports) ----
  // The parameters DDP reduces (requires_grad ones, model.parameters() order).
  const std::vector<Tensor>& parameters() const { return params_; }
  const std::vector<std::string>& parameter_names() const { return names_; }
  const BucketAssignment& bucket_assignment() const { return assignment_; }
  size_t num_buckets() const { return buckets_.size(); }
  // Bucket b's flat buffer (communication category).
  const Tensor& bucket_buffer(size_t b) const { return buckets_.at(b).buffer; }
  size_t bucket_bytes() const;  // all bucket buffers together
  bool buckets_rebuilt() const { return rebuilt_; }
  // All-reduces launched since construction.
  int64_t num_allreduces() const { return num_allreduces_; }
  // Parameters in the order their gradients became ready in the last synced backward.
  const std::vector<size_t>& last_ready_order() const { return last_ready_order_; }

 private:
  struct Bucket {
    std::vector<size_t> params;
    std::vector<int64_t> offsets;  // element offset of each parameter in `buffer`
    DType dtype = DType::float32;
    Device device;
    int64_t numel = 0;
    Tensor buffer;
    std::shared_ptr<Work> work;
  };

  void build_buckets(const std::vector<size_t>& order);
  void broadcast_buffers();
  void prepare_forward();
  void on_grad_ready(size_t p);
  void launch(size_t b);
  void finish_backward();
  void reset_iteration();
  Tensor slice_of(size_t p) const;  // param p's view into its bucket
  std::string unused_parameters_error(const std::vector<size_t>& unused) const;

  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<ProcessGroup> pg_;
  DDPOptions options_;
  std::vector<Tensor> params_;
  std::vector<std::string> names_;
  std::vector<ParamSpec> specs_;
  std::vector<uint64_t> hook_handles_;
  BucketAssignment assignment_;
  BucketReadiness readiness_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> slot_;  // slot_[p]: index of p within its bucket
  bool sync_ = true;
  bool in_backward_ = false;
  bool rebuilt_ = false;
  int64_t iteration_ = 0;
  int64_t num_allreduces_ = 0;
  std::vector<size_t> last_ready_order_;
  // Buffers broadcast before each forward, coalesced: one flat tensor per dtype.
  struct BufferGroup {
    std::vector<Tensor> buffers;
    Tensor flat;
  };
  std::vector<BufferGroup> buffer_groups_;
};

using DDP = DistributedDataParallel;

}  // namespace tally::distributed
