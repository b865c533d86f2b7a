// torch.nn.functional's composite layers over the differentiable ops (see nn/functional.h).
#include "nn/functional.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/node.h"
#include "base/checked.h"

namespace tally::nn::functional {

namespace {

Tensor scalar_like(const Tensor& x, double v) {
  return full({}, v, TensorOptions{}.with_dtype(x.dtype()).with_device(x.device()));
}

// log1p(x) with its gradient g / (1 + x): softplus's tail stays exact where log(1 + e) rounds
// to 0.
Tensor log1p(const Tensor& x) {
  Tensor out = ops::unary(ops::UnaryOp::log1p, x);
  autograd::record("Log1PBackward", {x}, {out}, {x},
                   [](autograd::BackwardContext& ctx, const TensorList& g) -> TensorList {
                     return {ops::div(g[0], ops::add(ctx.saved(0), 1.0))};
                   });
  return out;
}

void check_floating(const char* op, const Tensor& t, const char* what) {
  if (!is_floating(t.dtype()))
    throw std::invalid_argument(fmt::format("{}: {} must be floating point, got {} {}", op, what,
                                            dtype_name(t.dtype()), t.shape_string()));
}

}  // namespace

Tensor leaky_relu(const Tensor& x, double negative_slope) {
  check_floating("leaky_relu", x, "input");
  return where(gt(x, scalar_like(x, 0.0)), x, mul(x, negative_slope));
}

Tensor reduce_loss(const Tensor& loss, const std::string& reduction, const char* op) {
  if (reduction == "mean") return mean(loss);
  if (reduction == "sum") return sum(loss);
  if (reduction == "none") return loss;
  throw std::invalid_argument(fmt::format(
      "{}: {} is not a valid value for reduction ('mean', 'sum' or 'none')", op, reduction));
}

namespace {
void check_reduction(const std::string& reduction, const char* op, bool batchmean = false) {
  if (reduction == "mean" || reduction == "sum" || reduction == "none" ||
      (batchmean && reduction == "batchmean"))
    return;
  throw std::invalid_argument(
      fmt::format("{}: {} is not a valid value for reduction", op, reduction));
}

// input - target, target broadcast to input's shape (PyTorch broadcasts these losses).
Tensor difference(const char* op, const Tensor& input, const Tensor& target) {
  check_floating(op, input, "input");
  check_floating(op, target, "target");
  if (input.device() != target.device())
    throw std::invalid_argument(fmt::format("{}: input {} and target {} are on different devices",
                                            op, input.shape_string(), target.shape_string()));
  // Under autocast these losses run in float32, as PyTorch's autocast lists them.
  const auto [in, tg] = autocast::fp32(op, input, target);
  return sub(in, tg);
}
}  // namespace

Tensor mse_loss(const Tensor& input, const Tensor& target, const std::string& reduction) {
  check_reduction(reduction, "mse_loss");
  return reduce_loss(square(difference("mse_loss", input, target)), reduction, "mse_loss");
}

Tensor l1_loss(const Tensor& input, const Tensor& target, const std::string& reduction) {
  check_reduction(reduction, "l1_loss");
  return reduce_loss(abs(difference("l1_loss", input, target)), reduction, "l1_loss");
}

Tensor smooth_l1_loss(const Tensor& input, const Tensor& target, const std::string& reduction,
                      double beta) {
  check_reduction(reduction, "smooth_l1_loss");
  if (beta < 0.0)
    throw std::invalid_argument(
        fmt::format("smooth_l1_loss: beta must be non-negative, got {}", beta));
  if (beta == 0.0) return l1_loss(input, target, reduction);
  const Tensor a = abs(difference("smooth_l1_loss", input, target));
  const Tensor loss = where(lt(a, scalar_like(a, beta)), div(mul(square(a), 0.5), beta),
                            sub(a, scalar_like(a, 0.5 * beta)));
  return reduce_loss(loss, reduction, "smooth_l1_loss");
}

Tensor huber_loss(const Tensor& input, const Tensor& target, const std::string& reduction,
                  double delta) {
  check_reduction(reduction, "huber_loss");
  if (delta <= 0.0)
    throw std::invalid_argument(fmt::format("huber_loss: delta must be positive, got {}", delta));
  const Tensor a = abs(difference("huber_loss", input, target));
  const Tensor loss = where(lt(a, scalar_like(a, delta)), mul(square(a), 0.5),
                            mul(sub(a, scalar_like(a, 0.5 * delta)), delta));
  return reduce_loss(loss, reduction, "huber_loss");
}

Tensor binary_cross_entropy_with_logits(const Tensor& input_, const Tensor& target_,
                                        const Tensor& weight, const std::string& reduction,
                                        const Tensor& pos_weight) {
  constexpr const char* op = "binary_cross_entropy_with_logits";
  const auto [input, target] = autocast::fp32(op, input_, target_);
  check_reduction(reduction, op);
  check_floating(op, input, "input");
  check_floating(op, target, "target");
  if (input.sizes() != target.sizes())
    throw std::invalid_argument(fmt::format("{}: target size {} must be the same as input size {}",
                                            op, target.shape_string(), input.shape_string()));
  if (input.device() != target.device())
    throw std::invalid_argument(fmt::format("{}: input and target are on different devices", op));
  // -log(sigmoid(x)) = relu(-x) + log1p(exp(-|x|)), finite for every x.
  const Tensor neg_log_sigmoid = add(relu(neg(input)), log1p(exp(neg(abs(input)))));
  Tensor loss;
  if (pos_weight.defined()) {
    if (pos_weight.dim() > 0 && input.dim() > 0 && pos_weight.size(-1) != input.size(-1) &&
        pos_weight.size(-1) != 1)
      throw std::invalid_argument(
          fmt::format("{}: pos_weight {} does not broadcast along the last dim of input {}", op,
                      pos_weight.shape_string(), input.shape_string()));
    const Tensor log_weight = add(mul(sub(pos_weight, scalar_like(pos_weight, 1.0)), target), 1.0);
    loss = add(mul(sub(scalar_like(target, 1.0), target), input), mul(log_weight, neg_log_sigmoid));
  } else {
    loss = add(mul(sub(scalar_like(target, 1.0), target), input), neg_log_sigmoid);
  }
  if (weight.defined()) loss = mul(loss, weight);
  return reduce_loss(loss, reduction, op);
}

Tensor kl_div(const Tensor& input_, const Tensor& target_, const std::string& reduction,
              bool log_target) {
  const auto [input, target] = autocast::fp32("kl_div", input_, target_);
  check_reduction(reduction, "kl_div", /*batchmean=*/true);
  check_floating("kl_div", input, "input");
  check_floating("kl_div", target, "target");
  Tensor loss;
  if (log_target) {
    loss = mul(exp(target), sub(target, input));
  } else {
    // xlogy(t, t) - t * input: 0 where t == 0 (log reads 1 there, so no 0 * -inf).
    const Tensor zero = scalar_like(target, 0.0);
    const Tensor safe = where(gt(target, zero), target, scalar_like(target, 1.0));
    loss = mul(target, sub(log(safe), input));
  }
  if (reduction == "batchmean") {
    const Tensor total = sum(loss);
    return input.dim() == 0 ? total : div(total, static_cast<double>(input.size(0)));
  }
  return reduce_loss(loss, reduction, "kl_div");
}

Tensor group_norm(const Tensor& x_, int64_t num_groups, const Tensor& weight_, const Tensor& bias_,
                  double eps) {
  if (x_.dim() < 2)
    throw std::invalid_argument(fmt::format(
        "group_norm: expected an input of at least 2 dims [N, C, *], got {}", x_.shape_string()));
  const int64_t n = x_.size(0), c = x_.size(1);
  if (num_groups <= 0 || c % num_groups != 0)
    throw std::invalid_argument(
        fmt::format("group_norm: num_channels {} of input {} must be divisible by num_groups {}", c,
                    x_.shape_string(), num_groups));
  for (const Tensor* p : {&weight_, &bias_})
    if (p->defined() && (p->dim() != 1 || p->size(0) != c))
      throw std::invalid_argument(
          fmt::format("group_norm: weight and bias must be [{}] for input {}, got {}", c,
                      x_.shape_string(), p->shape_string()));
  const auto [weight, bias] = autocast::fp32("group_norm", weight_, bias_);
  // The fused op (one kernel each way, NativeGroupNormBackward0; it applies autocast to the
  // input itself) where it takes the parameters' dtypes (autocast's float32 ones beside a
  // 16-bit input are such); otherwise the composite: layer_norm over the groups, then the
  // affine, promoted.
  if (ops::group_norm_fast_path_applies(x_, weight, bias))
    return tally::group_norm(x_, num_groups, weight, bias, eps);
  const Tensor x = autocast::fp32("group_norm", x_)[0];
  const int64_t per_group = x.numel() / std::max<int64_t>(n * num_groups, 1);
  Tensor y = layer_norm(x.reshape({n, num_groups, per_group}), {per_group}, {}, {}, eps)
                 .reshape(x.sizes());
  if (!weight.defined() && !bias.defined()) return y;
  Shape per_channel(static_cast<size_t>(x.dim()), 1);
  per_channel[1] = c;
  if (weight.defined()) y = mul(y, weight.reshape(per_channel));
  if (bias.defined()) y = add(y, bias.reshape(per_channel));
  return y;
}

Tensor conv1d(const Tensor& input, const Tensor& weight, const Tensor& bias, int64_t stride,
              int64_t padding, int64_t dilation, int64_t groups) {
  if (input.dim() != 2 && input.dim() != 3)
    throw std::invalid_argument(fmt::format(
        "conv1d: expected a 2-D [C, L] or 3-D [N, C, L] input, got {}", input.shape_string()));
  if (weight.dim() != 3)
    throw std::invalid_argument(fmt::format(
        "conv1d: expected a 3-D weight [O, C / groups, K], got {}", weight.shape_string()));
  const int64_t h = input.dim() - 1;  // the unit height goes before the length
  return conv2d(input.unsqueeze(h), weight.unsqueeze(2), bias, {1, stride}, {0, padding},
                {1, dilation}, groups)
      .squeeze(h);
}

namespace {

// size or scale_factor for `k` spatial dims: one value stands for every dim, as PyTorch's int.
template <typename V>
std::vector<V> per_dim(const std::vector<V>& v, int64_t k, const char* what, const Tensor& x) {
  if (v.size() == 1) return std::vector<V>(static_cast<size_t>(k), v[0]);
  if (static_cast<int64_t>(v.size()) != k)
    throw std::invalid_argument(fmt::format(
        "interpolate: input and {} must have the same number of spatial dimensions, but got "
        "input with spatial dimensions of {} and {} of {} values (give (o1, ..., o{}) for an "
        "input (N, C, d1, ..., d{}))",
        what, shape_str(Shape(x.sizes().begin() + 2, x.sizes().end())), what, v.size(), k, k));
  return v;
}

}  // namespace

Tensor interpolate(const Tensor& x, std::optional<std::vector<int64_t>> size,
                   std::optional<std::vector<double>> scale_factor, const std::string& mode,
                   std::optional<bool> align_corners) {
  // PyTorch's modes: nearest for 3-D to 5-D inputs, each linear mode for its own rank.
  const int64_t want = mode == "linear" ? 3 : mode == "bilinear" ? 4 : mode == "trilinear" ? 5 : 0;
  if (mode != "nearest" && want == 0)
    throw std::invalid_argument(fmt::format(
        "interpolate: mode '{}' is not supported (nearest, linear, bilinear or trilinear)", mode));
  const bool linear = want != 0;
  if (!linear && align_corners.has_value())
    throw std::invalid_argument(
        "interpolate: align_corners option can only be set with the interpolating modes: "
        "linear | bilinear | bicubic | trilinear");
  if (linear ? x.dim() != want : x.dim() < 3 || x.dim() > 5)
    throw std::invalid_argument(fmt::format(
        "interpolate: got a {}-D input {}, but {} mode needs {}", x.dim(), x.shape_string(), mode,
        linear ? fmt::format("a {}-D input (N, C, {})", want,
                             want == 3   ? "L"
                             : want == 4 ? "H, W"
                                         : "D, H, W")
               : std::string("a 3-D, 4-D or 5-D input (N, C, ...)")));
  check_floating("interpolate", x, "input");
  if (size.has_value() == scale_factor.has_value())
    throw std::invalid_argument("interpolate: exactly one of size or scale_factor must be given");
  const int64_t k = x.dim() - 2;  // spatial dims
  std::vector<int64_t> sizes;
  std::vector<double> factors;
  if (size) sizes = per_dim(*size, k, "output size", x);
  if (scale_factor) factors = per_dim(*scale_factor, k, "scale_factor", x);
  std::vector<int64_t> in(static_cast<size_t>(k)), out(static_cast<size_t>(k));
  for (size_t j = 0; j < static_cast<size_t>(k); ++j) {
    in[j] = x.size(2 + static_cast<int64_t>(j));
    if (size) {
      out[j] = sizes[j];
    } else {
      const double s = factors[j];
      if (!(s > 0.0) || !std::isfinite(s))
        throw std::invalid_argument(
            fmt::format("interpolate: scale_factor must be positive and finite, got {}", s));
      const double scaled = std::floor(static_cast<double>(in[j]) * s);
      if (scaled >= 9.2e18)
        throw std::invalid_argument(
            fmt::format("interpolate: scale_factor {} makes the output of input {} too large", s,
                        x.shape_string()));
      out[j] = static_cast<int64_t>(scaled);
    }
    if (out[j] <= 0 || in[j] <= 0)
      throw std::invalid_argument(
          fmt::format("interpolate: input {} and output {} sizes must be greater than 0",
                      x.shape_string(), shape_str(size ? sizes : out)));
  }
  // PyTorch's upsample ops: a given scale_factor steps the source index by its inverse.
  return upsample(x, Shape(out.begin(), out.end()), scale_factor ? factors : std::vector<double>{},
                  linear, align_corners.value_or(false));
}

Tensor interpolate(const Tensor& x, std::optional<std::array<int64_t, 2>> size,
                   std::optional<std::array<double, 2>> scale_factor, const std::string& mode,
                   std::optional<bool> align_corners) {
  std::optional<std::vector<int64_t>> s;
  std::optional<std::vector<double>> f;
  if (size) s = std::vector<int64_t>(size->begin(), size->end());
  if (scale_factor) f = std::vector<double>(scale_factor->begin(), scale_factor->end());
  return interpolate(x, s, f, mode, align_corners);
}

}  // namespace tally::nn::functional
