// Raw conv2d ops: argument checks (every message names the op and the shapes), output
// allocation, the float16/bfloat16 -> float32 round trip the CPU BLAS path needs (cuDNN
// takes 16-bit tensors as they are), and the dispatch into the device's kernel.
#include "tensor/conv/ops.h"

#include <fmt/format.h>

#include <algorithm>

#include "base/checked.h"
#include "memory/meta.h"
#include "tensor/conv/kernels.h"
#include "tensor/dispatch.h"
#include "tensor/elementwise/ops.h"
#include "tensor/op_alloc.h"

namespace tally {

std::string Int2::str() const {
  return set ? fmt::format("[{}, {}]", h, w) : "[]";
}

}  // namespace tally

namespace tally::ops {

namespace {

// The dtype kernels compute in: on the CPU, BLAS has float32 and float64 and the 16-bit
// floats go through float32; cuDNN takes all four floating dtypes as they are (16-bit
// with float accumulation).
DType compute_dtype(DType d, Device device) {
  if (memory::behaves_as(device) == DeviceType::cuda) return d;
  return d == DType::float64 ? DType::float64 : DType::float32;
}

// `t` of dtype `dt` laid out as `f` (itself when it already is).
Tensor prepare(const Tensor& t, DType dt, MemoryFormat f = MemoryFormat::contiguous) {
  return contiguous(to(t, dt), f);
}

// The layout a convolution runs in (PyTorch's rule): channels_last when either 4-D operand is
// channels_last (Tensor::suggest_memory_format), else contiguous.
MemoryFormat conv_format(const Tensor& a, const Tensor& b) {
  return conv_memory_format({&a, &b});
}

std::string params_str(const Conv2dParams& p) {
  return fmt::format("stride {}, padding {}, dilation {}, groups {}", p.stride.str(),
                     p.padding.str(), p.dilation.str(), p.groups);
}

void check_params(const char* op, const Conv2dParams& p) {
  if (!p.stride.set || !p.padding.set || !p.dilation.set)
    throw std::invalid_argument(
        fmt::format("{}: stride, padding and dilation must be given ({})", op, params_str(p)));
  if (p.stride.h <= 0 || p.stride.w <= 0)
    throw std::invalid_argument(
        fmt::format("{}: stride must be positive, got {}", op, p.stride.str()));
  if (p.padding.h < 0 || p.padding.w < 0)
    throw std::invalid_argument(
        fmt::format("{}: padding must be non-negative, got {}", op, p.padding.str()));
  if (p.dilation.h <= 0 || p.dilation.w <= 0)
    throw std::invalid_argument(
        fmt::format("{}: dilation must be positive, got {}", op, p.dilation.str()));
  if (p.groups <= 0)
    throw std::invalid_argument(fmt::format("{}: groups must be positive, got {}", op, p.groups));
}

// Checks input (4-D) against weight and returns the output shape [N, O, OH, OW].
Shape conv_output_shape(const char* op, const Shape& in, const Shape& w, const Conv2dParams& p) {
  check_params(op, p);
  if (w.size() != 4)
    throw std::invalid_argument(
        fmt::format("{}: weight must be 4-D [out_channels, in_channels / groups, "
                    "kH, kW], got {}",
                    op, shape_str(w)));
  for (int64_t d : w)
    if (d <= 0)
      throw std::invalid_argument(
          fmt::format("{}: weight {} has an empty dimension", op, shape_str(w)));
  const int64_t C = in[1], O = w[0];
  if (C % p.groups != 0)
    throw std::invalid_argument(
        fmt::format("{}: groups {} does not divide the {} input channels of "
                    "input {}",
                    op, p.groups, C, shape_str(in)));
  if (O % p.groups != 0)
    throw std::invalid_argument(
        fmt::format("{}: groups {} does not divide the {} output channels of "
                    "weight {}",
                    op, p.groups, O, shape_str(w)));
  if (w[1] * p.groups != C) {
    const std::string per_group =
        p.groups == 1 ? "" : fmt::format(" ({} per group x {} groups)", w[1], p.groups);
    throw std::invalid_argument(
        fmt::format("{}: input {} has {} channels but weight {} expects {}{}", op, shape_str(in), C,
                    shape_str(w), w[1] * p.groups, per_group));
  }
  const int64_t eff_h = p.dilation.h * (w[2] - 1) + 1, eff_w = p.dilation.w * (w[3] - 1) + 1;
  const int64_t ph = in[2] + 2 * p.padding.h, pw = in[3] + 2 * p.padding.w;
  if (eff_h > ph || eff_w > pw)
    throw std::invalid_argument(fmt::format(
        "{}: kernel {}x{} (dilated to {}x{}) is larger than the padded input {}x{} (input {}, "
        "weight {}, {})",
        op, w[2], w[3], eff_h, eff_w, ph, pw, shape_str(in), shape_str(w), params_str(p)));
  const int64_t oh = conv_output_size(in[2], w[2], p.stride.h, p.padding.h, p.dilation.h);
  const int64_t ow = conv_output_size(in[3], w[3], p.stride.w, p.padding.w, p.dilation.w);
  return {in[0], O, oh, ow};
}

void check_floating(const char* op, const char* what, const Tensor& t) {
  if (!is_floating(t.dtype()))
    throw std::invalid_argument(fmt::format("{}: {} must be a floating tensor, got {} {}", op, what,
                                            dtype_name(t.dtype()), t.shape_string()));
}

// Input sizes as 4-D (an unbatched [C, H, W] input is a batch of one).
Shape batched(const char* op, const Shape& in) {
  if (in.size() == 4) return in;
  if (in.size() == 3) return {1, in[0], in[1], in[2]};
  throw std::invalid_argument(fmt::format(
      "{}: input must be 3-D [C, H, W] or 4-D [N, C, H, W], got {}", op, shape_str(in)));
}

Tensor as_batched(const Tensor& t) {
  return t.dim() == 3 ? unsqueeze(t, 0) : t;
}

// The backward ops' checks of the forward geometry (input `input_sizes`, weight
// `weight_sizes`) and of grad_output: floating, with the forward output's shape and the
// input's rank. Returns the input's batched (4-D) shape.
Shape check_backward(const char* op, const Tensor& grad_output, const Shape& input_sizes,
                     const Shape& weight_sizes, const Conv2dParams& p) {
  const Shape in4 = batched(op, input_sizes);
  const Shape out_shape = conv_output_shape(op, in4, weight_sizes, p);
  check_floating(op, "grad_output", grad_output);
  const Shape gy_shape = batched(op, grad_output.sizes());
  if (gy_shape != out_shape || grad_output.dim() != static_cast<int64_t>(input_sizes.size()))
    throw std::invalid_argument(
        fmt::format("{}: grad_output {} does not match the output {} of input {} "
                    "and weight {}",
                    op, grad_output.shape_string(), shape_str(out_shape), shape_str(input_sizes),
                    shape_str(weight_sizes)));
  return in4;
}

}  // namespace

int64_t conv_output_size(int64_t in, int64_t kernel, int64_t stride, int64_t padding,
                         int64_t dilation, bool ceil_mode) {
  const int64_t span =
      in + 2 * padding - dilation * (kernel - 1) - 1 + (ceil_mode ? stride - 1 : 0);
  // Floor division (the numerator may be negative when the kernel does not fit).
  int64_t out = (span >= 0 ? span / stride : -((-span + stride - 1) / stride)) + 1;
  if (ceil_mode && (out - 1) * stride >= in + padding) --out;
  return out;
}

Tensor conv2d(const Tensor& input, const Tensor& weight, const Tensor& bias, Int2 stride,
              Int2 padding, Int2 dilation, int64_t groups) {
  static const OpInfo info("conv2d");
  check_same_device(info.name, input.device(), weight.device());
  if (bias.defined()) check_same_device(info.name, input.device(), bias.device());
  DispatchScope scope(info, input, weight, bias);
  const Conv2dParams p{stride, padding, dilation, groups};
  const Shape in4 = batched(info.name, input.sizes());
  const Shape out_shape = conv_output_shape(info.name, in4, weight.sizes(), p);
  check_floating(info.name, "input", input);
  if (weight.dtype() != input.dtype())
    throw std::invalid_argument(fmt::format("conv2d: input {} is {} but weight {} is {}",
                                            input.shape_string(), dtype_name(input.dtype()),
                                            weight.shape_string(), dtype_name(weight.dtype())));
  if (bias.defined()) {
    if (bias.dim() != 1 || bias.size(0) != weight.size(0))
      throw std::invalid_argument(
          fmt::format("conv2d: bias {} does not match the {} output channels of "
                      "weight {}",
                      bias.shape_string(), weight.size(0), weight.shape_string()));
    if (bias.dtype() != input.dtype())
      throw std::invalid_argument(fmt::format("conv2d: input is {} but bias {} is {}",
                                              dtype_name(input.dtype()), bias.shape_string(),
                                              dtype_name(bias.dtype())));
  }
  const DType ct = compute_dtype(input.dtype(), input.device());
  const MemoryFormat f = conv_format(input, weight);
  const MemoryFormat kf = kernel_memory_format(input.device(), f);
  const Tensor x = prepare(as_batched(input), ct, kf);
  const Tensor w = prepare(weight, ct, kf);
  const Tensor b = bias.defined() ? prepare(bias, ct) : Tensor();
  Tensor out = alloc_output(out_shape, ct, input.device(), kf);
  conv_backends.get(info, input.device(), &ConvKernels::conv2d_forward)(out, x, w, b, p);
  out = contiguous(to(out, input.dtype()), f);
  return input.dim() == 3 ? squeeze(out, 0) : out;
}

namespace {
// conv2d's gradient for the input (for_input: `other` is the weight) or for the weight (`other`
// is the forward input), computed in the format conv_format picks and returned in it.
Tensor conv2d_backward(const OpInfo& info, const Tensor& grad_output, const Tensor& other,
                       const Shape& input_sizes, const Shape& weight_sizes, const Conv2dParams& p,
                       bool for_input) {
  check_same_device(info.name, grad_output.device(), other.device());
  DispatchScope scope(info, grad_output, other);
  const Shape in4 = check_backward(info.name, grad_output, input_sizes, weight_sizes, p);
  const Device dev = grad_output.device();
  const DType ct = compute_dtype(grad_output.dtype(), dev);
  const MemoryFormat f = conv_format(grad_output, other);
  const MemoryFormat kf = kernel_memory_format(dev, f);
  const Tensor gy = prepare(as_batched(grad_output), ct, kf);
  const Tensor o = prepare(for_input ? other : as_batched(other), ct, kf);
  Tensor g = alloc_output(for_input ? in4 : weight_sizes, ct, dev, kf);
  conv_backends.get(info, dev,
                    for_input ? &ConvKernels::conv2d_backward_input
                              : &ConvKernels::conv2d_backward_weight)(g, gy, o, p);
  g = contiguous(to(g, grad_output.dtype()), f);
  return for_input && input_sizes.size() == 3 ? squeeze(g, 0) : g;
}
}  // namespace

Tensor conv2d_backward_input(const Tensor& grad_output, const Tensor& weight,
                             const Shape& input_sizes, Int2 stride, Int2 padding, Int2 dilation,
                             int64_t groups) {
  static const OpInfo info("conv2d_backward_input");
  return conv2d_backward(info, grad_output, weight, input_sizes, weight.sizes(),
                         {stride, padding, dilation, groups}, /*for_input=*/true);
}

Tensor conv_transpose2d(const Tensor& input, const Tensor& weight, const Tensor& bias, Int2 stride,
                        Int2 padding, Int2 output_padding, int64_t groups, Int2 dilation) {
  static const OpInfo info("conv_transpose2d");
  check_same_device(info.name, input.device(), weight.device());
  if (bias.defined()) check_same_device(info.name, input.device(), bias.device());
  DispatchScope scope(info, input, weight, bias);
  check_floating(info.name, "input", input);
  if (input.dim() != 3 && input.dim() != 4)
    throw std::invalid_argument(
        fmt::format("conv_transpose2d: expected a 3-D or 4-D input, got {}", input.shape_string()));
  if (weight.dim() != 4)
    throw std::invalid_argument(
        fmt::format("conv_transpose2d: expected a 4-D weight [C, O / groups, kH, kW], got {}",
                    weight.shape_string()));
  if (weight.dtype() != input.dtype())
    throw std::invalid_argument(fmt::format("conv_transpose2d: input {} is {} but weight {} is {}",
                                            input.shape_string(), dtype_name(input.dtype()),
                                            weight.shape_string(), dtype_name(weight.dtype())));
  const Shape in4 = batched(info.name, input.sizes());
  if (groups <= 0 || in4[1] != weight.size(0) || weight.size(0) % groups != 0)
    throw std::invalid_argument(fmt::format(
        "conv_transpose2d: input {} has {} channels; weight {} expects {} (divisible by groups "
        "{})",
        input.shape_string(), in4[1], weight.shape_string(), weight.size(0), groups));
  const int64_t out_channels = base::checked_mul(weight.size(1), groups, "conv_transpose2d");
  if (stride.h <= 0 || stride.w <= 0 || dilation.h <= 0 || dilation.w <= 0 || padding.h < 0 ||
      padding.w < 0 || output_padding.h < 0 || output_padding.w < 0)
    throw std::invalid_argument(
        fmt::format("conv_transpose2d: stride {} and dilation {} must be positive, padding {} and "
                    "output_padding {} non-negative",
                    stride.str(), dilation.str(), padding.str(), output_padding.str()));
  if (output_padding.h >= stride.h || output_padding.w >= stride.w)
    throw std::invalid_argument(
        fmt::format("conv_transpose2d: output_padding {} must be smaller than stride {}",
                    output_padding.str(), stride.str()));
  auto out_size = [](int64_t in, int64_t k, int64_t s, int64_t p, int64_t d, int64_t op) {
    constexpr const char* what = "conv_transpose2d output size";
    const int64_t grown =
        base::checked_add(base::checked_mul(in - 1, s, what),
                          base::checked_add(base::checked_mul(d, k - 1, what), op + 1, what), what);
    return grown - base::checked_mul(p, int64_t{2}, what);
  };
  const int64_t oh =
      out_size(in4[2], weight.size(2), stride.h, padding.h, dilation.h, output_padding.h);
  const int64_t ow =
      out_size(in4[3], weight.size(3), stride.w, padding.w, dilation.w, output_padding.w);
  if (oh <= 0 || ow <= 0)
    throw std::invalid_argument(fmt::format(
        "conv_transpose2d: input {} with weight {}, stride {}, padding {} gives an empty output "
        "({}, {})",
        input.shape_string(), weight.shape_string(), stride.str(), padding.str(), oh, ow));
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != out_channels))
    throw std::invalid_argument(
        fmt::format("conv_transpose2d: bias {} does not match the {} output channels of weight {}",
                    bias.shape_string(), out_channels, weight.shape_string()));
  Shape out_sizes = {in4[0], out_channels, oh, ow};
  if (input.dim() == 3) out_sizes.erase(out_sizes.begin());
  Tensor out = conv2d_backward_input(input, weight, out_sizes, stride, padding, dilation, groups);
  if (bias.defined()) {
    const Shape per_channel =
        input.dim() == 3 ? Shape{out_channels, 1, 1} : Shape{1, out_channels, 1, 1};
    out = add(out, reshape(to(bias, out.dtype()), per_channel));
  }
  return out;
}

Tensor conv2d_backward_weight(const Tensor& grad_output, const Tensor& input,
                              const Shape& weight_sizes, Int2 stride, Int2 padding, Int2 dilation,
                              int64_t groups) {
  static const OpInfo info("conv2d_backward_weight");
  return conv2d_backward(info, grad_output, input, input.sizes(), weight_sizes,
                         {stride, padding, dilation, groups}, /*for_input=*/false);
}

}  // namespace tally::ops

namespace tally {

MemoryFormat conv_memory_format(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined() && t->dim() == 4 && t->suggest_memory_format() == MemoryFormat::channels_last)
      return MemoryFormat::channels_last;
  return MemoryFormat::contiguous;
}

bool ConvWorkspace::same_call(const ConvWorkspace& o) const {
  auto eq = [](const int* a, const int* b, int n) { return std::equal(a, a + n, b); };
  return kind == o.kind && dtype == o.dtype && tf32 == o.tf32 && eq(x, o.x, 4) && eq(w, o.w, 4) &&
         eq(y, o.y, 4) && eq(pad, o.pad, 2) && eq(stride, o.stride, 2) &&
         eq(dilation, o.dilation, 2) && groups == o.groups && accumulate == o.accumulate &&
         nhwc == o.nhwc;
}

}  // namespace tally
