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

// Saves the operands first (autograd::save_inputs: a checkpoint recompute that needs nothing
// more stops before the product), then computes out = product(a, b) and records it.
template <typename Compute>
Tensor record_product(const char* name, const Tensor& a, const Tensor& b, Compute product) {
  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  std::vector<SavedTensor> saved =
      autograd::save_inputs(name, {a, b}, {need_b ? a : Tensor(), need_a ? b : Tensor()});
  Tensor out = product(a, b);
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
  Tensor out = o::linear(x, weight, bias);
  autograd::record_saved("LinearBackward", {x, weight, bias}, {out}, std::move(saved),
                         [sx = x.sizes(), out_f = weight.size(0)](
                             BackwardContext& ctx, const TensorList& g) -> TensorList {
                           const bool nx = ctx.needs_input_grad(0), nw = ctx.needs_input_grad(1),
                                      nb = ctx.needs_input_grad(2);
                           if (!nw) {  // x was not saved (only the weight, when x needs a gradient)
                             const int64_t rows = shape_numel(Shape(sx.begin(), sx.end() - 1));
                             const Tensor g2 = o::reshape(g[0], {rows, out_f});
                             Tensor gx, gb;
                             if (nx) gx = o::reshape(o::mm(g2, ctx.saved(1)), sx);
                             if (nb) gb = o::sum(g2, {0});
                             return {gx, Tensor(), gb};
                           }
                           // x saved: the raw op (its bias gradient a sum, as PyTorch's).
                           auto [gx, gw, gb] = o::linear_backward(
                               ctx.saved(0), g[0], nx ? ctx.saved(1) : Tensor(), {nx, true, nb});
                           return {gx, gw, gb};
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
