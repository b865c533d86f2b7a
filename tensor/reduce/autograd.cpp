// Differentiable reduce family: forward, what is saved, and backward, one function each.
#include "tensor/reduce/autograd.h"

#include <algorithm>
#include <cmath>

#include "autograd/autocast.h"
#include "autograd/node.h"
#include "memory/context.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

namespace {

// `dims` wrapped and sorted (a 0-D input has none).
Shape wrapped_dims(const Shape& dims, int64_t rank, const char* op) {
  Shape ds;
  if (rank == 0) return ds;
  for (int64_t d : dims) ds.push_back(o::wrap_dim(d, rank, op));
  std::sort(ds.begin(), ds.end());
  return ds;
}

// A reduction's result (or gradient) over `dims` (wrapped; empty = all) broadcast back to
// `shape`.
Tensor unreduce(const Tensor& r, const Shape& shape, const Shape& dims, bool keepdim) {
  Tensor k = r;
  if (!keepdim) {
    if (dims.empty()) {
      k = o::reshape(r, Shape(shape.size(), 1));
    } else {
      for (int64_t d : dims) k = o::unsqueeze(k, d);
    }
  }
  return o::expand(k, shape);
}

// How many elements each output of a reduction over `dims` (wrapped; empty = all) covers.
int64_t reduced_count(const Tensor& x, const Shape& dims) {
  if (dims.empty()) return x.numel();
  int64_t n = 1;
  for (int64_t d : dims) n *= x.sizes()[static_cast<size_t>(d)];
  return n;
}

// PyTorch's evenly_distribute_backward, per reduced slice: the gradient of an extreme value
// split evenly among the elements equal to it (NaN results: among the NaNs).
Tensor evenly_distribute(const Tensor& g, const Tensor& x, const Tensor& result, const Shape& dims,
                         bool keepdim) {
  const Tensor r = unreduce(result, x.sizes(), dims, keepdim);
  const Tensor both_nan =
      o::mul(o::binary(o::BinaryOp::ne, x, x), o::binary(o::BinaryOp::ne, r, r));
  const Tensor mask = o::to(o::add(o::binary(o::BinaryOp::eq, x, r), both_nan), g.dtype());
  const Tensor count = o::sum(mask, dims, /*keepdim=*/true);
  return o::mul(o::div(unreduce(g, x.sizes(), dims, keepdim), count), mask);
}

Tensor record_extreme(const char* name, const Tensor& x, Tensor out, const Shape& dims,
                      bool keepdim) {
  record(name, {x}, {out}, {x, out},
         [dims, keepdim](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {evenly_distribute(g[0], ctx.saved(0), ctx.saved(1), dims, keepdim)};
         });
  return out;
}

ValuesIndices record_select(const char* name, const Tensor& x, ValuesIndices r, int64_t dim,
                            bool keepdim) {
  record(
      name, {x}, {r.values}, {r.indices},
      [sizes = x.sizes(), dim, keepdim](BackwardContext& ctx, const TensorList& g) -> TensorList {
        return {o::value_selecting_reduction_backward(g[0], ctx.saved(0), sizes, dim, keepdim)};
      });
  return r;
}

// d(var)/dx = 2 (x - mean) / max(0, N - correction), times the incoming gradient.
Tensor var_backward(const Tensor& g, const Tensor& x, const Shape& dims, double correction,
                    bool keepdim) {
  const auto n = static_cast<double>(reduced_count(x, dims));
  const Tensor diff = o::sub(x, o::mean(x, dims, /*keepdim=*/true));
  return o::mul(o::mul(diff, unreduce(g, x.sizes(), dims, keepdim)),
                2.0 / std::max(0.0, n - correction));
}

}  // namespace

// ---------------------------------------------------------------- selections

ValuesIndices max(const Tensor& x, int64_t dim, bool keepdim) {
  return record_select("MaxBackward", x, o::max(x, dim, keepdim), dim, keepdim);
}

ValuesIndices min(const Tensor& x, int64_t dim, bool keepdim) {
  return record_select("MinBackward", x, o::min(x, dim, keepdim), dim, keepdim);
}

Tensor max(const Tensor& x, CallSite site) {
  memory::CallSiteScope call_site(site);
  return record_extreme("MaxBackward", x, o::max(x), {}, false);
}
Tensor min(const Tensor& x, CallSite site) {
  memory::CallSiteScope call_site(site);
  return record_extreme("MinBackward", x, o::min(x), {}, false);
}

Tensor amax(const Tensor& x, const Shape& dims, bool keepdim, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::amax(x, dims, keepdim);
  return record_extreme("AmaxBackward", x, out, wrapped_dims(dims, x.dim(), "amax"), keepdim);
}

Tensor amin(const Tensor& x, const Shape& dims, bool keepdim, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::amin(x, dims, keepdim);
  return record_extreme("AminBackward", x, out, wrapped_dims(dims, x.dim(), "amin"), keepdim);
}

// ---------------------------------------------------------------- statistics

Tensor var(const Tensor& x, const Shape& dims, double correction, bool keepdim, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::var(x, dims, correction, keepdim);
  record("VarBackward", {x}, {out}, {x},
         [dims = wrapped_dims(dims, x.dim(), "var"), correction, keepdim](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {var_backward(g[0], ctx.saved(0), dims, correction, keepdim)};
         });
  return out;
}

Tensor std(const Tensor& x, const Shape& dims, double correction, bool keepdim, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::std(x, dims, correction, keepdim);
  record("StdBackward", {x}, {out}, {x, out},
         [dims = wrapped_dims(dims, x.dim(), "std"), correction, keepdim](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           // d(std) = d(var) / (2 std); where std == 0 the gradient is 0, as PyTorch.
           const Tensor s = ctx.saved(1);
           const Tensor gv =
               o::where(o::binary_scalar(o::BinaryOp::eq, s, 0.0),
                        o::zeros({}, g[0].dtype(), g[0].device()), o::div(g[0], o::mul(s, 2.0)));
           return {var_backward(gv, ctx.saved(0), dims, correction, keepdim)};
         });
  return out;
}

Tensor logsumexp(const Tensor& x_, const Shape& dims, bool keepdim, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [x] = autocast::fp32("logsumexp", x_);
  Tensor out = o::logsumexp(x, dims, keepdim);
  record("LogsumexpBackward", {x}, {out}, {x, out},
         [dims = wrapped_dims(dims, x.dim(), "logsumexp"), keepdim](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           // d/dx = softmax(x) over dims = exp(x - logsumexp(x)).
           const Tensor x_ = ctx.saved(0);
           const Tensor r = unreduce(ctx.saved(1), x_.sizes(), dims, keepdim);
           const Tensor p = o::unary(o::UnaryOp::exp, o::sub(x_, r));
           return {o::mul(p, unreduce(g[0], x_.sizes(), dims, keepdim))};
         });
  return out;
}

Tensor logsumexp(const Tensor& x, int64_t dim, bool keepdim, CallSite site) {
  memory::CallSiteScope call_site(site);
  return logsumexp(x, Shape{dim}, keepdim);
}

}  // namespace tally
