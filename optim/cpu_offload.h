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
//      unscaling rewrite gradients in place, which their version counter shows; this class's
//      clip_grad_norm_ does not, it scales on the host);
//   2. bucket by bucket, once its copies are done (the host waits on its fence), AdamW runs on
//      the host over every core (optim/cpu_adam.h: bit-identical to the CPU backend's AdamW);
//   3. the updated weights are cast to the parameter's dtype on the host and copied back to
//      the device on the copy stream while the next bucket updates; Tally's stream waits for
//      them (an event, no host wait) before the next forward reads them.
// With overlap_with_forward(model), step() updates buckets as above only while gradients are
// still on their way (the device still runs backward, or clipped gradients stream back); once
// the last one is on the host it returns, and steps 2 and 3 of each remaining parameter run
// when the next forward first calls its module (a forward pre-hook), in the forward's order: the
// host updates layer k while the device runs the forward of the layers before it. The gain is
// bounded by the first micro-batch's forward (docs/architecture.md). On the CPU the copies are
// plain copies and the steps equal AdamW's (or AdamW8bit's) bit for bit; on a meta device (dry
// runs) the state is allocated on the host of the target (meta:0 for a GPU target) and the copies
// are timed on its copy stream.
//
//   optim::CpuOffload opt(model->parameters());            // AdamW's defaults
//   for (...) { loss.backward(); opt.step(); opt.zero_grad(); }
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
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
  // Gradients step() sent: those the hooks did not, or changed since (clip_grad_norm_ and
  // unscale_ rewrite them; CpuOffload::clip_grad_norm_ does not).
  int64_t step_copies() const { return step_copies_; }
  // From now on, once a step's gradients are all on the host, the parameters it has not updated
  // yet wait for the next forward to call a module of `model` that holds them, or the block
  // around it (Module::is_checkpoint_block: a block's forward may read
  // its children's weights directly): a forward pre-hook on each such module (nn::Module's
  // hooks; each does nothing once this optimizer is gone). Every trainable parameter of this
  // optimizer must be a parameter of a module of `model`, and no gradient may be sent yet (call
  // it before the first backward). Results equal the undeferred steps' bit for bit, but a
  // parameter is current only once its module is called or finish_updates() has run: call that
  // before reading weights outside the model's forward (saving them, say). A gradient for a
  // parameter whose update is still pending (a forward read it without calling its module) is
  // an error. step(), state_dict(), load_state_dict() and the destructor finish pending updates
  // first. On the CPU, gradients are copied for the deferred update (zero_grad(false) could
  // zero them in place before it).
  void overlap_with_forward(nn::Module& model);
  // FSDP's clip_grad_norm_ for this optimizer (DeepSpeed's ZeRO-Offload clips in its host step
  // too): the total norm of its parameters' gradients, computed on the device as
  // optim::clip_grad_norm_ computes it, and read by the host (one synchronisation); the next
  // step() then updates with each gradient times min(1, max_norm / (norm + 1e-6)), rounded to
  // the gradient's dtype: the gradient clip_grad_norm_ would have left, so the steps equal
  // clip_grad_norm_ and step() bit for bit. The device's gradients are left as they are, so those
  // the hooks sent during backward are not sent again. Returns the norm as clip_grad_norm_ does.
  // A gradient changed between the two is an error at step(); a GradScaler that skips the step
  // drops the coefficient (on_skipped_step). On a meta device (a dry run) the norm has no
  // value: the coefficient is 1, and the host waits for the device as the read would.
  Tensor clip_grad_norm_(double max_norm, double norm_type = 2.0);
  bool overlaps_forward() const { return defer_; }
  // Runs every deferred update and copy back now.
  void finish_updates() { finish_deferred_updates(); }
  // Parameters whose update waits, and those updated by forward pre-hooks since construction.
  size_t deferred_updates() const {
    return static_cast<size_t>(
        std::count_if(deferred_at_.begin(), deferred_at_.end(), [](uint64_t d) { return d != 0; }));
  }
  int64_t updates_in_forward() const { return updates_in_forward_; }

 protected:
  void update_group(const ParamGroup& group, const std::vector<size_t>& indices) override;
  void check_options(const GroupOptions& o) const override;
  void check_parameter(const Tensor& p, size_t index) const override;
  std::optional<StateSpec> state_spec(size_t index, const std::string& name) const override;
  void finish_deferred_updates() override;
  void on_skipped_step() override;

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
  void fit_param_count();  // per-parameter vectors sized as num_params() (add_param_group)
  void install_hooks();
  void on_grad_ready(size_t index);
  void check_not_pending(size_t index) const;  // throws when its update is deferred
  void send(size_t index, uint64_t bucket);    // step 1 for one parameter
  void close_bucket(std::vector<size_t> indices);
  void flush_pending();
  bool fresh(size_t index) const;
  bool is_8bit(size_t index) const;
  DType master_dtype(size_t index) const;
  void init_state(const std::vector<size_t>& indices,
                  bool amsgrad);  // master copies and zero moments
  void update_on_host(AdamHyper h, const std::vector<size_t>& indices);
  void check_clipped(size_t index) const;  // throws if changed since clip_grad_norm_
  void write_back(size_t index);           // step 3 for one parameter
  // Steps 2 and 3 for those of `indices` whose update waits, by group; Tally's stream waits for
  // their copies back. Returns how many ran.
  size_t run_deferred(const std::vector<size_t>& indices);
  void before_forward(const std::vector<size_t>& indices);

  CpuOffloadOptions offload_;
  std::vector<std::pair<Tensor, uint64_t>> hooks_;
  std::vector<std::optional<Staged>> staged_;  // by global parameter index
  std::map<uint64_t, Bucket> buckets_;         // in the order they were sent
  uint64_t next_bucket_ = 0;
  std::vector<size_t> pending_;  // sent by the hooks, bucket not closed yet
  int64_t pending_bytes_ = 0;
  int64_t hooked_copies_ = 0, buckets_sent_ = 0, step_copies_ = 0;
  bool sync_ = true;  // false under no_sync()
  // clip_grad_norm_: per parameter, the gradient's storage and version it measured; the
  // coefficient; and, set by step(), each parameter's scale for its (possibly deferred) update.
  std::vector<std::optional<std::pair<const void*, uint64_t>>> clipped_;
  double clip_coef_ = 1;
  std::vector<double> scale_at_;
  bool defer_ = false;  // overlap_with_forward
  // The options of each update_group() that deferred updates (its group's as they were at
  // step()), by id; cleared once no update waits.
  std::map<uint64_t, AdamHyper> deferred_;
  std::vector<uint64_t> deferred_at_;  // by global parameter index: id + 1, or 0
  uint64_t next_deferred_ = 0;
  int64_t updates_in_forward_ = 0;
  std::shared_ptr<CpuOffload*> alive_;  // the forward pre-hooks' way to see this optimizer
};

}  // namespace tally::optim
