// Tensor: a layout (sizes, strides, offset, dtype) over a shared Storage. Views share the
// storage and never allocate; contiguous() allocates only when the layout needs it.
//
// This header declares the whole user-facing Tensor surface. Layout accessors and
// printing are defined in tensor/; the methods that record the autograd graph (views,
// to(), backward(), grad(), ...) are defined in autograd/tensor_methods.cpp, so that the
// tensor layer itself knows nothing about the graph (it only carries an opaque pointer).
#pragma once

#include <functional>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <source_location>
#include <string>
#include <vector>

#include "base/checked.h"
#include "tensor/dtype.h"
#include "tensor/storage.h"

namespace tally {

namespace autograd {
struct AutogradMeta;
}

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);  // "[2, 3]"
// The number of elements; std::invalid_argument for a negative dimension, std::length_error
// naming the shape when it exceeds 2^63 - 1 (base::checked_numel).
int64_t shape_numel(const Shape& s);
Shape contiguous_strides(const Shape& sizes);

// PyTorch's memory formats (torch.memory_format). `contiguous`: row-major strides.
// `channels_last`: a 4-D [N, C, H, W] tensor laid out as NHWC in memory, strides
// [H * W * C, 1, W * C, C] (cuDNN's tensor-core convolutions read it without transposing).
// The sizes, indexing and every op's results are the same in both; only the layout differs.
enum class MemoryFormat { contiguous, channels_last };
const char* memory_format_name(MemoryFormat f);  // "contiguous_format", "channels_last"
// The strides of `f` for `sizes`; channels_last needs 4-D sizes (std::invalid_argument
// naming `what` and the shape otherwise).
Shape memory_format_strides(const Shape& sizes, MemoryFormat f, const char* what);

struct TensorOptions {
  DType dtype = DType::float32;
  Device device = Device::cpu();
  bool requires_grad = false;

  TensorOptions& with_dtype(DType d) {
    dtype = d;
    return *this;
  }
  TensorOptions& with_device(Device d) {
    device = d;
    return *this;
  }
  TensorOptions& with_requires_grad(bool r = true) {
    requires_grad = r;
    return *this;
  }
};

class Tensor;
using TensorList = std::vector<Tensor>;
struct ValuesIndices;  // tensor/reduce/ops.h: (values, indices) of sort, topk, max, ...

struct TensorImpl {
  Storage storage;
  Shape sizes;
  Shape strides;
  int64_t offset = 0;  // in elements
  DType dtype = DType::float32;
  std::shared_ptr<autograd::AutogradMeta> autograd;  // null: no autograd state
};

class Tensor {
 public:
  Tensor() = default;
  // A tensor over `storage` with the given layout (no copy, no checks beyond bounds).
  static Tensor make(Storage storage, Shape sizes, Shape strides, int64_t offset, DType dtype);

  bool defined() const { return impl_ != nullptr; }
  const Shape& sizes() const { return impl().sizes; }
  const Shape& strides() const { return impl().strides; }
  Shape shape() const { return impl().sizes; }
  int64_t dim() const { return static_cast<int64_t>(impl().sizes.size()); }
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t stride(int64_t d) const;
  int64_t numel() const { return shape_numel(impl().sizes); }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().storage.device(); }
  bool is_cuda() const { return device().type == DeviceType::cuda; }
  const Storage& storage() const { return impl().storage; }
  int64_t storage_offset() const { return impl().offset; }
  size_t element_size() const { return dtype_size(impl().dtype); }
  size_t nbytes() const {
    return base::checked_mul(static_cast<size_t>(numel()), element_size(), "Tensor::nbytes");
  }
  bool is_contiguous() const;
  // Laid out as `f` (dimensions of size 1 take any stride, as in PyTorch).
  bool is_contiguous(MemoryFormat f) const;
  // channels_last when the tensor is 4-D, channels-last-contiguous and not row-major
  // contiguous; else contiguous (PyTorch's suggest_memory_format for dense tensors).
  MemoryFormat suggest_memory_format() const;
  void* data_ptr() const;
  template <typename T>
  T* data() const {
    return static_cast<T*>(data_ptr());
  }
  // Same TensorImpl (the same tensor object, not just the same storage).
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }
  // How many Tensor handles share this tensor object (PyTorch's Tensor::use_count).
  long use_count() const { return impl_.use_count(); }
  TensorImpl* unsafe_impl() const { return impl_.get(); }

  std::string str() const;  // PyTorch-style "tensor([...], dtype=...)"
  std::string shape_string() const { return shape_str(sizes()); }

  // ---- autograd state (tensor layer: storage only) ----
  autograd::AutogradMeta* autograd_meta() const { return impl().autograd.get(); }
  std::shared_ptr<autograd::AutogradMeta>& autograd_meta_ptr() const { return impl().autograd; }

  // ---- defined in autograd/tensor_methods.cpp: differentiable ----
  Tensor view(const Shape& shape) const;
  Tensor reshape(const Shape& shape) const;
  Tensor permute(const Shape& dims) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const;  // 2-D transpose
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;
  Tensor expand(const Shape& shape) const;
  Tensor squeeze() const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor contiguous() const;
  // This tensor laid out as `f` (itself when it already is); differentiable.
  Tensor contiguous(MemoryFormat f) const;
  // `site`, defaulted at the caller, is the user's line the copy is attributed to
  // (memory::CallSiteScope), as for backward() and the factories.
  Tensor to(Device device, std::source_location site = std::source_location::current()) const;
  Tensor to(DType dtype, std::source_location site = std::source_location::current()) const;
  Tensor to(Device device, DType dtype,
            std::source_location site = std::source_location::current()) const;
  Tensor clone() const;
  Tensor detach() const;  // shares storage, no graph

  double item() const;  // reads one element back (a host synchronisation on CUDA)
  template <typename T>
  T item() const {
    return static_cast<T>(item());
  }
  std::vector<double> tolist() const;  // all elements, row-major, as double

  bool requires_grad() const;
  Tensor& requires_grad_(bool requires_grad = true);
  bool is_leaf() const;
  Tensor grad() const;
  void set_grad(const Tensor& g) const;
  // Backpropagate from this tensor (a scalar unless `gradient` is given).
  void backward(const Tensor& gradient = Tensor(), bool retain_graph = false,
                std::source_location site = std::source_location::current()) const;
  // Hook on the gradient flowing into this tensor; may return a replacement (or undefined).
  void register_hook(std::function<Tensor(const Tensor&)> hook) const;

  Tensor sum() const;
  Tensor mean() const;
  // Elementwise maps, as torch.Tensor's methods (tensor/elementwise/autograd.h).
  Tensor sin() const;
  Tensor cos() const;
  Tensor erf() const;
  Tensor lerp(const Tensor& end, const Tensor& weight) const;
  Tensor lerp(const Tensor& end, double weight) const;
  // The index and mask ops as torch.Tensor's methods, each the free function of
  // tensor/index/autograd.h (tril, triu, repeat: tensor/compose; masked_fill: elementwise).
  Tensor gather(int64_t dim, const Tensor& index) const;
  // reduce: "" replaces, "add"/"sum" adds, "multiply" multiplies (PyTorch's reduce=).
  Tensor scatter(int64_t dim, const Tensor& index, const Tensor& src,
                 const std::string& reduce = "") const;
  Tensor scatter(int64_t dim, const Tensor& index, double value,
                 const std::string& reduce = "") const;
  Tensor scatter_add(int64_t dim, const Tensor& index, const Tensor& src) const;
  Tensor index_select(int64_t dim, const Tensor& index) const;
  Tensor index_add(int64_t dim, const Tensor& index, const Tensor& source,
                   double alpha = 1.0) const;
  Tensor index_fill(int64_t dim, const Tensor& index, double value) const;
  Tensor index_fill(int64_t dim, const Tensor& index, const Tensor& value) const;  // 0-dim
  Tensor cumsum(int64_t dim) const;
  Tensor cumprod(int64_t dim) const;
  ValuesIndices sort(int64_t dim = -1, bool descending = false) const;
  Tensor argsort(int64_t dim = -1, bool descending = false) const;  // sort's indices
  ValuesIndices topk(int64_t k, int64_t dim = -1, bool largest = true, bool sorted = true) const;
  Tensor flip(const Shape& dims) const;
  Tensor roll(const Shape& shifts, const Shape& dims = {}) const;
  Tensor masked_select(const Tensor& mask) const;
  Tensor masked_fill(const Tensor& mask, double value) const;
  Tensor tril(int64_t diagonal = 0) const;
  Tensor triu(int64_t diagonal = 0) const;
  Tensor repeat(const Shape& sizes) const;
  // In place and not recorded by autograd (ops::masked_fill_, masked_scatter_, scatter_add_,
  // scatter_, index_add_, index_fill_); return this tensor, as PyTorch's.
  Tensor& masked_fill_(const Tensor& mask, double value);
  Tensor& masked_scatter_(const Tensor& mask, const Tensor& source);
  Tensor& scatter_add_(int64_t dim, const Tensor& index, const Tensor& src);
  Tensor& scatter_(int64_t dim, const Tensor& index, const Tensor& src,
                   const std::string& reduce = "");
  Tensor& scatter_(int64_t dim, const Tensor& index, double value, const std::string& reduce = "");
  Tensor& index_add_(int64_t dim, const Tensor& index, const Tensor& source, double alpha = 1.0);
  Tensor& index_fill_(int64_t dim, const Tensor& index, double value);
  Tensor& index_fill_(int64_t dim, const Tensor& index, const Tensor& value);  // 0-dim value

 private:
  TensorImpl& impl() const;
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

}  // namespace tally
