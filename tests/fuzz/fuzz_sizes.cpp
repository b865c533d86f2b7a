// Sizes (issue 22's size arithmetic): shapes, strides, offsets and byte counts from the input,
// through the factories (empty, zeros, full, empty_host), the layout constructors (view,
// reshape, expand, as_strided over a small tensor) and the allocator (Storage::allocate).
// Whatever is accepted must be exact: numel is the product of the dimensions, nbytes is numel
// times the element size, and every element a layout reaches lies inside its storage (checked
// with 128-bit arithmetic here). Overflow must be an exception, never a wrapped size.
#include "fuzz_common.h"
#include "nn/data/dataset.h"
#include "tensor/ops.h"

using namespace tally;

namespace {

using i128 = __int128;

int64_t dim(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
      return in.ConsumeIntegralInRange<int64_t>(0, 8);
    case 1:
      return in.ConsumeIntegralInRange<int64_t>(-2, 1 << 12);
    case 2:  // near powers of two
      return (int64_t{1} << in.ConsumeIntegralInRange<int>(0, 62)) +
             in.ConsumeIntegralInRange<int64_t>(-1, 1);
    default:
      return in.ConsumeIntegral<int64_t>();
  }
}

Shape shape(FuzzedDataProvider& in) {
  Shape s(static_cast<size_t>(in.ConsumeIntegralInRange<int>(0, 5)));
  for (int64_t& d : s) d = dim(in);
  return s;
}

// The exact element count, or -1 past int64 (or for a negative dimension).
i128 exact_numel(const Shape& s) {
  i128 n = 1;
  for (int64_t d : s) {
    if (d < 0) return -1;
    n *= d;
    if (n > INT64_MAX) return -1;
  }
  return n;
}

void check_tensor(const Tensor& t, const Shape& sizes, DType dtype) {
  FUZZ_CHECK(t.sizes() == sizes);
  FUZZ_CHECK(t.dtype() == dtype);
  const i128 n = exact_numel(sizes);
  FUZZ_CHECK(n >= 0 && t.numel() == static_cast<int64_t>(n));
  FUZZ_CHECK(static_cast<i128>(t.nbytes()) == n * static_cast<i128>(dtype_size(dtype)));
}

// Every element of `t`'s layout lies inside its storage.
void check_in_bounds(const Tensor& t) {
  if (t.numel() == 0) return;
  i128 lo = t.storage_offset(), hi = t.storage_offset();
  for (int64_t d = 0; d < t.dim(); ++d) {
    const i128 span = static_cast<i128>(t.size(d) - 1) * t.stride(d);
    (span > 0 ? hi : lo) += span;
  }
  FUZZ_CHECK(lo >= 0);
  FUZZ_CHECK((hi + 1) * static_cast<i128>(t.element_size()) <=
             static_cast<i128>(t.storage().nbytes()));
}

constexpr DType kDtypes[] = {DType::float32, DType::float16, DType::bfloat16, DType::float64,
                             DType::int32,   DType::int64,   DType::bool_};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::scratch_dir(size_t{4} << 20);  // a 4 MiB cap: what fits is quick to fill and check
  FuzzedDataProvider in(data, size);
  const DType dtype = kDtypes[in.ConsumeIntegralInRange<size_t>(0, std::size(kDtypes) - 1)];
  const Shape s = shape(in);
  switch (in.ConsumeIntegralInRange<int>(0, 6)) {
    case 0:
      fuzz::accepts([&] { check_tensor(ops::empty(s, dtype), s, dtype); });
      break;
    case 1:
      fuzz::accepts([&] {
        const Tensor t = ops::zeros(s, dtype);
        check_tensor(t, s, dtype);
        const auto* p = static_cast<const unsigned char*>(t.data_ptr());
        for (size_t i = 0; i < t.nbytes(); ++i) FUZZ_CHECK(p[i] == 0);
      });
      break;
    case 2:
      fuzz::accepts([&] { check_tensor(data::empty_host(s, dtype, false), s, dtype); });
      break;
    case 3: {  // view / reshape of 24 elements (-1 allowed)
      const Tensor base = ops::arange(0, 24, 1, DType::int64);
      const bool view = in.ConsumeBool();
      fuzz::accepts([&] {
        const Tensor t = view ? ops::view(base, s) : ops::reshape(base, s);
        FUZZ_CHECK(t.numel() == 24);
        check_in_bounds(t);
        FUZZ_CHECK(ops::to_vector(t).size() == 24);
      });
      break;
    }
    case 4: {  // expand a [1, 3] or [3] tensor
      const Tensor base = ops::arange(0, 3, 1, DType::float32).reshape({1, 3});
      fuzz::accepts([&] {
        const Tensor t = ops::expand(base, s);
        check_in_bounds(t);
        if (t.numel() <= 4096)
          FUZZ_CHECK(ops::to_vector(t).size() == static_cast<size_t>(t.numel()));
      });
      break;
    }
    case 5: {  // as_strided over 64 elements: any strides and offset
      const Tensor base = ops::zeros({64}, dtype);
      Shape strides(s.size());
      for (int64_t& st : strides) st = dim(in);
      const int64_t offset = dim(in);
      fuzz::accepts([&] {
        const Tensor t = ops::as_strided(base, s, strides, offset);
        check_in_bounds(t);
        if (t.numel() <= 4096)
          FUZZ_CHECK(ops::to_vector(t).size() == static_cast<size_t>(t.numel()));
      });
      break;
    }
    default: {  // the allocator: any byte count
      const size_t bytes = in.ConsumeBool() ? in.ConsumeIntegral<size_t>()
                                            : in.ConsumeIntegralInRange<size_t>(0, 1 << 20);
      fuzz::accepts([&] {
        const Storage st = Storage::allocate(bytes, Device::cpu());
        FUZZ_CHECK(st.nbytes() == bytes);
        if (bytes) {
          FUZZ_CHECK(st.block_bytes() >= bytes);
          auto* p = static_cast<unsigned char*>(st.data());
          p[0] = p[bytes - 1] = 1;
        }
      });
      break;
    }
  }
  return 0;
}
