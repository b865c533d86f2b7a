// CpuOffload: AdamW / AdamW8bit with the state in pinned host memory (see cpu_offload.h).
#include "optim/cpu_offload.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "memory/context.h"
#include "memory/memory.h"
#include "memory/meta.h"
#include "nn/module.h"
#include "optim/clip_grad.h"
#include "optim/cpu_adam.h"
#include "optim/update_math.h"
#include "tensor/meta/cost.h"
#include "tensor/ops.h"

namespace tally::optim {
namespace {

constexpr const char* kMoments[] = {"exp_avg", "exp_avg_sq"};
constexpr const char* kScales[] = {"exp_avg_absmax", "exp_avg_sq_absmax"};

bool is_16bit(DType t) {
  return t == DType::bfloat16 || t == DType::float16;
}

// t's memory as one flat run (a dense tensor: row-major or channels_last).
Tensor flat(const Tensor& t) {
  return Tensor::make(t.storage(), {t.numel()}, {1}, t.storage_offset(), t.dtype());
}

int64_t num_blocks(int64_t n, int64_t block) {
  return (n + block - 1) / block;
}

// A zero host tensor under optimizer_state for a parameter on `device`.
Tensor host_state(const Shape& sizes, DType dtype, Device device) {
  memory::CategoryScope category(memory::Category::optimizer_state);
  Tensor t = ops::empty_host(sizes, dtype, device);
  ops::zero_(t);
  return t;
}

// The flat host gradient `g` as `dtype` (its master's), times clip_grad_norm_'s coefficient
// as clip_grad_norm_ would have left it: multiplied in the gradient's arithmetic type (float32
// for 16-bit gradients, then rounded back to 16 bits), then widened.
template <typename O>
void fill_clipped(const Tensor& g, double coef, O* out) {
  const int64_t n = g.numel();
  const float c = static_cast<float>(coef);
  switch (g.dtype()) {
    case DType::float32: {
      const float* x = g.data<float>();
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<O>(x[i] * c);
      return;
    }
    case DType::float64: {
      const double* x = g.data<double>();
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<O>(x[i] * coef);
      return;
    }
    case DType::bfloat16: {
      const BFloat16* x = g.data<BFloat16>();
      for (int64_t i = 0; i < n; ++i)
        out[i] = static_cast<O>(static_cast<float>(BFloat16(static_cast<float>(x[i]) * c)));
      return;
    }
    case DType::float16: {
      const Half* x = g.data<Half>();
      for (int64_t i = 0; i < n; ++i)
        out[i] = static_cast<O>(static_cast<float>(Half(static_cast<float>(x[i]) * c)));
      return;
    }
    default:
      throw std::invalid_argument(
          fmt::format("CpuOffload: a {} gradient cannot be clipped", dtype_name(g.dtype())));
  }
}

Tensor clipped_copy(const Tensor& g, double coef, DType dtype, Device device) {
  memory::CategoryScope category(memory::Category::temporary);
  Tensor w = ops::empty_host(g.sizes(), dtype, device);
  if (dtype == DType::float64)
    fill_clipped(g, coef, w.data<double>());
  else
    fill_clipped(g, coef, w.data<float>());
  return w;
}

}  // namespace

CpuOffload::CpuOffload(std::vector<Tensor> params, AdamOptions options, CpuOffloadOptions offload)
    : CpuOffload(std::vector<ParamGroup>{{std::move(params), {}}}, options, offload) {}

CpuOffload::CpuOffload(std::vector<ParamGroup> groups, AdamOptions defaults,
                       CpuOffloadOptions offload)
    : Optimizer(defaults.to_map()), offload_(offload) {
  if (offload_.bucket_bytes <= 0)
    throw std::invalid_argument(
        fmt::format("CpuOffload: bucket_bytes must be positive, got {}", offload_.bucket_bytes));
  const int64_t bs = offload_.quant.block_size;
  if (offload_.adamw8bit && (bs < kMin8bitBlock || bs > kMax8bitBlock || (bs & (bs - 1)) != 0))
    throw std::invalid_argument(
        fmt::format("CpuOffload(AdamW8bit): block_size {} is not a power of two from {} to {}", bs,
                    kMin8bitBlock, kMax8bitBlock));
  for (ParamGroup& g : groups) add_param_group(std::move(g));
  fit_param_count();
  if (offload_.overlap_backward) install_hooks();
}

void CpuOffload::fit_param_count() {
  staged_.resize(num_params());
  deferred_at_.resize(num_params());
  clipped_.resize(num_params());
  scale_at_.resize(num_params(), 1.0);
}

CpuOffload::~CpuOffload() {
  alive_.reset();  // the forward pre-hooks do nothing from now on
  // The steps taken are owed to the parameters: a pending update runs now.
  try {
    finish_deferred_updates();
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: a deferred update failed as the optimizer was destroyed: {}\n", name(),
               e.what());
  }
  for (auto& [p, h] : hooks_) autograd::remove_post_accumulate_grad_hook(p, h);
}

void CpuOffload::check_options(const GroupOptions& o) const {
  if (!(o.at("lr") >= 0))
    throw std::invalid_argument(fmt::format("{}: invalid learning rate {}", name(), o.at("lr")));
  if (!(o.at("eps") >= 0))
    throw std::invalid_argument(fmt::format("{}: invalid epsilon {}", name(), o.at("eps")));
  for (const char* b : {"beta1", "beta2"})
    if (!(o.at(b) >= 0 && o.at(b) < 1))
      throw std::invalid_argument(
          fmt::format("{}: invalid {} {} (must be in [0, 1))", name(), b, o.at(b)));
  if (!(o.at("weight_decay") >= 0))
    throw std::invalid_argument(
        fmt::format("{}: invalid weight_decay {}", name(), o.at("weight_decay")));
  if (o.at("capturable") != 0)
    throw std::invalid_argument(fmt::format(
        "{}: capturable is not supported (the update runs on the host, outside any CUDA graph)",
        name()));
  if (offload_.adamw8bit && o.at("amsgrad") != 0)
    throw std::invalid_argument(fmt::format("{}: amsgrad is not supported", name()));
}

void CpuOffload::check_parameter(const Tensor& p, size_t index) const {
  if (p.defined() && is_16bit(p.dtype())) {
    // check_param's other conditions (its dtype check asks for float32 or float64).
    if (!p.is_leaf())
      throw std::invalid_argument(fmt::format("{}: parameter {} (shape {}) is not a leaf tensor",
                                              name(), index, p.shape_string()));
    if (!p.is_contiguous() && !p.is_contiguous(MemoryFormat::channels_last))
      throw std::invalid_argument(
          fmt::format("{}: parameter {} (shape {}) is neither contiguous nor channels_last", name(),
                      index, p.shape_string()));
    return;
  }
  check_param(p, index, name());
}

DType CpuOffload::master_dtype(size_t index) const {
  const DType t = param_at(index).dtype();
  return is_16bit(t) ? DType::float32 : t;
}

bool CpuOffload::is_8bit(size_t index) const {
  return offload_.adamw8bit && param_at(index).numel() >= offload_.quant.min_8bit_size;
}

std::optional<StateSpec> CpuOffload::state_spec(size_t index, const std::string& n) const {
  const Tensor& p = param_at(index);
  const Shape flat_shape{p.numel()};
  if (n == "master") return StateSpec{flat_shape, master_dtype(index)};
  if (n == "exp_avg" || n == "exp_avg_sq")
    return is_8bit(index) ? StateSpec{flat_shape, DType::uint8, true}
                          : StateSpec{flat_shape, master_dtype(index)};
  if (n == "max_exp_avg_sq" && !offload_.adamw8bit)
    return StateSpec{flat_shape, master_dtype(index)};
  if ((n == "exp_avg_absmax" || n == "exp_avg_sq_absmax") && is_8bit(index))
    return StateSpec{{num_blocks(p.numel(), offload_.quant.block_size)}, DType::float32, true};
  return std::nullopt;
}

void CpuOffload::install_hooks() {
  size_t index = 0;
  try {
    for (const ParamGroup& g : param_groups())
      for (const Tensor& p : g.params) {
        const size_t i = index++;
        // A CPU parameter's gradient is on the host already: step() reads it in place.
        if (!p.requires_grad() || p.device() == Device::cpu()) continue;
        const uint64_t h = autograd::register_post_accumulate_grad_hook(
            p, [this, i](const Tensor&) { on_grad_ready(i); });
        hooks_.emplace_back(p, h);
      }
  } catch (...) {
    for (auto& [p, h] : hooks_) autograd::remove_post_accumulate_grad_hook(p, h);
    hooks_.clear();
    throw;
  }
}

bool CpuOffload::fresh(size_t i) const {
  const std::optional<Staged>& s = staged_[i];
  const Tensor g = param_at(i).grad();
  return s && g.defined() && s->key == g.storage().key() && s->version == g.storage().version();
}

void CpuOffload::send(size_t i, uint64_t bucket) {
  const Tensor& p = param_at(i);
  const Tensor g = p.grad();
  const Tensor src = flat(g);
  std::optional<Staged>& s = staged_[i];
  // A deferred update reads a copy: the CPU gradient itself could be zeroed in place first.
  if (p.device() == Device::cpu() && !defer_) {
    s = Staged{src, false, g.storage().key(), g.storage().version(), bucket, false};
    return;
  }
  // An earlier buffer of this parameter (an earlier backward of an accumulation) is reused.
  Tensor host = s && s->owned ? s->host_grad : Tensor();
  if (!host.defined()) {
    memory::CategoryScope category(memory::Category::gradient);
    host = ops::empty_host({g.numel()}, g.dtype(), g.device());
  }
  ops::copy_on_copy_stream_(host, src);
  s = Staged{host, true, g.storage().key(), g.storage().version(), bucket, false};
}

void CpuOffload::close_bucket(std::vector<size_t> indices) {
  if (indices.empty()) return;
  const Device d = param_at(indices.front()).device();
  buckets_[next_bucket_ - 1] = Bucket{std::move(indices), ops::CopyFence::record(d)};
  ++buckets_sent_;
}

void CpuOffload::check_not_pending(size_t i) const {
  if (deferred_at_[i] != 0)
    throw std::logic_error(fmt::format(
        "{}: parameter {} (shape {}) has a new gradient while its deferred update is pending: "
        "a forward read it without calling a module that holds it (overlap_with_forward updates "
        "a parameter just before the forward of its module, or of the block around it "
        "(is_checkpoint_block)); call finish_updates() before reading parameters elsewhere",
        name(), i, param_at(i).shape_string()));
}

void CpuOffload::on_grad_ready(size_t i) {
  const Tensor g = param_at(i).grad();
  check_not_pending(i);
  if (!g.defined() || !sync_) return;
  NoGradGuard no_grad;
  // A bucket holds one device's gradients (its fence is that device's).
  if (!pending_.empty() && !(param_at(pending_.front()).device() == g.device())) flush_pending();
  if (pending_.empty()) ++next_bucket_;
  send(i, next_bucket_ - 1);
  ++hooked_copies_;
  pending_.push_back(i);
  pending_bytes_ += static_cast<int64_t>(g.nbytes());
  if (pending_bytes_ >= offload_.bucket_bytes) flush_pending();
}

void CpuOffload::flush_pending() {
  std::vector<size_t> indices;
  indices.swap(pending_);
  pending_bytes_ = 0;
  close_bucket(std::move(indices));
}

void CpuOffload::init_state(const std::vector<size_t>& indices, bool amsgrad) {
  std::set<std::pair<int, int>> devices;
  for (size_t i : indices) {
    const Tensor& p = param_at(i);
    ParamState& s = state(i);
    auto& t = s.tensors;
    const Device d = p.device();
    const Shape n{p.numel()};
    // A state loaded by load_state_dict is made on the parameter's device: move it home.
    for (auto& [key, value] : t)
      if (!(value.device() == ops::host_of(d))) {
        memory::CategoryScope category(memory::Category::optimizer_state);
        Tensor h = ops::empty_host(value.sizes(), value.dtype(), d);
        ops::copy_(h, value);
        value = h;
      }
    if (!t.count("master")) {
      Tensor master = host_state(n, master_dtype(i), d);
      if (p.dtype() == master.dtype()) {
        ops::copy_on_copy_stream_(master, flat(p));
      } else {
        memory::CategoryScope category(memory::Category::temporary);
        Tensor tmp = ops::empty_host(n, p.dtype(), d);
        ops::copy_on_copy_stream_(tmp, flat(p));
        ops::CopyFence::record(d).synchronize();
        ops::copy_(master, tmp);
      }
      t["master"] = master;
      devices.insert({static_cast<int>(d.type), d.index});
    }
    if (!t.count("exp_avg")) {
      if (is_8bit(i)) {
        const int64_t blocks = num_blocks(p.numel(), offload_.quant.block_size);
        for (const char* m : kMoments) t[m] = host_state(n, DType::uint8, d);
        for (const char* m : kScales) t[m] = host_state({blocks}, DType::float32, d);
      } else {
        for (const char* m : kMoments) t[m] = host_state(n, master_dtype(i), d);
      }
    }
    if (amsgrad && !t.count("max_exp_avg_sq"))
      t["max_exp_avg_sq"] = host_state(n, master_dtype(i), d);
  }
  for (const auto& [type, index] : devices)
    ops::CopyFence::record(Device{static_cast<DeviceType>(type), index}).synchronize();
}

void CpuOffload::keep_16bit_weights(nn::Module& model, DType dtype) {
  if (dtype != DType::bfloat16 && dtype != DType::float16)
    throw std::invalid_argument(
        fmt::format("CpuOffload::keep_16bit_weights: dtype must be float16 or bfloat16, got {}",
                    dtype_name(dtype)));
  init_masters();
  NoGradGuard no_grad;
  memory::CategoryScope category(memory::Category::parameter);
  std::vector<Device> devices;
  for (const Tensor& p : model.parameters())
    if (p.dtype() == DType::float32) {
      if (std::find(devices.begin(), devices.end(), p.device()) == devices.end())
        devices.push_back(p.device());
      nn::set_data(p, ops::to(p, dtype));
    }
  // The float32 weights' segments are free now: given back, or the cache would hold them as
  // reserved memory that the half-sized gradients split.
  for (const Device& d : devices) memory::empty_cache(d);
}

void CpuOffload::init_masters() {
  size_t index = 0;
  for (const ParamGroup& g : param_groups()) {
    std::vector<size_t> indices;  // a frozen parameter has no state
    for (const Tensor& p : g.params) {
      if (p.defined() && p.requires_grad()) indices.push_back(index);
      ++index;
    }
    init_state(indices, g.flag("amsgrad"));
  }
}

namespace {
// A dry run's time for the host's update of `bytes` (AdamW) and `bytes8` (AdamW8bit): the host
// computes (its clock advances by the bytes over the target's host update bandwidths; on a CPU
// target, over its bandwidth), and the weights' copies back, queued after it, start no earlier
// than it ends (the device stream waits for them before the next forward in any case).
void charge_host_update(Device device, double bytes, double bytes8) {
  const tally::meta::Rates r = tally::meta::rates_of(device);
  const double rate = r.host_update_bandwidth > 0                     ? r.host_update_bandwidth
                      : memory::behaves_as(device) == DeviceType::cpu ? r.bandwidth
                                                                      : 0.0;
  if (rate <= 0 || bytes + bytes8 <= 0) return;
  const double rate8 = r.host_update_8bit_bandwidth > 0 ? r.host_update_8bit_bandwidth : rate;
  const double end = memory::meta_host_seconds(device) + bytes / rate + bytes8 / rate8;
  memory::sync_meta_host(device, end);
  memory::wait_meta_clock(device, end);
}
}  // namespace

void CpuOffload::update_on_host(AdamHyper h, const std::vector<size_t>& indices) {
  const Device device = param_at(indices.front()).device();
  const bool meta = ops::host_of(device).is_meta();  // a dry run: nothing to compute
  // Lists by (step count, 8-bit or not, master dtype): the bias corrections are per step.
  // And by clip_grad_norm_'s scale, which the kernels take per call.
  std::map<std::tuple<int64_t, bool, int, double>, std::vector<size_t>> lists_of;
  for (size_t i : indices) {
    ++state(i).step;
    lists_of[{state(i).step, is_8bit(i), static_cast<int>(master_dtype(i)), scale_at_[i]}]
        .push_back(i);
  }
  // What the update moves through host memory, AdamW's and AdamW8bit's (a dry run's time for it).
  double bytes = 0, bytes8 = 0;
  for (const auto& [key, members] : lists_of) {
    const auto [step, q8, dtype, scale] = key;
    const double master = static_cast<double>(dtype_size(static_cast<DType>(dtype)));
    TensorLists lists(Device::cpu(), static_cast<DType>(dtype), q8 ? 6 : 4 + (h.amsgrad ? 1 : 0));
    // A 16-bit gradient is read as it is, and, in this optimizer's buffer, the new weights
    // rounded into it in the same pass for write_back (parallel_adam_16_,
    // parallel_adamw8bit_16_): by gradient dtype, lists and output pointers.
    std::map<DType, std::pair<TensorLists, std::vector<void*>>> lists16;
    std::vector<Tensor> grads32;  // 16-bit gradients widened for the update (amsgrad)
    for (size_t i : members) {
      auto& t = state(i).tensors;
      Staged& staged = *staged_[i];
      Tensor g = staged.host_grad;
      const int64_t n = param_at(i).numel();
      const double grad = static_cast<double>(dtype_size(g.dtype()));
      const double param = static_cast<double>(dtype_size(param_at(i).dtype()));
      if ((q8 || !h.amsgrad) && is_16bit(g.dtype()) &&
          static_cast<DType>(dtype) == DType::float32) {
        auto& [l16, out] =
            lists16
                .try_emplace(g.dtype(), TensorLists(Device::cpu(), DType::float32, q8 ? 6 : 4),
                             std::vector<void*>{})
                .first->second;
        if (q8)
          l16.add({t.at("master").data_ptr(), g.data_ptr(), t.at("exp_avg").data_ptr(),
                   t.at("exp_avg_sq").data_ptr(), t.at("exp_avg_absmax").data_ptr(),
                   t.at("exp_avg_sq_absmax").data_ptr()},
                  n);
        else
          l16.add({t.at("master").data_ptr(), g.data_ptr(), t.at("exp_avg").data_ptr(),
                   t.at("exp_avg_sq").data_ptr()},
                  n);
        // The weights into the buffer where it is ours and has their dtype; else write_back
        // rounds the master (on the CPU the buffer is the gradient itself).
        staged.weights_ready = staged.owned && g.dtype() == param_at(i).dtype();
        out.push_back(staged.weights_ready ? g.data_ptr() : nullptr);
        // One pass: the master read and written, the gradient read, the moments read and
        // written (8-bit: a byte each), the rounded weights written.
        (q8 ? bytes8 : bytes) +=
            static_cast<double>(n) *
            (2 * 4.0 + grad + (q8 ? 4.0 : 16.0) + (staged.weights_ready ? param : 4.0 + param));
        continue;
      }
      if (scale != 1.0 && !meta) {
        const Tensor w = clipped_copy(g, scale, static_cast<DType>(dtype), device);
        grads32.push_back(w);
        g = w;
      } else if (g.dtype() != static_cast<DType>(dtype)) {
        memory::CategoryScope category(memory::Category::temporary);
        Tensor w = ops::empty_host(g.sizes(), static_cast<DType>(dtype), device);
        ops::copy_(w, g);
        grads32.push_back(w);
        g = w;
      }
      void* p = t.at("master").data_ptr();
      void* m = t.at("exp_avg").data_ptr();
      void* v = t.at("exp_avg_sq").data_ptr();
      // The master read and written, the gradient read (widened first: read, written, read
      // again), the moments read and written (8-bit: a byte each), the rounded weights written.
      (q8 ? bytes8 : bytes) +=
          static_cast<double>(n) *
          (2 * master + (grad == master ? grad : grad + 2 * master) + (q8 ? 4.0 : 4 * master) +
           (h.amsgrad ? 2 * master : 0.0) + (param == master ? 0.0 : master + param));
      if (q8)
        lists.add({p, g.data_ptr(), m, v, t.at("exp_avg_absmax").data_ptr(),
                   t.at("exp_avg_sq_absmax").data_ptr()},
                  n);
      else if (h.amsgrad)
        lists.add({p, g.data_ptr(), m, v, t.at("max_exp_avg_sq").data_ptr()}, n);
      else
        lists.add({p, g.data_ptr(), m, v}, n);
    }
    if (meta) continue;
    h.step = step;
    for (const auto& [gdtype, l16] : lists16) {
      if (q8) {
        AdamHyper a = h;
        a.amsgrad = false;
        parallel_adamw8bit_16_(l16.first, AdamW8bitHyper{a, offload_.quant.block_size}, gdtype,
                               l16.second, static_cast<float>(scale));
      } else {
        parallel_adam_16_(l16.first, h, gdtype, l16.second, static_cast<float>(scale));
      }
    }
    if (lists.empty()) continue;
    if (q8) {
      AdamHyper a = h;
      a.amsgrad = false;
      parallel_adamw8bit_(lists, AdamW8bitHyper{a, offload_.quant.block_size});
    } else {
      parallel_adam_(lists, h);
    }
  }
  if (meta) charge_host_update(device, bytes, bytes8);
}

void CpuOffload::write_back(size_t i) {
  Tensor& p = param_at(i);
  const Tensor& master = state(i).tensors.at("master");
  const Tensor dst = flat(p);
  if (p.dtype() == master.dtype()) {
    ops::copy_on_copy_stream_(dst, master);
    return;
  }
  // The weights in the parameter's dtype, rounded on the host: into the gradient's buffer,
  // which the update has read (it has the parameter's dtype), or a new one on the CPU, where
  // that buffer is the gradient itself.
  Staged& s = *staged_[i];
  if (s.weights_ready) {  // parallel_adam_16_ wrote them into the gradient's buffer
    ops::copy_on_copy_stream_(dst, s.host_grad);
    return;
  }
  Tensor buf = s.owned ? s.host_grad : Tensor();
  if (!buf.defined()) {
    memory::CategoryScope category(memory::Category::temporary);
    buf = ops::empty_host({p.numel()}, p.dtype(), p.device());
  }
  ops::copy_(buf, master);
  ops::copy_on_copy_stream_(dst, buf);
}

void CpuOffload::update_group(const ParamGroup& group, const std::vector<size_t>& indices) {
  for (size_t i : indices)
    if (found_inf_on(param_at(i).device()))
      throw std::invalid_argument(fmt::format(
          "{}: a capturable GradScaler's skip on the device is not supported; use a GradScaler "
          "without capturable",
          name()));
  fit_param_count();
  flush_pending();
  // clip_grad_norm_'s coefficient for each gradient it measured, all checked unchanged first.
  for (size_t i : indices) check_clipped(i);
  for (size_t i : indices) {
    scale_at_[i] = clipped_[i] ? clip_coef_ : 1.0;
    clipped_[i].reset();
  }
  // What the hooks did not send, or what changed since (clip_grad_norm_, GradScaler::unscale_):
  // one bucket per device.
  std::map<std::pair<int, int>, std::vector<size_t>> late;
  for (size_t i : indices)
    if (!fresh(i)) {
      const Device d = param_at(i).device();
      late[{static_cast<int>(d.type), d.index}].push_back(i);
    }
  // In buckets of about bucket_bytes, as the hooks send them: the host updates the first while
  // the rest are on their way, and an update that widens 16-bit gradients (amsgrad) holds
  // one bucket's float32 copies, not every parameter's.
  for (auto& [d, list] : late) {
    std::vector<size_t> bucket;
    int64_t bytes = 0;
    for (size_t i : list) {
      if (bucket.empty()) ++next_bucket_;
      send(i, next_bucket_ - 1);
      ++step_copies_;
      bucket.push_back(i);
      bytes += static_cast<int64_t>(param_at(i).grad().nbytes());
      if (bytes >= offload_.bucket_bytes) {
        close_bucket(std::exchange(bucket, {}));
        bytes = 0;
      }
    }
    close_bucket(std::move(bucket));
  }
  init_state(indices, group.flag("amsgrad"));

  const AdamHyper hyper = adam_hyper(group, /*decoupled=*/true);
  const std::set<size_t> wanted(indices.begin(), indices.end());
  std::set<std::pair<int, int>> devices;
  // overlap_with_forward: while gradients are still on their way (the device still runs
  // backward, or the copies of clipped gradients stream in), the host updates what has come, as
  // without it; once the last copy is done, the rest waits for the next forward.
  const ops::CopyFence newest =
      buckets_.empty() ? ops::CopyFence() : buckets_.rbegin()->second.fence;
  bool deferring = false;
  std::optional<uint64_t> record;  // this call's id in deferred_
  for (auto it = buckets_.begin(); it != buckets_.end();) {
    std::vector<size_t> mine;
    size_t left = 0;
    for (size_t i : it->second.indices) {
      if (!staged_[i] || staged_[i]->bucket != it->first) continue;  // sent again later
      if (wanted.count(i))
        mine.push_back(i);
      else
        ++left;
    }
    deferring = deferring || (defer_ && !mine.empty() && newest.query());
    if (!mine.empty() && deferring) {
      // Its gradients on the host (so the device's may be freed or zeroed at once), its update
      // left to the forward pre-hooks.
      it->second.fence.synchronize();
      if (!record) {
        record = next_deferred_++;
        deferred_.emplace(*record, hyper);
      }
      for (size_t i : mine) deferred_at_[i] = *record + 1;
    } else if (!mine.empty()) {
      it->second.fence.synchronize();  // its gradients are on the host
      update_on_host(hyper, mine);
      for (size_t i : mine) {
        write_back(i);
        const Device d = param_at(i).device();
        devices.insert({static_cast<int>(d.type), d.index});
        staged_[i].reset();  // the host gradient is spent
      }
    }
    it = left == 0 ? buckets_.erase(it) : std::next(it);
  }
  // The host waits for the weights' copies back: only the last bucket's is still running (the
  // others overlapped with later buckets' updates). Otherwise the device gradients, which the
  // copy stream keeps out of reuse, would be freed by zero_grad behind an event recorded after
  // the write-backs, and the next forward could not reuse them (7B: 12 GiB more reserved).
  for (const auto& [type, index] : devices)
    ops::CopyFence::record(Device{static_cast<DeviceType>(type), index}).synchronize();
}

void CpuOffload::overlap_with_forward(nn::Module& model) {
  fit_param_count();
  // Every trainable parameter's modules, checked before anything changes.
  std::vector<std::pair<nn::Module*, std::vector<size_t>>> holders;
  std::vector<bool> held(num_params(), false);
  for (const auto& [path, m] : model.named_modules()) {
    std::vector<size_t> mine;
    // A block's forward may read its children's weights without calling them (GPT's MLP fuses
    // c_fc's product and GELU): its hook updates its whole subtree.
    for (const Tensor& q : m->parameters(/*recurse=*/m->is_checkpoint_block()))
      for (size_t i = 0; i < num_params(); ++i)
        if (param_at(i).is_same(q) && q.requires_grad()) {
          mine.push_back(i);
          held[i] = true;
        }
    if (!mine.empty()) holders.emplace_back(m, std::move(mine));
  }
  for (size_t i = 0; i < num_params(); ++i) {
    const Tensor& p = param_at(i);
    if (p.defined() && p.requires_grad() && !held[i])
      throw std::invalid_argument(fmt::format(
          "{}.overlap_with_forward: parameter {} (shape {}) is not a parameter of any module of "
          "the model ({}): its deferred update would have no forward to run before",
          name(), i, p.shape_string(), model.type_name()));
    if (staged_[i])
      throw std::invalid_argument(fmt::format(
          "{}.overlap_with_forward: parameter {}'s gradient is already sent; call it before the "
          "first backward or right after a step",
          name(), i));
  }
  // A gradient for a parameter whose update is pending means a forward read stale weights: the
  // sending hooks check it, and a hook that only checks goes on every other parameter.
  for (size_t i = 0; i < num_params(); ++i) {
    const Tensor& p = param_at(i);
    if (!p.defined() || !p.requires_grad() ||
        std::any_of(hooks_.begin(), hooks_.end(),
                    [&](const auto& h) { return h.first.is_same(p); }))
      continue;
    const uint64_t h = autograd::register_post_accumulate_grad_hook(
        p, [this, i](const Tensor&) { check_not_pending(i); });
    hooks_.emplace_back(p, h);
  }
  if (!alive_) alive_ = std::make_shared<CpuOffload*>(this);
  for (auto& [m, indices] : holders)
    m->register_forward_pre_hook(
        [alive = std::weak_ptr<CpuOffload*>(alive_), list = std::move(indices)](nn::Module&) {
          if (const auto self = alive.lock()) (*self)->before_forward(list);
        });
  defer_ = true;
}

void CpuOffload::before_forward(const std::vector<size_t>& indices) {
  updates_in_forward_ += static_cast<int64_t>(run_deferred(indices));
}

size_t CpuOffload::run_deferred(const std::vector<size_t>& indices) {
  // Parameter by parameter, not by bucket: a bucket may straddle two layers, and the forward
  // needs only this one's weights.
  std::map<uint64_t, std::vector<size_t>> by_record;
  for (size_t i : indices)
    if (deferred_at_[i] != 0) {
      by_record[deferred_at_[i] - 1].push_back(i);
      deferred_at_[i] = 0;
    }
  if (by_record.empty()) return 0;
  // The optimizer's work, wherever it runs (a forward pre-hook runs it inside a forward).
  NoGradGuard no_grad;
  memory::PhaseScope phase("optimizer");
  memory::CategoryScope category(memory::Category::temporary);
  std::vector<Device> devices;
  size_t ran = 0;
  for (const auto& [id, list] : by_record) {
    ran += list.size();
    update_on_host(deferred_.at(id), list);
    for (size_t i : list) {
      write_back(i);
      staged_[i].reset();
      const Device dev = param_at(i).device();
      if (std::find(devices.begin(), devices.end(), dev) == devices.end()) devices.push_back(dev);
    }
  }
  // Tally's stream waits for these weights before the forward reads them; the host does not.
  for (const Device& dev : devices) ops::CopyFence::record(dev).wait();
  return ran;
}

void CpuOffload::finish_deferred_updates() {
  std::vector<size_t> all;
  for (size_t i = 0; i < deferred_at_.size(); ++i)
    if (deferred_at_[i] != 0) all.push_back(i);
  run_deferred(all);
  deferred_.clear();
}

Tensor CpuOffload::clip_grad_norm_(double max_norm, double norm_type) {
  fit_param_count();
  NoGradGuard no_grad;
  memory::CategoryScope category(memory::Category::temporary);
  std::vector<Tensor> params;
  for (size_t i = 0; i < num_params(); ++i) params.push_back(param_at(i));
  const std::string op = fmt::format("{}.clip_grad_norm_", name());
  const auto [grads, total] = detail::total_grad_norm(params, norm_type, op.c_str());
  for (auto& c : clipped_) c.reset();
  if (grads.empty()) return ops::zeros({});
  const Device d = total.device();
  if (d.is_meta()) {
    memory::sync_meta_host(d, memory::meta_seconds(d));  // the read's wait
    clip_coef_ = 1;
  } else if (total.dtype() == DType::float64) {
    clip_coef_ = detail::clip_coef(ops::item(total), max_norm);
  } else {  // float32 arithmetic, as clip_grad_norm_'s kernels
    clip_coef_ =
        detail::clip_coef(static_cast<float>(ops::item(total)), static_cast<float>(max_norm));
  }
  for (size_t i = 0; i < num_params(); ++i) {
    const Tensor g = param_at(i).defined() ? param_at(i).grad() : Tensor();
    if (g.defined()) clipped_[i] = std::make_pair(g.storage().key(), g.storage().version());
  }
  return is_16bit(grads[0].dtype()) ? ops::to(total, grads[0].dtype()) : total;
}

void CpuOffload::check_clipped(size_t i) const {
  if (!clipped_[i]) return;
  const auto [key, version] = *clipped_[i];
  const Tensor g = param_at(i).grad();
  if (!g.defined() || g.storage().key() != key || g.storage().version() != version)
    throw std::invalid_argument(fmt::format(
        "{}: parameter {} (shape {}): its gradient changed after clip_grad_norm_ measured it; "
        "clip after the last change (unscaling, another backward), right before step()",
        name(), i, param_at(i).shape_string()));
}

void CpuOffload::on_skipped_step() {
  for (auto& c : clipped_) c.reset();
}

}  // namespace tally::optim
