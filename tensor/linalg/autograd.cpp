// Differentiable linear algebra: forward, what is saved, and backward, one function each.
//   C = A B:  dA = dC B^T (needs B),  dB = A^T dC (needs A),  each reduced over the batch
//   dimensions its operand was broadcast along.
#include "tensor/linalg/autograd.h"

#include <fmt/format.h>

#include "autograd/autocast.h"
#include "autograd/node.h"
#include "memory/context.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

namespace {

// Gradients of C = A B for the user's shapes sa, sb (1-D operands promoted as in forward).
// a / b are the saved operands (undefined when not needed).
TensorList product_backward(const Tensor& g, const Tensor& a, const Tensor& b, const Shape& sa,
                            const Shape& sb, bool need_a, bool need_b) {
  const bool a1 = sa.size() == 1, b1 = sb.size() == 1;
  const int64_t K = sa.back();
  const Shape spa = a1 ? Shape{1, K} : sa;  // promoted shapes
  const Shape spb = b1 ? Shape{K, 1} : sb;
  // The gradient of the promoted product: batch + [M, N] (only size-1 dims inserted).
  Shape sg(g.sizes().begin(), g.sizes().end() - (a1 ? 0 : 1) - (b1 ? 0 : 1));
  sg.push_back(spa[spa.size() - 2]);
  sg.push_back(spb.back());
  const Tensor gp = o::reshape(g, sg);
  Tensor ga, gb;
  if (need_a) {
    const Tensor bp = o::reshape(b, spb);
    ga = o::reshape(o::sum_to(o::matmul(gp, o::transpose(bp, -1, -2)), spa), sa);
  }
  if (need_b) {
    const Tensor ap = o::reshape(a, spa);
    if (spb.size() == 2 && spa.size() > 2) {
      // One matrix for a batch: sum_b A_b^T dC_b = A2^T dC2 with the batch folded into rows.
      const int64_t rows = shape_numel(spa) / K;
      gb = o::mm(o::transpose(o::reshape(ap, {rows, K}), 0, 1), o::reshape(gp, {rows, spb.back()}));
    } else {
      gb = o::sum_to(o::matmul(o::transpose(ap, -1, -2), gp), spb);
    }
    gb = o::reshape(gb, sb);
  }
  return {ga, gb};
}

// The dtype linear_backward writes a weight's gradient in: float32 when backward delivers the
// weight's gradient in float32 (autograd::grad_dtype) and the product is 16-bit, so the GEMM
// writes it; otherwise the gradient's own dtype (the engine converts any other wish).
DType weight_grad(const Tensor& grad_output, DType wanted) {
  const DType g = grad_output.dtype();
  return wanted == DType::float32 && (g == DType::float16 || g == DType::bfloat16) ? wanted : g;
}

// A bias's gradient: grad_output summed over its leading dims, written in the dtype backward
// delivers the bias's gradient in (float32 for autocast's cast of a float32 parameter,
// autograd::grad_dtype) by the sum itself, so no cast follows.
Tensor bias_grad(const Tensor& grad_output, DType wanted) {
  Shape lead;
  for (int64_t d = 0; d + 1 < grad_output.dim(); ++d) lead.push_back(d);
  const DType dtype = weight_grad(grad_output, wanted);
  if (lead.empty())  // a 1-D input: the gradient itself (no dims is a full sum to o::sum)
    return grad_output.dtype() == dtype ? grad_output : o::to(grad_output, dtype);
  return o::sum(grad_output, lead, false, dtype);
}

// Saves the operands first (autograd::save_inputs: a checkpoint recompute that needs nothing
// more stops before the product), then computes out = product(a, b) and records it.
template <typename Compute>
Tensor record_product(const char* name, const Tensor& a, const Tensor& b, Compute product) {
  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  std::vector<SavedTensor> saved =
      autograd::save_inputs(name, {a, b}, {need_b ? a : Tensor(), need_a ? b : Tensor()});
  Tensor out = product_output([&] { return product(a, b); });
  autograd::record_saved(
      name, {a, b}, {out}, std::move(saved),
      [sa = a.sizes(), sb = b.sizes()](BackwardContext& ctx, const TensorList& g) -> TensorList {
        const bool na = ctx.needs_input_grad(0), nb = ctx.needs_input_grad(1);
        return product_backward(g[0], nb ? ctx.saved(0) : Tensor(), na ? ctx.saved(1) : Tensor(),
                                sa, sb, na, nb);
      });
  return out;
}

}  // namespace

Tensor matmul(const Tensor& a_, const Tensor& b_, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [a, b] = autocast::lower("matmul", a_, b_);
  return record_product("MatmulBackward", a, b, o::matmul);
}

Tensor mm(const Tensor& a_, const Tensor& b_, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [a, b] = autocast::lower("mm", a_, b_);
  return record_product("MmBackward", a, b, o::mm);
}

Tensor bmm(const Tensor& a_, const Tensor& b_, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [a, b] = autocast::lower("bmm", a_, b_);
  return record_product("BmmBackward", a, b, o::bmm);
}

Tensor linear(const Tensor& x_, const Tensor& weight_, const Tensor& bias_, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [x, weight, bias] = autocast::lower("linear", x_, weight_, bias_);
  const bool need_x = x.requires_grad(), need_w = weight.requires_grad();
  // Saved before the product (record_product's comment).
  std::vector<SavedTensor> saved = autograd::save_inputs(
      "LinearBackward", {x, weight, bias}, {need_w ? x : Tensor(), need_x ? weight : Tensor()});
  // Named references: clang 14 does not capture structured bindings in a lambda.
  const Tensor &in = x, &w = weight, &b = bias;
  Tensor out = product_output([&] { return o::linear(in, w, b); });
  // The weight's gradient in the dtype backward delivers it in (float32 for autocast's cast of
  // a float32 parameter: written so by the GEMM).
  const DType gw_dtype = autograd::grad_dtype(weight);
  const DType gb_dtype = bias.defined() ? autograd::grad_dtype(bias) : DType::float32;
  autograd::record_saved(
      "LinearBackward", {x, weight, bias}, {out}, std::move(saved),
      [sx = x.sizes(), out_f = weight.size(0), gw_dtype, gb_dtype](
          BackwardContext& ctx, const TensorList& g) -> TensorList {
        const bool nx = ctx.needs_input_grad(0), nw = ctx.needs_input_grad(1),
                   nb = ctx.needs_input_grad(2);
        // The bias gradient a sum, as PyTorch's (in the bias's gradient dtype).
        const Tensor gb = nb ? bias_grad(g[0], gb_dtype) : Tensor();
        if (!nw) {  // x was not saved (only the weight, when x needs a gradient)
          const int64_t rows = shape_numel(Shape(sx.begin(), sx.end() - 1));
          Tensor gx;
          if (nx) gx = o::reshape(o::mm(o::reshape(g[0], {rows, out_f}), ctx.saved(1)), sx);
          return {gx, Tensor(), gb};
        }
        // x saved: the raw op.
        auto [gx, gw, unused] = o::linear_backward(ctx.saved(0), g[0], nx ? ctx.saved(1) : Tensor(),
                                                   {nx, true, false}, weight_grad(g[0], gw_dtype));
        return {gx, gw, gb};
      });
  return out;
}

Tensor linear_gelu_linear(const Tensor& x_, const Tensor& fc_weight_, const Tensor& fc_bias_,
                          const Tensor& proj_weight_, const Tensor& proj_bias_, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [x, w1, b1, w2, b2] =
      autocast::lower("linear", x_, fc_weight_, fc_bias_, proj_weight_, proj_bias_);
  if (w2.dim() == 2 && w1.dim() == 2 && w2.size(1) != w1.size(0))
    throw std::invalid_argument(
        fmt::format("linear_gelu_linear: fc_weight {} makes {} features but proj_weight {} "
                    "expects {}",
                    w1.shape_string(), w1.size(0), w2.shape_string(), w2.size(1)));
  auto [h, pre] = o::linear_gelu(x, w1, b1);
  // Saved before the second product, so a checkpoint recompute stops there (early stop, as
  // linear's: a transformer block's last product is never run again).
  const char* name = "LinearGeluLinearBackward";
  std::vector<SavedTensor> saved =
      autograd::save_inputs(name, {x, w1, b1, w2, b2}, {x, w1, pre, h, w2});
  Tensor out = o::linear(h, w2, b2);
  const DType gw1_dtype = autograd::grad_dtype(w1), gw2_dtype = autograd::grad_dtype(w2);
  const DType gb1_dtype = b1.defined() ? autograd::grad_dtype(b1) : DType::float32,
              gb2_dtype = b2.defined() ? autograd::grad_dtype(b2) : DType::float32;
  autograd::record_saved(
      name, {x, w1, b1, w2, b2}, {out}, std::move(saved),
      [gw1_dtype, gw2_dtype, gb1_dtype, gb2_dtype](BackwardContext& ctx,
                                                   const TensorList& g) -> TensorList {
        const bool nx = ctx.needs_input_grad(0), nw1 = ctx.needs_input_grad(1),
                   nb1 = ctx.needs_input_grad(2), nw2 = ctx.needs_input_grad(3),
                   nb2 = ctx.needs_input_grad(4);
        const Tensor w2s = ctx.saved(4);
        Tensor gw2, gb2, gx, gw1, gb1;
        if (nw2) {
          auto [unused, gw, unused_b] = o::linear_backward(
              ctx.saved(3), g[0], w2s, {false, true, false}, weight_grad(g[0], gw2_dtype));
          gw2 = gw;
        }
        if (nb2) gb2 = bias_grad(g[0], gb2_dtype);
        if (nx || nw1 || nb1) {
          const Tensor pre_s = ctx.saved(2);
          const int64_t hidden = pre_s.size(-1), out_f = w2s.size(0);
          const int64_t rows = out_f ? g[0].numel() / out_f : 0;
          // d(pre) = (g W2) * gelu'(pre), in one product.
          const Tensor dpre =
              o::mm_dgelu(o::reshape(g[0], {rows, out_f}), w2s, o::reshape(pre_s, {rows, hidden}));
          if (nx || nw1) {
            auto [gx_, gw_, unused] =
                o::linear_backward(ctx.saved(0), o::reshape(dpre, pre_s.sizes()), ctx.saved(1),
                                   {nx, nw1, false}, weight_grad(dpre, gw1_dtype));
            gx = gx_;
            gw1 = gw_;
          }
          if (nb1) gb1 = bias_grad(dpre, gb1_dtype);
        }
        return {gx, gw1, gb1, gw2, gb2};
      });
  return out;
}

Tensor embedding(const Tensor& weight, const Tensor& indices, int64_t padding_idx, CallSite site) {
  memory::CallSiteScope call_site(site);
  const int64_t V = weight.dim() == 2 ? weight.size(0) : 0;
  if (weight.dim() == 2 && (padding_idx < -1 || padding_idx >= V))
    throw std::invalid_argument(
        fmt::format("embedding: padding_idx {} must be -1 (none) or in "
                    "[0, {}) for weight {}",
                    padding_idx, V, weight.shape_string()));
  Tensor out = o::embedding(weight, indices);  // checks weight and indices
  record("EmbeddingBackward", {weight}, {out}, {indices},
         [V, padding_idx](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {o::embedding_backward(g[0], ctx.saved(0), V, padding_idx)};
         });
  return out;
}

}  // namespace tally
