// Differentiable pooling: forward, what is saved, and backward, one function each.
// Max pooling keeps the argmax (int64, output-sized) rather than the input; the average
// pools keep nothing but shapes.
#include "tensor/pool/autograd.h"

#include "autograd/node.h"
#include "memory/context.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

std::pair<Tensor, Tensor> max_pool2d_with_indices(const Tensor& x, Int2 kernel_size, Int2 stride,
                                                  Int2 padding, Int2 dilation, bool ceil_mode,
                                                  CallSite site) {
  memory::CallSiteScope call_site(site);
  auto [out, indices] =
      o::max_pool2d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode);
  record("MaxPool2DWithIndicesBackward", {x}, {out}, {indices},
         [in_sizes = x.sizes(), f = x.suggest_memory_format(), kernel_size, stride, padding,
          dilation, ceil_mode](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {o::contiguous(o::max_pool2d_backward(g[0], ctx.saved(0), in_sizes, kernel_size,
                                                        stride, padding, dilation, ceil_mode),
                                 f)};
         });
  return {out, indices};
}

Tensor max_pool2d(const Tensor& x, Int2 kernel_size, Int2 stride, Int2 padding, Int2 dilation,
                  bool ceil_mode, CallSite site) {
  memory::CallSiteScope call_site(site);
  return max_pool2d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode).first;
}

Tensor avg_pool2d(const Tensor& x, Int2 kernel_size, Int2 stride, Int2 padding, bool ceil_mode,
                  bool count_include_pad, std::optional<int64_t> divisor_override, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                             divisor_override);
  record(
      "AvgPool2DBackward", {x}, {out}, {},
      [in_sizes = x.sizes(), f = x.suggest_memory_format(), kernel_size, stride, padding, ceil_mode,
       count_include_pad, divisor_override](BackwardContext&, const TensorList& g) -> TensorList {
        return {
            o::contiguous(o::avg_pool2d_backward(g[0], in_sizes, kernel_size, stride, padding,
                                                 ceil_mode, count_include_pad, divisor_override),
                          f)};
      });
  return out;
}

Tensor upsample(const Tensor& x, const Shape& output_size, const std::vector<double>& scale_factors,
                bool linear, bool align_corners, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::upsample(x, output_size, scale_factors, linear, align_corners);
  // PyTorch's node names, by mode and rank (without its trailing 0, as Tally's others).
  static const char* const kNearest[] = {"UpsampleNearest1DBackward", "UpsampleNearest2DBackward",
                                         "UpsampleNearest3DBackward"};
  static const char* const kLinear[] = {"UpsampleLinear1DBackward", "UpsampleBilinear2DBackward",
                                        "UpsampleTrilinear3DBackward"};
  const size_t k = static_cast<size_t>(x.dim() - 3);
  record(linear ? kLinear[k] : kNearest[k], {x}, {out}, {},
         [in_sizes = x.sizes(), scale_factors, linear, align_corners](
             BackwardContext&, const TensorList& g) -> TensorList {
           return {o::upsample_backward(g[0], in_sizes, scale_factors, linear, align_corners)};
         });
  return out;
}

Tensor adaptive_avg_pool2d(const Tensor& x, Int2 output_size, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::adaptive_avg_pool2d(x, output_size);
  record("AdaptiveAvgPool2DBackward", {x}, {out}, {},
         [in_sizes = x.sizes(), f = x.suggest_memory_format()](BackwardContext&,
                                                               const TensorList& g) -> TensorList {
           // The gradient in the input's layout (a channels_last input's stays so).
           return {o::contiguous(o::adaptive_avg_pool2d_backward(g[0], in_sizes, f), f)};
         });
  return out;
}

}  // namespace tally
