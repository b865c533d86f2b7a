#include "tensor/tensor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

#include "memory/checked.h"

namespace tally {

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t shape_numel(const Shape& s) {
  return memory::checked_numel(s, "numel");
}

Shape contiguous_strides(const Shape& sizes) {
  // Checked once: the strides below are partial products of a shape whose dimensions
  // (zeros as ones) multiply to at most 2^63 - 1.
  (void)memory::checked_numel(sizes, "contiguous_strides");
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
  (void)memory::checked_numel(sizes, what);
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
  if (memory::checked_numel(sizes, "Tensor::make") > 0) {
    static constexpr const char* what = "Tensor::make: the extent of the layout";
    int64_t hi = offset, lo = offset;
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int64_t span = memory::checked_mul(sizes[i] - 1, strides[i], what);
      if (span > 0)
        hi = memory::checked_add(hi, span, what);
      else
        lo = memory::checked_add(lo, span, what);
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

// Format a CPU tensor's elements recursively.
void format_elems(std::ostringstream& os, const Tensor& t, std::vector<int64_t>& idx, size_t d,
                  const std::string& indent) {
  const bool fp = is_floating(t.dtype());
  auto elem = [&]() -> std::string {
    int64_t off = t.storage_offset();
    for (size_t i = 0; i < idx.size(); ++i) off += idx[i] * t.strides()[i];
    const char* base = static_cast<const char*>(t.storage().data());
    std::string s;
    TALLY_DISPATCH_ALL(t.dtype(), "print", [&] {
      const scalar_t v = reinterpret_cast<const scalar_t*>(base)[off];
      if constexpr (std::is_same_v<scalar_t, bool>) {
        s = v ? "True" : "False";
      } else if (fp) {
        const double x = static_cast<double>(static_cast<acc_t<scalar_t>>(v));
        s = std::isfinite(x) ? fmt::format("{:.4f}", x)
                             : (std::isnan(x) ? "nan" : (x > 0 ? "inf" : "-inf"));
      } else {
        s = fmt::format("{}", static_cast<int64_t>(v));
      }
    });
    return s;
  };
  if (t.dim() == 0) {
    os << elem();
    return;
  }
  os << "[";
  const int64_t n = t.sizes()[d];
  const bool last = d + 1 == static_cast<size_t>(t.dim());
  const int64_t edge = 3;
  for (int64_t i = 0; i < n; ++i) {
    if (n > 2 * edge + 1 && i == edge) {
      os << (last ? "..., " : "...,\n" + indent + " ");
      i = n - edge - 1;
      continue;
    }
    idx[d] = i;
    if (last) {
      os << elem();
    } else {
      format_elems(os, t, idx, d + 1, indent + " ");
    }
    if (i + 1 < n) os << (last ? ", " : ",\n" + indent + " ");
  }
  os << "]";
}

}  // namespace

std::string Tensor::str() const {
  if (!defined()) return "tensor(undefined)";
  std::ostringstream os;
  os << "tensor(";
  if (device().type != DeviceType::cpu) {
    os << "<" << shape_str(sizes()) << " on " << device().str() << ">";
  } else {
    std::vector<int64_t> idx(static_cast<size_t>(dim()), 0);
    format_elems(os, *this, idx, 0, "       ");
  }
  if (dtype() != DType::float32 && dtype() != DType::int64 && dtype() != DType::bool_)
    os << ", dtype=" << dtype_name(dtype());
  if (device().type != DeviceType::cpu) os << ", device='" << device().str() << "'";
  if (requires_grad()) os << ", requires_grad=True";
  os << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) {
  return os << t.str();
}

}  // namespace tally
