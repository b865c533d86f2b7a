// Differentiable conv2d: forward, what is saved, and backward in one function.
#include "tensor/conv/autograd.h"

#include "autograd/autocast.h"
#include "autograd/node.h"
#include "memory/context.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

Tensor conv2d(const Tensor& input_, const Tensor& weight_, const Tensor& bias_, Int2 stride,
              Int2 padding, Int2 dilation, int64_t groups, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [input, weight, bias] = autocast::lower("conv2d", input_, weight_, bias_);
  Tensor out = o::conv2d(input, weight, bias, stride, padding, dilation, groups);
  // d/d(input) needs the weight; d/d(weight) needs the input; d/d(bias) needs neither.
  const bool input_grad = input.requires_grad(), weight_grad = weight.requires_grad();
  record("Conv2dBackward", {input, weight, bias}, {out},
         {weight_grad ? input : Tensor(), input_grad ? weight : Tensor()},
         [in_sizes = input.sizes(), w_sizes = weight.sizes(), stride, padding, dilation, groups](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           Tensor gx, gw, gb;
           if (ctx.needs_input_grad(0))
             gx = o::conv2d_backward_input(g[0], ctx.saved(1), in_sizes, stride, padding, dilation,
                                           groups);
           if (ctx.needs_input_grad(1))
             gw = o::conv2d_backward_weight(g[0], ctx.saved(0), w_sizes, stride, padding, dilation,
                                            groups);
           if (ctx.needs_input_grad(2))
             gb = in_sizes.size() == 4 ? o::sum(g[0], {0, 2, 3}) : o::sum(g[0], {1, 2});
           return {gx, gw, gb};
         });
  return out;
}

}  // namespace tally
