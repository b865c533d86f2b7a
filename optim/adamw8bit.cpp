// AdamW8bit: options, the 8-bit state and the per-bucket fused update (see adamw8bit.h), and
// the CPU block-wise quantization helpers.
#include "optim/adamw8bit.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "optim/multi_tensor.h"
#include "optim/update_math.h"
#include "tensor/ops.h"

namespace tally::optim {

namespace {

constexpr const char* kMoments[] = {"exp_avg", "exp_avg_sq"};
constexpr const char* kScales[] = {"exp_avg_absmax", "exp_avg_sq_absmax"};

bool valid_block_size(int64_t bs) {
  return bs >= kMin8bitBlock && bs <= kMax8bitBlock && (bs & (bs - 1)) == 0;
}

void check_block_size(int64_t bs, const char* op) {
  if (!valid_block_size(bs))
    throw std::invalid_argument(
        fmt::format("{}: invalid block_size {} (must be a power of two from {} to {})", op, bs,
                    kMin8bitBlock, kMax8bitBlock));
}

int64_t num_blocks(int64_t numel, int64_t block_size) {
  return (numel + block_size - 1) / block_size;
}

}  // namespace

AdamW8bit::AdamW8bit(std::vector<Tensor> params, AdamOptions options, AdamW8bitOptions quant)
    : AdamW8bit(std::vector<ParamGroup>{{std::move(params), {}}}, options, quant) {}

AdamW8bit::AdamW8bit(std::vector<ParamGroup> groups, AdamOptions defaults, AdamW8bitOptions quant)
    : Optimizer(defaults.to_map()), quant_(quant) {
  check_block_size(quant_.block_size, "AdamW8bit");
  if (quant_.min_8bit_size < 0)
    throw std::invalid_argument(
        fmt::format("AdamW8bit: invalid min_8bit_size {} (must be >= 0)", quant_.min_8bit_size));
  for (ParamGroup& g : groups) add_param_group(std::move(g));
  check_params();
}

void AdamW8bit::check_options(const GroupOptions& o) const {
  if (!(o.at("lr") >= 0))  // PyTorch's `not 0.0 <= lr`: NaN is invalid too
    throw std::invalid_argument(fmt::format("AdamW8bit: invalid learning rate {}", o.at("lr")));
  if (!(o.at("eps") >= 0))
    throw std::invalid_argument(fmt::format("AdamW8bit: invalid epsilon {}", o.at("eps")));
  for (const char* b : {"beta1", "beta2"})
    if (!(o.at(b) >= 0 && o.at(b) < 1))
      throw std::invalid_argument(
          fmt::format("AdamW8bit: invalid {} {} (must be in [0, 1))", b, o.at(b)));
  if (!(o.at("weight_decay") >= 0))
    throw std::invalid_argument(
        fmt::format("AdamW8bit: invalid weight_decay {}", o.at("weight_decay")));
  if (o.at("amsgrad") != 0)
    throw std::invalid_argument(
        fmt::format("AdamW8bit: amsgrad is not supported (amsgrad = {})", o.at("amsgrad")));
  if (o.count("capturable") && o.at("capturable") != 0)
    throw std::invalid_argument(
        "AdamW8bit: capturable is not supported (its step count stays on the host); use AdamW");
}

void AdamW8bit::check_params() const {
  size_t index = 0;
  for (const ParamGroup& g : param_groups())
    for (const Tensor& p : g.params) {
      if (p.dtype() != DType::float32)
        throw std::invalid_argument(
            fmt::format("AdamW8bit: parameter {} (shape {}) has dtype {}; float32 expected", index,
                        p.shape_string(), dtype_name(p.dtype())));
      ++index;
    }
}

std::optional<StateSpec> AdamW8bit::state_spec(size_t index, const std::string& name) const {
  const Tensor& p = param_at(index);
  const bool moment = name == kMoments[0] || name == kMoments[1];
  if (!is_8bit(p))
    return moment ? std::optional<StateSpec>(StateSpec{p.sizes(), p.dtype()}) : std::nullopt;
  if (moment) return StateSpec{{p.numel()}, DType::uint8, true};
  if (name == kScales[0] || name == kScales[1])
    return StateSpec{{num_blocks(p.numel(), quant_.block_size)}, DType::float32, true};
  return std::nullopt;
}

void AdamW8bit::check_loaded_state(size_t index, const ParamState& s) const {
  const Tensor& p = param_at(index);
  std::vector<const char*> names(std::begin(kMoments), std::end(kMoments));
  if (is_8bit(p)) names.insert(names.end(), std::begin(kScales), std::end(kScales));
  const auto present = std::count_if(names.begin(), names.end(),
                                     [&](const char* n) { return s.tensors.count(n) > 0; });
  if (present == 0) return;
  for (const char* n : names)
    if (!s.tensors.count(n))
      throw std::invalid_argument(
          fmt::format("AdamW8bit.load_state_dict: parameter {} (shape {}) has {} of its {} state "
                      "tensors; '{}' is missing",
                      index, p.shape_string(), present, names.size(), n));
}

void AdamW8bit::update_group(const ParamGroup& group, const std::vector<size_t>& indices) {
  AdamHyper h = adam_hyper(group, /*decoupled=*/true);
  h.amsgrad = false;
  check_params();  // a group added after construction
  for (const size_t i : indices)
    if (found_inf_on(param_at(i).device()))
      throw std::invalid_argument(
          "AdamW8bit: a capturable GradScaler's skip on the device is not supported; use a "
          "GradScaler without capturable");
  // Bucket by (device, step count, 8-bit or not): the bias corrections are per step, and the
  // two kinds of state are two kernels.
  auto key = [&](size_t i) { return state(i).step * 2 + (is_8bit(param_at(i)) ? 1 : 0); };
  for (const std::vector<size_t>& bucket : buckets(indices, key)) {
    const Tensor& first = param_at(bucket[0]);
    const bool q8 = is_8bit(first);
    TensorLists lists(first.device(), first.dtype(), q8 ? 6 : 4);
    for (size_t i : bucket) {
      const Tensor& p = param_at(i);
      const Tensor g = p.grad();
      ParamState& s = state(i);
      auto& t = s.tensors;
      if (!t.count("exp_avg")) {
        if (q8) {
          const int64_t blocks = num_blocks(p.numel(), quant_.block_size);
          for (const char* n : kMoments) t[n] = make_state({p.numel()}, DType::uint8, p.device());
          for (const char* n : kScales) t[n] = make_state({blocks}, DType::float32, p.device());
        } else {
          for (const char* n : kMoments) t[n] = make_state(p);
        }
      }
      ++s.step;
      if (q8)
        lists.add(
            {p.data_ptr(), g.data_ptr(), t.at("exp_avg").data_ptr(), t.at("exp_avg_sq").data_ptr(),
             t.at("exp_avg_absmax").data_ptr(), t.at("exp_avg_sq_absmax").data_ptr()},
            p.numel());
      else
        lists.add(
            {p.data_ptr(), g.data_ptr(), t.at("exp_avg").data_ptr(), t.at("exp_avg_sq").data_ptr()},
            p.numel());
    }
    h.step = state(bucket[0]).step;
    if (q8)
      fused_adamw8bit_(lists, AdamW8bitHyper{h, quant_.block_size});
    else
      fused_adam_(lists, h);
  }
}

QuantizedBlocks quantize_blockwise(const Tensor& x, bool is_signed, int64_t block_size) {
  check_block_size(block_size, "quantize_blockwise");
  if (x.dtype() != DType::float32 || !x.is_contiguous() || x.device() != Device::cpu())
    throw std::invalid_argument(
        fmt::format("quantize_blockwise: a contiguous float32 CPU tensor expected, got {} {} on {}",
                    dtype_name(x.dtype()), x.shape_string(), x.device().str()));
  const int64_t n = x.numel();
  QuantizedBlocks q{ops::empty({n}, DType::uint8), ops::empty({num_blocks(n, block_size)})};
  const float* map = is_signed ? dynamic_maps().signed_map : dynamic_maps().unsigned_map;
  const float* v = x.data<float>();
  auto* codes = static_cast<uint8_t*>(q.codes.data_ptr());
  float* absmax = q.absmax.data<float>();
  for (int64_t begin = 0, b = 0; begin < n; begin += block_size, ++b) {
    const int64_t end = std::min(n, begin + block_size);
    float m = 0.f;
    for (int64_t i = begin; i < end; ++i) m = detail::absmax_step(m, v[i]);
    absmax[b] = m;
    for (int64_t i = begin; i < end; ++i) codes[i] = detail::quantize8(map, v[i], m);
  }
  return q;
}

Tensor dequantize_blockwise(const QuantizedBlocks& q, bool is_signed, int64_t block_size) {
  check_block_size(block_size, "dequantize_blockwise");
  const int64_t n = q.codes.numel();
  if (q.codes.dtype() != DType::uint8 || q.absmax.dtype() != DType::float32 ||
      !q.codes.is_contiguous() || !q.absmax.is_contiguous() || q.codes.device() != Device::cpu() ||
      q.absmax.device() != Device::cpu() || q.absmax.numel() != num_blocks(n, block_size))
    throw std::invalid_argument(fmt::format(
        "dequantize_blockwise: codes (uint8 [n]) and absmax (float32 [ceil(n / {})]) on the CPU "
        "expected, got {} {} and {} {}",
        block_size, dtype_name(q.codes.dtype()), q.codes.shape_string(),
        dtype_name(q.absmax.dtype()), q.absmax.shape_string()));
  Tensor out = ops::empty({n});
  const float* map = is_signed ? dynamic_maps().signed_map : dynamic_maps().unsigned_map;
  const auto* codes = static_cast<const uint8_t*>(q.codes.data_ptr());
  const float* absmax = q.absmax.data<float>();
  float* o = out.data<float>();
  for (int64_t i = 0; i < n; ++i) o[i] = detail::dequantize8(map, codes[i], absmax[i / block_size]);
  return out;
}

}  // namespace tally::optim
