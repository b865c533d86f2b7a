#include "tensor/tensor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "base/checked.h"

namespace tally {

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t shape_numel(const Shape& s) {
  return base::checked_numel(s, "numel");
}

Shape contiguous_strides(const Shape& sizes) {
  // Checked once: the strides below are partial products of a shape whose dimensions
  // (zeros as ones) multiply to at most 2^63 - 1.
  (void)base::checked_numel(sizes, "contiguous_strides");
  Shape st(sizes.size());
  int64_t acc = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    st[i] = acc;
    acc *= std::max<int64_t>(sizes[i], 1);
  }
  return st;
}

const char* memory_format_name(MemoryFormat f) {
  return f == MemoryFormat::channels_last ? "channels_last" : "contiguous_format";
}

Shape memory_format_strides(const Shape& sizes, MemoryFormat f, const char* what) {
  if (f == MemoryFormat::contiguous) return contiguous_strides(sizes);
  if (sizes.size() != 4)
    throw std::invalid_argument(fmt::format(
        "{}: channels_last needs a 4-D [N, C, H, W] tensor, got shape {}", what, shape_str(sizes)));
  (void)base::checked_numel(sizes, what);
  const int64_t c = std::max<int64_t>(sizes[1], 1), h = std::max<int64_t>(sizes[2], 1),
                w = std::max<int64_t>(sizes[3], 1);
  return {h * w * c, 1, w * c, c};
}

Tensor Tensor::make(Storage storage, Shape sizes, Shape strides, int64_t offset, DType dtype) {
  if (sizes.size() != strides.size())
    throw std::invalid_argument(fmt::format("Tensor::make: sizes {} and strides {} differ in rank",
                                            shape_str(sizes), shape_str(strides)));
  for (int64_t d : sizes)
    if (d < 0)
      throw std::invalid_argument(
          fmt::format("Tensor::make: negative size in {}", shape_str(sizes)));
  // Bounds: the largest reachable element must lie inside the storage.
  if (base::checked_numel(sizes, "Tensor::make") > 0) {
    static constexpr const char* what = "Tensor::make: the extent of the layout";
    int64_t hi = offset, lo = offset;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int64_t span = base::checked_mul(sizes[i] - 1, strides[i], what);
      if (span > 0)
        hi = base::checked_add(hi, span, what);
      else
        lo = base::checked_add(lo, span, what);
    }
    const auto cap = static_cast<int64_t>(storage.nbytes() / dtype_size(dtype));
    if (lo < 0 || hi >= cap)
      throw std::out_of_range(fmt::format(
          "Tensor::make: layout sizes {} strides {} offset {} reaches outside a storage of {} "
          "elements",
          shape_str(sizes), shape_str(strides), offset, cap));
  }
  Tensor t;
  t.impl_ = std::make_shared<TensorImpl>();
  t.impl_->storage = std::move(storage);
  t.impl_->sizes = std::move(sizes);
  t.impl_->strides = std::move(strides);
  t.impl_->offset = offset;
  t.impl_->dtype = dtype;
  return t;
}

TensorImpl& Tensor::impl() const {
  if (!impl_) throw std::logic_error("use of an undefined Tensor");
  return *impl_;
}

static int64_t wrap_dim(int64_t d, int64_t rank, const char* what) {
  if (d < -rank || d >= rank)
    throw std::out_of_range(
        fmt::format("{}: dimension {} out of range for a {}-D tensor", what, d, rank));
  return d < 0 ? d + rank : d;
}

int64_t Tensor::size(int64_t d) const {
  return impl().sizes[static_cast<size_t>(wrap_dim(d, dim(), "size"))];
}
int64_t Tensor::stride(int64_t d) const {
  return impl().strides[static_cast<size_t>(wrap_dim(d, dim(), "stride"))];
}

bool Tensor::is_contiguous() const {
  const TensorImpl& t = impl();
  int64_t expected = 1;
  for (size_t i = t.sizes.size(); i-- > 0;) {
    if (t.sizes[i] == 1) continue;
    if (t.strides[i] != expected) return false;
    expected *= t.sizes[i];
  }
  return true;
}

bool Tensor::is_contiguous(MemoryFormat f) const {
  if (f == MemoryFormat::contiguous) return is_contiguous();
  const TensorImpl& t = impl();
  if (t.sizes.size() != 4) return false;
  int64_t expected = 1;
  for (const size_t i : {size_t{1}, size_t{3}, size_t{2}, size_t{0}}) {
    if (t.sizes[i] == 1) continue;
    if (t.strides[i] != expected) return false;
    expected *= t.sizes[i];
  }
  return true;
}

MemoryFormat Tensor::suggest_memory_format() const {
  return dim() == 4 && !is_contiguous() && is_contiguous(MemoryFormat::channels_last)
             ? MemoryFormat::channels_last
             : MemoryFormat::contiguous;
}

void* Tensor::data_ptr() const {
  const TensorImpl& t = impl();
  return static_cast<char*>(t.storage.data()) +
         t.offset * static_cast<int64_t>(dtype_size(t.dtype));
}

namespace {

// Printing follows torch/_tensor_str.py with its default options: precision 4, a summary
// (3 items at each end of every dimension) past 1,000 elements, 80 columns.
constexpr int64_t kPrintThreshold = 1000;
constexpr int64_t kEdgeItems = 3;
constexpr int64_t kLineWidth = 80;

// The element at `idx` of a CPU tensor, as a double (floating and integer dtypes) or a bool.
double element(const Tensor& t, const std::vector<int64_t>& idx) {
  int64_t off = t.storage_offset();
  for (size_t i = 0; i < idx.size(); ++i) off += idx[i] * t.strides()[i];
  const char* base = static_cast<const char*>(t.storage().data());
  double x = 0;
  TALLY_DISPATCH_ALL(t.dtype(), "print", [&] {
    const scalar_t v = reinterpret_cast<const scalar_t*>(base)[off];
    if constexpr (std::is_same_v<scalar_t, bool>)
      x = v ? 1 : 0;
    else
      x = static_cast<double>(static_cast<acc_t<scalar_t>>(v));
  });
  return x;
}

// The indices printed along a dimension of size n: all, or 3 at each end with a gap.
std::vector<int64_t> shown(int64_t n, bool summarize) {
  std::vector<int64_t> out;
  if (summarize && n > 2 * kEdgeItems) {
    for (int64_t i = 0; i < kEdgeItems; ++i) out.push_back(i);
    for (int64_t i = n - kEdgeItems; i < n; ++i) out.push_back(i);
  } else {
    for (int64_t i = 0; i < n; ++i) out.push_back(i);
  }
  return out;
}

// PyTorch's _Formatter: one style and width for every element printed.
class Formatter {
 public:
  Formatter(DType dtype, const std::vector<double>& values)
      : floating_(is_floating(dtype)), boolean_(dtype == DType::bool_) {
    if (!floating_) {
      for (double v : values) width_ = std::max(width_, plain(v).size());
      return;
    }
    std::vector<double> finite;  // nonzero and finite, absolute
    for (double v : values)
      if (std::isfinite(v) && v != 0) finite.push_back(v);
    if (finite.empty()) return;  // zeros, nan, inf: int mode, width 1
    double lo = std::abs(finite[0]), hi = lo;
    for (double v : finite) {
      lo = std::min(lo, std::abs(v));
      hi = std::max(hi, std::abs(v));
      if (v != std::ceil(v)) int_mode_ = false;
    }
    sci_ = hi / lo > 1000.0 || hi > 1.0e8 || (!int_mode_ && lo < 1.0e-4);
    for (double v : finite) {
      const size_t w = sci_        ? fmt::format("{:.4e}", v).size()
                       : int_mode_ ? fmt::format("{:.0f}", v).size() + 1
                                   : fmt::format("{:.4f}", v).size();
      width_ = std::max(width_, w);
    }
  }

  size_t width() const { return width_; }

  std::string format(double v) const {
    std::string s;
    if (!floating_) {
      s = plain(v);
    } else if (!std::isfinite(v)) {
      s = std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
    } else if (sci_) {
      s = fmt::format("{:.4e}", v);
    } else if (int_mode_) {
      s = fmt::format("{:.0f}.", v);
    } else {
      s = fmt::format("{:.4f}", v);
    }
    return s.size() < width_ ? std::string(width_ - s.size(), ' ') + s : s;
  }

 private:
  std::string plain(double v) const {
    if (boolean_) return v != 0 ? "True" : "False";
    return fmt::format("{}", static_cast<int64_t>(v));
  }

  bool floating_, boolean_;
  bool int_mode_ = true;
  bool sci_ = false;
  size_t width_ = 1;
};

void collect(const Tensor& t, std::vector<int64_t>& idx, size_t d, bool summarize,
             std::vector<double>& out) {
  if (d == idx.size()) {
    out.push_back(element(t, idx));
    return;
  }
  for (int64_t i : shown(t.sizes()[d], summarize)) {
    idx[d] = i;
    collect(t, idx, d + 1, summarize, out);
  }
}

// _tensor_str_with_formatter: `indent` is the column of this bracket's contents.
std::string format_dims(const Tensor& t, std::vector<int64_t>& idx, size_t d, bool summarize,
                        const Formatter& f, int64_t indent) {
  const int64_t n = t.sizes()[d];
  const std::vector<int64_t> items = shown(n, summarize);
  std::vector<std::string> parts;
  if (d + 1 == idx.size()) {  // _vector_str: as many items a line as fit in 80 columns
    for (size_t k = 0; k < items.size(); ++k) {
      if (k == static_cast<size_t>(kEdgeItems) && items.size() < static_cast<size_t>(n))
        parts.push_back(" ...");
      idx[d] = items[k];
      parts.push_back(f.format(element(t, idx)));
    }
    const auto per_line = static_cast<size_t>(
        std::max<int64_t>(1, (kLineWidth - indent) / static_cast<int64_t>(f.width() + 2)));
    std::string out = "[";
    for (size_t k = 0; k < parts.size(); ++k) {
      if (k > 0) out += k % per_line == 0 ? ",\n" + std::string(indent + 1, ' ') : ", ";
      out += parts[k];
    }
    return out + "]";
  }
  for (size_t k = 0; k < items.size(); ++k) {
    if (k == static_cast<size_t>(kEdgeItems) && items.size() < static_cast<size_t>(n))
      parts.push_back("...");
    idx[d] = items[k];
    parts.push_back(format_dims(t, idx, d + 1, summarize, f, indent + 1));
  }
  const std::string sep =
      "," + std::string(idx.size() - d - 1, '\n') + std::string(indent + 1, ' ');
  std::string out = "[";
  for (size_t k = 0; k < parts.size(); ++k) out += (k ? sep : "") + parts[k];
  return out + "]";
}

}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "tensor(undefined)";
  std::string out = "tensor(";
  // PyTorch's suffixes, in its order: device, size (an empty tensor that is not 1-D), dtype
  // (not the defaults; always for an empty tensor, which has no values to tell).
  std::vector<std::string> suffixes;
  if (device().type != DeviceType::cpu) suffixes.push_back("device='" + device().str() + "'");
  bool default_dtype =
      dtype() == DType::float32 || dtype() == DType::int64 || dtype() == DType::bool_;
  if (device().type != DeviceType::cpu) {
    // The values stay on the device: printing does not synchronise.
    out += "<" + shape_str(sizes()) + " on " + device().str() + ">";
  } else if (numel() == 0) {
    out += "[]";
    if (dim() != 1) {
      std::string size = "size=(";
      for (int64_t i = 0; i < dim(); ++i) size += (i ? ", " : "") + std::to_string(sizes()[i]);
      suffixes.push_back(size + ")");
    }
    default_dtype = dtype() == DType::float32;
  } else {
    const bool summarize = numel() > kPrintThreshold;
    std::vector<int64_t> idx(static_cast<size_t>(dim()), 0);
    std::vector<double> values;
    collect(*this, idx, 0, summarize, values);
    const Formatter f(dtype(), values);
    out += dim() == 0 ? f.format(values[0]) : format_dims(*this, idx, 0, summarize, f, 7);
  }
  if (!default_dtype) suffixes.push_back(std::string("dtype=") + dtype_name(dtype()));
  if (requires_grad()) suffixes.push_back("requires_grad=True");
  for (const std::string& x : suffixes) out += ", " + x;
  return out + ")";
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) {
  return os << t.str();
}

}  // namespace tally
