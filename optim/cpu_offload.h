// CpuOffload: AdamW (or AdamW8bit) with its state in host memory, torchao's CPUOffloadOptimizer
// and ZeRO-Offload's single-GPU recipe. The model's weights and gradients stay on the device
// (float32, or bfloat16 / float16 weights made with Module::to(dtype)); the float32 master
// weights and both moments live in pinned host memory from the pinned caching allocator
// (memory::get_pinned_allocator()), tagged `optimizer_state`, as flat runs in the
// parameter's memory order. A step:
//   1. each gradient goes to a pinned host buffer (`gradient`) on the device's copy stream.
//      With `overlap_backward`, a post-accumulate-grad hook sends it as soon as backward has
//      accumulated it, in buckets of about `bucket_bytes`, so the copies overlap with the rest
//      of backward; step() sends what the hooks did not (or what changed since: clipping and
//      unscaling rewrite gradients in place, which their version counter shows);
//   2. bucket by bucket, once its copies are done (the host waits on its fence), AdamW runs on
//      the host over every core (optim/cpu_adam.h: bit-identical to the CPU backend's AdamW);
//   3. the updated weights are cast to the parameter's dtype on the host and copied back to
//      the device on the copy stream while the next bucket updates; Tally's stream waits for
//      them (an event, no host wait) before the next forward reads them.
// On the CPU the copies are plain copies and the steps equal AdamW's (or AdamW8bit's) bit for
// bit; on a meta device (dry runs) the state is allocated on the host of the target (meta:0
// for a GPU target) and the copies are timed on its copy stream.
//
//   optim::CpuOffload opt(model->parameters());            // AdamW's defaults
//   for (...) { loss.backward(); opt.step(); opt.zero_grad(); }
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "optim/adam.h"
#include "optim/adamw8bit.h"
#include "tensor/pinned.h"

namespace tally::nn {
class Module;
}

namespace tally::optim {

struct CpuOffloadOptions {
  // AdamW8bit's block-wise 8-bit moments on the host (parameters under quant.min_8bit_size
  // keep float32 ones), instead of AdamW's float32 moments.
  bool adamw8bit = false;
  AdamW8bitOptions quant = {};
  // Send gradients during backward (post-accumulate-grad hooks) rather than at step().
  bool overlap_backward = true;
  // Gradients sent together (one fence the host waits on before updating them).
  int64_t bucket_bytes = int64_t{32} << 20;
};

class CpuOffload : public Optimizer {
 public:
  // `options` as AdamW's (lr, betas, eps, weight_decay, amsgrad, maximize); capturable is
  // refused (the update runs on the host).
  CpuOffload(std::vector<Tensor> params, AdamOptions options = AdamW::default_options(),
             CpuOffloadOptions offload = {});
  CpuOffload(std::vector<ParamGroup> groups, AdamOptions defaults, CpuOffloadOptions offload = {});
  ~CpuOffload() override;  // removes the hooks
  const char* name() const override {
    return offload_.adamw8bit ? "CpuOffload(AdamW8bit)" : "CpuOffload(AdamW)";
  }

  const CpuOffloadOptions& offload_options() const { return offload_; }

  // RAII, as DistributedDataParallel::no_sync: while alive, backward's gradients are not final
  // (gradient accumulation: more micro-batches follow), so the hooks do not send them; the last
  // micro-batch's backward, outside the guard, sends the accumulated ones.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(CpuOffload& o) : o_(o), prev_(o.sync_) { o_.sync_ = false; }
    ~NoSyncGuard() { o_.sync_ = prev_; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    CpuOffload& o_;
    bool prev_;
  };
  NoSyncGuard no_sync() { return NoSyncGuard(*this); }
  // Makes every trainable parameter's master weights and moments now, from the parameters as
  // they are (otherwise the first step does). Call it before converting float32 weights to 16 bits
  // on the device, so that the masters keep the float32 values:
  //   opt.init_masters(); model.to(DType::bfloat16);
  void init_masters();
  // init_masters(), then every float32 parameter of `model` (trainable or frozen) becomes
  // `dtype` (float16 or bfloat16) where it lives, in place (nn::set_data: the modules, hooks and
  // this optimizer keep the same tensors), and the device's cached float32 segments are given
  // back. The device then holds 16-bit weights and gradients while the float32 masters stay on
  // the host: train_* --amp bf16 --optimizer adamw:cpu. Parameters of other dtypes are left.
  void keep_16bit_weights(nn::Module& model, DType dtype = DType::bfloat16);
  // Gradients sent by the hooks, and buckets sent (hooks' and step()'s), since construction.
  int64_t hooked_copies() const { return hooked_copies_; }
  int64_t buckets_sent() const { return buckets_sent_; }

 protected:
  void update_group(const ParamGroup& group, const std::vector<size_t>& indices) override;
  void check_options(const GroupOptions& o) const override;
  void check_parameter(const Tensor& p, size_t index) const override;
  std::optional<StateSpec> state_spec(size_t index, const std::string& name) const override;

 private:
  struct Staged {
    Tensor host_grad;  // the gradient on the host (the CPU gradient itself on the CPU)
    bool owned;        // host_grad is this optimizer's buffer (it may be overwritten)
    const void* key;   // the device gradient's storage and version when it was sent
    uint64_t version;
    uint64_t bucket;
    bool weights_ready = false;  // host_grad holds the updated weights (parameter's dtype)
  };
  struct Bucket {
    std::vector<size_t> indices;
    ops::CopyFence fence;
  };
  void install_hooks();
  void on_grad_ready(size_t index);
  void send(size_t index, uint64_t bucket);  // step 1 for one parameter
  void close_bucket(std::vector<size_t> indices);
  void flush_pending();
  bool fresh(size_t index) const;
  bool is_8bit(size_t index) const;
  DType master_dtype(size_t index) const;
  void init_state(const std::vector<size_t>& indices,
                  bool amsgrad);  // master copies and zero moments
  void update_on_host(const ParamGroup& group, const std::vector<size_t>& indices);
  void write_back(size_t index);  // step 3 for one parameter

  CpuOffloadOptions offload_;
  std::vector<std::pair<Tensor, uint64_t>> hooks_;
  std::vector<std::optional<Staged>> staged_;  // by global parameter index
  std::map<uint64_t, Bucket> buckets_;         // in the order they were sent
  uint64_t next_bucket_ = 0;
  std::vector<size_t> pending_;  // sent by the hooks, bucket not closed yet
  int64_t pending_bytes_ = 0;
  int64_t hooked_copies_ = 0, buckets_sent_ = 0;
  bool sync_ = true;  // false under no_sync()
};

}  // namespace tally::optim
