// Differentiable conv2d: forward, what is saved, and backward in one function.
#include "tensor/conv/autograd.h"

#include "autograd/autocast.h"
#include "autograd/node.h"
#include "memory/context.h"
#include "tensor/conv/transpose.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

Tensor conv2d(const Tensor& input_, const Tensor& weight_, const Tensor& bias_, Int2 stride,
              Int2 padding, Int2 dilation, int64_t groups, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [input, weight, bias] = autocast::lower("conv2d", input_, weight_, bias_);
  // Named references: clang 14 does not capture structured bindings in a lambda.
  const Tensor &in = input, &w = weight, &b = bias;
  Tensor out =
      product_output([&] { return o::conv2d(in, w, b, stride, padding, dilation, groups); });
  // d/d(input) needs the weight; d/d(weight) needs the input; d/d(bias) needs neither.
  const bool input_grad = input.requires_grad(), weight_grad = weight.requires_grad();
  record(
      "Conv2dBackward", {input, weight, bias}, {out},
      {weight_grad ? input : Tensor(), input_grad ? weight : Tensor()},
      [in_sizes = input.sizes(), w_sizes = weight.sizes(),
       w_format = weight.suggest_memory_format(), out_format = out.suggest_memory_format(), stride,
       padding, dilation, groups](BackwardContext& ctx, const TensorList& g) -> TensorList {
        // The gradients run in the forward's layout (a row-major upstream gradient of a
        // channels_last convolution is laid out channels_last first, as PyTorch does).
        const Tensor gy = out_format == MemoryFormat::channels_last
                              ? o::contiguous(g[0], MemoryFormat::channels_last)
                              : g[0];
        Tensor gx, gw, gb;
        if (ctx.needs_input_grad(0))
          gx = o::conv2d_backward_input(gy, ctx.saved(1), in_sizes, stride, padding, dilation,
                                        groups);
        if (ctx.needs_input_grad(1))
          // In the weight's layout (a channels_last product of channels_last activations
          // goes back to a row-major weight's).
          gw = o::contiguous(o::conv2d_backward_weight(gy, ctx.saved(0), w_sizes, stride, padding,
                                                       dilation, groups),
                             w_format);
        if (ctx.needs_input_grad(2))
          gb = in_sizes.size() == 4 ? o::sum(g[0], {0, 2, 3}) : o::sum(g[0], {1, 2});
        return {gx, gw, gb};
      });
  return out;
}

Tensor conv_transpose2d(const Tensor& input_, const Tensor& weight_, const Tensor& bias_,
                        Int2 stride, Int2 padding, Int2 output_padding, int64_t groups,
                        Int2 dilation, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [input, weight, bias] = autocast::lower("conv_transpose2d", input_, weight_, bias_);
  Tensor out =
      o::conv_transpose2d(input, weight, bias, stride, padding, output_padding, groups, dilation);
  const bool input_grad = input.requires_grad(), weight_grad = weight.requires_grad();
  record("ConvolutionBackward", {input, weight, bias}, {out},
         {weight_grad ? input : Tensor(), input_grad ? weight : Tensor()},
         [in_sizes = input.sizes(), w_sizes = weight.sizes(), stride, padding, dilation, groups](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           Tensor gx, gw, gb;
           // out = conv2d's input gradient of `input`, so d/d(input) is conv2d itself and
           // d/d(weight) conv2d's weight gradient with `input` as the output's gradient.
           if (ctx.needs_input_grad(0))
             gx = o::conv2d(g[0], ctx.saved(1), {}, stride, padding, dilation, groups);
           if (ctx.needs_input_grad(1))
             gw = o::conv2d_backward_weight(ctx.saved(0), g[0], w_sizes, stride, padding, dilation,
                                            groups);
           if (ctx.needs_input_grad(2))
             gb = in_sizes.size() == 4 ? o::sum(g[0], {0, 2, 3}) : o::sum(g[0], {1, 2});
           return {gx, gw, gb};
         });
  return out;
}

}  // namespace tally
