#include "distributed/ddp.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "autograd/engine.h"
#include "memory/context.h"
#include "tensor/ops.h"

namespace tally::distributed {
namespace {

// MiB as bytes; `mb` must be in [0, 2^43) (the bytes fit in 63 bits; NaN and inf fail).
size_t mib_to_bytes(const char* name, double mb) {
  if (!(mb >= 0 && mb < 8796093022208.0))
    throw std::invalid_argument(fmt::format(
        "DistributedDataParallel: {} must be a number of MiB in [0, 2^43), got {}", name, mb));
  return static_cast<size_t>(mb * 1024.0 * 1024.0);
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<nn::Module> module,
                                                 std::shared_ptr<ProcessGroup> pg,
                                                 DDPOptions options)
    : module_(std::move(module)), pg_(std::move(pg)), options_(options) {
  if (!module_) throw std::invalid_argument("DistributedDataParallel: null module");
  if (!pg_) throw std::invalid_argument("DistributedDataParallel: null process group");
  if (!(options_.bucket_cap_mb > 0))
    throw std::invalid_argument(fmt::format(
        "DistributedDataParallel: bucket_cap_mb must be > 0, got {}", options_.bucket_cap_mb));
  // Checked up front (build_buckets converts them again).
  (void)mib_to_bytes("bucket_cap_mb", options_.bucket_cap_mb);
  (void)mib_to_bytes("first_bucket_cap_mb", options_.first_bucket_cap_mb);
  for (const auto& [name, p] : module_->named_parameters()) {
    if (!p.requires_grad()) continue;
    if (!(p.device() == pg_->device()))
      throw std::invalid_argument(
          fmt::format("DistributedDataParallel: parameter '{}' is on {} but the process group "
                      "(rank {}) is on {}; "
                      "move the model first (model->to(device))",
                      name, p.device().str(), pg_->rank(), pg_->device().str()));
    params_.push_back(p);
    names_.push_back(name);
    specs_.push_back({p.numel(), p.dtype(), p.device()});
  }
  if (params_.empty())
    throw std::invalid_argument(
        "DistributedDataParallel: the module has no parameter that requires a gradient");

  NoGradGuard ng;
  if (pg_->size() > 1) {
    // Every rank must hold the same parameters: compare counts and sizes across ranks.
    int64_t total = 0, weighted = 0;
    for (size_t i = 0; i < specs_.size(); ++i) {
      total += specs_[i].numel;
      weighted += specs_[i].numel * static_cast<int64_t>(i + 1) % 1000003;
    }
    const Tensor mine =
        ops::from_vector({static_cast<double>(params_.size()), static_cast<double>(total),
                          static_cast<double>(weighted)},
                         {3}, DType::int64, pg_->device());
    const std::vector<double> all = pg_->all_gather(mine).tolist();
    for (int r = 1; r < pg_->size(); ++r)
      for (int k = 0; k < 3; ++k)
        if (all[static_cast<size_t>(r * 3 + k)] != all[static_cast<size_t>(k)])
          throw std::runtime_error(
              fmt::format("DistributedDataParallel: rank {} has {} parameters ({} elements) but "
                          "rank 0 has {} ({} elements); "
                          "every rank must build the same model",
                          r, all[static_cast<size_t>(r * 3)], all[static_cast<size_t>(r * 3 + 1)],
                          all[0], all[1]));
    // Rank 0's parameters and buffers everywhere.
    std::vector<std::shared_ptr<Work>> works;
    for (const Tensor& p : module_->parameters()) works.push_back(pg_->broadcast(p.detach(), 0));
    for (const Tensor& b : module_->buffers()) works.push_back(pg_->broadcast(b.detach(), 0));
    for (auto& w : works) w->wait();
  }

  build_buckets({});
  for (size_t p = 0; p < params_.size(); ++p)
    hook_handles_.push_back(autograd::register_post_accumulate_grad_hook(
        params_[p], [this, p](const Tensor&) { on_grad_ready(p); }));
}

DistributedDataParallel::~DistributedDataParallel() {
  for (size_t p = 0; p < params_.size() && p < hook_handles_.size(); ++p)
    autograd::remove_post_accumulate_grad_hook(params_[p], hook_handles_[p]);
}

void DistributedDataParallel::build_buckets(const std::vector<size_t>& order) {
  assignment_ = compute_bucket_assignment(
      specs_, mib_to_bytes("bucket_cap_mb", options_.bucket_cap_mb),
      mib_to_bytes("first_bucket_cap_mb", options_.first_bucket_cap_mb), order);
  readiness_ = BucketReadiness(assignment_);
  buckets_.clear();  // frees the old buffers (record_stream keeps them safe from reuse)
  slot_.assign(params_.size(), 0);
  memory::AllocContextScope ctx(memory::Category::communication, "ddp", "allreduce_bucket");
  for (const std::vector<size_t>& members : assignment_.buckets) {
    Bucket b;
    b.params = members;
    b.dtype = specs_[members.front()].dtype;
    b.device = specs_[members.front()].device;
    for (size_t i = 0; i < members.size(); ++i) {
      slot_[members[i]] = i;
      b.offsets.push_back(b.numel);
      b.numel += specs_[members[i]].numel;
    }
    // Straight from the allocator (an op would put its own name on the block), then zeroed.
    b.buffer = Tensor::make(
        Storage::allocate(static_cast<size_t>(b.numel) * dtype_size(b.dtype), b.device), {b.numel},
        {1}, 0, b.dtype);
    ops::zero_(b.buffer);
    buckets_.push_back(std::move(b));
  }
}

size_t DistributedDataParallel::bucket_bytes() const {
  size_t n = 0;
  for (const Bucket& b : buckets_) n += b.buffer.nbytes();
  return n;
}

Tensor DistributedDataParallel::slice_of(size_t p) const {
  const Bucket& b = buckets_[assignment_.bucket_of[p]];
  return ops::view(ops::narrow(b.buffer, 0, b.offsets[slot_[p]], specs_[p].numel),
                   params_[p].sizes());
}

void DistributedDataParallel::reset_iteration() {
  for (Bucket& b : buckets_) b.work.reset();
  readiness_.reset();
  in_backward_ = false;
}

void DistributedDataParallel::prepare_forward() {
  if (in_backward_) reset_iteration();  // the previous backward failed part-way
  if (options_.broadcast_buffers && pg_->size() > 1) broadcast_buffers();
}

void DistributedDataParallel::broadcast_buffers() {
  NoGradGuard ng;
  if (buffer_groups_.empty()) {
    // One flat tensor per dtype (BatchNorm: float running stats, int64 counters), so a
    // forward costs a broadcast or two instead of one per buffer.
    for (const Tensor& b : module_->buffers()) {
      auto it =
          std::find_if(buffer_groups_.begin(), buffer_groups_.end(), [&](const BufferGroup& g) {
            return g.buffers.front().dtype() == b.dtype() &&
                   g.buffers.front().device() == b.device();
          });
      if (it == buffer_groups_.end())
        it = buffer_groups_.insert(buffer_groups_.end(), BufferGroup{});
      it->buffers.push_back(b);
    }
    memory::AllocContextScope ctx(memory::Category::communication, "ddp", "broadcast_buffers");
    for (BufferGroup& g : buffer_groups_) {
      int64_t n = 0;
      for (const Tensor& b : g.buffers) n += b.numel();
      const DType dt = g.buffers.front().dtype();
      g.flat = Tensor::make(
          Storage::allocate(static_cast<size_t>(n) * dtype_size(dt), g.buffers.front().device()),
          {n}, {1}, 0, dt);
    }
  }
  std::vector<std::shared_ptr<Work>> works;
  for (BufferGroup& g : buffer_groups_) {
    int64_t off = 0;
    if (pg_->rank() == 0)
      for (const Tensor& b : g.buffers) {
        ops::copy_(ops::view(ops::narrow(g.flat, 0, off, b.numel()), b.sizes()), b);
        off += b.numel();
      }
    works.push_back(pg_->broadcast(g.flat, 0));
  }
  for (size_t i = 0; i < works.size(); ++i) {
    works[i]->wait();
    if (pg_->rank() == 0) continue;
    int64_t off = 0;
    for (const Tensor& b : buffer_groups_[i].buffers) {
      ops::copy_(b, ops::view(ops::narrow(buffer_groups_[i].flat, 0, off, b.numel()), b.sizes()));
      off += b.numel();
    }
  }
}

void DistributedDataParallel::on_grad_ready(size_t p) {
  if (!sync_) return;  // no_sync(): accumulate locally
  if (!in_backward_) {
    in_backward_ = true;
    autograd::queue_callback([this] { finish_backward(); });
  }
  const Tensor g = params_[p].grad();
  {
    memory::AllocContextScope ctx(memory::Category::communication, "ddp", "allreduce_bucket");
    if (g.defined())
      ops::copy_(slice_of(p), g);
    else
      ops::zero_(slice_of(p));
  }
  for (size_t b : readiness_.mark_ready(p)) launch(b);
}

void DistributedDataParallel::launch(size_t b) {
  memory::AllocContextScope ctx(memory::Category::communication, "ddp", "allreduce_bucket");
  buckets_[b].work = pg_->all_reduce(buckets_[b].buffer, ReduceOp::avg);
  ++num_allreduces_;
}

std::string DistributedDataParallel::unused_parameters_error(
    const std::vector<size_t>& unused) const {
  std::string names, indices;
  for (size_t i = 0; i < unused.size(); ++i) {
    if (i) {
      names += ", ";
      indices += " ";
    }
    names += names_[unused[i]];
    indices += std::to_string(unused[i]);
  }
  return fmt::format(
      "DistributedDataParallel (rank {}): expected to have finished reduction in the prior "
      "iteration before "
      "starting a new one. This error indicates that your module has parameters that were not used "
      "in producing "
      "loss. You can enable unused parameter detection by passing find_unused_parameters = true to "
      "DDPOptions, and by making sure all forward outputs participate in calculating loss.\n"
      "Parameters which did not receive grad for rank {}: {}\n"
      "Parameter indices which did not receive grad for rank {}: {}",
      pg_->rank(), pg_->rank(), names, pg_->rank(), indices);
}

void DistributedDataParallel::finish_backward() {
  const std::vector<size_t> unused = readiness_.unready_params();
  if (!unused.empty()) {
    if (!options_.find_unused_parameters) {
      const std::string msg = unused_parameters_error(unused);
      reset_iteration();
      throw std::runtime_error(msg);
    }
    for (size_t p : unused) {
      ops::zero_(slice_of(p));
      for (size_t b : readiness_.mark_ready(p)) launch(b);
    }
  }
  if (!readiness_.all_launched())
    throw std::logic_error(
        "DistributedDataParallel: internal error: buckets left unlaunched at the end of backward");
  // The compute stream waits for each bucket's all-reduce; then the averages go to .grad.
  for (Bucket& b : buckets_) {
    if (b.work) b.work->wait();
  }
  {
    memory::CategoryScope cat(memory::Category::gradient);
    for (size_t p = 0; p < params_.size(); ++p) {
      const Tensor g = params_[p].grad();
      if (g.defined()) {
        ops::copy_(g, slice_of(p));
      } else {
        params_[p].set_grad(ops::clone(slice_of(p)));
      }
    }
  }
  last_ready_order_ = readiness_.ready_order();
  reset_iteration();
  ++iteration_;
  if (options_.rebuild_buckets && !rebuilt_) {
    rebuilt_ = true;
    std::vector<size_t> order = rebuild_order(last_ready_order_, params_.size());
    if (pg_->size() > 1) {
      // Every rank must use the same buckets: rank 0's order.
      NoGradGuard ng;
      std::vector<double> v(order.begin(), order.end());
      Tensor t = ops::from_vector(v, {static_cast<int64_t>(v.size())}, DType::int64, pg_->device());
      pg_->broadcast(t, 0)->wait();
      const std::vector<double> got = t.tolist();
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<size_t>(got[i]);
    }
    build_buckets(order);
  }
}

}  // namespace tally::distributed
