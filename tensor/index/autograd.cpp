// Differentiable index family: forward, what is saved, and backward, one function each.
#include "tensor/index/autograd.h"

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "autograd/node.h"
#include "memory/context.h"
#include "tensor/dispatch.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

namespace {

// Gradient of a gather along dim: zeros of the input's shape with g added at index.
Tensor gather_backward(const Tensor& g, const Shape& sizes, int64_t dim, const Tensor& index) {
  return o::scatter_add(o::zeros(sizes, g.dtype(), g.device()), dim, index, g);
}

// src's gradient gs (index's shape) in zeros of src's shape where src is larger than index
// (the rest of src was never read).
Tensor pad_to(const Tensor& gs, const Shape& src_sizes) {
  if (gs.sizes() == src_sizes) return gs;
  Tensor z = o::zeros(src_sizes, gs.dtype(), gs.device());
  Tensor part = z;
  for (int64_t d = 0; d < gs.dim(); ++d) part = o::narrow(part, d, 0, gs.size(d));
  o::copy_(part, gs);
  return z;
}

// Gradient of a scatter's src: g gathered at index.
Tensor scatter_src_backward(const Tensor& g, int64_t dim, const Tensor& index,
                            const Shape& src_sizes) {
  return pad_to(o::gather(g, dim, index), src_sizes);
}

// The product of the sources each place of `like` got in a scatter with reduce='multiply'
// (1 where none came): d out / d x.
Tensor scatter_product(const Tensor& like, int64_t dim, const Tensor& index, const Tensor& src) {
  return o::scatter(o::ones(like.sizes(), src.dtype(), src.device()), dim, index, src, "multiply");
}

// Gradient of src in out = scatter(x, dim, index, src, reduce='multiply'): place p holds
// x[p] times its sources' product, so src[j] (sent to p) gets g[p] x[p] times the product
// of p's other sources. Zero sources are counted rather than divided by: a nonzero src[j]
// gets g x (product of p's nonzero sources) / src[j] when p got no zero, a zero src[j] gets
// g x (that product) when it is p's only zero; every other gradient is 0.
Tensor scatter_mul_src_backward(const Tensor& g, const Tensor& x, int64_t dim, const Tensor& index,
                                const Tensor& src) {
  Tensor s = src;
  for (int64_t d = 0; d < index.dim(); ++d) s = o::narrow(s, d, 0, index.size(d));
  const Tensor zero = o::binary_scalar(o::BinaryOp::eq, s, 0.0);
  const Tensor safe = o::masked_fill(s, zero, 1.0);
  const Tensor at =
      o::gather(o::mul(o::mul(g, x), scatter_product(x, dim, index, safe)), dim, index);
  const Tensor zeros_at = o::gather(o::scatter_add(o::zeros(x.sizes(), g.dtype(), g.device()), dim,
                                                   index, o::to(zero, g.dtype())),
                                    dim, index);
  const Tensor none = o::binary_scalar(o::BinaryOp::eq, zeros_at, 0.0);
  const Tensor one = o::binary_scalar(o::BinaryOp::eq, zeros_at, 1.0);
  const Tensor zg = o::masked_fill(at, o::binary_scalar(o::BinaryOp::eq, one, 0.0), 0.0);
  const Tensor ng =
      o::masked_fill(o::div(at, safe), o::binary_scalar(o::BinaryOp::eq, none, 0.0), 0.0);
  return pad_to(o::where(zero, zg, ng), src.sizes());
}

Tensor record_scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
                          Tensor out) {
  record("ScatterAddBackward", {x, src}, {out}, {index},
         [dim, ss = src.sizes()](BackwardContext& ctx, const TensorList& g) -> TensorList {
           Tensor gs;
           if (ctx.needs_input_grad(1)) gs = scatter_src_backward(g[0], dim, ctx.saved(0), ss);
           return {g[0], gs};
         });
  return out;
}

// out is x with the places at index (along dim) set to a constant: x's gradient is g with
// those places zeroed, by the same op (`zero_at`).
using ZeroAt = Tensor (*)(const Tensor& g, int64_t dim, const Tensor& index);
Tensor scatter_zero(const Tensor& g, int64_t dim, const Tensor& index) {
  return o::scatter(g, dim, index, 0.0);
}
Tensor index_fill_zero(const Tensor& g, int64_t dim, const Tensor& index) {
  return o::index_fill(g, dim, index, 0.0);
}
Tensor record_overwrite(const char* name, ZeroAt zero_at, const Tensor& x, int64_t dim,
                        const Tensor& index, Tensor out) {
  record(name, {x}, {out}, {index},
         [zero_at, dim](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {zero_at(g[0], dim, ctx.saved(0))};
         });
  return out;
}

// out depends on x as the identity (a scalar added at some places).
Tensor record_identity(const char* name, const Tensor& x, Tensor out) {
  record(name, {x}, {out}, {},
         [](BackwardContext&, const TensorList& g) -> TensorList { return {g[0]}; });
  return out;
}

}  // namespace

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::gather(x, dim, index);
  record("GatherBackward", {x}, {out}, {index},
         [sizes = x.sizes(), dim](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {gather_backward(g[0], sizes, dim, ctx.saved(0))};
         });
  return out;
}

Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
               const std::string& reduce, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::scatter(x, dim, index, src, reduce);
  if (reduce == "add" || reduce == "sum") return record_scatter_add(x, dim, index, src, out);
  if (reduce == "multiply") {
    record("ScatterBackward", {x, src}, {out}, {index, x, src},
           [dim](BackwardContext& ctx, const TensorList& g) -> TensorList {
             const Tensor &i = ctx.saved(0), &xs = ctx.saved(1), &ss = ctx.saved(2);
             Tensor gx, gs;
             if (ctx.needs_input_grad(0)) gx = o::mul(g[0], scatter_product(xs, dim, i, ss));
             if (ctx.needs_input_grad(1)) gs = scatter_mul_src_backward(g[0], xs, dim, i, ss);
             return {gx, gs};
           });
    return out;
  }
  record("ScatterBackward", {x, src}, {out}, {index},
         [dim, ss = src.sizes()](BackwardContext& ctx, const TensorList& g) -> TensorList {
           const Tensor& i = ctx.saved(0);
           Tensor gx, gs;
           if (ctx.needs_input_grad(0)) gx = scatter_zero(g[0], dim, i);
           if (ctx.needs_input_grad(1)) gs = scatter_src_backward(g[0], dim, i, ss);
           return {gx, gs};
         });
  return out;
}

Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, double value,
               const std::string& reduce, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::scatter(x, dim, index, value, reduce);
  if (reduce == "add" || reduce == "sum") return record_identity("ScatterBackward", x, out);
  if (reduce == "multiply") {
    record("ScatterBackward", {x}, {out}, {index},
           [dim, value](BackwardContext& ctx, const TensorList& g) -> TensorList {
             const Tensor& i = ctx.saved(0);
             const Tensor v = o::expand(o::full({}, value, g[0].dtype(), g[0].device()), i.sizes());
             return {o::mul(g[0], scatter_product(g[0], dim, i, v))};
           });
    return out;
  }
  return record_overwrite("ScatterBackward", scatter_zero, x, dim, index, out);
}

Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
                   CallSite site) {
  memory::CallSiteScope call_site(site);
  return record_scatter_add(x, dim, index, src, o::scatter_add(x, dim, index, src));
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::index_select(x, dim, index);
  record("IndexSelectBackward", {x}, {out}, {index},
         [sizes = x.sizes(), dim](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {
               o::index_add(o::zeros(sizes, g[0].dtype(), g[0].device()), dim, ctx.saved(0), g[0])};
         });
  return out;
}

Tensor index_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& source,
                 double alpha, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::index_add(x, dim, index, source, alpha);
  record("IndexAddBackward", {x, source}, {out}, {index},
         [dim, alpha](BackwardContext& ctx, const TensorList& g) -> TensorList {
           Tensor gs;
           if (ctx.needs_input_grad(1)) {
             gs = o::index_select(g[0], dim, ctx.saved(0));
             if (alpha != 1.0) gs = o::mul(gs, alpha);
           }
           return {g[0], gs};
         });
  return out;
}

Tensor index_fill(const Tensor& x, int64_t dim, const Tensor& index, double value, CallSite site) {
  memory::CallSiteScope call_site(site);
  return record_overwrite("IndexFillBackward", index_fill_zero, x, dim, index,
                          o::index_fill(x, dim, index, value));
}

Tensor index_fill(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& value,
                  CallSite site) {
  memory::CallSiteScope call_site(site);
  if (value.dim() != 0)
    throw std::invalid_argument(fmt::format(
        "index_fill: only supports a 0-dimensional value tensor, but got tensor with {} "
        "dimension(s) {}",
        value.dim(), value.shape_string()));
  Tensor out = o::index_fill(x, dim, index, o::item(value));
  record("IndexFillBackward", {x, value}, {out}, {index},
         [dim, vd = value.dtype()](BackwardContext& ctx, const TensorList& g) -> TensorList {
           const Tensor gx = index_fill_zero(g[0], dim, ctx.saved(0));
           Tensor gv;
           // g at the filled places (g - gx is exactly that, zero elsewhere), summed.
           if (ctx.needs_input_grad(1)) gv = o::to(o::sum(o::sub(g[0], gx)), vd);
           return {gx, gv};
         });
  return out;
}

namespace {

// Where x[..., mask, ...] reads at dim: x's shape with the mask's dims as one (`flat`), the
// wrapped dim, and the mask's true positions in that dim (int64 on x's device; read back to
// the host, as the result's size depends on them). `op` names the caller in the errors.
struct MaskPlan {
  Shape flat;
  int64_t dim = 0;
  Tensor positions;
};

MaskPlan mask_plan(const char* op, const Tensor& x, int64_t dim, const Tensor& mask) {
  const int64_t k = mask.dim();
  if (mask.dtype() != DType::bool_ || k == 0)
    throw std::invalid_argument(
        fmt::format("{}: the mask must be a bool tensor of 1 or "
                    "more dims, got {} {}",
                    op, dtype_name(mask.dtype()), mask.shape_string()));
  const int64_t d = o::wrap_dim(dim, x.dim(), op);
  bool ok = d + k <= x.dim();
  for (int64_t j = 0; ok && j < k; ++j) ok = mask.size(j) == x.size(d + j);
  if (!ok)
    throw std::out_of_range(
        fmt::format("{}: the mask {} does not match the indexed tensor {} at dims {} to {}", op,
                    mask.shape_string(), x.shape_string(), d, d + k - 1));
  check_same_device(op, x.device(), mask.device());
  MaskPlan p;
  p.dim = d;
  p.flat.assign(x.sizes().begin(), x.sizes().begin() + d);
  p.flat.push_back(mask.numel());
  p.flat.insert(p.flat.end(), x.sizes().begin() + d + k, x.sizes().end());
  const std::vector<double> m = o::to_vector(mask);
  std::vector<double> where;
  for (size_t i = 0; i < m.size(); ++i)
    if (m[i] != 0.0) where.push_back(static_cast<double>(i));
  p.positions =
      o::from_vector(where, {static_cast<int64_t>(where.size())}, DType::int64, x.device());
  return p;
}

}  // namespace

Tensor index_mask(const Tensor& x, int64_t dim, const Tensor& mask, CallSite site) {
  memory::CallSiteScope call_site(site);
  const MaskPlan p = mask_plan("index_mask", x, dim, mask);
  return index_select(x.reshape(p.flat), p.dim, p.positions, site);
}

Tensor index_mask_put(const Tensor& x, int64_t dim, const Tensor& mask, const Tensor& values,
                      CallSite site) {
  memory::CallSiteScope call_site(site);
  const MaskPlan p = mask_plan("index_mask_put", x, dim, mask);
  check_same_device("index_mask_put", x.device(), values.device());
  Shape selected = p.flat;
  selected[static_cast<size_t>(p.dim)] = p.positions.numel();
  // values broadcast to x[..., mask, ...]'s shape (o::broadcast_shapes names both on a misfit).
  if (o::broadcast_shapes(values.sizes(), selected, "index_mask_put") != selected)
    throw std::invalid_argument(
        fmt::format("index_mask_put: values {} do not broadcast to the selected shape {}",
                    values.shape_string(), shape_str(selected)));
  const Tensor v = (values.dtype() == x.dtype() ? values : values.to(x.dtype())).expand(selected);
  // The selected entries zeroed, then the values added there: positions are distinct. One node,
  // named as PyTorch's index_put_ gradient, so the result's grad_fn reads as PyTorch's.
  const Shape flat = p.flat;
  const int64_t d = p.dim;
  const Tensor cleared = o::index_fill(o::reshape(x, flat), d, p.positions, 0.0);
  Tensor out = o::reshape(o::index_add(cleared, d, p.positions, v, 1.0), x.sizes());
  record("IndexPutBackward0", {x, v}, {out}, {p.positions},
         [flat, d, sizes = x.sizes()](BackwardContext& ctx, const TensorList& g) -> TensorList {
           const Tensor gf = o::reshape(g[0], flat);
           Tensor gx, gv;
           if (ctx.needs_input_grad(0))
             gx = o::reshape(index_fill_zero(gf, d, ctx.saved(0)), sizes);
           if (ctx.needs_input_grad(1)) gv = o::index_select(gf, d, ctx.saved(0));
           return {gx, gv};
         });
  return out;
}

Tensor cumsum(const Tensor& x, int64_t dim, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::cumsum(x, dim);
  record("CumsumBackward", {x}, {out}, {},
         [dim](BackwardContext&, const TensorList& g) -> TensorList {
           return {o::cumsum(g[0], dim, /*reverse=*/true)};
         });
  return out;
}

namespace {

// Gradient of out = cumprod(x) along dim. Before a row's first zero: the reversed cumulative
// sum of g * out over x. At the first zero z: the reversed cumulative sum of g times the
// running product with x[z] taken as 1. After it: 0 (every product there holds x[z]).
Tensor cumprod_backward(const Tensor& g, const Tensor& x, const Tensor& out, int64_t dim) {
  const Tensor zero = o::binary_scalar(o::BinaryOp::eq, x, 0.0);
  const Tensor seen = o::cumsum(zero, dim);  // zeros up to here (int64)
  const Tensor before = o::binary_scalar(o::BinaryOp::eq, seen, 0.0);
  const Tensor first =
      o::binary_scalar(o::BinaryOp::eq, o::mul(o::to(zero, DType::int64), seen), 1.0);
  const Tensor safe = o::masked_fill(x, zero, 1.0);
  const Tensor t1 = o::div(o::cumsum(o::mul(g, out), dim, /*reverse=*/true), safe);
  const Tensor t2 =
      o::cumsum(o::mul(g, o::cumprod(o::masked_fill(x, first, 1.0), dim)), dim, /*reverse=*/true);
  return o::where(before, t1,
                  o::masked_fill(t2, o::binary_scalar(o::BinaryOp::eq, first, 0.0), 0.0));
}

}  // namespace

Tensor cumprod(const Tensor& x, int64_t dim, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::cumprod(x, dim);
  if (!is_floating(x.dtype())) return out;
  record("CumprodBackward", {x}, {out}, {x, out},
         [dim](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {cumprod_backward(g[0], ctx.saved(0), ctx.saved(1), dim)};
         });
  return out;
}

namespace {

ValuesIndices record_sorted(const char* name, const Tensor& x, ValuesIndices r, int64_t dim) {
  record(name, {x}, {r.values}, {r.indices},
         [sizes = x.sizes(), dim](BackwardContext& ctx, const TensorList& g) -> TensorList {
           if (sizes.empty()) return {g[0]};
           return {gather_backward(g[0], sizes, dim, ctx.saved(0))};
         });
  return r;
}

}  // namespace

ValuesIndices sort(const Tensor& x, int64_t dim, bool descending) {
  return record_sorted("SortBackward", x, o::sort(x, dim, descending), dim);
}

ValuesIndices topk(const Tensor& x, int64_t k, int64_t dim, bool largest, bool sorted) {
  return record_sorted("TopkBackward", x, o::topk(x, k, dim, largest, sorted), dim);
}

Tensor flip(const Tensor& x, const Shape& dims, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::flip(x, dims);
  record("FlipBackward", {x}, {out}, {},
         [dims](BackwardContext&, const TensorList& g) -> TensorList {
           return {o::flip(g[0], dims)};
         });
  return out;
}

Tensor roll(const Tensor& x, const Shape& shifts, const Shape& dims, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::roll(x, shifts, dims);
  Shape back;
  for (int64_t s : shifts) back.push_back(-s);
  record("RollBackward", {x}, {out}, {},
         [back, dims](BackwardContext&, const TensorList& g) -> TensorList {
           return {o::roll(g[0], back, dims)};
         });
  return out;
}

Tensor masked_select(const Tensor& x, const Tensor& mask, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::masked_select(x, mask);
  record("MaskedSelectBackward", {x}, {out}, {mask},
         [sizes = x.sizes()](BackwardContext& ctx, const TensorList& g) -> TensorList {
           const Tensor& m = ctx.saved(0);
           const Shape shape = o::broadcast_shapes(sizes, m.sizes(), "masked_select");
           Tensor gx = o::zeros(shape, g[0].dtype(), g[0].device());
           o::masked_scatter_(gx, m, g[0]);
           return {o::sum_to(gx, sizes)};
         });
  return out;
}

}  // namespace tally
