// Differentiable shape ops: forward, what is saved (nothing), and backward, one function
// each. cat/stack hand each input a slice of the incoming gradient (a view, converted to
// the input's dtype when cat promoted it); split/chunk join their pieces' gradients.
#include "tensor/shape/autograd.h"

#include "autograd/node.h"
#include "base/checked.h"
#include "memory/context.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

namespace {

struct InputMeta {
  Shape sizes;
  DType dtype;
  bool skipped;  // cat's legacy rule: a [0] tensor among higher-rank ones
};

std::vector<InputMeta> metas(const TensorList& ts) {
  std::vector<InputMeta> m;
  m.reserve(ts.size());
  for (size_t i = 0; i < ts.size(); ++i)
    m.push_back({ts[i].sizes(), ts[i].dtype(), o::cat_skips(ts, i)});
  return m;
}

// When the pieces' gradients already lie side by side along d in one contiguous tensor of
// the input's shape (the fused attention writes q, k, v's gradients into one [B, T, 3C]
// buffer), that tensor, as a view; otherwise undefined and the caller concatenates.
Tensor joined_view(const TensorList& g, int64_t d, const Shape& sizes, DType dtype) {
  if (g.empty() || !g[0].defined()) return {};
  const Tensor& first = g[0];
  const Shape strides = contiguous_strides(sizes);
  const int64_t step = strides[static_cast<size_t>(d)];
  int64_t at = 0;
  for (const Tensor& p : g) {
    if (!p.defined() || p.dtype() != dtype || !p.storage().is_same(first.storage()) ||
        p.sizes().size() != sizes.size() || p.strides() != strides ||
        p.storage_offset() != first.storage_offset() + at * step)
      return {};
    for (int64_t i = 0; i < p.dim(); ++i)
      if (i != d && p.size(i) != sizes[static_cast<size_t>(i)]) return {};
    at += p.size(d);
  }
  if (at != sizes[static_cast<size_t>(d)]) return {};
  static constexpr const char* what = "joined_view: the end of the joined gradient";
  const size_t end = base::checked_mul(
      static_cast<size_t>(base::checked_add(first.storage_offset(), shape_numel(sizes), what)),
      dtype_size(dtype), what);
  if (end > first.storage().nbytes()) return {};
  return o::as_strided(first, sizes, strides, first.storage_offset());
}

// Records the backward of split/chunk: the pieces' gradients joined along d.
TensorList record_split(const char* name, const Tensor& t, TensorList pieces, int64_t dim) {
  if (!autograd::needs_grad({t})) return pieces;
  const int64_t d = o::wrap_dim(dim, t.dim(), name);
  record(
      name, {t}, pieces, {},
      [d, dt = t.dtype(), sizes = t.sizes()](BackwardContext&, const TensorList& g) -> TensorList {
        if (Tensor joined = joined_view(g, d, sizes, dt); joined.defined()) return {joined};
        // The engine hands zeros for pieces that received no gradient.
        return {o::to(o::cat(g, d), dt)};
      });
  return pieces;
}

}  // namespace

Tensor cat(const TensorList& tensors, int64_t dim, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::cat(tensors, dim);
  if (!autograd::needs_grad(tensors)) return out;
  record("CatBackward", tensors, {out}, {},
         [d = o::cat_dim(tensors, dim), inputs = metas(tensors)](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           TensorList grads(inputs.size());
           int64_t offset = 0;
           for (size_t i = 0; i < inputs.size(); ++i) {
             const InputMeta& in = inputs[i];
             if (in.skipped) {
               if (ctx.needs_input_grad(i)) grads[i] = o::zeros(in.sizes, in.dtype, g[0].device());
               continue;
             }
             const int64_t n = in.sizes[static_cast<size_t>(d)];
             if (ctx.needs_input_grad(i)) grads[i] = o::to(o::narrow(g[0], d, offset, n), in.dtype);
             offset += n;
           }
           return grads;
         });
  return out;
}

Tensor stack(const TensorList& tensors, int64_t dim, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::stack(tensors, dim);
  if (!autograd::needs_grad(tensors)) return out;
  std::vector<DType> dtypes;
  for (const Tensor& t : tensors) dtypes.push_back(t.dtype());
  record("StackBackward", tensors, {out}, {},
         [d = o::wrap_dim(dim, tensors[0].dim() + 1, "stack"), dtypes](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           TensorList grads(dtypes.size());
           for (size_t i = 0; i < dtypes.size(); ++i)
             if (ctx.needs_input_grad(i))
               grads[i] = o::to(o::select(g[0], d, static_cast<int64_t>(i)), dtypes[i]);
           return grads;
         });
  return out;
}

TensorList split(const Tensor& t, int64_t split_size, int64_t dim, CallSite site) {
  memory::CallSiteScope call_site(site);
  return record_split("SplitBackward", t, o::split(t, split_size, dim), dim);
}

TensorList split(const Tensor& t, const std::vector<int64_t>& sizes, int64_t dim, CallSite site) {
  memory::CallSiteScope call_site(site);
  return record_split("SplitWithSizesBackward", t, o::split(t, sizes, dim), dim);
}

TensorList chunk(const Tensor& t, int64_t chunks, int64_t dim, CallSite site) {
  memory::CallSiteScope call_site(site);
  return record_split("ChunkBackward", t, o::chunk(t, chunks, dim), dim);
}

}  // namespace tally
