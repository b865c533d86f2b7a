#include "tensor/dtype.h"

#include <fmt/format.h>

#include <iterator>

namespace tally {

namespace {

// What Tally knows of each dtype, in DType's order.
struct DTypeInfo {
  size_t size;       // bytes per element
  const char* name;  // PyTorch's name
  int rank;          // PyTorch's promotion order (float16 and bfloat16 tie)
};
constexpr DTypeInfo kDTypes[] = {
    {4, "float32", 5}, {2, "float16", 4}, {2, "bfloat16", 4}, {8, "float64", 6},
    {4, "int32", 2},   {8, "int64", 3},   {1, "bool", 0},     {1, "uint8", 1},
};
static_assert(std::size(kDTypes) == static_cast<size_t>(DType::uint8) + 1);

// The entry of t; nullptr for a value outside the enum.
const DTypeInfo* info(DType t) {
  const auto i = static_cast<size_t>(t);
  return i < std::size(kDTypes) ? &kDTypes[i] : nullptr;
}

}  // namespace

size_t dtype_size(DType t) {
  const DTypeInfo* d = info(t);
  return d ? d->size : 0;
}

const char* dtype_name(DType t) {
  const DTypeInfo* d = info(t);
  return d ? d->name : "?";
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  auto rank = [](DType t) {
    const DTypeInfo* d = info(t);
    return d ? d->rank : 0;
  };
  // float16 with bfloat16 promotes to float32, as in PyTorch.
  if ((a == DType::float16 && b == DType::bfloat16) ||
      (a == DType::bfloat16 && b == DType::float16))
    return DType::float32;
  return rank(a) >= rank(b) ? a : b;
}

void unsupported_dtype(const char* op, DType t) {
  throw std::invalid_argument(fmt::format("{}: dtype {} is not supported", op, dtype_name(t)));
}

}  // namespace tally
