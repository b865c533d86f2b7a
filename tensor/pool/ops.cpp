// Raw pooling ops: argument checks (every message names the op and the shapes), output
// size, allocation, and the dispatch into the device's kernel. Unbatched [C, H, W]
// inputs run as a batch of one.
#include "tensor/pool/ops.h"

#include <fmt/format.h>

#include "tensor/dispatch.h"
#include "tensor/elementwise/ops.h"
#include "tensor/op_alloc.h"
#include "tensor/pool/kernels.h"

namespace tally::ops {

namespace {

// Backward kernels accumulate in acc_t of the gradient's dtype.
DType accumulate_dtype(DType d) {
  return d == DType::float64 ? DType::float64 : DType::float32;
}

// Input sizes as 4-D (an unbatched [C, H, W] input is a batch of one), with a non-empty
// plane.
Shape batched(const char* op, const Shape& in) {
  Shape s;
  if (in.size() == 4)
    s = in;
  else if (in.size() == 3)
    s = {1, in[0], in[1], in[2]};
  else
    throw std::invalid_argument(fmt::format(
        "{}: input must be 3-D [C, H, W] or 4-D [N, C, H, W], got {}", op, shape_str(in)));
  if (s[2] <= 0 || s[3] <= 0)
    throw std::invalid_argument(
        fmt::format("{}: input {} has an empty spatial dimension", op, shape_str(in)));
  return s;
}

// The layout of a pool's result: a channels_last input's is channels_last, else contiguous.
MemoryFormat input_format(const Tensor& input) {
  return input.suggest_memory_format();
}

Tensor as_batched(const Tensor& t) {
  return t.dim() == 3 ? unsqueeze(t, 0) : t;
}
Tensor unbatched_like(const Tensor& t, size_t rank) {
  return rank == 3 ? squeeze(t, 0) : t;
}

void check_floating(const char* op, const Tensor& t) {
  if (!is_floating(t.dtype()))
    throw std::invalid_argument(fmt::format("{}: expected a floating tensor, got {} {}", op,
                                            dtype_name(t.dtype()), t.shape_string()));
}

// Resolves and checks a pooling window against a 4-D input; returns the output shape.
Shape pool_output_shape(const char* op, const Shape& in4, Int2 kernel, Int2 stride, Int2 padding,
                        Int2 dilation, bool ceil_mode, Pool2dParams& p) {
  if (!kernel.set || kernel.h <= 0 || kernel.w <= 0)
    throw std::invalid_argument(
        fmt::format("{}: kernel_size must be positive, got {}", op, kernel.str()));
  if (!stride.set) stride = kernel;
  if (stride.h <= 0 || stride.w <= 0)
    throw std::invalid_argument(
        fmt::format("{}: stride must be positive, got {}", op, stride.str()));
  if (!padding.set || padding.h < 0 || padding.w < 0)
    throw std::invalid_argument(
        fmt::format("{}: padding must be non-negative, got {}", op, padding.str()));
  if (!dilation.set || dilation.h <= 0 || dilation.w <= 0)
    throw std::invalid_argument(
        fmt::format("{}: dilation must be positive, got {}", op, dilation.str()));
  const int64_t eff_h = dilation.h * (kernel.h - 1) + 1, eff_w = dilation.w * (kernel.w - 1) + 1;
  // PyTorch (pool2d_shape_check): padding at most half the kernel, for max and average.
  if (padding.h > kernel.h / 2 || padding.w > kernel.w / 2)
    throw std::invalid_argument(
        fmt::format("{}: padding {} should be at most half of the kernel size {} "
                    "(input {})",
                    op, padding.str(), kernel.str(), shape_str(in4)));
  const int64_t ph = in4[2] + 2 * padding.h, pw = in4[3] + 2 * padding.w;
  if (eff_h > ph || eff_w > pw)
    throw std::invalid_argument(fmt::format(
        "{}: kernel {} (dilated {}) is larger than the padded input "
        "{}x{} (input {}, padding {})",
        op, kernel.str(), Int2{eff_h, eff_w}.str(), ph, pw, shape_str(in4), padding.str()));
  const int64_t oh = conv_output_size(in4[2], kernel.h, stride.h, padding.h, dilation.h, ceil_mode);
  const int64_t ow = conv_output_size(in4[3], kernel.w, stride.w, padding.w, dilation.w, ceil_mode);
  if (oh <= 0 || ow <= 0)
    throw std::invalid_argument(
        fmt::format("{}: input {} gives a non-positive output size {}x{} (kernel {}, "
                    "stride {}, padding {})",
                    op, shape_str(in4), oh, ow, kernel.str(), stride.str(), padding.str()));
  p.kH = kernel.h, p.kW = kernel.w, p.sH = stride.h, p.sW = stride.w;
  p.pH = padding.h, p.pW = padding.w, p.dH = dilation.h, p.dW = dilation.w;
  return {in4[0], in4[1], oh, ow};
}

Pool2dParams avg_params(const char* op, bool count_include_pad,
                        std::optional<int64_t> divisor_override) {
  Pool2dParams p;
  p.count_include_pad = count_include_pad;
  if (divisor_override) {
    if (*divisor_override == 0)
      throw std::invalid_argument(fmt::format("{}: divisor_override must not be zero", op));
    p.divisor = *divisor_override;
  }
  return p;
}

// grad_output as 4-D, checked against the input's rank and, where given, the expected
// batched output shape (otherwise only batch and channels are checked).
Shape grad_output_batched(const char* op, const Tensor& grad_output, const Shape& input_sizes,
                          const Shape& in4, const Shape* expected = nullptr) {
  const auto mismatch = [&] {
    return std::invalid_argument(
        fmt::format("{}: grad_output {} does not match the output{}{} for input {}", op,
                    grad_output.shape_string(), expected ? " " : "",
                    expected ? shape_str(*expected) : "", shape_str(input_sizes)));
  };
  if (grad_output.dim() != static_cast<int64_t>(input_sizes.size())) throw mismatch();
  const Shape& g = grad_output.sizes();
  const Shape gy4 = g.size() == 3 ? Shape{1, g[0], g[1], g[2]} : g;
  if (expected ? gy4 != *expected : (gy4[0] != in4[0] || gy4[1] != in4[1])) throw mismatch();
  check_floating(op, grad_output);
  return gy4;
}

// An interpolation's geometry (InterpParams) from the input's sizes and the output's spatial
// sizes, checked; the scales as PyTorch's area_pixel_compute_scale and compute_scales_value.
InterpParams upsample_params(const char* op, const Shape& in, const Shape& out,
                             const std::vector<double>& factors, bool linear, bool align_corners) {
  if (in.size() < 3 || in.size() > 5)
    throw std::invalid_argument(
        fmt::format("{}: expected a 3-D, 4-D or 5-D input (N, C, ...), got {}", op, shape_str(in)));
  const size_t k = in.size() - 2;
  if (out.size() != k || (!factors.empty() && factors.size() != k))
    throw std::invalid_argument(
        fmt::format("{}: input {} has {} spatial dims, got output size {} and {} scale factors", op,
                    shape_str(in), k, shape_str(out), factors.size()));
  InterpParams p;
  p.planes = in[0] * in[1];
  p.dims = static_cast<int>(k);
  p.linear = linear;
  p.align_corners = linear && align_corners;
  for (size_t j = 0; j < k; ++j) {
    const size_t a = 3 - k + j;
    const int64_t i = in[2 + j], o = out[j];
    if (i <= 0 || o <= 0)
      throw std::invalid_argument(
          fmt::format("{}: input and output sizes should be greater than 0, but got input {} "
                      "and output {}",
                      op, shape_str(in), shape_str(out)));
    const double f = factors.empty() ? 0.0 : factors[j];
    if (!factors.empty() && !(f > 0.0))
      throw std::invalid_argument(fmt::format("{}: scale factors must be positive, got {}", op, f));
    p.in[a] = i;
    p.out[a] = o;
    p.nearest_scale[a] =
        f > 0.0 ? static_cast<float>(1.0 / f) : static_cast<float>(i) / static_cast<float>(o);
    if (o > 1 && p.align_corners) {
      p.linear_scale_f[a] = static_cast<float>(i - 1) / static_cast<float>(o - 1);
      p.linear_scale_d[a] = static_cast<double>(i - 1) / static_cast<double>(o - 1);
    } else if (o > 1) {
      p.linear_scale_f[a] =
          f > 0.0 ? static_cast<float>(1.0 / f) : static_cast<float>(i) / static_cast<float>(o);
      p.linear_scale_d[a] = f > 0.0 ? 1.0 / f : static_cast<double>(i) / static_cast<double>(o);
    }
  }
  return p;
}

}  // namespace

Tensor upsample(const Tensor& input, const Shape& output_size,
                const std::vector<double>& scale_factors, bool linear, bool align_corners) {
  static const OpInfo info("upsample");
  DispatchScope scope(info, input);
  check_floating(info.name, input);
  const InterpParams p =
      upsample_params(info.name, input.sizes(), output_size, scale_factors, linear, align_corners);
  Shape out{input.size(0), input.size(1)};
  out.insert(out.end(), output_size.begin(), output_size.end());
  const Tensor x = contiguous(input);
  Tensor y = alloc_output(out, input.dtype(), input.device());
  if (y.numel() > 0)
    pool_backends.get(info, input.device(), &PoolKernels::upsample_forward)(y, x, p);
  return y;
}

Tensor upsample_backward(const Tensor& grad_output, const Shape& input_sizes,
                         const std::vector<double>& scale_factors, bool linear,
                         bool align_corners) {
  static const OpInfo info("upsample_backward");
  DispatchScope scope(info, grad_output);
  check_floating(info.name, grad_output);
  const Shape& g = grad_output.sizes();
  if (g.size() != input_sizes.size() || g.size() < 3 || g[0] != input_sizes[0] ||
      g[1] != input_sizes[1])
    throw std::invalid_argument(
        fmt::format("{}: grad_output {} does not match the input {} (N, C and the rank)", info.name,
                    grad_output.shape_string(), shape_str(input_sizes)));
  const InterpParams p = upsample_params(info.name, input_sizes, Shape(g.begin() + 2, g.end()),
                                         scale_factors, linear, align_corners);
  const Tensor gy = contiguous(grad_output);
  Tensor gx = alloc_output(input_sizes, grad_output.dtype(), grad_output.device());
  if (gx.numel() > 0)
    pool_backends.get(info, grad_output.device(), &PoolKernels::upsample_backward)(gx, gy, p);
  return gx;
}

std::pair<Tensor, Tensor> max_pool2d_with_indices(const Tensor& input, Int2 kernel_size,
                                                  Int2 stride, Int2 padding, Int2 dilation,
                                                  bool ceil_mode) {
  static const OpInfo info("max_pool2d");
  DispatchScope scope(info, input);
  const Shape in4 = batched(info.name, input.sizes());
  check_floating(info.name, input);
  Pool2dParams p;
  const Shape out4 =
      pool_output_shape(info.name, in4, kernel_size, stride, padding, dilation, ceil_mode, p);
  const MemoryFormat kf = kernel_memory_format(input.device(), input_format(input));
  const Tensor x = contiguous(as_batched(input), kf);
  Tensor out = alloc_output(out4, input.dtype(), input.device(), kf);
  Tensor indices = alloc_output(out4, DType::int64, input.device(), kf);
  pool_backends.get(info, input.device(), &PoolKernels::max_pool2d_forward)(out, indices, x, p);
  const size_t rank = input.sizes().size();
  return {unbatched_like(contiguous(out, input_format(input)), rank),
          unbatched_like(indices, rank)};
}

Tensor max_pool2d_backward(const Tensor& grad_output, const Tensor& indices,
                           const Shape& input_sizes, Int2 kernel_size, Int2 stride, Int2 padding,
                           Int2 dilation, bool ceil_mode) {
  static const OpInfo info("max_pool2d_backward");
  check_same_device(info.name, grad_output.device(), indices.device());
  DispatchScope scope(info, grad_output, indices);
  const Shape in4 = batched(info.name, input_sizes);
  if (indices.dtype() != DType::int64 || indices.sizes() != grad_output.sizes())
    throw std::invalid_argument(fmt::format(
        "{}: indices must be int64 of grad_output's shape {}, got {} {}", info.name,
        grad_output.shape_string(), dtype_name(indices.dtype()), indices.shape_string()));
  Pool2dParams p;
  const Shape out4 =
      pool_output_shape(info.name, in4, kernel_size, stride, padding, dilation, ceil_mode, p);
  grad_output_batched(info.name, grad_output, input_sizes, in4, &out4);
  // In grad_output's layout (channels_last when the forward's input was: its indices are too).
  const MemoryFormat kf = kernel_memory_format(grad_output.device(), input_format(grad_output));
  const Tensor gy = contiguous(as_batched(grad_output), kf);
  const Tensor idx = contiguous(as_batched(indices), kf);
  Tensor gx = alloc_output(in4, grad_output.dtype(), grad_output.device(), kf);
  pool_backends.get(info, grad_output.device(), &PoolKernels::max_pool2d_backward)(gx, gy, idx, p);
  return unbatched_like(gx, input_sizes.size());
}

Tensor avg_pool2d(const Tensor& input, Int2 kernel_size, Int2 stride, Int2 padding, bool ceil_mode,
                  bool count_include_pad, std::optional<int64_t> divisor_override) {
  static const OpInfo info("avg_pool2d");
  DispatchScope scope(info, input);
  const Shape in4 = batched(info.name, input.sizes());
  check_floating(info.name, input);
  Pool2dParams p = avg_params(info.name, count_include_pad, divisor_override);
  const Shape out4 =
      pool_output_shape(info.name, in4, kernel_size, stride, padding, 1, ceil_mode, p);
  const Tensor x = contiguous(as_batched(input));
  Tensor out = alloc_output(out4, input.dtype(), input.device());
  pool_backends.get(info, input.device(), &PoolKernels::avg_pool2d_forward)(out, x, p);
  return unbatched_like(contiguous(out, input_format(input)), input.sizes().size());
}

Tensor avg_pool2d_backward(const Tensor& grad_output, const Shape& input_sizes, Int2 kernel_size,
                           Int2 stride, Int2 padding, bool ceil_mode, bool count_include_pad,
                           std::optional<int64_t> divisor_override) {
  static const OpInfo info("avg_pool2d_backward");
  DispatchScope scope(info, grad_output);
  const Shape in4 = batched(info.name, input_sizes);
  Pool2dParams p = avg_params(info.name, count_include_pad, divisor_override);
  const Shape out4 =
      pool_output_shape(info.name, in4, kernel_size, stride, padding, 1, ceil_mode, p);
  grad_output_batched(info.name, grad_output, input_sizes, in4, &out4);
  const Tensor gy = contiguous(as_batched(grad_output));
  Tensor gx = alloc_output(in4, accumulate_dtype(grad_output.dtype()), grad_output.device());
  pool_backends.get(info, grad_output.device(), &PoolKernels::avg_pool2d_backward)(gx, gy, p);
  return unbatched_like(to(gx, grad_output.dtype()), input_sizes.size());
}

Tensor adaptive_avg_pool2d(const Tensor& input, Int2 output_size) {
  static const OpInfo info("adaptive_avg_pool2d");
  DispatchScope scope(info, input);
  const Shape in4 = batched(info.name, input.sizes());
  check_floating(info.name, input);
  if (!output_size.set || output_size.h <= 0 || output_size.w <= 0)
    throw std::invalid_argument(fmt::format("{}: output_size must be positive, got {} (input {})",
                                            info.name, output_size.str(), input.shape_string()));
  const MemoryFormat kf = kernel_memory_format(input.device(), input_format(input));
  const Tensor x = contiguous(as_batched(input), kf);
  // Its output keeps the input's layout (a [N, C, 1, 1] result is the same memory either way).
  Tensor out = alloc_output({in4[0], in4[1], output_size.h, output_size.w}, input.dtype(),
                            input.device(), kf);
  pool_backends.get(info, input.device(), &PoolKernels::adaptive_avg_pool2d_forward)(out, x);
  return unbatched_like(contiguous(out, input_format(input)), input.sizes().size());
}

Tensor adaptive_avg_pool2d_backward(const Tensor& grad_output, const Shape& input_sizes,
                                    MemoryFormat input_format) {
  static const OpInfo info("adaptive_avg_pool2d_backward");
  DispatchScope scope(info, grad_output);
  const Shape in4 = batched(info.name, input_sizes);
  grad_output_batched(info.name, grad_output, input_sizes, in4);
  if (input_format == MemoryFormat::channels_last && input_sizes.size() != 4)
    throw std::invalid_argument(
        fmt::format("{}: a channels_last gradient needs 4-D input sizes, got {}", info.name,
                    shape_str(input_sizes)));
  const MemoryFormat kf = kernel_memory_format(grad_output.device(), input_format);
  const Tensor gy = contiguous(as_batched(grad_output), kf);
  Tensor gx = alloc_output(in4, accumulate_dtype(grad_output.dtype()), grad_output.device(), kf);
  pool_backends.get(info, grad_output.device(), &PoolKernels::adaptive_avg_pool2d_backward)(gx, gy);
  return unbatched_like(to(gx, grad_output.dtype()), input_sizes.size());
}

}  // namespace tally::ops
