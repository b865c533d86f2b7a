// Differentiable index family: forward, what is saved, and backward, one function each.
#include "tensor/index/autograd.h"

#include "autograd/node.h"
#include "memory/context.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

namespace {

// Gradient of a gather along dim: zeros of the input's shape with g added at index.
Tensor gather_backward(const Tensor& g, const Shape& sizes, int64_t dim, const Tensor& index) {
  return o::scatter_add(o::zeros(sizes, g.dtype(), g.device()), dim, index, g);
}

// Gradient of a scatter's src: g gathered at index, in zeros of src's shape where src is
// larger than index (the rest of src was never read).
Tensor scatter_src_backward(const Tensor& g, int64_t dim, const Tensor& index,
                            const Shape& src_sizes) {
  Tensor gs = o::gather(g, dim, index);
  if (gs.sizes() == src_sizes) return gs;
  Tensor z = o::zeros(src_sizes, gs.dtype(), gs.device());
  Tensor part = z;
  for (int64_t d = 0; d < gs.dim(); ++d) part = o::narrow(part, d, 0, gs.size(d));
  o::copy_(part, gs);
  return z;
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
               CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::scatter(x, dim, index, src);
  record("ScatterBackward", {x, src}, {out}, {index},
         [dim, ss = src.sizes()](BackwardContext& ctx, const TensorList& g) -> TensorList {
           const Tensor& i = ctx.saved(0);
           Tensor gx, gs;
           if (ctx.needs_input_grad(0)) gx = o::scatter(g[0], dim, i, 0.0);
           if (ctx.needs_input_grad(1)) gs = scatter_src_backward(g[0], dim, i, ss);
           return {gx, gs};
         });
  return out;
}

Tensor scatter(const Tensor& x, int64_t dim, const Tensor& index, double value, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::scatter(x, dim, index, value);
  record("ScatterBackward", {x}, {out}, {index},
         [dim](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {o::scatter(g[0], dim, ctx.saved(0), 0.0)};
         });
  return out;
}

Tensor scatter_add(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& src,
                   CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::scatter_add(x, dim, index, src);
  record("ScatterAddBackward", {x, src}, {out}, {index},
         [dim, ss = src.sizes()](BackwardContext& ctx, const TensorList& g) -> TensorList {
           Tensor gs;
           if (ctx.needs_input_grad(1)) gs = scatter_src_backward(g[0], dim, ctx.saved(0), ss);
           return {g[0], gs};
         });
  return out;
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
