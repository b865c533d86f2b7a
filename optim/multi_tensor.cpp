// CPU kernels of the fused optimizer updates: the reference the CUDA kernels are checked
// against. The arithmetic follows PyTorch's single-tensor float32 paths operation by operation.
#include "optim/multi_tensor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "optim/update_math.h"
#include "tensor/dispatch.h"
#include "tensor/ops.h"

namespace tally::optim {

void TensorLists::add(std::initializer_list<void*> p, int64_t numel) {
  if (static_cast<int>(p.size()) != depth)
    throw std::logic_error(
        fmt::format("TensorLists::add: {} pointers for a list of depth {}", p.size(), depth));
  std::array<void*, kMaxListDepth> a{};
  std::copy(p.begin(), p.end(), a.begin());
  ptrs.push_back(a);
  numels.push_back(numel);
}

int64_t chunk_count(const TensorLists& l) {
  int64_t n = 0;
  for (const int64_t numel : l.numels) n += (numel + kChunkSize - 1) / kChunkSize;
  return n;
}

size_t chunk_table_bytes(const TensorLists& l) {
  const int64_t chunks = chunk_count(l);
  return chunks == 0 ? 0
                     : l.size() * sizeof(ChunkEntry) + static_cast<size_t>(chunks) * sizeof(Chunk);
}

namespace cpu {
namespace {

template <typename F>
void for_dtype(const TensorLists& l, const char* op, F f) {
  if (l.dtype == DType::float32)
    f(float{});
  else if (l.dtype == DType::float64)
    f(double{});
  else
    throw std::invalid_argument(
        fmt::format("{}: parameters and gradients must be float32 or float64, got {}", op,
                    dtype_name(l.dtype)));
}

// The element-wise updates' loop: Scalars<T>(h) once for the lists' dtype T, then
// update(s, lists, t) for each tensor t, with lists(t, k) its k-th list's data as T*.
template <template <typename> class Scalars, typename Hyper, typename F>
void update_each(const TensorLists& l, const char* op, const Hyper& h, F update) {
  for_dtype(l, op, [&](auto zero) {
    using T = decltype(zero);
    const Scalars<T> s(h);
    auto lists = [&](size_t t, int k) { return static_cast<T*>(l.ptrs[t][k]); };
    for (size_t t = 0; t < l.size(); ++t) update(s, lists, t);
  });
}

void sgd_(const TensorLists& l, const SGDHyper& h) {
  update_each<detail::SGDScalars>(l, "SGD", h, [&](const auto& s, auto lists, size_t t) {
    auto* p = lists(t, 0);
    const auto* g = lists(t, 1);
    auto* buf = l.depth > 2 ? lists(t, 2) : nullptr;
    for (int64_t i = 0; i < l.numels[t]; ++i)
      detail::sgd_element(s, p[i], g[i], buf ? &buf[i] : nullptr);
  });
}

void adam_(const TensorLists& l, const AdamHyper& h) {
  update_each<detail::AdamScalars>(l, "Adam", h, [&](const auto& s, auto lists, size_t t) {
    auto* p = lists(t, 0);
    const auto* g = lists(t, 1);
    auto* m = lists(t, 2);
    auto* v = lists(t, 3);
    auto* vmax = l.depth > 4 ? lists(t, 4) : nullptr;
    for (int64_t i = 0; i < l.numels[t]; ++i)
      detail::adam_element(s, p[i], g[i], m[i], v[i], vmax ? &vmax[i] : nullptr);
  });
}

double norm_power_sum(const TensorLists& l, double norm_type) {
  double acc = 0;
  for_dtype(l, "clip_grad_norm_", [&](auto zero) {
    using T = decltype(zero);
    for (size_t t = 0; t < l.size(); ++t) {
      const T* x = static_cast<const T*>(l.ptrs[t][0]);
      for (int64_t i = 0; i < l.numels[t]; ++i) {
        const double v = detail::norm_term(static_cast<double>(x[i]), norm_type);
        acc = std::isinf(norm_type) ? detail::nan_max(acc, v) : acc + v;
      }
    }
  });
  return acc;
}

void clip_scale_(const TensorLists& l, double total_norm, double max_norm) {
  for_dtype(l, "clip_grad_norm_", [&](auto zero) {
    using T = decltype(zero);
    const T c = detail::clip_coef(static_cast<T>(total_norm), static_cast<T>(max_norm));
    for (size_t t = 0; t < l.size(); ++t) {
      T* x = static_cast<T*>(l.ptrs[t][0]);
      for (int64_t i = 0; i < l.numels[t]; ++i) x[i] *= c;
    }
  });
}

bool unscale_(const TensorLists& l, float inv_scale) {
  bool found = false;
  for_dtype(l, "GradScaler.unscale_", [&](auto zero) {
    using T = decltype(zero);
    const T c = static_cast<T>(inv_scale);
    for (size_t t = 0; t < l.size(); ++t) {
      T* x = static_cast<T*>(l.ptrs[t][0]);
      for (int64_t i = 0; i < l.numels[t]; ++i) {
        if (!std::isfinite(x[i])) found = true;
        x[i] *= c;
      }
    }
  });
  return found;
}

Tensor total_norm(const TensorLists& l, double norm_type) {
  return ops::full({}, detail::finish_norm(norm_power_sum(l, norm_type), norm_type), l.dtype);
}

// The total read back from its 0-dim tensor (rounded to the dtype, as on CUDA).
void clip_scale(const TensorLists& l, const Tensor& total_norm, double max_norm) {
  clip_scale_(l, ops::item(total_norm), max_norm);
}

void unscale(const TensorLists& l, float inv_scale, const Tensor& found_inf) {
  if (unscale_(l, inv_scale)) ops::fill_(found_inf, 1.0);
}

}  // namespace

const MultiTensorKernels multi_tensor_kernels{
    .sgd = &sgd_,
    .adam = &adam_,
    .total_norm = &total_norm,
    .clip_scale = &clip_scale,
    .unscale = &unscale,
};

}  // namespace cpu

// The registration point of the fused kernels (a layer above tensor/backends.cpp's families).
namespace {
const Backends<MultiTensorKernels> multi_tensor_backends{
    &cpu::multi_tensor_kernels, TALLY_CUDA_TABLE(cuda::multi_tensor_kernels),
    &meta::multi_tensor_kernels};
}  // namespace

void fused_sgd_(const TensorLists& l, const SGDHyper& h) {
  static const OpInfo info("_fused_sgd_");
  DispatchScope scope(info, l.device);
  multi_tensor_backends.get(info, l.device, &MultiTensorKernels::sgd)(l, h);
}

void fused_adam_(const TensorLists& l, const AdamHyper& h) {
  static const OpInfo adam("_fused_adam_"), adamw("_fused_adamw_");
  const OpInfo& info = h.decoupled ? adamw : adam;
  DispatchScope scope(info, l.device);
  multi_tensor_backends.get(info, l.device, &MultiTensorKernels::adam)(l, h);
}

Tensor foreach_norm(const TensorLists& l, double norm_type) {
  static const OpInfo info("_foreach_norm");
  DispatchScope scope(info, l.device);
  return multi_tensor_backends.get(info, l.device, &MultiTensorKernels::total_norm)(l, norm_type);
}

void clip_scale_(const TensorLists& l, const Tensor& total_norm, double max_norm) {
  static const OpInfo info("_foreach_mul_");
  DispatchScope scope(info, l.device);
  multi_tensor_backends.get(info, l.device, &MultiTensorKernels::clip_scale)(l, total_norm,
                                                                             max_norm);
}

void unscale_(const TensorLists& l, float inv_scale, const Tensor& found_inf) {
  static const OpInfo info("_amp_foreach_non_finite_check_and_unscale_");
  DispatchScope scope(info, l.device);
  multi_tensor_backends.get(info, l.device, &MultiTensorKernels::unscale)(l, inv_scale, found_inf);
}

}  // namespace tally::optim
