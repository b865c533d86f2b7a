// tally.Tensor, tally.dtype and tally.device: numpy in (tally.tensor copies, tally.from_numpy
// views) and out (Tensor.numpy() views the tensor's memory), the Tensor's methods, operators
// and indexing, and the factories.
#include <fmt/format.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "autograd/node.h"
#include "common.h"
#include "memory/cpu_provider.h"

namespace tally::python {

namespace {

// iter(tensor): the rows along dim 0, each made when asked for.
struct RowIterator {
  Tensor tensor;
  int64_t next;
};

struct DTypeName {
  const char* name;
  DType dtype;
};
constexpr DTypeName kDTypeNames[] = {
    {"float32", DType::float32}, {"float", DType::float32},     {"float16", DType::float16},
    {"half", DType::float16},    {"bfloat16", DType::bfloat16}, {"float64", DType::float64},
    {"double", DType::float64},  {"int32", DType::int32},       {"int", DType::int32},
    {"int64", DType::int64},     {"long", DType::int64},        {"bool", DType::bool_},
    {"uint8", DType::uint8},
};

std::optional<DType> dtype_by_name(const std::string& s) {
  for (const auto& n : kDTypeNames)
    if (s == n.name) return n.dtype;
  return std::nullopt;
}

// numpy arrays viewed by tensors without a copy (from_numpy): each array is held until the
// last Storage over its memory is gone. Heap-allocated and never destroyed, so that no
// Python object is released after the interpreter has finalised.
struct Borrowed {
  std::weak_ptr<const void> storage;
  py::object owner;
};
std::vector<Borrowed>& borrowed() {
  static auto* list = new std::vector<Borrowed>();
  return *list;
}
void release_expired_borrows() {
  auto& list = borrowed();
  std::erase_if(list, [](const Borrowed& b) { return b.storage.expired(); });
}

Shape shape_from(py::handle h) {
  Shape s;
  if (py::isinstance<py::int_>(h)) return {h.cast<int64_t>()};
  for (py::handle d : h) s.push_back(d.cast<int64_t>());
  return s;
}

TensorOptions options_from(const py::kwargs& kw, DType default_dtype = DType::float32) {
  TensorOptions o;
  o.dtype = default_dtype;
  o.device = Device::cpu();
  if (kw.contains("dtype") && !kw["dtype"].is_none()) o.dtype = to_dtype(kw["dtype"]);
  if (kw.contains("device") && !kw["device"].is_none()) o.device = to_device(kw["device"]);
  if (kw.contains("requires_grad")) o.requires_grad = kw["requires_grad"].cast<bool>();
  for (auto item : kw) {
    const std::string k = py::str(item.first);
    if (k != "dtype" && k != "device" && k != "requires_grad")
      throw py::type_error("unexpected keyword argument '" + k + "'");
  }
  return o;
}

// A Python number or array-like as a tensor next to `like` (its device; numbers keep
// Python's kind: float -> like's floating dtype or float32, int -> like's dtype).
Tensor operand(py::handle h, const Tensor& like) {
  if (py::isinstance<Tensor>(h)) return h.cast<Tensor>();
  if (py::isinstance<py::bool_>(h) || py::isinstance<py::int_>(h) ||
      py::isinstance<py::float_>(h)) {
    DType d = like.dtype();
    if (py::isinstance<py::float_>(h) && !is_floating(d)) d = DType::float32;
    TensorOptions o;
    o.dtype = d;
    o.device = like.device();
    return full({}, h.cast<double>(), o);
  }
  return to_tensor(h, std::nullopt, like.device());
}

bool is_number(py::handle h) {
  return py::isinstance<py::int_>(h) || py::isinstance<py::float_>(h);
}

// Tensor.size(dim=None) and Tensor.stride(dim=None): the whole tuple, or one dimension's entry
// (a negative dim counts from the end).
template <const Shape& (Tensor::*all)() const, int64_t (Tensor::*one)(int64_t) const>
py::object all_or_one(const Tensor& x, py::object dim) {
  if (dim.is_none()) return py::tuple(py::cast((x.*all)()));
  return py::int_((x.*one)(dim.cast<int64_t>()));
}

// Tensor.max(dim=None, keepdim=False) and Tensor.min: over every element, else (values,
// indices) along dim.
template <bool kMax>
py::object max_or_min(const Tensor& x, py::object dim, bool keepdim) {
  if (dim.is_none()) return py::cast(kMax ? tally::max(x) : tally::min(x));
  const int64_t d = dim.cast<int64_t>();
  const ValuesIndices r = kMax ? tally::max(x, d, keepdim) : tally::min(x, d, keepdim);
  return py::make_tuple(r.values, r.indices);
}

// Tensor.__OP__ (a OP b) and __rOP__ (b OP a) for a Python operand b: a number with a floating
// tensor takes the scalar forms, `number(a, b)` and `reflected(a, b)` (no tensor made for b);
// anything else becomes a tensor like a (operand) for `tensors`, in the operator's order.
void def_arithmetic(py::class_<Tensor>& cls, const char* name, const char* rname,
                    Tensor (*number)(const Tensor&, double),
                    Tensor (*reflected)(const Tensor&, double),
                    Tensor (*tensors)(const Tensor&, const Tensor&)) {
  cls.def(name, [number, tensors](const Tensor& a, py::handle b) {
    return is_number(b) && is_floating(a.dtype()) ? number(a, b.cast<double>())
                                                  : tensors(a, operand(b, a));
  });
  cls.def(rname, [reflected, tensors](const Tensor& a, py::handle b) {
    return is_number(b) && is_floating(a.dtype()) ? reflected(a, b.cast<double>())
                                                  : tensors(operand(b, a), a);
  });
}

int64_t wrap_index(int64_t i, int64_t size, const char* what) {
  if (i < -size || i >= size)
    throw py::index_error(std::string(what) + ": index " + std::to_string(i) +
                          " is out of bounds for a dimension of size " + std::to_string(size));
  return i < 0 ? i + size : i;
}

// Whether `h` indexes with integers held in a tensor, a numpy array or a list (PyTorch's
// advanced indexing), rather than an int, a slice, None or ....
bool is_tensor_index(py::handle h) {
  return py::isinstance<Tensor>(h) || py::isinstance<py::array>(h) || py::isinstance<py::list>(h);
}

// t[..., idx, ...] with integer indices `idx` (any shape) at dimension `dim`: the result has
// t's shape with that dimension replaced by idx's shape, as in PyTorch. A gather of rows
// through the embedding op (dim moved first, the rest flattened), so it is differentiable
// (repeated indices accumulate their gradients) on every device.
Tensor index_with_tensor(const Tensor& t, int64_t dim, const Tensor& idx) {
  if (idx.dtype() != DType::int64 && idx.dtype() != DType::int32)
    throw py::index_error("tensor indices must be int64 or int32, got " +
                          std::string(dtype_name(idx.dtype())) + " " + idx.shape_string());
  const Shape& sizes = t.sizes();
  const int64_t rank = t.dim();
  Shape perm{dim}, others;
  int64_t rest = 1;
  for (int64_t d = 0; d < rank; ++d) {
    if (d == dim) continue;
    perm.push_back(d);
    others.push_back(sizes[static_cast<size_t>(d)]);
    rest *= sizes[static_cast<size_t>(d)];
  }
  const Tensor rows = t.permute(perm).reshape({sizes[static_cast<size_t>(dim)], rest});
  Tensor out;
  try {
    out = embedding(rows, idx.device() == t.device() ? idx : idx.to(t.device()));
  } catch (const std::out_of_range& e) {
    throw py::index_error(fmt::format("index out of range for dimension {} of size {}: {}", dim,
                                      sizes[static_cast<size_t>(dim)], e.what()));
  }
  // [idx..., others...] -> [others before dim, idx..., others after dim].
  Shape gathered(idx.sizes().begin(), idx.sizes().end());
  gathered.insert(gathered.end(), others.begin(), others.end());
  out = out.reshape(gathered);
  const int64_t k = idx.dim();
  Shape back;
  for (int64_t d = 0; d < dim; ++d) back.push_back(k + d);
  for (int64_t d = 0; d < k; ++d) back.push_back(d);
  for (int64_t d = dim; d < rank - 1; ++d) back.push_back(k + d);
  return out.permute(back);
}

// The dims an index takes: a boolean mask one per its dims, any other index one.
int64_t dims_taken(py::handle h) {
  if (py::isinstance<Tensor>(h) && h.cast<Tensor>().dtype() == DType::bool_)
    return std::max<int64_t>(h.cast<Tensor>().dim(), 1);
  if (py::isinstance<py::array>(h) && h.cast<py::array>().dtype().kind() == 'b')
    return std::max<int64_t>(h.cast<py::array>().ndim(), 1);
  return 1;
}

// t[..., mask, ...] at dim (index_mask), its errors as Python's IndexError.
Tensor index_mask_py(const Tensor& t, int64_t dim, const Tensor& mask) {
  if (mask.dim() == 0)
    throw py::index_error("tensor[..., mask]: a 0-d boolean index is not supported");
  try {
    return index_mask(t, dim, mask.device() == t.device() ? mask : mask.to(t.device()));
  } catch (const std::out_of_range& e) {
    throw py::index_error(e.what());
  }
}

Tensor getitem(const Tensor& t, py::handle index) {
  std::vector<py::handle> items;
  if (py::isinstance<py::tuple>(index)) {
    for (py::handle h : index) items.push_back(h);
  } else {
    items.push_back(index);
  }
  int64_t consumed = 0;  // dimensions the indices take
  for (py::handle h : items)
    if (!h.is_none() && h.ptr() != Py_Ellipsis) consumed += dims_taken(h);
  Tensor r = t;
  int64_t dim = 0;
  int tensor_indices = 0;
  for (py::handle h : items) {
    if (h.is_none()) {
      r = r.unsqueeze(dim++);
    } else if (h.ptr() == Py_Ellipsis) {
      dim = r.dim() - consumed;
      if (dim < 0) throw py::index_error("too many indices for tensor");
    } else if (py::isinstance<py::slice>(h)) {
      if (dim >= r.dim()) throw py::index_error("too many indices for tensor");
      Py_ssize_t start, stop, step, length;
      if (PySlice_GetIndicesEx(h.ptr(), r.size(dim), &start, &stop, &step, &length) != 0)
        throw py::error_already_set();
      if (step <= 0) throw py::value_error("tensor slices take a positive step");
      r = r.slice(dim, start, length > 0 ? start + (length - 1) * step + 1 : start, step);
      ++dim;
      --consumed;
    } else if (py::isinstance<py::int_>(h)) {
      if (dim >= r.dim()) throw py::index_error("too many indices for tensor");
      r = r.select(dim, wrap_index(h.cast<int64_t>(), r.size(dim), "index"));
      --consumed;
    } else if (is_tensor_index(h)) {
      if (dim >= r.dim()) throw py::index_error("too many indices for tensor");
      if (++tensor_indices > 1)
        throw py::index_error(
            "indexing with more than one tensor of indices is not supported "
            "(index one dimension at a time)");
      const Tensor idx = py::isinstance<Tensor>(h) ? h.cast<Tensor>() : to_tensor(h);
      if (idx.dtype() == DType::bool_) {  // a mask over the next idx.dim() dims: one dim left
        r = index_mask_py(r, dim, idx);
        ++dim;
        consumed -= std::max<int64_t>(idx.dim(), 1);
        continue;
      }
      r = index_with_tensor(r, dim, idx);
      dim += idx.dim();
      --consumed;
    } else {
      throw py::type_error("tensor indices are ints, slices, None, ... and integer tensors, got " +
                           std::string(py::str(py::type::of(h))));
    }
  }
  return r;
}

Tensor to_any(const Tensor& t, const py::args& args, const py::kwargs& kw) {
  std::optional<Device> device;
  std::optional<DType> dtype;
  auto take = [&](py::handle h) {
    if (py::isinstance<Device>(h)) {
      device = h.cast<Device>();
    } else if (py::isinstance<Tensor>(h)) {
      device = h.cast<Tensor>().device();
      dtype = h.cast<Tensor>().dtype();
    } else if (py::isinstance<py::str>(h) && !dtype_by_name(h.cast<std::string>())) {
      device = parse_device(h.cast<std::string>());
    } else {
      dtype = to_dtype(h);
    }
  };
  for (py::handle a : args) take(a);
  if (kw.contains("device")) device = to_device(kw["device"]);
  if (kw.contains("dtype")) dtype = to_dtype(kw["dtype"]);
  Tensor out = device && dtype ? t.to(*device, *dtype)
               : device        ? t.to(*device)
               : dtype         ? t.to(*dtype)
                               : t;
  // memory_format=tally.channels_last (PyTorch's x.to(memory_format=...)).
  if (kw.contains("memory_format")) out = out.contiguous(to_memory_format(kw["memory_format"]));
  return out;
}

Shape dims_arg(const py::object& dim) {
  if (dim.is_none()) return {};
  if (py::isinstance<py::int_>(dim)) return {dim.cast<int64_t>()};
  return shape_from(dim);
}

}  // namespace

void check_in_place(const Tensor& x, const char* what) {
  if (x.requires_grad() && GradMode::is_enabled())
    throw py::value_error(std::string(what) +
                          ": a tensor that requires grad cannot be written in place outside "
                          "tally.no_grad()");
}

MemoryFormat to_memory_format(py::handle h) {
  if (py::isinstance<MemoryFormat>(h)) return h.cast<MemoryFormat>();
  throw py::value_error(
      "memory_format must be tally.channels_last or tally.contiguous_format, got " +
      py::repr(h).cast<std::string>());
}

DType to_dtype(py::handle h) {
  if (py::isinstance<DType>(h)) return h.cast<DType>();
  if (py::isinstance<py::str>(h)) {
    if (auto d = dtype_by_name(h.cast<std::string>())) return *d;
  }
  // numpy dtypes and scalar types (np.float32, np.dtype("int64"))
  try {
    py::object d = py::module_::import("numpy").attr("dtype")(h);
    if (auto r = dtype_by_name(py::str(d.attr("name")))) return *r;
    throw py::type_error("Tally has no dtype equal to numpy's " +
                         std::string(py::str(d.attr("name"))));
  } catch (py::error_already_set&) {
    throw py::type_error("not a dtype: " + std::string(py::repr(h)) +
                         " (expected tally.float32, ..., a name such as 'bfloat16', or a numpy "
                         "dtype)");
  }
}

py::object numpy_dtype(DType d) {
  if (d == DType::bfloat16) throw py::type_error("numpy has no bfloat16");
  return py::module_::import("numpy").attr("dtype")(d == DType::bool_ ? "bool" : dtype_name(d));
}

Device parse_device(const std::string& s) {
  auto colon = s.find(':');
  const std::string type = s.substr(0, colon);
  int index = 0;
  if (colon != std::string::npos) {
    try {
      size_t used = 0;
      index = std::stoi(s.substr(colon + 1), &used);
      if (used != s.size() - colon - 1 || index < 0) throw std::invalid_argument(s);
    } catch (const std::exception&) {
      throw py::value_error("device '" + s + "': expected cpu, cuda[:N] or meta[:N]");
    }
  }
  if (type == "cpu") return Device::cpu();
  if (type == "cuda") return Device::cuda(index);
  if (type == "meta") return Device::meta(index);
  throw py::value_error("device '" + s + "': expected cpu, cuda[:N] or meta[:N]");
}

Device to_device(py::handle h) {
  if (h.is_none()) return memory::default_device();
  if (py::isinstance<Device>(h)) return h.cast<Device>();
  if (py::isinstance<py::str>(h)) return parse_device(h.cast<std::string>());
  throw py::type_error("not a device: " + std::string(py::repr(h)) +
                       " (expected a tally.device or a string such as 'cpu')");
}

Int2 int2(py::handle h) {
  if (h.is_none()) return Int2();
  if (py::isinstance<py::int_>(h)) return Int2(h.cast<int64_t>());
  auto v = h.cast<std::vector<int64_t>>();
  if (v.size() != 2) throw py::value_error("expected an int or a pair of ints");
  return Int2(v[0], v[1]);
}

std::string device_str(Device d) {
  switch (d.type) {
    case DeviceType::cpu:
      return "cpu";
    case DeviceType::cuda:
      return "cuda:" + std::to_string(d.index);
    case DeviceType::meta:
      return "meta:" + std::to_string(d.index);
  }
  return d.str();
}

py::object tensor_or_none(const Tensor& t) {
  return t.defined() ? py::cast(t) : py::none();
}

Tensor from_numpy(py::array array) {
  release_expired_borrows();
  const DType dtype = to_dtype(array.dtype());
  const auto item = static_cast<int64_t>(array.itemsize());
  Shape sizes, strides;
  int64_t extent = 1;  // elements from the first to one past the last
  bool empty = false;
  for (py::ssize_t d = 0; d < array.ndim(); ++d) {
    const int64_t n = array.shape(d), st = array.strides(d);
    if (n == 0) empty = true;
    if (st < 0 || st % item != 0)
      throw py::value_error(
          "from_numpy: the array's strides (in bytes) must be non-negative multiples of its "
          "item size; use tally.tensor(array) to copy it");
    sizes.push_back(n);
    strides.push_back(st / item);
    if (n > 0) extent += (n - 1) * (st / item);
  }
  if (empty) extent = 0;
  void* data = const_cast<void*>(array.data());
  Storage storage = Storage::borrow(data, static_cast<size_t>(extent * item), Device::cpu());
  borrowed().push_back({storage.watch(), py::reinterpret_borrow<py::object>(array)});
  return Tensor::make(std::move(storage), sizes, strides, 0, dtype);
}

Tensor to_tensor(py::handle h, std::optional<DType> dtype, std::optional<Device> device) {
  if (py::isinstance<Tensor>(h)) {
    Tensor t = h.cast<Tensor>();
    if (dtype && device) return t.to(*device, *dtype);
    if (dtype) return t.to(*dtype);
    if (device) return t.to(*device);
    return t;
  }
  py::module_ np = py::module_::import("numpy");
  const bool is_array = py::isinstance<py::array>(h);
  py::array arr = np.attr("asarray")(h);
  DType target;
  if (dtype) {
    target = *dtype;
  } else {
    const char kind = arr.dtype().kind();
    if (!is_array && kind == 'f') {
      target = DType::float32;  // Python floats: float32, as torch.tensor([1.0])
    } else if (!is_array && (kind == 'i' || kind == 'u')) {
      target = DType::int64;
    } else {
      try {
        target = to_dtype(arr.dtype());
      } catch (py::type_error&) {
        if (kind == 'f')
          target = DType::float32;
        else if (kind == 'i' || kind == 'u')
          target = DType::int64;
        else
          throw;
      }
    }
  }
  const DType staged = target == DType::bfloat16 ? DType::float32 : target;
  // asarray(order="C"), not ascontiguousarray: that one makes a 0-D array 1-D, and
  // tensor(3.0) is 0-D in PyTorch.
  arr = np.attr("asarray")(arr, numpy_dtype(staged), "C");
  Shape sizes;
  for (py::ssize_t d = 0; d < arr.ndim(); ++d) sizes.push_back(arr.shape(d));
  TensorOptions o;
  o.dtype = staged;
  Tensor view = tally::from_blob(const_cast<void*>(arr.data()), sizes, o);
  NoGradGuard no_grad;
  const Device dev = device.value_or(Device::cpu());
  Tensor out = dev.type == DeviceType::cpu ? view.clone() : view.to(dev);
  if (target != staged) out = out.to(target);
  return out;
}

py::array to_numpy(const Tensor& t_in) {
  NoGradGuard no_grad;
  Tensor t = t_in.detach();
  if (t.device().type != DeviceType::cpu) t = t.to(Device::cpu());
  if (t.dtype() == DType::bfloat16) t = t.to(DType::float32);
  const auto item = static_cast<py::ssize_t>(t.element_size());
  std::vector<py::ssize_t> shape, strides;
  for (int64_t d = 0; d < t.dim(); ++d) {
    shape.push_back(t.size(d));
    strides.push_back(t.stride(d) * item);
  }
  auto* keep = new Tensor(t);
  py::capsule base(keep, [](void* p) { delete static_cast<Tensor*>(p); });
  return py::array(py::dtype::from_args(numpy_dtype(t.dtype())), shape, strides, t.data_ptr(),
                   base);
}

namespace {

// Raises MemoryError, naming the op and the shape, where what `op` builds outside Tally's
// allocator (`bytes_per_element` for each of the tensor's elements: Python objects, a numpy
// copy) would leave the system less than the CPU allocator's reserve. Past that, filling it
// brings the kernel's out-of-memory killer rather than an error: an expanded tensor of 2^31
// elements (one float of storage) is 64 GiB of Python floats.
void check_host_room(const char* op, const Tensor& t, uint64_t bytes_per_element) {
  const uint64_t elements = static_cast<uint64_t>(t.numel());
  uint64_t bytes = 0, available = 0;
  if (memory::CpuProvider::host_can_hold(elements, bytes_per_element, bytes, available)) return;
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const std::string need = bytes == UINT64_MAX ? std::string("more than 2^64 bytes")
                                               : fmt::format("{:.2f} GiB", bytes / kGiB);
  PyErr_SetString(PyExc_MemoryError,
                  fmt::format("Tensor.{}: a tensor of shape {} ({} elements) needs {} outside the "
                              "allocator, and the system can give {:.2f} GiB (keeping {} MiB)",
                              op, t.shape_string(), elements, need, available / kGiB,
                              memory::CpuProvider::kOsReserve >> 20)
                      .c_str());
  throw py::error_already_set();
}

}  // namespace

// Tensor.grad_fn, as PyTorch's: the node that made a non-leaf tensor (None for a leaf), with
// name() (Tally's node name: 'MulBackward', ...) and next_functions, one (node or None,
// input_nr) pair per input: AccumulateGrad, with .variable, for a leaf that requires grad.
namespace {

void bind_grad_fn(py::module_& m, py::class_<Tensor>& cls) {
  using autograd::Node;
  py::class_<Node, std::shared_ptr<Node>>(m, "Node", "an autograd graph node (Tensor.grad_fn)")
      .def("name", &Node::name)
      .def_property_readonly("next_functions",
                             [](const Node& n) {
                               py::tuple out(n.next_edges.size());
                               for (size_t i = 0; i < n.next_edges.size(); ++i) {
                                 const autograd::Edge& e = n.next_edges[i];
                                 out[i] =
                                     py::make_tuple(e.fn ? py::cast(e.fn) : py::none(), e.input_nr);
                               }
                               return out;
                             })
      .def_property_readonly("variable",
                             [](const Node& n) -> py::object {
                               const auto* acc = dynamic_cast<const autograd::AccumulateGrad*>(&n);
                               if (!acc)
                                 throw py::attribute_error(n.name() + " has no attribute variable");
                               return py::cast(acc->variable());
                             })
      .def("__repr__", [](const Node& n) { return "<" + n.name() + " object>"; });
  cls.def_property_readonly("grad_fn", [](const Tensor& x) -> py::object {
    const autograd::AutogradMeta* meta = x.autograd_meta();
    if (!meta || !meta->grad_fn) return py::none();
    return py::cast(meta->grad_fn);
  });
}

}  // namespace

Shape shape_from_args(const py::args& args) {
  if (args.size() == 1 && !py::isinstance<py::int_>(args[0])) return shape_from(args[0]);
  Shape s;
  for (py::handle d : args) s.push_back(d.cast<int64_t>());
  return s;
}

void bind_tensor(py::module_& m) {
  py::enum_<DType>(m, "dtype", "Element types (tally.float32, tally.bfloat16, ...)")
      .value("float32", DType::float32)
      .value("float16", DType::float16)
      .value("bfloat16", DType::bfloat16)
      .value("float64", DType::float64)
      .value("int32", DType::int32)
      .value("int64", DType::int64)
      .value("bool", DType::bool_)
      .value("uint8", DType::uint8)
      .def_property_readonly("itemsize", [](DType d) { return dtype_size(d); })
      .def_property_readonly("is_floating_point", [](DType d) { return is_floating(d); })
      .def(
          "__str__", [](DType d) { return std::string("tally.") + dtype_name(d); }, py::prepend())
      .def(
          "__repr__", [](DType d) { return std::string("tally.") + dtype_name(d); }, py::prepend());
  for (const auto& n : kDTypeNames) m.attr(n.name) = py::cast(n.dtype);

  // torch.memory_format: tally.contiguous_format and tally.channels_last.
  py::enum_<MemoryFormat>(m, "memory_format",
                          "Memory layouts (tally.contiguous_format, tally.channels_last)")
      .value("contiguous_format", MemoryFormat::contiguous)
      .value("channels_last", MemoryFormat::channels_last)
      .def(
          "__str__", [](MemoryFormat f) { return std::string("tally.") + memory_format_name(f); },
          py::prepend())
      .def(
          "__repr__", [](MemoryFormat f) { return std::string("tally.") + memory_format_name(f); },
          py::prepend());
  m.attr("contiguous_format") = py::cast(MemoryFormat::contiguous);
  m.attr("channels_last") = py::cast(MemoryFormat::channels_last);

  py::class_<Device>(m, "device", "A device: tally.device('cpu'), 'cuda:0', 'meta:1'")
      .def(py::init([](const std::string& s) { return parse_device(s); }), py::arg("spec"))
      .def(py::init([](const std::string& type, int index) {
             return parse_device(type + ":" + std::to_string(index));
           }),
           py::arg("type"), py::arg("index"))
      .def_property_readonly("type",
                             [](Device d) {
                               const std::string s = device_str(d);
                               return s.substr(0, s.find(':'));
                             })
      .def_readonly("index", &Device::index)
      .def("__eq__",
           [](Device a, py::handle b) {
             try {
               return a == to_device(b);
             } catch (...) {
               return false;
             }
           })
      .def("__hash__", [](Device d) { return std::hash<std::string>()(device_str(d)); })
      .def("__str__", &device_str)
      .def("__repr__", [](Device d) { return "device('" + device_str(d) + "')"; });
  py::implicitly_convertible<py::str, Device>();

  py::class_<RowIterator>(m, "_TensorRowIterator")
      .def("__iter__", [](RowIterator& it) -> RowIterator& { return it; })
      .def("__next__", [](RowIterator& it) {
        if (it.next >= it.tensor.size(0)) throw py::stop_iteration();
        return it.tensor.select(0, it.next++);
      });
  py::class_<Tensor> t(m, "Tensor", py::dynamic_attr(),
                       "A tensor: a layout over a block of Tally's caching allocator");
  t.def(py::init([](py::object data) { return to_tensor(data); }), py::arg("data"))
      .def_property_readonly("shape",
                             [](const Tensor& x) { return py::tuple(py::cast(x.sizes())); })
      .def("size", &all_or_one<&Tensor::sizes, &Tensor::size>, py::arg("dim") = py::none())
      .def("stride", &all_or_one<&Tensor::strides, &Tensor::stride>, py::arg("dim") = py::none())
      .def("dim", &Tensor::dim)
      .def_property_readonly("ndim", &Tensor::dim)
      .def("numel", &Tensor::numel)
      .def("element_size", &Tensor::element_size)
      .def_property_readonly("nbytes", &Tensor::nbytes)
      .def_property_readonly("dtype", &Tensor::dtype)
      .def_property_readonly("device", &Tensor::device)
      .def_property_readonly("is_cuda", &Tensor::is_cuda)
      .def_property_readonly("is_meta", [](const Tensor& x) { return x.device().is_meta(); })
      .def_property_readonly("is_leaf", &Tensor::is_leaf)
      .def(
          "is_contiguous",
          [](const Tensor& x, py::handle f) { return x.is_contiguous(to_memory_format(f)); },
          py::arg("memory_format") = MemoryFormat::contiguous)
      .def("data_ptr", [](const Tensor& x) { return reinterpret_cast<uintptr_t>(x.data_ptr()); })
      .def("storage_offset", &Tensor::storage_offset)
      .def_property("requires_grad", &Tensor::requires_grad,
                    [](Tensor& x, bool r) { x.requires_grad_(r); })
      .def(
          "requires_grad_", [](Tensor& x, bool r) { return x.requires_grad_(r); },
          py::arg("requires_grad") = true)
      .def_property(
          "grad", [](const Tensor& x) { return tensor_or_none(x.grad()); },
          [](const Tensor& x, py::object g) {
            x.set_grad(g.is_none() ? Tensor() : g.cast<Tensor>());
          })
      .def(
          "backward",
          [](const Tensor& x, py::object gradient, bool retain_graph) {
            x.backward(gradient.is_none() ? Tensor() : operand(gradient, x), retain_graph);
          },
          py::arg("gradient") = py::none(), py::arg("retain_graph") = false)
      .def(
          "register_hook",
          [](const Tensor& x, py::function hook) {
            x.register_hook([hook](const Tensor& g) -> Tensor {
              py::object r = hook(g);
              return r.is_none() ? Tensor() : r.cast<Tensor>();
            });
          },
          py::arg("hook"))
      .def("detach", &Tensor::detach)
      .def("clone", &Tensor::clone)
      .def(
          "contiguous",
          [](const Tensor& x, py::handle f) { return x.contiguous(to_memory_format(f)); },
          py::arg("memory_format") = MemoryFormat::contiguous)
      .def("numpy", &to_numpy, "A numpy array over this CPU tensor's memory (no copy)")
      .def(
          "__array__",
          [](const Tensor& x, py::object dtype) {
            py::array a = to_numpy(x);
            if (dtype.is_none()) return a;
            // astype copies every element, an expanded tensor's repeats too.
            check_host_room("__array__", x, py::dtype::from_args(dtype).itemsize());
            return py::array(a.attr("astype")(dtype));
          },
          py::arg("dtype") = py::none())
      .def("tolist",
           [](const Tensor& x) {
             // A Python object and a list slot for each element: 24 + 8 bytes for a float.
             check_host_room("tolist", x, 32);
             return to_numpy(x).attr("tolist")();
           })
      .def("item",
           [](const Tensor& x) -> py::object {
             const double v = x.item();
             if (x.dtype() == DType::bool_) return py::bool_(v != 0);
             if (!is_floating(x.dtype())) return py::int_(static_cast<int64_t>(v));
             return py::float_(v);
           })
      .def("to", &to_any,
           "to(device), to(dtype), to(device, dtype), to(other); memory_format= lays the "
           "result out as tally.channels_last or tally.contiguous_format")
      .def("cpu", [](const Tensor& x) { return x.to(Device::cpu()); })
      .def(
          "cuda", [](const Tensor& x, int index) { return x.to(Device::cuda(index)); },
          py::arg("index") = 0)
      .def("float", [](const Tensor& x) { return x.to(DType::float32); })
      .def("double", [](const Tensor& x) { return x.to(DType::float64); })
      .def("half", [](const Tensor& x) { return x.to(DType::float16); })
      .def("bfloat16", [](const Tensor& x) { return x.to(DType::bfloat16); })
      .def("long", [](const Tensor& x) { return x.to(DType::int64); })
      .def("int", [](const Tensor& x) { return x.to(DType::int32); })
      .def("bool", [](const Tensor& x) { return x.to(DType::bool_); })
      .def("type", [](const Tensor& x, py::object d) { return x.to(to_dtype(d)); })
      // views and shapes
      .def("view", [](const Tensor& x, py::args s) { return x.view(shape_from_args(s)); })
      .def("reshape", [](const Tensor& x, py::args s) { return x.reshape(shape_from_args(s)); })
      .def("permute", [](const Tensor& x, py::args s) { return x.permute(shape_from_args(s)); })
      .def("expand", [](const Tensor& x, py::args s) { return x.expand(shape_from_args(s)); })
      .def("transpose", &Tensor::transpose, py::arg("dim0"), py::arg("dim1"))
      .def("t", &Tensor::t)
      .def_property_readonly("T",
                             [](const Tensor& x) {
                               Shape dims;
                               for (int64_t d = x.dim() - 1; d >= 0; --d) dims.push_back(d);
                               return x.permute(dims);
                             })
      .def("unsqueeze", &Tensor::unsqueeze, py::arg("dim"))
      .def(
          "squeeze",
          [](const Tensor& x, py::object dim) {
            return dim.is_none() ? x.squeeze() : x.squeeze(dim.cast<int64_t>());
          },
          py::arg("dim") = py::none())
      .def("flatten", &Tensor::flatten, py::arg("start_dim") = 0, py::arg("end_dim") = -1)
      .def(
          "split",  // torch.Tensor.split: one size for every piece, or a list of sizes
          [](const Tensor& x, py::object size, int64_t dim) {
            return py::isinstance<py::int_>(size)
                       ? split(x, size.cast<int64_t>(), dim)
                       : split(x, size.cast<std::vector<int64_t>>(), dim);
          },
          py::arg("split_size"), py::arg("dim") = 0)
      .def(
          "chunk",
          [](const Tensor& x, int64_t chunks, int64_t dim) { return chunk(x, chunks, dim); },
          py::arg("chunks"), py::arg("dim") = 0)
      .def("narrow", &Tensor::narrow, py::arg("dim"), py::arg("start"), py::arg("length"))
      .def("select", &Tensor::select, py::arg("dim"), py::arg("index"))
      .def("__getitem__", &getitem)
      .def("__setitem__",
           [](const Tensor& x, py::handle index, py::handle value) {
             check_in_place(x, "item assignment");
             // Tensor indices gather a copy: writing into it would change nothing.
             bool gathers = is_tensor_index(index);
             if (py::isinstance<py::tuple>(index))
               for (py::handle h : index) gathers = gathers || is_tensor_index(h);
             if (gathers)
               throw py::index_error(
                   "item assignment through tensor indices (index_put_) is not supported; "
                   "assign through ints and slices");
             Tensor dst = getitem(x, index);
             if (is_number(value) || py::isinstance<py::bool_>(value))
               ops::fill_(dst, value.cast<double>());
             else
               ops::copy_(dst, operand(value, x));
             x.storage().bump_version();
           })
      .def("fill_",
           [](Tensor& x, double v) -> Tensor& {
             check_in_place(x, "fill_");
             ops::fill_(x, v);
             x.storage().bump_version();
             return x;
           })
      .def("zero_",
           [](Tensor& x) -> Tensor& {
             check_in_place(x, "zero_");
             ops::zero_(x);
             x.storage().bump_version();
             return x;
           })
      .def("copy_",
           [](Tensor& x, py::handle src) -> Tensor& {
             check_in_place(x, "copy_");
             ops::copy_(x, operand(src, x));
             x.storage().bump_version();
             return x;
           })
      .def("__len__",
           [](const Tensor& x) {
             if (x.dim() == 0) throw py::type_error("len() of a 0-d tensor");
             return x.size(0);
           })
      .def("__iter__",
           [](const Tensor& x) {
             // PyTorch's: the rows along dim 0 (views), made one at a time; a 0-D tensor has
             // none to give.
             if (x.dim() == 0) throw py::type_error("iteration over a 0-d tensor");
             return RowIterator{x, 0};
           })
      .def("__repr__", &Tensor::str)
      .def("__hash__", [](const Tensor& x) { return reinterpret_cast<uintptr_t>(x.unsafe_impl()); })
      .def("__bool__",
           [](const Tensor& x) {
             if (x.numel() != 1)
               throw py::value_error(
                   "the truth value of a tensor with more than one element is ambiguous");
             return x.item() != 0;
           })
      .def("__float__", [](const Tensor& x) { return x.item(); })
      .def("__int__", [](const Tensor& x) { return static_cast<int64_t>(x.item()); })
      .def("__index__",
           [](const Tensor& x) {
             if (is_floating(x.dtype()) || x.numel() != 1)
               throw py::type_error("only integer tensors of one element can be an index");
             return static_cast<int64_t>(x.item());
           })
      // reductions and elementwise methods
      .def(
          "sum",
          [](const Tensor& x, py::object dim, bool keepdim, py::object dtype) {
            return tally::sum(
                x, dims_arg(dim), keepdim,
                dtype.is_none() ? std::nullopt : std::optional<DType>(to_dtype(dtype)));
          },
          py::arg("dim") = py::none(), py::arg("keepdim") = false, py::kw_only(),
          py::arg("dtype") = py::none())
      .def(
          "mean",
          [](const Tensor& x, py::object dim, bool keepdim) {
            return tally::mean(x, dims_arg(dim), keepdim);
          },
          py::arg("dim") = py::none(), py::arg("keepdim") = false)
      .def(
          "var",
          [](const Tensor& x, py::object dim, double correction, bool keepdim) {
            return tally::var(x, dims_arg(dim), correction, keepdim);
          },
          py::arg("dim") = py::none(), py::arg("correction") = 1.0, py::arg("keepdim") = false)
      .def(
          "std",
          [](const Tensor& x, py::object dim, double correction, bool keepdim) {
            return tally::std(x, dims_arg(dim), correction, keepdim);
          },
          py::arg("dim") = py::none(), py::arg("correction") = 1.0, py::arg("keepdim") = false)
      .def("max", &max_or_min<true>, py::arg("dim") = py::none(), py::arg("keepdim") = false)
      .def("min", &max_or_min<false>, py::arg("dim") = py::none(), py::arg("keepdim") = false)
      .def(
          "argmax",
          [](const Tensor& x, int64_t dim, bool keepdim) {
            return tally::max(x, dim, keepdim).indices;
          },
          py::arg("dim"), py::arg("keepdim") = false)
      .def(
          "amax",
          [](const Tensor& x, py::object dim, bool keepdim) {
            return tally::amax(x, dims_arg(dim), keepdim);
          },
          py::arg("dim") = py::none(), py::arg("keepdim") = false)
      .def("relu", [](const Tensor& x) { return tally::relu(x); })
      .def("sigmoid", [](const Tensor& x) { return tally::sigmoid(x); })
      .def("tanh", [](const Tensor& x) { return tally::tanh(x); })
      .def("exp", [](const Tensor& x) { return tally::exp(x); })
      .def("log", [](const Tensor& x) { return tally::log(x); })
      .def("sqrt", [](const Tensor& x) { return tally::sqrt(x); })
      .def("abs", [](const Tensor& x) { return tally::abs(x); })
      .def("square", [](const Tensor& x) { return tally::square(x); })
      .def(
          "clamp",
          [](const Tensor& x, std::optional<double> lo, std::optional<double> hi) {
            return tally::clamp(x, lo, hi);
          },
          py::arg("min") = py::none(), py::arg("max") = py::none())
      .def(
          "softmax", [](const Tensor& x, int64_t dim) { return tally::softmax(x, dim); },
          py::arg("dim"))
      .def(
          "log_softmax", [](const Tensor& x, int64_t dim) { return tally::log_softmax(x, dim); },
          py::arg("dim"))
      .def("matmul", [](const Tensor& a, const Tensor& b) { return tally::matmul(a, b); });
  // operators
  def_arithmetic(
      t, "__add__", "__radd__", [](const Tensor& a, double b) { return tally::add(a, b); },
      [](const Tensor& a, double b) { return tally::add(a, b); },
      [](const Tensor& a, const Tensor& b) { return tally::add(a, b); });
  def_arithmetic(
      t, "__sub__", "__rsub__", [](const Tensor& a, double b) { return tally::add(a, -b); },
      [](const Tensor& a, double b) { return b - a; },
      [](const Tensor& a, const Tensor& b) { return tally::sub(a, b); });
  def_arithmetic(
      t, "__mul__", "__rmul__", [](const Tensor& a, double b) { return tally::mul(a, b); },
      [](const Tensor& a, double b) { return tally::mul(a, b); },
      [](const Tensor& a, const Tensor& b) { return tally::mul(a, b); });
  def_arithmetic(
      t, "__truediv__", "__rtruediv__", [](const Tensor& a, double b) { return tally::div(a, b); },
      [](const Tensor& a, double b) { return b / a; },
      [](const Tensor& a, const Tensor& b) { return tally::div(a, b); });
  t.def("__pow__",
        [](const Tensor& a, py::handle b) {
          return is_number(b) ? tally::pow(a, b.cast<double>()) : tally::pow(a, operand(b, a));
        })
      .def("__matmul__",
           [](const Tensor& a, py::handle b) { return tally::matmul(a, operand(b, a)); })
      .def("__rmatmul__",
           [](const Tensor& a, py::handle b) { return tally::matmul(operand(b, a), a); })
      .def("__neg__", [](const Tensor& a) { return tally::neg(a); })
      .def("__abs__", [](const Tensor& a) { return tally::abs(a); })
      .def("__eq__", [](const Tensor& a, py::handle b) { return tally::eq(a, operand(b, a)); })
      .def("__ne__", [](const Tensor& a, py::handle b) { return tally::ne(a, operand(b, a)); })
      .def("__lt__", [](const Tensor& a, py::handle b) { return tally::lt(a, operand(b, a)); })
      .def("__le__", [](const Tensor& a, py::handle b) { return tally::le(a, operand(b, a)); })
      .def("__gt__", [](const Tensor& a, py::handle b) { return tally::gt(a, operand(b, a)); })
      .def("__ge__", [](const Tensor& a, py::handle b) { return tally::ge(a, operand(b, a)); });

  // ---- creating tensors ----
  m.def(
      "tensor",
      [](py::object data, py::object dtype, py::object device, bool requires_grad) {
        std::optional<DType> d;
        if (!dtype.is_none()) d = to_dtype(dtype);
        std::optional<Device> dev;
        if (!device.is_none()) dev = to_device(device);
        Tensor t = py::isinstance<Tensor>(data) ? to_tensor(data, d, dev).detach().clone()
                                                : to_tensor(data, d, dev);
        if (requires_grad) t.requires_grad_(true);
        return t;
      },
      py::arg("data"), py::kw_only(), py::arg("dtype") = py::none(), py::arg("device") = py::none(),
      py::arg("requires_grad") = false,
      "A tensor holding a copy of `data` (a numpy array, a list or a number) in Tally's "
      "allocator");
  m.def("from_numpy", &from_numpy, py::arg("array"),
        "A CPU tensor over the numpy array's memory (no copy, like torch.from_numpy)");
  m.def(
      "as_tensor",
      [](py::object data, py::object dtype, py::object device) -> Tensor {
        if (py::isinstance<py::array>(data) && dtype.is_none() &&
            (device.is_none() || to_device(device).type == DeviceType::cpu)) {
          try {
            return from_numpy(data.cast<py::array>());
          } catch (py::error_already_set&) {
            throw;
          } catch (...) {
          }
        }
        std::optional<DType> d;
        if (!dtype.is_none()) d = to_dtype(dtype);
        std::optional<Device> dev;
        if (!device.is_none()) dev = to_device(device);
        return to_tensor(data, d, dev);
      },
      py::arg("data"), py::arg("dtype") = py::none(), py::arg("device") = py::none(),
      "No copy where it can (a CPU numpy array of a dtype Tally has), else tensor(data)");

  m.def("zeros",
        [](py::args s, py::kwargs kw) { return zeros(shape_from_args(s), options_from(kw)); });
  m.def("ones",
        [](py::args s, py::kwargs kw) { return ones(shape_from_args(s), options_from(kw)); });
  m.def("empty",
        [](py::args s, py::kwargs kw) { return empty(shape_from_args(s), options_from(kw)); });
  m.def("rand",
        [](py::args s, py::kwargs kw) { return rand(shape_from_args(s), options_from(kw)); });
  m.def("randn",
        [](py::args s, py::kwargs kw) { return randn(shape_from_args(s), options_from(kw)); });
  m.def(
      "full",
      [](py::object size, double value, py::kwargs kw) {
        return full(shape_from(size), value, options_from(kw));
      },
      py::arg("size"), py::arg("fill_value"));
  m.def(
      "randint",
      [](int64_t low, int64_t high, py::object size, py::kwargs kw) {
        return randint(low, high, shape_from(size), options_from(kw, DType::int64));
      },
      py::arg("low"), py::arg("high"), py::arg("size"));
  m.def(
      "arange",
      [](py::object a, py::object b, py::object step, py::kwargs kw) {
        // PyTorch's rule: int64 when every bound is an integer (Python's or numpy's), by
        // type: arange(10.0) is float32.
        auto integer = [](const py::object& h) { return h.is_none() || PyIndex_Check(h.ptr()); };
        auto number = [](const py::object& h, const char* name) {
          try {
            return h.cast<double>();
          } catch (const py::cast_error&) {
            throw py::type_error(std::string("arange: ") + name + " must be a number, got " +
                                 std::string(py::str(py::type::of(h).attr("__name__"))));
          }
        };
        const bool ints = integer(a) && integer(b) && integer(step);
        TensorOptions o = options_from(kw, ints ? DType::int64 : DType::float32);
        const double st = step.is_none() ? 1.0 : number(step, "step");
        return b.is_none() ? arange(0.0, number(a, "end"), st, o)
                           : arange(number(a, "start"), number(b, "end"), st, o);
      },
      py::arg("start"), py::arg("end") = py::none(), py::arg("step") = 1);
  // x.new_zeros(2, 3) & co.: x's dtype and device unless given (PyTorch's Tensor.new_*).
  auto like_x = [](const Tensor& x, const py::kwargs& kw) {
    TensorOptions o = options_from(kw, x.dtype());
    if (!kw.contains("device") || kw["device"].is_none()) o.device = x.device();
    return o;
  };
  t.def("new_zeros", [like_x](const Tensor& x, py::args s,
                              py::kwargs kw) { return zeros(shape_from_args(s), like_x(x, kw)); })
      .def("new_ones", [like_x](const Tensor& x, py::args s,
                                py::kwargs kw) { return ones(shape_from_args(s), like_x(x, kw)); })
      .def("new_empty",
           [like_x](const Tensor& x, py::args s, py::kwargs kw) {
             return empty(shape_from_args(s), like_x(x, kw));
           })
      .def(
          "new_full",
          [like_x](const Tensor& x, py::object size, double value, py::kwargs kw) {
            return full(shape_from(size), value, like_x(x, kw));
          },
          py::arg("size"), py::arg("fill_value"));
  m.def("zeros_like", [](const Tensor& x) { return zeros_like(x); });
  m.def("ones_like", [](const Tensor& x) { return ones_like(x); });
  m.def("manual_seed", &manual_seed, py::arg("seed"), "Seeds the default generator");

  // ---- autograd ----
  m.def("is_grad_enabled", &GradMode::is_enabled);
  m.def("_set_grad_enabled", &GradMode::set_enabled);
  py::module_ ag = m.def_submodule("autograd", "torch.autograd: backward and grad");
  ag.def(
      "backward",
      [](const TensorList& tensors, py::object grads, bool retain_graph) {
        autograd::backward(tensors, grads.is_none() ? TensorList{} : grads.cast<TensorList>(),
                           retain_graph);
      },
      py::arg("tensors"), py::arg("grad_tensors") = py::none(), py::arg("retain_graph") = false);
  ag.def(
      "grad",
      [](py::object outputs, py::object inputs, py::object grad_outputs, bool retain_graph) {
        auto list = [](py::object o) {
          return py::isinstance<Tensor>(o) ? TensorList{o.cast<Tensor>()} : o.cast<TensorList>();
        };
        TensorList r = autograd::grad(list(outputs), list(inputs),
                                      grad_outputs.is_none() ? TensorList{} : list(grad_outputs),
                                      retain_graph);
        py::tuple out(r.size());
        for (size_t i = 0; i < r.size(); ++i) out[i] = tensor_or_none(r[i]);
        return out;
      },
      py::arg("outputs"), py::arg("inputs"), py::arg("grad_outputs") = py::none(),
      py::arg("retain_graph") = false);
  bind_grad_fn(m, t);
}

}  // namespace tally::python
