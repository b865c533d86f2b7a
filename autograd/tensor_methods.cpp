// Tensor's differentiable methods (declared in tensor/tensor.h): views, conversions and the
// autograd surface (requires_grad, grad, backward, hooks).
#include <fmt/format.h>

#include <atomic>
#include <numeric>

#include "autograd/node.h"
#include "autograd/ops.h"

namespace tally {

using autograd::AutogradMeta;
using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

namespace {

// Records a view-like op whose backward maps the gradient with `back`.
Tensor view_op(const char* name, const Tensor& in, Tensor out,
               std::function<Tensor(const Tensor&)> back) {
  record(name, {in}, {out}, {},
         [back = std::move(back)](BackwardContext&, const TensorList& g) -> TensorList {
           return {back(g[0])};
         });
  return out;
}

// Gradient of a slice-like view: zeros of the input's shape with g written into the view.
std::function<Tensor(const Tensor&)> scatter_back(const Tensor& in,
                                                  std::function<Tensor(const Tensor&)> make_view) {
  return [shape = in.sizes(), dt = in.dtype(), dev = in.device(),
          make_view = std::move(make_view)](const Tensor& g) {
    Tensor z = o::zeros(shape, dt, dev);
    o::copy_(make_view(z), g);
    return z;
  };
}

}  // namespace

Tensor Tensor::view(const Shape& shape) const {
  return view_op("ViewBackward", *this, o::view(*this, shape),
                 [s = sizes()](const Tensor& g) { return o::reshape(g, s); });
}

Tensor Tensor::reshape(const Shape& shape) const {
  return view_op("ReshapeBackward", *this, o::reshape(*this, shape),
                 [s = sizes()](const Tensor& g) { return o::reshape(g, s); });
}

Tensor Tensor::permute(const Shape& dims) const {
  Tensor out = o::permute(*this, dims);  // checks dims: one per dimension, each once
  Shape inv(dims.size());
  for (size_t i = 0; i < dims.size(); ++i)
    inv[static_cast<size_t>(o::wrap_dim(dims[i], dim(), "permute"))] = static_cast<int64_t>(i);
  return view_op("PermuteBackward", *this, std::move(out),
                 [inv](const Tensor& g) { return o::permute(g, inv); });
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  return view_op("TransposeBackward", *this, o::transpose(*this, d0, d1),
                 [d0, d1](const Tensor& g) { return o::transpose(g, d0, d1); });
}

Tensor Tensor::t() const {
  if (dim() > 2)
    throw std::invalid_argument(
        fmt::format("t: expects a tensor with <= 2 dimensions, got {}", dim()));
  return dim() < 2 ? *this : transpose(0, 1);
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  return view_op("NarrowBackward", *this, o::narrow(*this, d, start, length),
                 scatter_back(*this, [d, start, length](const Tensor& z) {
                   return o::narrow(z, d, start, length);
                 }));
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  return view_op("SliceBackward", *this, o::slice(*this, d, start, end, step),
                 scatter_back(*this, [d, start, end, step](const Tensor& z) {
                   return o::slice(z, d, start, end, step);
                 }));
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  return view_op(
      "SelectBackward", *this, o::select(*this, d, index),
      scatter_back(*this, [d, index](const Tensor& z) { return o::select(z, d, index); }));
}

Tensor Tensor::expand(const Shape& shape) const {
  return view_op("ExpandBackward", *this, o::expand(*this, shape),
                 [s = sizes()](const Tensor& g) { return o::sum_to(g, s); });
}

Tensor Tensor::squeeze() const {
  return view_op("SqueezeBackward", *this, o::squeeze(*this),
                 [s = sizes()](const Tensor& g) { return o::reshape(g, s); });
}
Tensor Tensor::squeeze(int64_t d) const {
  return view_op("SqueezeBackward", *this, o::squeeze(*this, d),
                 [s = sizes()](const Tensor& g) { return o::reshape(g, s); });
}
Tensor Tensor::unsqueeze(int64_t d) const {
  return view_op("UnsqueezeBackward", *this, o::unsqueeze(*this, d),
                 [s = sizes()](const Tensor& g) { return o::reshape(g, s); });
}
Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  return view_op("FlattenBackward", *this, o::flatten(*this, start_dim, end_dim),
                 [s = sizes()](const Tensor& g) { return o::reshape(g, s); });
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return view_op("ContiguousBackward", *this, o::contiguous(*this),
                 [](const Tensor& g) { return g; });
}

Tensor Tensor::contiguous(MemoryFormat f) const {
  if (is_contiguous(f)) return *this;
  return view_op("ContiguousBackward", *this, o::contiguous(*this, f),
                 [](const Tensor& g) { return g; });
}

Tensor Tensor::to(Device device, DType dtype, std::source_location site) const {
  if (this->device() == device && this->dtype() == dtype) return *this;
  memory::CallSiteScope call_site(site);
  Tensor out = o::to(*this, device, dtype);
  if (!is_floating(dtype)) return out;
  return view_op(
      "ToCopyBackward", *this, out,
      [d = this->device(), t = this->dtype()](const Tensor& g) { return o::to(g, d, t); });
}
Tensor Tensor::to(Device device, std::source_location site) const {
  return to(device, dtype(), site);
}
Tensor Tensor::to(DType dtype, std::source_location site) const {
  return to(device(), dtype, site);
}

Tensor Tensor::clone() const {
  return view_op("CloneBackward", *this, o::clone(*this), [](const Tensor& g) { return g; });
}

Tensor Tensor::detach() const {
  return Tensor::make(storage(), sizes(), strides(), storage_offset(), dtype());
}

double Tensor::item() const {
  return o::item(*this);
}
std::vector<double> Tensor::tolist() const {
  return o::to_vector(*this);
}

bool Tensor::requires_grad() const {
  const AutogradMeta* m = autograd_meta();
  return m && m->requires_grad;
}

Tensor& Tensor::requires_grad_(bool requires_grad) {
  auto& meta = autograd_meta_ptr();
  if (meta && meta->grad_fn && !requires_grad)
    throw std::runtime_error(
        "requires_grad_: you can only change requires_grad flags of leaf tensors");
  if (requires_grad && !is_floating(dtype()))
    throw std::invalid_argument(
        fmt::format("requires_grad_: only floating point tensors can require gradients (got {})",
                    dtype_name(dtype())));
  if (!meta) meta = std::make_shared<AutogradMeta>();
  meta->requires_grad = requires_grad;
  return *this;
}

bool Tensor::is_leaf() const {
  const AutogradMeta* m = autograd_meta();
  return !m || !m->grad_fn;
}

Tensor Tensor::grad() const {
  const AutogradMeta* m = autograd_meta();
  return m ? m->grad : Tensor();
}

void Tensor::set_grad(const Tensor& g) const {
  auto& meta = autograd_meta_ptr();
  if (!meta) meta = std::make_shared<AutogradMeta>();
  if (g.defined() && g.sizes() != sizes())
    throw std::invalid_argument(
        fmt::format("set_grad: gradient of shape {} for a tensor of shape {}", g.shape_string(),
                    shape_string()));
  meta->grad = g;
}

void Tensor::backward(const Tensor& gradient, bool retain_graph, std::source_location site) const {
  memory::CallSiteScope call_site(site);
  autograd::backward({*this}, {gradient}, retain_graph);
}

void Tensor::register_hook(std::function<Tensor(const Tensor&)> hook) const {
  if (!requires_grad())
    throw std::runtime_error(
        "register_hook: cannot register a hook on a tensor that doesn't require gradient");
  AutogradMeta* m = autograd_meta();
  if (m->grad_fn) {
    m->grad_fn->output_hooks[m->output_nr].push_back(std::move(hook));
  } else {
    m->hooks.push_back(std::move(hook));
  }
}

}  // namespace tally

namespace tally::autograd {

uint64_t register_post_accumulate_grad_hook(const Tensor& t, PostAccumulateGradHook hook) {
  if (!t.requires_grad())
    throw std::runtime_error(
        "register_post_accumulate_grad_hook: cannot register a hook on a tensor that doesn't "
        "require gradient");
  AutogradMeta* m = t.autograd_meta();
  if (m->grad_fn)
    throw std::runtime_error(
        "register_post_accumulate_grad_hook: post accumulate grad hooks cannot be registered on "
        "non-leaf tensors");
  static std::atomic<uint64_t> next_handle{1};
  const uint64_t handle = next_handle.fetch_add(1);
  m->post_accumulate_grad_hooks.emplace_back(handle, std::move(hook));
  return handle;
}

void remove_post_accumulate_grad_hook(const Tensor& t, uint64_t handle) {
  AutogradMeta* m = t.autograd_meta();
  if (!m) return;
  std::erase_if(m->post_accumulate_grad_hooks,
                [handle](const auto& h) { return h.first == handle; });
}

}  // namespace tally::autograd

namespace tally {

Tensor Tensor::sum() const {
  return tally::sum(*this);
}
Tensor Tensor::mean() const {
  return tally::mean(*this);
}
Tensor Tensor::sin() const {
  return tally::sin(*this);
}
Tensor Tensor::cos() const {
  return tally::cos(*this);
}
Tensor Tensor::erf() const {
  return tally::erf(*this);
}
Tensor Tensor::lerp(const Tensor& end, const Tensor& weight) const {
  return tally::lerp(*this, end, weight);
}
Tensor Tensor::lerp(const Tensor& end, double weight) const {
  return tally::lerp(*this, end, weight);
}
Tensor Tensor::gather(int64_t dim, const Tensor& index) const {
  return tally::gather(*this, dim, index);
}
Tensor Tensor::scatter(int64_t dim, const Tensor& index, const Tensor& src,
                       const std::string& reduce) const {
  return tally::scatter(*this, dim, index, src, reduce);
}
Tensor Tensor::scatter(int64_t dim, const Tensor& index, double value,
                       const std::string& reduce) const {
  return tally::scatter(*this, dim, index, value, reduce);
}
Tensor Tensor::scatter_add(int64_t dim, const Tensor& index, const Tensor& src) const {
  return tally::scatter_add(*this, dim, index, src);
}
Tensor Tensor::index_select(int64_t dim, const Tensor& index) const {
  return tally::index_select(*this, dim, index);
}
Tensor Tensor::index_add(int64_t dim, const Tensor& index, const Tensor& source,
                         double alpha) const {
  return tally::index_add(*this, dim, index, source, alpha);
}
Tensor Tensor::index_fill(int64_t dim, const Tensor& index, double value) const {
  return tally::index_fill(*this, dim, index, value);
}
Tensor Tensor::index_fill(int64_t dim, const Tensor& index, const Tensor& value) const {
  return tally::index_fill(*this, dim, index, value);
}
Tensor Tensor::cumsum(int64_t dim) const {
  return tally::cumsum(*this, dim);
}
Tensor Tensor::cumprod(int64_t dim) const {
  return tally::cumprod(*this, dim);
}
ValuesIndices Tensor::sort(int64_t dim, bool descending) const {
  return tally::sort(*this, dim, descending);
}
Tensor Tensor::argsort(int64_t dim, bool descending) const {
  return tally::sort(*this, dim, descending).indices;
}
ValuesIndices Tensor::topk(int64_t k, int64_t dim, bool largest, bool sorted) const {
  return tally::topk(*this, k, dim, largest, sorted);
}
Tensor Tensor::flip(const Shape& dims) const {
  return tally::flip(*this, dims);
}
Tensor Tensor::roll(const Shape& shifts, const Shape& dims) const {
  return tally::roll(*this, shifts, dims);
}
Tensor Tensor::masked_select(const Tensor& mask) const {
  return tally::masked_select(*this, mask);
}
Tensor Tensor::masked_fill(const Tensor& mask, double value) const {
  return tally::masked_fill(*this, mask, value);
}
Tensor Tensor::tril(int64_t diagonal) const {
  return tally::tril(*this, diagonal);
}
Tensor Tensor::triu(int64_t diagonal) const {
  return tally::triu(*this, diagonal);
}
Tensor Tensor::repeat(const Shape& sizes) const {
  return tally::repeat(*this, sizes);
}
Tensor& Tensor::masked_fill_(const Tensor& mask, double value) {
  ops::masked_fill_(*this, mask, value);
  return *this;
}
Tensor& Tensor::masked_scatter_(const Tensor& mask, const Tensor& source) {
  ops::masked_scatter_(*this, mask, source);
  return *this;
}
Tensor& Tensor::scatter_add_(int64_t dim, const Tensor& index, const Tensor& src) {
  ops::scatter_add_(*this, dim, index, src);
  return *this;
}
Tensor& Tensor::scatter_(int64_t dim, const Tensor& index, const Tensor& src,
                         const std::string& reduce) {
  ops::scatter_(*this, dim, index, src, reduce);
  return *this;
}
Tensor& Tensor::scatter_(int64_t dim, const Tensor& index, double value,
                         const std::string& reduce) {
  ops::scatter_(*this, dim, index, value, reduce);
  return *this;
}
Tensor& Tensor::index_add_(int64_t dim, const Tensor& index, const Tensor& source, double alpha) {
  ops::index_add_(*this, dim, index, source, alpha);
  return *this;
}
Tensor& Tensor::index_fill_(int64_t dim, const Tensor& index, double value) {
  ops::index_fill_(*this, dim, index, value);
  return *this;
}
Tensor& Tensor::index_fill_(int64_t dim, const Tensor& index, const Tensor& value) {
  if (value.dim() != 0)
    throw std::invalid_argument(
        fmt::format("index_fill_: only supports a 0-dimensional value tensor, but got tensor "
                    "with {} dimension(s) {}",
                    value.dim(), value.shape_string()));
  ops::index_fill_(*this, dim, index, ops::item(value));
  return *this;
}

}  // namespace tally
