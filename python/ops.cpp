// Index, scan, sort and shape ops from Python, as PyTorch users write them: tally.gather,
// x.scatter_add(...), tally.topk, F.pad, F.one_hot, tally.einsum, x[mask], x[mask] = v, and
// the arithmetic methods (x.add(y, alpha=2), x.pow(2), ...). Bound after bind_tensor and
// bind_functional: the methods go onto the Tensor class those made, and x[mask] wraps the
// indexing bind_tensor defined.
#include <fmt/format.h>
#include <pybind11/stl.h>

#include <limits>

#include "common.h"

namespace tally::python {

namespace {

using T = const Tensor&;

// A 0-D zero of x's dtype on x's device: the other side of x's comparisons with zero.
Tensor zero_of(const Tensor& x) {
  return ops::full({}, 0.0, x.dtype(), x.device());
}

Shape dims_list(const py::object& d) {
  if (d.is_none()) return {};
  if (py::isinstance<py::int_>(d)) return {d.cast<int64_t>()};
  return d.cast<Shape>();
}

// A Python number or tensor as the other operand of an arithmetic method on x: a number
// takes x's dtype when x is floating (or when both are integers), float32 otherwise.
Tensor other_of(py::handle h, const Tensor& x) {
  if (py::isinstance<Tensor>(h)) return h.cast<Tensor>();
  if (py::isinstance<py::bool_>(h) || py::isinstance<py::int_>(h) ||
      py::isinstance<py::float_>(h)) {
    const bool int_value = !py::isinstance<py::float_>(h);
    const DType d = is_floating(x.dtype()) || int_value ? x.dtype() : DType::float32;
    return ops::full({}, h.cast<double>(), d, x.device());
  }
  return to_tensor(h, std::nullopt, x.device());
}

// (values, indices) as PyTorch's named tuple: r.values, r.indices, or unpacked.
py::object values_indices(const ValuesIndices& r, const char* name) {
  static auto* types = new py::dict();  // never freed: outlives the interpreter's teardown
  py::dict& d = *types;
  if (!d.contains(name))
    d[name] = py::module_::import("collections").attr("namedtuple")(name, "values indices");
  return d[name](r.values, r.indices);
}

double norm_p(const py::object& p) {
  if (p.is_none()) return 2.0;
  if (py::isinstance<py::str>(p)) {
    const auto s = p.cast<std::string>();
    if (s == "fro") return 2.0;
    throw py::value_error("norm: p='" + s + "' is not supported (numbers, inf and 'fro' are)");
  }
  return p.cast<double>();
}

Shape ints_of(const py::object& o) {
  if (py::isinstance<py::int_>(o)) return {o.cast<int64_t>()};
  return o.cast<Shape>();
}

// x's mask index: a bool tensor (or numpy bool array) whose shape is x's leading dims
// (PyTorch's rule).
bool is_mask(py::handle h) {
  if (py::isinstance<py::array>(h)) return h.cast<py::array>().dtype().kind() == 'b';
  return py::isinstance<Tensor>(h) && h.cast<Tensor>().dtype() == DType::bool_;
}

Tensor mask_of(py::handle h, const Tensor& x) {
  return py::isinstance<Tensor>(h) ? h.cast<Tensor>() : to_tensor(h, std::nullopt, x.device());
}

// The mask expanded over x's trailing dims, and the shape x[mask] has.
std::pair<Tensor, Shape> mask_plan(const Tensor& x, const Tensor& mask) {
  const int64_t k = mask.dim();
  bool ok = k <= x.dim();
  for (int64_t d = 0; ok && d < k; ++d) ok = mask.size(d) == x.size(d);
  if (!ok)
    throw py::index_error(
        fmt::format("tensor[mask]: the mask {} must match the leading dims of "
                    "the indexed tensor {}",
                    mask.shape_string(), x.shape_string()));
  Shape full = mask.sizes(), rest;
  for (int64_t d = k; d < x.dim(); ++d) {
    full.push_back(1);
    rest.push_back(x.size(d));
  }
  Shape out{-1};
  out.insert(out.end(), rest.begin(), rest.end());
  return {ops::expand(ops::view(mask, full), x.sizes()), out};
}

// x[index] = v through a boolean mask: the mask and the dim of x it starts at. Integer
// indices beside the mask (x[0, mask]) are folded into it: `mask` then covers x's dims from
// the first integer's or the mask's to the last, true only at the integers' positions, and
// value_shape is PyTorch's selected shape (the integers' dims gone), which v broadcasts to
// before it is laid out as the folded mask selects.
struct MaskIndex {
  Tensor mask;
  int64_t dim = 0;
  Shape value_shape;  // empty: no integer index, the selected shape is the mask's own
};

bool is_full_slice(py::handle h) {
  return py::isinstance<py::slice>(h) && h.attr("start").is_none() && h.attr("stop").is_none() &&
         h.attr("step").is_none();
}

bool is_int_index(py::handle h) {
  return py::isinstance<py::int_>(h) && !py::isinstance<py::bool_>(h);
}

// The mask over x's dims lo .. hi - 1 that selects what x[..., i, ..., mask, ...] selects:
// true where every integer dim (ints: dim -> index) is at its index and the mask holds.
Tensor fold_integers(const Tensor& x, const Tensor& mask, int64_t mask_dim,
                     const std::vector<std::pair<int64_t, int64_t>>& ints, int64_t lo, int64_t hi) {
  const std::vector<double> m = ops::to_vector(mask);
  const Shape span(x.sizes().begin() + lo, x.sizes().begin() + hi);
  int64_t n = 1;
  for (int64_t s : span) n *= s;
  std::vector<double> folded(static_cast<size_t>(n), 0.0);
  const int64_t k = mask.dim();
  std::vector<int64_t> at(span.size(), 0);  // the coordinates of element e in the span
  for (int64_t e = 0; e < n; ++e) {
    bool on = true;
    for (const auto& [d, i] : ints) on = on && at[static_cast<size_t>(d - lo)] == i;
    if (on) {
      int64_t flat = 0;
      for (int64_t j = 0; j < k; ++j)
        flat = flat * mask.size(j) + at[static_cast<size_t>(mask_dim - lo + j)];
      on = m[static_cast<size_t>(flat)] != 0.0;
    }
    folded[static_cast<size_t>(e)] = on ? 1.0 : 0.0;
    for (int64_t j = static_cast<int64_t>(span.size()) - 1; j >= 0; --j) {
      if (++at[static_cast<size_t>(j)] < span[static_cast<size_t>(j)]) break;
      at[static_cast<size_t>(j)] = 0;
    }
  }
  return ops::from_vector(folded, span, DType::bool_, x.device());
}

// index as a mask write: one mask, alone or in a tuple among integers, full slices (:) and at
// most one Ellipsis (x[mask], x[:, mask], x[..., mask, :], x[0, mask], as PyTorch: an integer
// selects before the mask indexes); nullopt when index holds no mask. Other companions of a
// mask raise an IndexError naming what to write instead.
std::optional<MaskIndex> mask_index(const Tensor& x, py::handle index) {
  std::vector<py::handle> items;
  if (py::isinstance<py::tuple>(index)) {
    for (py::handle h : index) items.push_back(h);
  } else {
    items.push_back(index);
  }
  size_t at = items.size();
  for (size_t i = 0; i < items.size(); ++i)
    if (is_mask(items[i])) {
      if (at != items.size())
        throw py::index_error("tensor[...] = v: one boolean mask at most is supported");
      at = i;
    }
  if (at == items.size()) return std::nullopt;
  MaskIndex r;
  r.mask = mask_of(items[at], x);
  if (r.mask.dim() == 0)
    throw py::index_error("tensor[..., mask] = v: a 0-d boolean index is not supported");
  const int64_t k = r.mask.dim();
  // The dims each item takes (the mask k, the Ellipsis what is left, the others one).
  int64_t taken = 0, ellipses = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i == at) {
      taken += k;
    } else if (items[i].ptr() == Py_Ellipsis) {
      ++ellipses;
    } else if (is_full_slice(items[i]) || is_int_index(items[i])) {
      ++taken;
    } else {
      throw py::index_error(
          "tensor[..., mask, ...] = v: the other indices must be integers, full slices (:) or "
          "one Ellipsis; index the other dims first (y = x[1:3]; y[mask] = v writes into x)");
    }
  }
  if (ellipses > 1) throw py::index_error("an index can only have a single ellipsis ('...')");
  if (taken > x.dim())
    throw py::index_error(fmt::format("too many indices for tensor of dimension {}", x.dim()));
  std::vector<std::pair<int64_t, int64_t>> ints;  // (dim, index)
  int64_t d = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i == at) {
      r.dim = d;
      d += k;
    } else if (items[i].ptr() == Py_Ellipsis) {
      d += x.dim() - taken;
    } else {
      if (is_int_index(items[i])) {
        const int64_t size = x.size(d);
        int64_t v = items[i].cast<int64_t>();
        if (v < -size || v >= size)
          throw py::index_error(
              fmt::format("index {} is out of bounds for dimension {} with size {}", v, d, size));
        ints.emplace_back(d, v < 0 ? v + size : v);
      }
      ++d;
    }
  }
  bool fits = true;
  for (int64_t j = 0; fits && j < k; ++j) fits = r.mask.size(j) == x.size(r.dim + j);
  if (!fits)
    throw py::index_error(fmt::format(
        "tensor[..., mask, ...] = v: the mask {} does not match the indexed tensor {} at dims "
        "{} to {}",
        r.mask.shape_string(), x.shape_string(), r.dim, r.dim + k - 1));
  if (r.mask.device() != x.device()) r.mask = r.mask.to(x.device());
  if (ints.empty()) return r;
  // PyTorch's selected shape: the integers' dims gone, the mask's dims one of its count.
  const int64_t count = static_cast<int64_t>(ops::item(ops::sum(ops::to(r.mask, DType::int64))));
  for (int64_t j = 0; j < x.dim(); ++j) {
    bool integer = false;
    for (const auto& [dim, i] : ints) integer = integer || dim == j;
    if (j == r.dim) r.value_shape.push_back(count);
    if (!integer && (j < r.dim || j >= r.dim + k)) r.value_shape.push_back(x.size(j));
  }
  const int64_t lo = std::min(ints.front().first, r.dim);
  const int64_t hi = std::max(ints.back().first + 1, r.dim + k);
  r.mask = fold_integers(x, r.mask, r.dim, ints, lo, hi);
  r.dim = lo;
  return r;
}

// x[..., mask, ...] = value (a number or a tensor broadcast to the selected shape), as
// PyTorch's index_put_. Without autograd, one masked write into x. When x (not a leaf) or the
// value requires grad, the result is index_mask_put's, copied into x, and x's history becomes
// that op's: gradients reach the entries not written and the value.
void mask_put(const Tensor& x, const MaskIndex& at, py::handle value) {
  Tensor v;
  if (py::isinstance<Tensor>(value))
    v = value.cast<Tensor>();
  else if (py::isinstance<py::int_>(value) || py::isinstance<py::float_>(value))
    v = ops::full({}, value.cast<double>(), x.dtype(), x.device());
  else
    v = to_tensor(value, x.dtype(), x.device());
  if (v.device() != x.device()) v = v.to(x.device());
  // Leading size-1 dims beyond the selected shape's rank go, as PyTorch's setitem drops them.
  const bool folded = !at.value_shape.empty();
  const int64_t rank =
      folded ? static_cast<int64_t>(at.value_shape.size()) : x.dim() - at.mask.dim() + 1;
  while (v.dim() > rank && v.size(0) == 1) v = v.squeeze(0);
  if (folded && v.numel() != 1) {
    // v as PyTorch's selected shape, then laid out as the folded mask selects (the same
    // row-major order, the integers' dims gone).
    const Shape& want = at.value_shape;
    if (ops::broadcast_shapes(v.sizes(), want, "tensor[..., i, mask, ...] = v") != want)
      throw py::value_error(fmt::format(
          "shape mismatch: value tensor of shape {} cannot be broadcast to indexing result of "
          "shape {}",
          v.shape_string(), shape_str(want)));
    Shape laid(x.sizes().begin(), x.sizes().begin() + at.dim);
    laid.push_back(static_cast<int64_t>(ops::item(ops::sum(ops::to(at.mask, DType::int64)))));
    laid.insert(laid.end(), x.sizes().begin() + at.dim + at.mask.dim(), x.sizes().end());
    v = v.expand(want).reshape(laid);
  }
  if (GradMode::is_enabled() && (x.requires_grad() || v.requires_grad())) {
    if (x.requires_grad() && x.is_leaf())
      throw py::value_error(
          "item assignment: a leaf tensor that requires grad cannot be written in place outside "
          "tally.no_grad()");
    if (x.storage_offset() != 0 || x.nbytes() != x.storage().nbytes() || !x.is_contiguous())
      throw py::value_error(fmt::format(
          "item assignment through a mask into a view {} is not differentiable here; write into "
          "a clone() (y = x.clone(); y[mask] = v)",
          x.shape_string()));
    const Tensor y = index_mask_put(x, at.dim, at.mask, v);
    ops::copy_(x, y);
    x.storage().bump_version();
    x.autograd_meta_ptr() = y.autograd_meta_ptr();
    return;
  }
  // The mask over x's dims dim .. dim + k - 1, broadcast over the others.
  const int64_t k = at.mask.dim();
  Shape view(static_cast<size_t>(at.dim), 1), selected(x.sizes().begin(), x.sizes().end());
  view.insert(view.end(), at.mask.sizes().begin(), at.mask.sizes().end());
  view.resize(static_cast<size_t>(x.dim()), 1);
  const Tensor full = ops::expand(ops::view(at.mask, view), x.sizes());
  if (v.dtype() != x.dtype()) v = v.to(x.dtype());
  if (v.numel() == 1) {
    ops::masked_fill_(x, full, ops::item(v));
    return;
  }
  // v broadcast to x[..., mask, ...]'s shape, read in order (masked_scatter_'s row-major order
  // over x is that shape's).
  selected.erase(selected.begin() + at.dim, selected.begin() + at.dim + k);
  selected.insert(selected.begin() + at.dim,
                  static_cast<int64_t>(ops::item(ops::sum(ops::to(at.mask, DType::int64)))));
  ops::masked_scatter_(x, full, ops::contiguous(ops::expand(v, selected)));
}

// x.NAME_(mask, arg) for an in-place masked write op(x, mask, arg): refused where
// check_in_place says, returns x.
template <typename Arg, void (*op)(const Tensor&, const Tensor&, Arg)>
auto masked_in_place(const char* what) {
  return [what](Tensor& x, T mask, Arg arg) -> Tensor& {
    check_in_place(x, what);
    op(x, mask, arg);
    return x;
  };
}

// scatter's reduce= argument: None, 'add', 'sum' or 'multiply' (ops::scatter checks it).
std::string reduce_of(const py::object& reduce) {
  return reduce.is_none() ? std::string() : reduce.cast<std::string>();
}

// A Python number or a one-element tensor as a double (index_fill's value).
double number_of(const py::object& v) {
  return py::isinstance<Tensor>(v) ? v.cast<Tensor>().item() : v.cast<double>();
}

// x.scatter_, x.index_add_, x.index_fill_: in place, not recorded by autograd (refused on a
// tensor that requires grad while grad mode is on, as the other in-place writes).
void bind_index_in_place(py::class_<Tensor>& cls) {
  cls.def(
      "scatter_",
      [](Tensor& x, int64_t dim, T index, py::object src, py::object value,
         py::object reduce) -> Tensor& {
        check_in_place(x, "scatter_");
        const std::string r = reduce_of(reduce);
        if (!src.is_none() && py::isinstance<Tensor>(src))
          ops::scatter_(x, dim, index, src.cast<Tensor>(), r);
        else if (!src.is_none() || !value.is_none())
          ops::scatter_(x, dim, index, number_of(src.is_none() ? value : src), r);
        else
          throw py::type_error("scatter_: give src (a tensor) or value (a number)");
        return x;
      },
      py::arg("dim"), py::arg("index"), py::arg("src") = py::none(), py::kw_only(),
      py::arg("value") = py::none(), py::arg("reduce") = py::none());
  cls.def(
      "index_add_",
      [](Tensor& x, int64_t dim, T index, T source, double alpha) -> Tensor& {
        check_in_place(x, "index_add_");
        ops::index_add_(x, dim, index, source, alpha);
        return x;
      },
      py::arg("dim"), py::arg("index"), py::arg("source"), py::kw_only(), py::arg("alpha") = 1.0);
  cls.def(
      "index_fill_",
      [](Tensor& x, int64_t dim, T index, py::object value) -> Tensor& {
        check_in_place(x, "index_fill_");
        ops::index_fill_(x, dim, index, number_of(value));
        return x;
      },
      py::arg("dim"), py::arg("index"), py::arg("value"));
}

}  // namespace

void bind_ops(py::module_& m, py::module_& F) {
  auto cls = py::reinterpret_borrow<py::class_<Tensor>>(m.attr("Tensor"));

  // ---- gather / scatter / index ----
  m.def(
      "gather", [](T x, int64_t dim, T index) { return gather(x, dim, index); }, py::arg("input"),
      py::arg("dim"), py::arg("index"));
  cls.def(
      "gather", [](T x, int64_t dim, T index) { return gather(x, dim, index); }, py::arg("dim"),
      py::arg("index"));
  auto scatter_fn = [](T x, int64_t dim, T index, py::object src, py::object value,
                       py::object reduce) {
    const std::string r = reduce_of(reduce);
    if (!src.is_none() && !py::isinstance<Tensor>(src))
      return scatter(x, dim, index, src.cast<double>(), r);
    if (!src.is_none()) return scatter(x, dim, index, src.cast<Tensor>(), r);
    if (value.is_none()) throw py::type_error("scatter: give src (a tensor) or value (a number)");
    return scatter(x, dim, index, value.cast<double>(), r);
  };
  m.def("scatter", scatter_fn, py::arg("input"), py::arg("dim"), py::arg("index"),
        py::arg("src") = py::none(), py::kw_only(), py::arg("value") = py::none(),
        py::arg("reduce") = py::none());
  cls.def("scatter", scatter_fn, py::arg("dim"), py::arg("index"), py::arg("src") = py::none(),
          py::kw_only(), py::arg("value") = py::none(), py::arg("reduce") = py::none());
  bind_index_in_place(cls);
  auto scatter_add_fn = [](T x, int64_t dim, T index, T src) {
    return scatter_add(x, dim, index, src);
  };
  m.def("scatter_add", scatter_add_fn, py::arg("input"), py::arg("dim"), py::arg("index"),
        py::arg("src"));
  cls.def("scatter_add", scatter_add_fn, py::arg("dim"), py::arg("index"), py::arg("src"));
  cls.def(
      "scatter_add_",
      [](Tensor& x, int64_t dim, T index, T src) -> Tensor& {
        if (x.requires_grad() && GradMode::is_enabled())
          throw py::value_error(
              "scatter_add_: a tensor that requires grad cannot be written in "
              "place outside tally.no_grad()");
        ops::scatter_add_(x, dim, index, src);
        return x;
      },
      py::arg("dim"), py::arg("index"), py::arg("src"));
  auto index_select_fn = [](T x, int64_t dim, T index) { return index_select(x, dim, index); };
  m.def("index_select", index_select_fn, py::arg("input"), py::arg("dim"), py::arg("index"));
  cls.def("index_select", index_select_fn, py::arg("dim"), py::arg("index"));
  auto index_add_fn = [](T x, int64_t dim, T index, T source, double alpha) {
    return index_add(x, dim, index, source, alpha);
  };
  m.def("index_add", index_add_fn, py::arg("input"), py::arg("dim"), py::arg("index"),
        py::arg("source"), py::kw_only(), py::arg("alpha") = 1.0);
  cls.def("index_add", index_add_fn, py::arg("dim"), py::arg("index"), py::arg("source"),
          py::kw_only(), py::arg("alpha") = 1.0);

  // value a number or a 0-dim tensor (differentiable: its gradient sums the filled places').
  auto index_fill_fn = [](T x, int64_t dim, T index, py::object value) {
    if (py::isinstance<Tensor>(value)) return index_fill(x, dim, index, value.cast<Tensor>());
    return index_fill(x, dim, index, value.cast<double>());
  };
  m.def("index_fill", index_fill_fn, py::arg("input"), py::arg("dim"), py::arg("index"),
        py::arg("value"));
  cls.def("index_fill", index_fill_fn, py::arg("dim"), py::arg("index"), py::arg("value"));

  // ---- scans and sorting ----
  auto cumprod_fn = [](T x, int64_t dim, py::object dtype) {
    return cumprod(dtype.is_none() ? x : x.to(to_dtype(dtype)), dim);
  };
  m.def("cumprod", cumprod_fn, py::arg("input"), py::arg("dim"), py::kw_only(),
        py::arg("dtype") = py::none());
  cls.def("cumprod", cumprod_fn, py::arg("dim"), py::kw_only(), py::arg("dtype") = py::none());
  auto cumsum_fn = [](T x, int64_t dim, py::object dtype) {
    const Tensor in = dtype.is_none() ? x : x.to(to_dtype(dtype));
    return cumsum(in, dim);
  };
  m.def("cumsum", cumsum_fn, py::arg("input"), py::arg("dim"), py::kw_only(),
        py::arg("dtype") = py::none());
  cls.def("cumsum", cumsum_fn, py::arg("dim"), py::kw_only(), py::arg("dtype") = py::none());
  auto sort_fn = [](T x, int64_t dim, bool descending) {
    return values_indices(sort(x, dim, descending), "sort");
  };
  m.def("sort", sort_fn, py::arg("input"), py::arg("dim") = -1, py::arg("descending") = false);
  cls.def("sort", sort_fn, py::arg("dim") = -1, py::arg("descending") = false);
  // argsort: sort's indices (Tally's sort is stable, so `stable` changes nothing); msort: sort
  // along dim 0's values.
  auto argsort_fn = [](T x, int64_t dim, bool descending, bool /*stable*/) {
    return sort(x, dim, descending).indices;
  };
  m.def("argsort", argsort_fn, py::arg("input"), py::arg("dim") = -1, py::arg("descending") = false,
        py::kw_only(), py::arg("stable") = false);
  cls.def("argsort", argsort_fn, py::arg("dim") = -1, py::arg("descending") = false, py::kw_only(),
          py::arg("stable") = false);
  auto msort_fn = [](T x) { return sort(x, 0).values; };
  m.def("msort", msort_fn, py::arg("input"));
  cls.def("msort", msort_fn);
  // max / min along a dim as PyTorch's (values, indices) named tuple (they were plain tuples),
  // argmax over every element when dim is None, and torch.max / torch.min / torch.argmax.
  py::delattr(cls, "max");
  py::delattr(cls, "min");
  py::delattr(cls, "argmax");
  auto max_fn = [](T x, py::object dim, bool keepdim) -> py::object {
    if (dim.is_none()) return py::cast(max(x));
    return values_indices(max(x, dim.cast<int64_t>(), keepdim), "max");
  };
  auto min_fn = [](T x, py::object dim, bool keepdim) -> py::object {
    if (dim.is_none()) return py::cast(min(x));
    return values_indices(min(x, dim.cast<int64_t>(), keepdim), "min");
  };
  auto argmax_fn = [](T x, py::object dim, bool keepdim) {
    if (dim.is_none()) return max(x.reshape({-1}), 0, false).indices;
    return max(x, dim.cast<int64_t>(), keepdim).indices;
  };
  cls.def("max", max_fn, py::arg("dim") = py::none(), py::arg("keepdim") = false);
  cls.def("min", min_fn, py::arg("dim") = py::none(), py::arg("keepdim") = false);
  cls.def("argmax", argmax_fn, py::arg("dim") = py::none(), py::arg("keepdim") = false);
  m.def("max", max_fn, py::arg("input"), py::arg("dim") = py::none(), py::arg("keepdim") = false);
  m.def("min", min_fn, py::arg("input"), py::arg("dim") = py::none(), py::arg("keepdim") = false);
  if (py::hasattr(m, "argmax")) py::delattr(m, "argmax");
  m.def("argmax", argmax_fn, py::arg("input"), py::arg("dim") = py::none(),
        py::arg("keepdim") = false);
  // all / any: whether every (some) element is nonzero, over dim or everything; bool results.
  // Counted, so that an empty reduction gives the identity (all: true, any: false).
  auto count_where = [](T x, bool zero, py::object dim, bool keepdim) {
    NoGradGuard no_grad;
    return sum((zero ? eq(x, zero_of(x)) : ne(x, zero_of(x))).to(DType::int64), dims_list(dim),
               keepdim);
  };
  auto all_fn = [count_where](T x, py::object dim, bool keepdim) {
    const Tensor n = count_where(x, true, dim, keepdim);
    return eq(n, zero_of(n));
  };
  auto any_fn = [count_where](T x, py::object dim, bool keepdim) {
    const Tensor n = count_where(x, false, dim, keepdim);
    return ne(n, zero_of(n));
  };
  m.def("all", all_fn, py::arg("input"), py::arg("dim") = py::none(), py::arg("keepdim") = false);
  m.def("any", any_fn, py::arg("input"), py::arg("dim") = py::none(), py::arg("keepdim") = false);
  cls.def("all", all_fn, py::arg("dim") = py::none(), py::arg("keepdim") = false);
  cls.def("any", any_fn, py::arg("dim") = py::none(), py::arg("keepdim") = false);
  // torch.nonzero: the indices of the nonzero elements, [N, x.dim()] (as_tuple: one 1-D tensor
  // per dim), row-major; each dim's coordinates read under the mask.
  auto nonzero_fn = [](T x, bool as_tuple) -> py::object {
    if (x.dim() == 0) throw py::value_error("nonzero: a 0-d input is not supported; reshape(1) it");
    const Tensor mask = ne(x, zero_of(x));
    std::vector<Tensor> coords;
    for (int64_t d = 0; d < x.dim(); ++d) {
      Shape shape(static_cast<size_t>(x.dim()), 1);
      shape[static_cast<size_t>(d)] = x.size(d);
      const Tensor idx = arange(static_cast<double>(x.size(d)),
                                TensorOptions{}.with_dtype(DType::int64).with_device(x.device()))
                             .view(shape)
                             .expand(x.sizes());
      coords.push_back(ops::masked_select(idx, mask));
    }
    if (as_tuple) return py::tuple(py::cast(coords));
    return py::cast(stack(coords, 1));
  };
  m.def("nonzero", nonzero_fn, py::arg("input"), py::kw_only(), py::arg("as_tuple") = false);
  cls.def("nonzero", nonzero_fn, py::kw_only(), py::arg("as_tuple") = false);
  // base ** x for a number base: pow(full(base), x), differentiable in x.
  cls.def("__rpow__", [](T x, double base) {
    return pow(
        ops::full(x.sizes(), base, is_floating(x.dtype()) ? x.dtype() : DType::float32, x.device()),
        x);
  });
  auto topk_fn = [](T x, int64_t k, int64_t dim, bool largest, bool sorted) {
    return values_indices(topk(x, k, dim, largest, sorted), "topk");
  };
  m.def("topk", topk_fn, py::arg("input"), py::arg("k"), py::arg("dim") = -1,
        py::arg("largest") = true, py::arg("sorted") = true);
  cls.def("topk", topk_fn, py::arg("k"), py::arg("dim") = -1, py::arg("largest") = true,
          py::arg("sorted") = true);

  // ---- shape ----
  auto tril_fn = [](T x, int64_t diagonal) { return tril(x, diagonal); };
  auto triu_fn = [](T x, int64_t diagonal) { return triu(x, diagonal); };
  m.def("tril", tril_fn, py::arg("input"), py::arg("diagonal") = 0);
  m.def("triu", triu_fn, py::arg("input"), py::arg("diagonal") = 0);
  cls.def("tril", tril_fn, py::arg("diagonal") = 0);
  cls.def("triu", triu_fn, py::arg("diagonal") = 0);
  cls.def("repeat", [](T x, py::args sizes) {
    Shape s;
    if (sizes.size() == 1 && !py::isinstance<py::int_>(sizes[0]))
      s = sizes[0].cast<Shape>();
    else
      for (py::handle h : sizes) s.push_back(h.cast<int64_t>());
    return repeat(x, s);
  });
  auto flip_fn = [](T x, py::object dims) { return flip(x, ints_of(dims)); };
  m.def("flip", flip_fn, py::arg("input"), py::arg("dims"));
  cls.def("flip", [](T x, py::args dims) {
    if (dims.size() == 1) return flip(x, ints_of(dims[0]));
    return flip(x, dims.cast<Shape>());
  });
  // fliplr / flipud: flip over dim 1 / dim 0 (PyTorch's errors for too few dims).
  auto fliplr_fn = [](T x) {
    if (x.dim() < 2) throw py::value_error("fliplr: Input must be >= 2-d, got " + x.shape_string());
    return flip(x, {1});
  };
  auto flipud_fn = [](T x) {
    if (x.dim() < 1) throw py::value_error("flipud: Input must be >= 1-d, got " + x.shape_string());
    return flip(x, {0});
  };
  m.def("fliplr", fliplr_fn, py::arg("input"));
  m.def("flipud", flipud_fn, py::arg("input"));
  cls.def("fliplr", fliplr_fn);
  cls.def("flipud", flipud_fn);
  auto roll_fn = [](T x, py::object shifts, py::object dims) {
    return roll(x, ints_of(shifts), dims_list(dims));
  };
  m.def("roll", roll_fn, py::arg("input"), py::arg("shifts"), py::arg("dims") = py::none());
  cls.def("roll", roll_fn, py::arg("shifts"), py::arg("dims") = py::none());
  F.def(
      "pad",
      [](T x, py::object pad_, const std::string& mode, py::object value) {
        return pad(x, pad_.cast<Shape>(), mode, value.is_none() ? 0.0 : value.cast<double>());
      },
      py::arg("input"), py::arg("pad"), py::arg("mode") = "constant",
      py::arg("value") = py::none());
  F.def(
      "one_hot", [](T x, int64_t num_classes) { return one_hot(x, num_classes); },
      py::arg("tensor"), py::arg("num_classes") = -1);

  // ---- masks ----
  auto masked_select_fn = [](T x, T mask) { return masked_select(x, mask); };
  m.def("masked_select", masked_select_fn, py::arg("input"), py::arg("mask"));
  cls.def("masked_select", masked_select_fn, py::arg("mask"));
  auto masked_fill_fn = [](T x, T mask, py::object value) {
    const double v =
        py::isinstance<Tensor>(value) ? value.cast<Tensor>().item() : value.cast<double>();
    return masked_fill(x, mask, v);
  };
  m.def("masked_fill", masked_fill_fn, py::arg("input"), py::arg("mask"), py::arg("value"));
  cls.def("masked_fill", masked_fill_fn, py::arg("mask"), py::arg("value"));
  cls.def("masked_fill_", masked_in_place<double, &ops::masked_fill_>("masked_fill_"),
          py::arg("mask"), py::arg("value"));
  cls.def("masked_scatter_", masked_in_place<T, &ops::masked_scatter_>("masked_scatter_"),
          py::arg("mask"), py::arg("source"));
  // x[mask] and x[mask] = v, for a bool tensor (PyTorch's mask over x's leading dims);
  // every other index goes to bind_tensor's __getitem__ / __setitem__.
  // (Deleted first: pybind11 would otherwise chain the new ones after the old, which throw.)
  py::object getitem = cls.attr("__getitem__");
  py::object setitem = cls.attr("__setitem__");
  py::delattr(cls, "__getitem__");
  py::delattr(cls, "__setitem__");
  cls.def("__getitem__", [getitem](T x, py::object index) -> py::object {
    if (!is_mask(index)) return getitem(x, index);
    const Tensor mask = mask_of(index, x);
    auto [full, shape] = mask_plan(x, mask);
    return py::cast(masked_select(x, full).reshape(shape));
  });
  cls.def("__setitem__", [setitem](T x, py::object index, py::object value) {
    const std::optional<MaskIndex> at = mask_index(x, index);
    if (!at) {
      setitem(x, index, value);
      return;
    }
    mask_put(x, *at, value);
  });

  // ---- norm, einsum ----
  auto norm_fn = [](T x, py::object p, py::object dim, bool keepdim) {
    return norm(x, norm_p(p), dims_list(dim), keepdim);
  };
  m.def("norm", norm_fn, py::arg("input"), py::arg("p") = "fro", py::arg("dim") = py::none(),
        py::arg("keepdim") = false);
  cls.def("norm", norm_fn, py::arg("p") = "fro", py::arg("dim") = py::none(),
          py::arg("keepdim") = false);
  m.def("einsum", [](const std::string& eq, py::args operands) {
    TensorList ts;
    if (operands.size() == 1 && !py::isinstance<Tensor>(operands[0]))
      ts = operands[0].cast<TensorList>();
    else
      for (py::handle h : operands) ts.push_back(h.cast<Tensor>());
    return einsum(eq, ts);
  });

  // ---- arithmetic methods (PyTorch's names and arguments) ----
  cls.def(
      "add", [](T x, py::object o, double alpha) { return add(x, other_of(o, x), alpha); },
      py::arg("other"), py::kw_only(), py::arg("alpha") = 1.0);
  cls.def(
      "sub", [](T x, py::object o, double alpha) { return sub(x, other_of(o, x), alpha); },
      py::arg("other"), py::kw_only(), py::arg("alpha") = 1.0);
  cls.def(
      "mul", [](T x, py::object o) { return mul(x, other_of(o, x)); }, py::arg("other"));
  cls.def(
      "div", [](T x, py::object o) { return div(x, other_of(o, x)); }, py::arg("other"));
  cls.def(
      "pow",
      [](T x, py::object e) {
        return py::isinstance<Tensor>(e) ? pow(x, e.cast<Tensor>()) : pow(x, e.cast<double>());
      },
      py::arg("exponent"));
  cls.def("neg", [](T x) { return neg(x); });
  cls.def("rsqrt", [](T x) { return rsqrt(x); });
  cls.def(
      "maximum", [](T x, T o) { return maximum(x, o); }, py::arg("other"));
  cls.def(
      "minimum", [](T x, T o) { return minimum(x, o); }, py::arg("other"));
  for (const char* name : {"eq", "ne", "lt", "le", "gt", "ge"}) {
    const std::string n = name;
    cls.def(
        name,
        [n](T x, py::object o) {
          const Tensor y = other_of(o, x);
          return n == "eq"   ? eq(x, y)
                 : n == "ne" ? ne(x, y)
                 : n == "lt" ? lt(x, y)
                 : n == "le" ? le(x, y)
                 : n == "gt" ? gt(x, y)
                             : ge(x, y);
        },
        py::arg("other"));
  }
  cls.def(
      "where", [](T x, T cond, py::object o) { return where(cond, x, other_of(o, x)); },
      py::arg("condition"), py::arg("other"));

  // ---- everyday methods, composed from the ops above ----
  // argmin as argmax; amin, logsumexp and bmm as methods too (tally.amin & co. exist).
  auto argmin_fn = [](T x, py::object dim, bool keepdim) {
    if (dim.is_none()) return min(x.reshape({-1}), 0, false).indices;
    return min(x, dim.cast<int64_t>(), keepdim).indices;
  };
  cls.def("argmin", argmin_fn, py::arg("dim") = py::none(), py::arg("keepdim") = false);
  m.def("argmin", argmin_fn, py::arg("input"), py::arg("dim") = py::none(),
        py::arg("keepdim") = false);
  cls.def(
      "amin", [](T x, py::object dim, bool keepdim) { return amin(x, dims_list(dim), keepdim); },
      py::arg("dim") = py::none(), py::arg("keepdim") = false);
  cls.def(
      "logsumexp",
      [](T x, py::object dim, bool keepdim) { return logsumexp(x, dims_list(dim), keepdim); },
      py::arg("dim"), py::arg("keepdim") = false);
  cls.def(
      "bmm", [](T a, T b) { return bmm(a, b); }, py::arg("mat2"));
  // Another tensor's shape or dtype.
  cls.def(
      "expand_as", [](T x, T o) { return x.expand(o.sizes()); }, py::arg("other"));
  cls.def(
      "view_as", [](T x, T o) { return x.view(o.sizes()); }, py::arg("other"));
  cls.def(
      "reshape_as", [](T x, T o) { return x.reshape(o.sizes()); }, py::arg("other"));
  cls.def(
      "type_as", [](T x, T o) { return x.to(o.dtype()); }, py::arg("other"));
  // unbind: the slices along dim, as a tuple (differentiable, as select is).
  auto unbind_fn = [](T x, int64_t dim) {
    if (x.dim() == 0) throw py::index_error("unbind: cannot be applied to a 0-D tensor");
    const int64_t n = x.size(dim);
    py::tuple out(n);
    for (int64_t i = 0; i < n; ++i) out[i] = x.select(dim, i);
    return out;
  };
  cls.def("unbind", unbind_fn, py::arg("dim") = 0);
  m.def("unbind", unbind_fn, py::arg("input"), py::arg("dim") = 0);
  // isnan / isinf / isfinite: bool tensors (x != x is NaN alone; x - x is 0 for finite x and NaN
  // for infinities and NaN). An integer or bool tensor has neither.
  auto isnan_fn = [](T x) {
    return is_floating(x.dtype()) ? ne(x, x) : ops::zeros(x.sizes(), DType::bool_, x.device());
  };
  auto isfinite_fn = [](T x) {
    if (!is_floating(x.dtype())) return ops::full(x.sizes(), 1.0, DType::bool_, x.device());
    NoGradGuard no_grad;
    return eq(sub(x, x), zero_of(x));
  };
  auto isinf_fn = [](T x) {
    if (!is_floating(x.dtype())) return ops::zeros(x.sizes(), DType::bool_, x.device());
    NoGradGuard no_grad;
    return eq(abs(x),
              ops::full({}, std::numeric_limits<double>::infinity(), x.dtype(), x.device()));
  };
  for (auto [name, fn] : {std::pair<const char*, Tensor (*)(T)>{"isnan", +isnan_fn},
                          {"isinf", +isinf_fn},
                          {"isfinite", +isfinite_fn}}) {
    cls.def(name, fn);
    m.def(name, fn, py::arg("input"));
  }
  // clamp with one bound.
  cls.def(
      "clamp_min", [](T x, double lo) { return clamp(x, lo, std::nullopt); }, py::arg("min"));
  cls.def(
      "clamp_max", [](T x, double hi) { return clamp(x, std::nullopt, hi); }, py::arg("max"));
  // F.normalize: x over its p-norm along dim, the norm at least eps (PyTorch's formula).
  F.def(
      "normalize",
      [](T x, double p, int64_t dim, double eps) {
        const Tensor n = clamp(norm(x, p, {dim}, /*keepdim=*/true), eps, std::nullopt);
        return div(x, n.expand(x.sizes()));
      },
      py::arg("input"), py::arg("p") = 2.0, py::arg("dim") = 1, py::arg("eps") = 1e-12);
  // outer (ger): out[i, j] = a[i] * b[j] for 1-D a and b.
  auto outer_fn = [](T a, T b) {
    if (a.dim() != 1 || b.dim() != 1)
      throw py::value_error(fmt::format("outer: expected two 1-D tensors, got {} and {}",
                                        a.shape_string(), b.shape_string()));
    return mul(a.unsqueeze(1), b.unsqueeze(0));
  };
  m.def("outer", outer_fn, py::arg("input"), py::arg("vec2"));
  m.def("ger", outer_fn, py::arg("input"), py::arg("vec2"));
  cls.def("outer", outer_fn, py::arg("vec2"));
  // movedim: the source dims to the destination places, the others in their order.
  auto movedim_fn = [](T x, py::object source, py::object destination) {
    const Shape src = ints_of(source), dst = ints_of(destination);
    const int64_t rank = x.dim();
    if (src.size() != dst.size())
      throw py::value_error(
          fmt::format("movedim: source {} and destination {} must have as many dims",
                      shape_str(src), shape_str(dst)));
    Shape order(static_cast<size_t>(rank), -1);
    std::vector<bool> used(static_cast<size_t>(rank), false);
    for (size_t i = 0; i < src.size(); ++i) {
      const int64_t s = ops::wrap_dim(src[i], rank, "movedim");
      const int64_t d = ops::wrap_dim(dst[i], rank, "movedim");
      if (rank == 0) continue;  // dim 0 / -1 of a 0-D tensor: itself
      if (used[static_cast<size_t>(s)] || order[static_cast<size_t>(d)] >= 0)
        throw py::value_error(fmt::format("movedim: repeated dim in source {} or destination {}",
                                          shape_str(src), shape_str(dst)));
      used[static_cast<size_t>(s)] = true;
      order[static_cast<size_t>(d)] = s;
    }
    int64_t next = 0;
    for (int64_t& o : order)
      if (o < 0) {
        while (used[static_cast<size_t>(next)]) ++next;
        o = next++;
      }
    return x.permute(order);
  };
  m.def("movedim", movedim_fn, py::arg("input"), py::arg("source"), py::arg("destination"));
  cls.def("movedim", movedim_fn, py::arg("source"), py::arg("destination"));
  // unflatten: dim viewed as `sizes` (one of them may be -1).
  cls.def(
      "unflatten",
      [](T x, int64_t dim, py::object sizes) {
        const auto d = static_cast<size_t>(ops::wrap_dim(dim, x.dim(), "unflatten"));
        if (x.dim() == 0) throw py::index_error("unflatten: cannot be applied to a 0-D tensor");
        Shape shape(x.sizes().begin(), x.sizes().begin() + static_cast<int64_t>(d));
        for (int64_t k : ints_of(sizes)) shape.push_back(k);
        shape.insert(shape.end(), x.sizes().begin() + static_cast<int64_t>(d) + 1, x.sizes().end());
        return x.view(shape);
      },
      py::arg("dim"), py::arg("sizes"));
  // addcmul / addcdiv: input + value * t1 * t2 (t1 / t2).
  cls.def(
      "addcmul", [](T x, T a, T b, double v) { return add(x, mul(mul(a, b), v)); },
      py::arg("tensor1"), py::arg("tensor2"), py::kw_only(), py::arg("value") = 1.0);
  cls.def(
      "addcdiv", [](T x, T a, T b, double v) { return add(x, mul(div(a, b), v)); },
      py::arg("tensor1"), py::arg("tensor2"), py::kw_only(), py::arg("value") = 1.0);
  // logical_not and count_nonzero: a zero is false, anything else (NaN too) true.
  auto logical_not_fn = [](T x) { return eq(x, zero_of(x)); };
  cls.def("logical_not", logical_not_fn);
  m.def("logical_not", logical_not_fn, py::arg("input"));
  auto count_nonzero_fn = [count_where](T x, py::object dim) {
    return count_where(x, false, dim, false);
  };
  cls.def("count_nonzero", count_nonzero_fn, py::arg("dim") = py::none());
  m.def("count_nonzero", count_nonzero_fn, py::arg("input"), py::arg("dim") = py::none());
  // isclose's test over every element (PyTorch's: equal, or a finite difference within
  // atol + rtol * |other|; NaNs equal with equal_nan), and equal: one shape, every element eq.
  auto allclose_fn = [](T a, T b, double rtol, double atol, bool equal_nan) {
    if (a.dtype() != b.dtype())
      throw py::type_error(fmt::format("allclose: the inputs' dtypes differ ({} and {})",
                                       dtype_name(a.dtype()), dtype_name(b.dtype())));
    NoGradGuard no_grad;
    const Tensor x = a.to(DType::float64), y = b.to(DType::float64);
    const Tensor diff = abs(sub(x, y));
    const Tensor bound = add(mul(abs(y), rtol), atol);
    Tensor close = maximum(eq(x, y).to(DType::float64),
                           mul(eq(sub(diff, diff), zero_of(diff)).to(DType::float64),
                               le(diff, bound).to(DType::float64)));
    if (equal_nan)
      close = maximum(close, mul(ne(x, x).to(DType::float64), ne(y, y).to(DType::float64)));
    return close.numel() == 0 || ops::item(amin(close)) == 1.0;
  };
  m.def("allclose", allclose_fn, py::arg("input"), py::arg("other"), py::arg("rtol") = 1e-5,
        py::arg("atol") = 1e-8, py::arg("equal_nan") = false);
  cls.def("allclose", allclose_fn, py::arg("other"), py::arg("rtol") = 1e-5, py::arg("atol") = 1e-8,
          py::arg("equal_nan") = false);
  auto equal_fn = [](T a, T b) {
    if (a.sizes() != b.sizes()) return false;
    NoGradGuard no_grad;
    return a.numel() == 0 || ops::item(amin(eq(a, b).to(DType::float32))) == 1.0;
  };
  m.def("equal", equal_fn, py::arg("input"), py::arg("other"));
  cls.def("equal", equal_fn, py::arg("other"));
}

}  // namespace tally::python
