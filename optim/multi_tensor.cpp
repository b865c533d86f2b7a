// CPU kernels of the fused optimizer updates: the reference the CUDA kernels are checked
// against. The arithmetic follows PyTorch's single-tensor float32 paths operation by operation
// (AdamW8bit's, bitsandbytes' block-wise 8-bit update, whose code books are made here too).
#include "optim/multi_tensor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "optim/cpu_adam.h"
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

std::array<float, 256> create_dynamic_map(bool is_signed) {
  // Decade e = 0..6 covers [0.1, 1] * 10^(e - 6), cut into 2^e equal bins (2^(e+1) unsigned:
  // the sign bit buys one more fraction bit); each bin's midpoint is a code, mirrored when
  // signed. 2 * (1 + 2 + ... + 64) = 254 codes either way, plus 0 and 1.
  std::vector<double> codes;
  for (int e = 0; e < 7; ++e) {
    const int bins = is_signed ? 1 << e : 2 << e;
    const double decade = std::pow(10.0, e - 6);
    for (int j = 0; j < bins; ++j) {
      const double mid = 0.1 + 0.9 * (j + 0.5) / bins;
      codes.push_back(decade * mid);
      if (is_signed) codes.push_back(-decade * mid);
    }
  }
  codes.push_back(0.0);
  codes.push_back(1.0);
  if (codes.size() != 256)
    throw std::logic_error(fmt::format("create_dynamic_map: {} codes", codes.size()));
  std::sort(codes.begin(), codes.end());
  std::array<float, 256> map{};
  for (size_t i = 0; i < map.size(); ++i) map[i] = static_cast<float>(codes[i]);
  return map;
}

const DynamicMaps& dynamic_maps() {
  static const DynamicMaps maps = [] {
    DynamicMaps m{};
    const std::array<float, 256> s = create_dynamic_map(true), u = create_dynamic_map(false);
    std::copy(s.begin(), s.end(), m.signed_map);
    std::copy(u.begin(), u.end(), m.unsigned_map);
    return m;
  }();
  return maps;
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

void sgd(const TensorLists& l, const SGDHyper& h) {
  if (h.found_inf && *h.found_inf != 0) return;  // a capturable GradScaler's skip
  update_each<detail::SGDScalars>(l, "SGD", h, [&](const auto& s0, auto lists, size_t t) {
    auto s = s0;
    if (h.lr_device) s.set_lr(*h.lr_device);
    auto* p = lists(t, 0);
    const auto* g = lists(t, 1);
    auto* buf = l.depth > 2 ? lists(t, 2) : nullptr;
    for (int64_t i = 0; i < l.numels[t]; ++i)
      detail::sgd_element(s, p[i], g[i], buf ? &buf[i] : nullptr);
  });
}

void adam(const TensorLists& l, const AdamHyper& h) {
  if (h.found_inf && *h.found_inf != 0) return;  // a capturable GradScaler's skip (no step)
  update_each<detail::AdamScalars>(l, "Adam", h, [&](const auto& s0, auto lists, size_t t) {
    auto* p = lists(t, 0);
    const auto* g = lists(t, 1);
    auto* m = lists(t, 2);
    auto* v = lists(t, 3);
    auto* vmax = h.amsgrad ? lists(t, 4) : nullptr;
    auto s = s0;
    if (h.lr_device) s.set_lr(*h.lr_device);
    if (h.capturable) {  // the tensor's own step, counted here (the last list)
      float* step = static_cast<float*>(l.ptrs[t][static_cast<size_t>(l.depth - 1)]);
      *step += 1.0f;
      s.set_step(static_cast<double>(*step));
    }
    for (int64_t i = 0; i < l.numels[t]; ++i)
      detail::adam_element(s, p[i], g[i], m[i], v[i], vmax ? &vmax[i] : nullptr);
  });
}

// Block by block: dequantize, update (adam8bit_element), then requantize against the block's
// new absmax. The updated moments wait in m, v between the two passes.
void adamw8bit(const TensorLists& l, const AdamW8bitHyper& h) {
  if (l.dtype != DType::float32)
    throw std::invalid_argument(fmt::format(
        "AdamW8bit: parameters and gradients must be float32, got {}", dtype_name(l.dtype)));
  const detail::AdamScalars<float> s(h.adam);
  const DynamicMaps& maps = dynamic_maps();
  const int64_t bs = h.block_size;
  std::vector<float> m(static_cast<size_t>(bs)), v(static_cast<size_t>(bs));
  for (size_t t = 0; t < l.size(); ++t) {
    auto* p = static_cast<float*>(l.ptrs[t][0]);
    const auto* g = static_cast<const float*>(l.ptrs[t][1]);
    auto* qm = static_cast<uint8_t*>(l.ptrs[t][2]);
    auto* qv = static_cast<uint8_t*>(l.ptrs[t][3]);
    auto* am = static_cast<float*>(l.ptrs[t][4]);
    auto* av = static_cast<float*>(l.ptrs[t][5]);
    const int64_t n = l.numels[t];
    for (int64_t begin = 0, b = 0; begin < n; begin += bs, ++b) {
      const int64_t end = std::min(n, begin + bs);
      float max_m = 0.f, max_v = 0.f;
      for (int64_t i = begin; i < end; ++i) {
        float& mi = m[static_cast<size_t>(i - begin)];
        float& vi = v[static_cast<size_t>(i - begin)];
        detail::adam8bit_element(s, maps, p[i], g[i], qm[i], qv[i], am[b], av[b], mi, vi);
        max_m = detail::absmax_step(max_m, mi);
        max_v = detail::absmax_step(max_v, vi);
      }
      am[b] = max_m;
      av[b] = max_v;
      for (int64_t i = begin; i < end; ++i) {
        qm[i] = detail::quantize8(maps.signed_map, m[static_cast<size_t>(i - begin)], max_m);
        qv[i] = detail::quantize8(maps.unsigned_map, v[static_cast<size_t>(i - begin)], max_v);
      }
    }
  }
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

void unscale(const TensorLists& l, float inv_scale, const float* scale, const Tensor& found_inf) {
  if (scale) inv_scale = static_cast<float>(1.0 / static_cast<double>(*scale));
  if (unscale_(l, inv_scale)) ops::fill_(found_inf, 1.0);
}

void update_scale(const Tensor& scale, const Tensor& growth_tracker, const Tensor& found_inf,
                  double growth_factor, double backoff_factor, int64_t growth_interval) {
  detail::update_scale(scale.data<float>(), growth_tracker.data<int64_t>(), found_inf.data<float>(),
                       static_cast<float>(growth_factor), static_cast<float>(backoff_factor),
                       growth_interval);
}

// Adam(W) and AdamW8bit over every core (optim/cpu_adam.cpp), where the update is one they take.
void threaded_adam(const TensorLists& l, const AdamHyper& h) {
  if (!h.capturable && !h.lr_device && (l.dtype == DType::float32 || l.dtype == DType::float64))
    parallel_adam_(l, h);
  else
    adam(l, h);
}

// fused_adamw8bit_ has checked the block size and the depth; another dtype goes to the serial
// kernel, whose error names AdamW8bit.
void threaded_adamw8bit(const TensorLists& l, const AdamW8bitHyper& h) {
  if (l.dtype == DType::float32)
    parallel_adamw8bit_(l, h);
  else
    adamw8bit(l, h);
}

}  // namespace

const MultiTensorKernels serial_multi_tensor_kernels{TALLY_MULTI_TENSOR_KERNELS};
const MultiTensorKernels multi_tensor_kernels{.sgd = &sgd,
                                              .adam = &threaded_adam,
                                              .adamw8bit = &threaded_adamw8bit,
                                              .total_norm = &total_norm,
                                              .clip_scale = &clip_scale,
                                              .unscale = &unscale,
                                              .update_scale = &update_scale};

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
  const int depth = 4 + (h.amsgrad ? 1 : 0) + (h.capturable ? 1 : 0);
  if (l.depth != depth)
    throw std::logic_error(
        fmt::format("{}: a list of depth {}, {} expected (amsgrad {}, "
                    "capturable {})",
                    info.name, l.depth, depth, h.amsgrad, h.capturable));
  multi_tensor_backends.get(info, l.device, &MultiTensorKernels::adam)(l, h);
}

void fused_adamw8bit_(const TensorLists& l, const AdamW8bitHyper& h) {
  static const OpInfo info("_fused_adamw8bit_");
  DispatchScope scope(info, l.device);
  const int64_t bs = h.block_size;
  if (bs < kMin8bitBlock || bs > kMax8bitBlock || (bs & (bs - 1)) != 0)
    throw std::invalid_argument(
        fmt::format("AdamW8bit: block_size {} is not a power of two from {} to {}", bs,
                    kMin8bitBlock, kMax8bitBlock));
  if (l.depth != 6)
    throw std::logic_error(fmt::format("AdamW8bit: a list of depth {}, 6 expected", l.depth));
  multi_tensor_backends.get(info, l.device, &MultiTensorKernels::adamw8bit)(l, h);
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

void amp_update_scale_(const Tensor& scale, const Tensor& growth_tracker, const Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval) {
  static const OpInfo info("_amp_update_scale_");
  DispatchScope scope(info, scale.device());
  if (scale.dtype() != DType::float32 || scale.numel() != 1 ||
      growth_tracker.dtype() != DType::int64 || growth_tracker.numel() != 1 ||
      found_inf.dtype() != DType::float32 || found_inf.numel() != 1 ||
      !(growth_tracker.device() == scale.device()) || !(found_inf.device() == scale.device()))
    throw std::invalid_argument(fmt::format(
        "_amp_update_scale_: expected float32 scale, int64 growth_tracker and float32 found_inf, "
        "one element each on one device; got {} {} on {}, {} {} on {}, {} {} on {}",
        dtype_name(scale.dtype()), scale.shape_string(), scale.device().str(),
        dtype_name(growth_tracker.dtype()), growth_tracker.shape_string(),
        growth_tracker.device().str(), dtype_name(found_inf.dtype()), found_inf.shape_string(),
        found_inf.device().str()));
  multi_tensor_backends.get(info, scale.device(), &MultiTensorKernels::update_scale)(
      scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval);
}

void unscale_(const TensorLists& l, float inv_scale, const float* scale, const Tensor& found_inf) {
  static const OpInfo info("_amp_foreach_non_finite_check_and_unscale_");
  DispatchScope scope(info, l.device);
  multi_tensor_backends.get(info, l.device, &MultiTensorKernels::unscale)(l, inv_scale, scale,
                                                                          found_inf);
}

}  // namespace tally::optim
