// CUDA elementwise kernels: copies with dtype conversion (and host<->device transfers),
// fills, Philox random fills (the same numbers as the CPU), binary/unary maps, where,
// clamp, and the sum reduction. Floating binary/unary maps and same-dtype copies over
// contiguous operands take the vectorised fast path (tensor/cuda/vectorized.cuh, the op a
// template parameter), and so does a binary map of a contiguous operand and a broadcast single
// element (a 0-D tensor: read on the device by every thread); everything else the strided
// general path.
#include <algorithm>
#include <cmath>

#include "tensor/cuda/device_types.cuh"
#include "tensor/cuda/graph.h"
#include "tensor/cuda/grid.cuh"
#include "tensor/cuda/runtime.h"
#include "tensor/cuda/vectorized.cuh"
#include "tensor/elementwise/kernels.h"
#include "tensor/elementwise/math.h"
#include "tensor/op_alloc.h"

namespace tally::cuda {
namespace {

template <int N, typename Op>
__global__ void elementwise_kernel(int64_t n, Indexer<N> ix, Op op) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t off[N];
    ix.get(i, off);
    op(off, i);
  }
}

// The same for n < 2^31: 32-bit linear indices and divisions (Indexer::get32).
template <int N, typename Op>
__global__ void elementwise_kernel32(uint32_t n, Indexer<N> ix, Op op) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    int64_t off[N];
    ix.get32(i, off);
    op(off, static_cast<int64_t>(i));
  }
}

template <int N, typename Op>
void launch(const char* name, const Tensor& out, const std::vector<const Tensor*>& operands,
            Op op) {
  const int64_t n = out.numel();
  if (n == 0) return;
  NvtxRange range(name);
  DeviceGuard g(out.device().index);
  std::vector<const Shape*> strides;
  std::vector<int64_t> offsets;
  for (const Tensor* t : operands) {
    strides.push_back(&t->strides());
    offsets.push_back(t->storage_offset());
  }
  const Indexer<N> ix = make_indexer<N>(out.sizes(), strides, offsets);
  if (n < (int64_t{1} << 31))
    elementwise_kernel32<N><<<blocks_for(n), kThreads, 0, stream(out.device().index)>>>(
        static_cast<uint32_t>(n), ix, op);
  else
    elementwise_kernel<N><<<blocks_for(n), kThreads, 0, stream(out.device().index)>>>(n, ix, op);
  check_launch(name);
}

// ------------------------------------------------------------------ copy / fill

template <typename D, typename S>
struct CopyOp {
  D* dst;
  const S* src;
  __device__ void operator()(const int64_t* o, int64_t) const {
    if constexpr (std::is_same_v<D, S>)
      dst[o[0]] = src[o[1]];
    else
      dst[o[0]] = store<D>(load(src[o[1]]));
  }
};

// Eight elements, 16-byte aligned (one 16-byte access for 16-bit types, two for float).
template <typename T>
struct alignas(16) Oct {
  T v[8];
};

// Contiguous dtype conversion within float32 / float16 / bfloat16 (autocast's casts): eight
// elements a thread step, vector loads and stores on both sides; the tail (< 8) by block 0.
template <typename D, typename S>
__global__ void __launch_bounds__(vec::kThreads) cast_kernel(D* dst, const S* src, int64_t n) {
  const int64_t octs = n / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < octs;
       i += stride) {
    const Oct<S> x = reinterpret_cast<const Oct<S>*>(src)[i];
    Oct<D> y;
#pragma unroll
    for (int e = 0; e < 8; ++e) y.v[e] = store<D>(static_cast<float>(load(x.v[e])));
    reinterpret_cast<Oct<D>*>(dst)[i] = y;
  }
  if (blockIdx.x == 0) {
    const int64_t j = octs * 8 + threadIdx.x;
    if (j < n) dst[j] = store<D>(static_cast<float>(load(src[j])));
  }
}

bool is_float_family(DType t) {
  return t == DType::float32 || t == DType::float16 || t == DType::bfloat16;
}

template <typename F>
void with_float_family(DType t, F&& f) {
  if (t == DType::float32)
    f.template operator()<float>();
  else if (t == DType::float16)
    f.template operator()<__half>();
  else
    f.template operator()<__nv_bfloat16>();
}

// dst[b][k][r] = src[b][r][k]: a batch of [rows, cols] row-major matrices transposed, through
// 32 x 32 tiles in shared memory (reads and writes both coalesced). U moves an element's bytes.
template <typename U>
__global__ void __launch_bounds__(256)
    batched_transpose_kernel(U* __restrict__ dst, const U* __restrict__ src, int64_t batch,
                             int64_t rows, int64_t cols) {
  __shared__ U tile[32][33];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * 32,
                k0 = static_cast<int64_t>(blockIdx.x) * 32;
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const U* s = src + b * rows * cols;
    U* d = dst + b * rows * cols;
    for (int i = ty; i < 32; i += 8) {
      const int64_t r = r0 + i, k = k0 + tx;
      if (r < rows && k < cols) tile[i][tx] = s[r * cols + k];
    }
    __syncthreads();
    for (int i = ty; i < 32; i += 8) {
      const int64_t k = k0 + i, r = r0 + tx;
      if (r < rows && k < cols) d[k * rows + r] = tile[tx][i];
    }
    __syncthreads();
  }
}

// A same-dtype copy between the two 4-D layouts (row-major NCHW and channels_last NHWC) as a
// batched transpose: per sample, [C, H * W] <-> [H * W, C]. False when it does not apply.
bool copy_layout_transpose(const Tensor& dst, const Tensor& src) {
  if (dst.dtype() != src.dtype() || dst.sizes() != src.sizes() || dst.dim() != 4 ||
      dst.device() != src.device() || dst.numel() == 0)
    return false;
  const bool to_last =
      src.is_contiguous() && dst.suggest_memory_format() == MemoryFormat::channels_last;
  const bool to_first =
      dst.is_contiguous() && src.suggest_memory_format() == MemoryFormat::channels_last;
  if (!to_last && !to_first) return false;
  const size_t es = dst.element_size();
  if (es != 2 && es != 4 && es != 8) return false;
  const int64_t n = dst.size(0), c = dst.size(1), hw = dst.size(2) * dst.size(3);
  const int64_t rows = to_last ? c : hw, cols = to_last ? hw : c;
  const int dev = dst.device().index;
  DeviceGuard g(dev);
  NvtxRange range("copy_ (layout)");
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>((rows + 31) / 32),
                  static_cast<unsigned>(std::min<int64_t>(n, 65535)));
  if (grid.y > 65535) return false;
  auto go = [&]<typename U>() {
    batched_transpose_kernel<U><<<grid, dim3(32, 8), 0, stream(dev)>>>(
        static_cast<U*>(dst.data_ptr()), static_cast<const U*>(src.data_ptr()), n, rows, cols);
  };
  if (es == 2)
    go.template operator()<uint16_t>();
  else if (es == 4)
    go.template operator()<uint32_t>();
  else
    go.template operator()<uint64_t>();
  check_launch("copy_ (layout)");
  return true;
}

void copy_device(const Tensor& dst, const Tensor& src) {
  if (copy_layout_transpose(dst, src)) return;
  if (dst.dtype() == src.dtype() && dst.sizes() == src.sizes() && dst.is_contiguous() &&
      src.is_contiguous() && dst.device() == src.device()) {
    if (dst.numel() == 0) return;
    NvtxRange range("copy_");
    DeviceGuard g(dst.device().index);
    check(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), dst.nbytes(), cudaMemcpyDeviceToDevice,
                          stream(dst.device().index)),
          "copy_");
    return;
  }
  if (is_float_family(dst.dtype()) && is_float_family(src.dtype()) && dst.sizes() == src.sizes() &&
      dst.is_contiguous() && src.is_contiguous() && dst.device() == src.device() &&
      reinterpret_cast<uintptr_t>(dst.data_ptr()) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(src.data_ptr()) % 16 == 0) {
    const int64_t n = dst.numel();
    if (n == 0) return;
    NvtxRange range("copy_");
    const int dev = dst.device().index;
    DeviceGuard g(dev);
    with_float_family(dst.dtype(), [&]<typename D>() {
      with_float_family(src.dtype(), [&]<typename S>() {
        cast_kernel<D, S>
            <<<vec::grid_for(std::max<int64_t>(n / 8, 1), dev), vec::kThreads, 0, stream(dev)>>>(
                static_cast<D*>(dst.data_ptr()), static_cast<const S*>(src.data_ptr()), n);
      });
    });
    check_launch("copy_");
    return;
  }
  TALLY_DISPATCH_ALL(dst.dtype(), "copy_", [&] {
    using D = dev_t<scalar_t>;
    TALLY_DISPATCH_ALL(src.dtype(), "copy_", [&] {
      using S = dev_t<scalar_t>;
      launch<2>("copy_", dst, {&dst, &src},
                CopyOp<D, S>{static_cast<D*>(dst.storage().data()),
                             static_cast<const S*>(src.storage().data())});
    });
  });
}

template <typename T>
struct FillOp {
  T* dst;
  T value;
  __device__ void operator()(const int64_t* o, int64_t) const { dst[o[0]] = value; }
};

// ---- copy_many: a list's float-family casts in one launch (autocast's weight casts). The
// pairs travel in the kernel's parameters (__grid_constant__: read in place, never copied to
// local memory), so there is no table to upload and a CUDA graph captures them as they are.
// Block b copies chunk b - first[i] of pair i (kManyChunk elements, eight a thread step with
// vector loads and stores; a chunk starts at a multiple of 8 elements, so 16-byte aligned
// tensors stay aligned), the pair's last few elements one by one.
constexpr int kManyMax = 80;
constexpr int64_t kManyChunk = int64_t{vec::kThreads} * 8 * 4;
struct ManyArgs {
  const void* src[kManyMax];
  void* dst[kManyMax];
  int64_t numel[kManyMax];
  int32_t first[kManyMax + 1];  // blocks before pair i; first[n] = the grid
  int n;
};

template <typename D, typename S>
__global__ void __launch_bounds__(vec::kThreads)
    cast_many_kernel(const __grid_constant__ ManyArgs a) {
  const int b = static_cast<int>(blockIdx.x);
  int lo = 0, hi = a.n - 1;  // the last pair whose first block is <= b
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.first[mid] <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  const S* src = static_cast<const S*>(a.src[lo]);
  D* dst = static_cast<D*>(a.dst[lo]);
  const int64_t begin = static_cast<int64_t>(b - a.first[lo]) * kManyChunk;
  const int64_t end = std::min(begin + kManyChunk, a.numel[lo]);
  const int64_t oct_end = begin + (end - begin) / 8 * 8;
  for (int64_t e = begin + threadIdx.x * 8; e < oct_end; e += int64_t{vec::kThreads} * 8) {
    const Oct<S> x = *reinterpret_cast<const Oct<S>*>(src + e);
    Oct<D> y;
#pragma unroll
    for (int k = 0; k < 8; ++k) y.v[k] = store<D>(static_cast<float>(load(x.v[k])));
    *reinterpret_cast<Oct<D>*>(dst + e) = y;
  }
  for (int64_t e = oct_end + threadIdx.x; e < end; e += vec::kThreads)
    dst[e] = store<D>(static_cast<float>(load(src[e])));
}

void copy(const Tensor& dst, const Tensor& src);

void copy_many(const TensorList& dsts, const TensorList& srcs) {
  if (dsts.empty()) return;
  const auto batched = [](const Tensor& d, const Tensor& s) {
    return is_float_family(d.dtype()) && is_float_family(s.dtype()) && d.is_cuda() && s.is_cuda() &&
           d.device() == s.device() && d.is_contiguous() && s.is_contiguous() && d.numel() > 0 &&
           reinterpret_cast<uintptr_t>(d.data_ptr()) % 16 == 0 &&
           reinterpret_cast<uintptr_t>(s.data_ptr()) % 16 == 0;
  };
  std::vector<size_t> pairs;
  for (size_t i = 0; i < dsts.size(); ++i) {
    if (batched(dsts[i], srcs[i]))
      pairs.push_back(i);
    else
      copy(dsts[i], srcs[i]);
  }
  if (pairs.empty()) return;
  NvtxRange range("_foreach_copy_");
  const int dev = dsts[pairs[0]].device().index;
  DeviceGuard g(dev);
  with_float_family(dsts[pairs[0]].dtype(), [&]<typename D>() {
    with_float_family(srcs[pairs[0]].dtype(), [&]<typename S>() {
      ManyArgs a{};
      const auto flush = [&] {
        if (a.n == 0) return;
        cast_many_kernel<D, S>
            <<<static_cast<unsigned>(a.first[a.n]), vec::kThreads, 0, stream(dev)>>>(a);
        check_launch("_foreach_copy_");
        a = ManyArgs{};
      };
      for (size_t i : pairs) {
        const int64_t blocks = (dsts[i].numel() + kManyChunk - 1) / kManyChunk;
        if (a.n == kManyMax || a.first[a.n] + blocks > INT32_MAX) flush();
        if (blocks > INT32_MAX) {  // one pair alone past the grid: its own copy
          copy(dsts[i], srcs[i]);
          continue;
        }
        a.src[a.n] = srcs[i].data_ptr();
        a.dst[a.n] = dsts[i].data_ptr();
        a.numel[a.n] = dsts[i].numel();
        a.first[a.n + 1] = a.first[a.n] + static_cast<int32_t>(blocks);
        ++a.n;
      }
      flush();
    });
  });
}

void copy(const Tensor& dst, const Tensor& src) {
  const bool dcuda = dst.is_cuda(), scuda = src.is_cuda();
  if (dcuda && scuda) {
    if (dst.device().index != src.device().index) {
      // Peer copy through a contiguous buffer on the destination device.
      Tensor tmp = ops::view(alloc_scratch(src.numel(), src.dtype(), dst.device()), src.sizes());
      Tensor s = ops::contiguous(src);
      check(cudaMemcpyPeerAsync(tmp.data_ptr(), dst.device().index, s.data_ptr(),
                                src.device().index, s.nbytes(), stream(dst.device().index)),
            "copy_ (peer)");
      copy_device(dst, tmp);
      return;
    }
    copy_device(dst, src);
    return;
  }
  if (dcuda) {  // host -> device
    NvtxRange range("copy_ (H2D)");
    // Convert on the host into a contiguous buffer of the destination dtype.
    Tensor host = ops::view(alloc_scratch(dst.numel(), dst.dtype(), Device::cpu()), dst.sizes());
    cpu::elementwise_kernels.copy(host, src);
    const bool direct = dst.is_contiguous();
    Tensor target =
        direct ? dst
               : ops::view(alloc_scratch(dst.numel(), dst.dtype(), dst.device()), dst.sizes());
    DeviceGuard g(dst.device().index);
    // From pageable memory the call returns once the host buffer has been staged. A capture
    // copies from a pinned copy the graph keeps (its replays read it again).
    const void* from = keep_for_replay(dst.device().index, host.data_ptr(), host.nbytes());
    check(cudaMemcpyAsync(target.data_ptr(), from ? from : host.data_ptr(), host.nbytes(),
                          cudaMemcpyHostToDevice, stream(dst.device().index)),
          "copy_ (H2D)");
    if (!direct) copy_device(dst, target);
    return;
  }
  // device -> host: the caller reads the host memory next, so this waits for the stream.
  check_not_capturing(src.device().index, "copy_ (device to host)");
  NvtxRange range("copy_ (D2H)");
  Tensor s = src;
  if (!s.is_contiguous()) {
    s = ops::view(alloc_scratch(src.numel(), src.dtype(), src.device()), src.sizes());
    copy_device(s, src);
  }
  Tensor host = ops::view(alloc_scratch(src.numel(), src.dtype(), Device::cpu()), src.sizes());
  DeviceGuard g(src.device().index);
  check(cudaMemcpyAsync(host.data_ptr(), s.data_ptr(), s.nbytes(), cudaMemcpyDeviceToHost,
                        stream(src.device().index)),
        "copy_ (D2H)");
  synchronize(src.device().index);
  cpu::elementwise_kernels.copy(dst, host);
}

void fill(const Tensor& dst, double value) {
  TALLY_DISPATCH_ALL(dst.dtype(), "fill_", [&] {
    using T = dev_t<scalar_t>;
    T v;
    const scalar_t hv = [&] {
      if constexpr (std::is_same_v<scalar_t, bool>)
        return value != 0.0;
      else if constexpr (std::is_same_v<scalar_t, Half> || std::is_same_v<scalar_t, BFloat16>)
        return scalar_t(static_cast<float>(value));
      else
        return static_cast<scalar_t>(value);
    }();
    std::memcpy(static_cast<void*>(&v), &hv, sizeof(T));
    launch<1>("fill_", dst, {&dst}, FillOp<T>{static_cast<T*>(dst.storage().data()), v});
  });
}

// ------------------------------------------------------------------ random

enum class RandKind { uniform, normal, integer };

template <typename T>
struct RandOp {
  T* dst;
  PhiloxState state;
  RandKind kind;
  int64_t low;
  uint64_t span;
  __device__ void operator()(const int64_t* o, int64_t i) const {
    const Philox4 r = philox4x32(state.offset + static_cast<uint64_t>(i / 4), 0, state.seed);
    const int j = static_cast<int>(i % 4);
    double v;
    if (kind == RandKind::uniform) {
      v = static_cast<double>(uniform_from_bits(r[j]));
    } else if (kind == RandKind::normal) {
      v = math::normal_from_philox(r, j);
    } else {
      v = static_cast<double>(low + static_cast<int64_t>(r[j] % span));
    }
    dst[o[0]] = store<T>(v);
  }
};

void rand_fill(const Tensor& dst, PhiloxState state, RandKind kind, int64_t low, int64_t high) {
  TALLY_DISPATCH_ALL(dst.dtype(), "random", [&] {
    using T = dev_t<scalar_t>;
    launch<1>("random", dst, {&dst},
              RandOp<T>{static_cast<T*>(dst.storage().data()), state, kind, low,
                        static_cast<uint64_t>(high - low)});
  });
}

void rand_uniform(const Tensor& dst, PhiloxState s) {
  rand_fill(dst, s, RandKind::uniform, 0, 1);
}
void rand_normal(const Tensor& dst, PhiloxState s) {
  rand_fill(dst, s, RandKind::normal, 0, 1);
}
void rand_int(const Tensor& dst, int64_t low, int64_t high, PhiloxState s) {
  rand_fill(dst, s, RandKind::integer, low, high);
}

// ------------------------------------------------------------------ binary / unary

// out = a (op) b. Compare: a bool result from the operands read as double; else T from the
// arithmetic in the accumulation type.
template <typename T, bool Compare>
struct BinaryKernelOp {
  ops::BinaryOp op;
  std::conditional_t<Compare, bool, T>* out;
  const T* a;
  const T* b;
  __device__ void operator()(const int64_t* o, int64_t) const {
    if constexpr (Compare)
      out[o[0]] = math::compare_value(op, static_cast<double>(load(a[o[1]])),
                                      static_cast<double>(load(b[o[2]])));
    else
      out[o[0]] = store<T>(math::binary_value<dacc_t<T>>(op, load(a[o[1]]), load(b[o[2]])));
  }
};

// out = a (op) s, or s (op) a when reversed; Compare as above (arithmetic in double for the
// integer types).
template <typename T, bool Compare>
struct ScalarOp {
  ops::BinaryOp op;
  std::conditional_t<Compare, bool, T>* out;
  const T* a;
  double s;
  bool reverse;
  __device__ void operator()(const int64_t* o, int64_t) const {
    if constexpr (Compare) {
      const double x = static_cast<double>(load(a[o[1]]));
      out[o[0]] = reverse ? math::compare_value(op, s, x) : math::compare_value(op, x, s);
    } else {
      using A = std::conditional_t<std::is_floating_point_v<dacc_t<T>>, dacc_t<T>, double>;
      const A x = static_cast<A>(load(a[o[1]]));
      const A y = static_cast<A>(s);
      out[o[0]] =
          store<T>(reverse ? math::binary_value<A>(op, y, x) : math::binary_value<A>(op, x, y));
    }
  }
};

// GELU for float16 / bfloat16 results. Computed in float32 like every 16-bit op, but without
// erff / tanhf, whose instruction count (erff: a 7-term polynomial whose coefficients are
// selected per element, then an exp2 branch) made bf16 GELU ALU-bound at 68-77% of the H200's
// 4.3 TB/s while the same loop moves a bf16 copy at 95%.
//
// Exact GELU: x * Phi(x) with Phi(-|x|) = 2^Q(|x|), Q a degree-10 polynomial fitted (weighted
// minimax, long double) to log2 Phi(-t) on [0, 6.5]: |error in Phi| <= 1.6e-7 everywhere and
// relative error of Phi(-t) <= 5e-6 in the tail; past |x| = 6.5 Phi is 0 or 1, as float32's
// 1 + erf saturates. On the H200, over all 65,536 bf16 inputs, 64 results differ from those of
// 0.5 x (1 + erff(x / sqrt 2)): 13 by one ulp, the rest in the tail x in [-6.5, -4.4] where that
// formula cancels (or gives -0) and this one keeps the exact value; every result is within one
// ulp of the exact GELU (tests/tensor/elementwise/test_elementwise.cpp checks all bf16 and fp16
// inputs).
__device__ __forceinline__ float ex2_approx(float q) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(q));
  return r;
}
__device__ __forceinline__ float rcp_approx(float q) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(q));
  return r;
}
__device__ __forceinline__ float gelu_16bit(float x) {
  const float t = fabsf(x);
  float q = -1.142554318e-08f;
  q = fmaf(q, t, 3.978113909e-07f);
  q = fmaf(q, t, -5.858466011e-06f);
  q = fmaf(q, t, 4.571726095e-05f);
  q = fmaf(q, t, -1.706173061e-04f);
  q = fmaf(q, t, -2.319417108e-04f);
  q = fmaf(q, t, 7.235255558e-03f);
  q = fmaf(q, t, -5.263700709e-02f);
  q = fmaf(q, t, -4.591571987e-01f);
  q = fmaf(q, t, -1.151111722e+00f);
  q = fmaf(q, t, -9.999998808e-01f);
  const float lower = t < 6.5f ? ex2_approx(q) : 0.f;  // Phi(-|x|); NaN compares false: 0
  return x * (x < 0.f ? lower : 1.f - lower);  // NaN stays NaN, -inf gives NaN (as 0.5 x (1 + erf))
}
// tanh GELU: 0.5 x (1 + tanh(z)) = x * sigmoid(2 z), z = sqrt(2/pi) (x + 0.044715 x^3), as
// x / (1 + 2^(-2 z log2 e)): one ex2 and one reciprocal. No cancellation for x << 0.
__device__ __forceinline__ float gelu_tanh_16bit(float x) {
  constexpr float kA = -2.0f * 0.7978845608028654f * 1.4426950408889634f, kB = kA * 0.044715f;
  return x * rcp_approx(1.f + ex2_approx(x * fmaf(kB, x * x, kA)));
}

// The value of unary op `op` at x for a result stored as T.
template <typename T, typename A>
__device__ __forceinline__ A unary_value(ops::UnaryOp op, A x) {
  if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
    if (op == ops::UnaryOp::gelu) return gelu_16bit(x);
    if (op == ops::UnaryOp::gelu_tanh) return gelu_tanh_16bit(x);
  }
  return math::unary_value<A>(op, x);
}

template <typename T>
struct UnaryKernelOp {
  ops::UnaryOp op;
  T* out;
  const T* a;
  __device__ void operator()(const int64_t* o, int64_t) const {
    out[o[0]] = store<T>(unary_value<T>(op, load(a[o[1]])));
  }
};

template <typename T>
struct AffineOp {
  T* out;
  const T* x;
  double a, b;
  __device__ void operator()(const int64_t* o, int64_t) const {
    out[o[0]] = store<T>(math::affine_value(load(x[o[1]]), a, b));
  }
};

template <typename T>
struct ClampOp {
  T* out;
  const T* a;
  bool has_lo, has_hi;
  double lo, hi;
  __device__ void operator()(const int64_t* o, int64_t) const {
    using A = std::conditional_t<std::is_floating_point_v<dacc_t<T>>, dacc_t<T>, double>;
    const A v = static_cast<A>(load(a[o[1]]));
    if constexpr (std::is_floating_point_v<A>) {
      if (isnan(v)) {
        out[o[0]] = a[o[1]];
        return;
      }
    }
    out[o[0]] = store<T>(math::clamp_value(v, has_lo, lo, has_hi, hi));
  }
};

template <typename T>
struct WhereOp {
  T* out;
  const bool* c;
  const T* a;
  const T* b;
  __device__ void operator()(const int64_t* o, int64_t) const {
    out[o[0]] = c[o[1]] ? a[o[2]] : b[o[3]];
  }
};

// out = lerp(a, b, w), w a tensor (HasW) or the scalar ws; arithmetic in the accumulation type.
template <typename T, bool HasW>
struct LerpOp {
  T* out;
  const T* a;
  const T* b;
  const T* w;
  double ws;
  __device__ void operator()(const int64_t* o, int64_t) const {
    using A = dacc_t<T>;
    const A wv = HasW ? static_cast<A>(load(w[o[3]])) : static_cast<A>(ws);
    out[o[0]] = store<T>(math::lerp_value<A>(load(a[o[1]]), load(b[o[2]]), wv));
  }
};

// ---- the contiguous fast path: the op as a template parameter

template <ops::BinaryOp OP>
struct BinaryF {
  template <typename A>
  __device__ __forceinline__ A operator()(A x, A y) const {
    return math::binary_value<A>(OP, x, y);
  }
};

template <ops::BinaryOp OP>
struct ScalarF {
  double s;
  bool reverse;
  template <typename A>
  __device__ __forceinline__ A operator()(A x) const {
    const A y = static_cast<A>(s);
    return reverse ? math::binary_value<A>(OP, y, x) : math::binary_value<A>(OP, x, y);
  }
};

// a (op) s, or s (op) a when reversed, with s one element in device memory (a 0-D or
// one-element tensor broadcast over a: a loss scale, a mean's 1 / count, a clipping factor),
// read by every thread.
template <ops::BinaryOp OP, typename T>
struct DeviceScalarF {
  const T* s;
  bool reverse;
  template <typename A>
  __device__ __forceinline__ A operator()(A x) const {
    const A y = load(*s);
    return reverse ? math::binary_value<A>(OP, y, x) : math::binary_value<A>(OP, x, y);
  }
};

template <ops::UnaryOp OP, typename T>
struct UnaryF {
  template <typename A>
  __device__ __forceinline__ A operator()(A x) const {
    return unary_value<T>(OP, x);
  }
};

template <typename T>
struct AffineF {
  double a, b;
  template <typename A>
  __device__ __forceinline__ A operator()(A x) const {
    return math::affine_value(x, a, b);
  }
};

// clang-format off
#define TALLY_ARITH_OPS(X) \
  X(add) X(sub) X(mul) X(div) X(pow) X(maximum) X(minimum) X(relu_backward) X(gelu_backward) \
  X(gelu_tanh_backward) X(add_relu) X(silu_backward) X(sigmoid_backward) X(tanh_backward) \
  X(silu_mul)
// clang-format on

// f(std::integral_constant<ops::BinaryOp, OP>{}) for the arithmetic op `op`, which the fast
// path takes as a template parameter; false (f not called) for the others.
template <typename F>
bool with_arith_op(ops::BinaryOp op, F&& f) {
  switch (op) {
#define TALLY_CASE(OP)                                             \
  case ops::BinaryOp::OP:                                          \
    f(std::integral_constant<ops::BinaryOp, ops::BinaryOp::OP>{}); \
    return true;
    TALLY_ARITH_OPS(TALLY_CASE)
#undef TALLY_CASE
    default:
      return false;
  }
}

template <typename T>
bool binary_fast(ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  if constexpr (!std::is_floating_point_v<dacc_t<T>>) {
    return false;
  } else {
    const char* name = ops::binary_op_name(op);
    return with_arith_op(op, [&](auto c) {
      vec::launch_map<T, 2>(name, out, a, &b, BinaryF<decltype(c)::value>{});
    });
  }
}

// out = a (op) one, `one` a single element of a's dtype (reverse: one (op) a).
template <typename T>
bool device_scalar_fast(ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& one,
                        bool reverse) {
  if constexpr (!std::is_floating_point_v<dacc_t<T>>) {
    return false;
  } else {
    const char* name = ops::binary_op_name(op);
    return with_arith_op(op, [&](auto c) {
      vec::launch_map<T, 1>(
          name, out, a, nullptr,
          DeviceScalarF<decltype(c)::value, T>{static_cast<const T*>(one.data_ptr()), reverse});
    });
  }
}

template <typename T>
bool scalar_fast(ops::BinaryOp op, const Tensor& out, const Tensor& a, double s, bool reverse) {
  if constexpr (!std::is_floating_point_v<dacc_t<T>>) {
    return false;
  } else {
    const char* name = ops::binary_op_name(op);
    return with_arith_op(op, [&](auto c) {
      vec::launch_map<T, 1>(name, out, a, nullptr, ScalarF<decltype(c)::value>{s, reverse});
    });
  }
}

// clang-format off
#define TALLY_UNARY_OPS(X) \
  X(neg) X(exp) X(log) X(sqrt) X(rsqrt) X(abs) X(sign) X(relu) X(sigmoid) X(tanh) X(silu) \
  X(gelu) X(gelu_tanh) X(reciprocal) X(square) X(sin) X(cos) X(log1p) X(expm1) X(erf)
// clang-format on

template <typename T>
bool unary_fast(ops::UnaryOp op, const Tensor& out, const Tensor& a) {
  const char* name = ops::unary_op_name(op);
  switch (op) {
#define TALLY_CASE(OP)                                                           \
  case ops::UnaryOp::OP:                                                         \
    vec::launch_map<T, 1>(name, out, a, nullptr, UnaryF<ops::UnaryOp::OP, T>{}); \
    return true;
    TALLY_UNARY_OPS(TALLY_CASE)
#undef TALLY_CASE
  }
  return false;
}

}  // namespace

namespace vec {

// Two packs a thread (map_kernel's paired loop then runs once a thread), at most 2^20 blocks
// (past that the kernels stride). Measured on the H200 (session 6, 67M-element copy and GELU):
// a grid capped at 8 blocks an SM held a bf16 copy at 86% of 4.3 TB/s and fp32 GELU at 85%;
// with two packs a thread they reach 95-97% (the loads in flight, not the ALU, were short).
int grid_for(int64_t packs, int /*device*/) {
  const int64_t want = (packs + 2 * kThreads - 1) / (2 * kThreads);
  return static_cast<int>(std::clamp<int64_t>(want, 1, int64_t{1} << 20));
}

bool applies(const Tensor& out, const Tensor& a, const Tensor* b) {
  auto ok = [&](const Tensor& t) {
    return t.dtype() == out.dtype() && t.sizes() == out.sizes() && t.is_contiguous() &&
           reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  return is_floating(out.dtype()) && ok(out) && ok(a) && (!b || ok(*b));
}

}  // namespace vec

namespace {

// out = a (op) b with out and a float32 and b 16-bit (B: __half or __nv_bfloat16, widened on
// load; ops::binary_widens). Contiguous operands of one shape: a thread a pack of 4 elements
// (16 bytes of a and out, 8 of b) at a time, the tail by block 0.
template <typename B, typename F>
__global__ void __launch_bounds__(vec::kThreads)
    widened_map_kernel(float* out, const float* a, const B* b, int64_t n, F f) {
  struct alignas(8) B4 {
    B v[4];
  };
  const int64_t packs = n / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const auto* pa = reinterpret_cast<const float4*>(a);
  const auto* pb = reinterpret_cast<const B4*>(b);
  auto* po = reinterpret_cast<float4*>(out);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packs;
       i += stride) {
    const float4 x = pa[i];
    const B4 y = pb[i];
    po[i] = float4{f(x.x, load(y.v[0])), f(x.y, load(y.v[1])), f(x.z, load(y.v[2])),
                   f(x.w, load(y.v[3]))};
  }
  if (blockIdx.x == 0) {
    const int64_t j = packs * 4 + threadIdx.x;
    if (j < n) out[j] = f(a[j], load(b[j]));
  }
}

// The same over any strides (broadcast operands).
template <typename B>
struct WidenedBinaryOp {
  ops::BinaryOp op;
  float* out;
  const float* a;
  const B* b;
  __device__ void operator()(const int64_t* o, int64_t) const {
    out[o[0]] = math::binary_value<float>(op, a[o[1]], load(b[o[2]]));
  }
};

template <typename B>
void binary_widened(ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  const char* name = ops::binary_op_name(op);
  auto contiguous_aligned = [&](const Tensor& t, size_t align) {
    return t.sizes() == out.sizes() && t.is_contiguous() &&
           reinterpret_cast<uintptr_t>(t.data_ptr()) % align == 0;
  };
  const int64_t n = out.numel();
  if (n > 0 && contiguous_aligned(out, 16) && contiguous_aligned(a, 16) &&
      contiguous_aligned(b, 8) && with_arith_op(op, [&](auto c) {
        NvtxRange range(name);
        const int dev = out.device().index;
        DeviceGuard g(dev);
        const int64_t blocks =
            std::clamp<int64_t>((n / 4 + vec::kThreads - 1) / vec::kThreads, 1, int64_t{1} << 20);
        widened_map_kernel<B><<<static_cast<unsigned>(blocks), vec::kThreads, 0, stream(dev)>>>(
            static_cast<float*>(out.data_ptr()), static_cast<const float*>(a.data_ptr()),
            static_cast<const B*>(b.data_ptr()), n, BinaryF<decltype(c)::value>{});
        check_launch(name);
      }))
    return;
  launch<3>(name, out, {&out, &a, &b},
            WidenedBinaryOp<B>{op, static_cast<float*>(out.storage().data()),
                               static_cast<const float*>(a.storage().data()),
                               static_cast<const B*>(b.storage().data())});
}

void binary(ops::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  if (ops::binary_mixed<__nv_bfloat16, __half>(
          op, out, a, b, [&](auto b16) { binary_widened<decltype(b16)>(op, out, a, b); }))
    return;
  TALLY_DISPATCH_ALL(a.dtype(), ops::binary_op_name(op), [&] {
    using T = dev_t<scalar_t>;
    if (!math::is_compare(op) && vec::applies(out, a, &b) && binary_fast<T>(op, out, a, b)) return;
    // A full operand and a broadcast single element (not out's own: an in-place op must not
    // overwrite the element other threads still read): the fast path, the element read on the
    // device.
    auto one = [&](const Tensor& t) {  // t (broadcast to out's shape) addresses one element
      for (int64_t d = 0; d < t.dim(); ++d)
        if (t.size(d) != 1 && t.stride(d) != 0) return false;
      return t.numel() > 0 && t.dtype() == out.dtype() &&
             t.storage().data() != out.storage().data();
    };
    if (!math::is_compare(op) && one(b) && vec::applies(out, a) &&
        device_scalar_fast<T>(op, out, a, b, false))
      return;
    if (!math::is_compare(op) && one(a) && vec::applies(out, b) &&
        device_scalar_fast<T>(op, out, b, a, true))
      return;
    if (math::is_compare(op)) {
      launch<3>(ops::binary_op_name(op), out, {&out, &a, &b},
                BinaryKernelOp<T, true>{op, static_cast<bool*>(out.storage().data()),
                                        dptr<scalar_t>(a), dptr<scalar_t>(b)});
    } else {
      launch<3>(
          ops::binary_op_name(op), out, {&out, &a, &b},
          BinaryKernelOp<T, false>{op, dptr<scalar_t>(out), dptr<scalar_t>(a), dptr<scalar_t>(b)});
    }
  });
}

void binary_scalar(ops::BinaryOp op, const Tensor& out, const Tensor& a, double b, bool reverse) {
  TALLY_DISPATCH_ALL(a.dtype(), ops::binary_op_name(op), [&] {
    using T = dev_t<scalar_t>;
    if (!math::is_compare(op) && vec::applies(out, a) && scalar_fast<T>(op, out, a, b, reverse))
      return;
    if (math::is_compare(op)) {
      launch<2>(ops::binary_op_name(op), out, {&out, &a},
                ScalarOp<T, true>{op, static_cast<bool*>(out.storage().data()), dptr<scalar_t>(a),
                                  b, reverse});
    } else {
      launch<2>(ops::binary_op_name(op), out, {&out, &a},
                ScalarOp<T, false>{op, dptr<scalar_t>(out), dptr<scalar_t>(a), b, reverse});
    }
  });
}

void unary(ops::UnaryOp op, const Tensor& out, const Tensor& a) {
  TALLY_DISPATCH_FLOAT(a.dtype(), ops::unary_op_name(op), [&] {
    using T = dev_t<scalar_t>;
    if (vec::applies(out, a) && unary_fast<T>(op, out, a)) return;
    launch<2>(ops::unary_op_name(op), out, {&out, &a},
              UnaryKernelOp<T>{op, dptr<scalar_t>(out), dptr<scalar_t>(a)});
  });
}

void affine(const Tensor& out, const Tensor& x, double a, double b) {
  TALLY_DISPATCH_FLOAT(x.dtype(), "affine", [&] {
    using T = dev_t<scalar_t>;
    if (vec::applies(out, x)) {
      vec::launch_map<T, 1>("affine", out, x, nullptr, AffineF<T>{a, b});
      return;
    }
    launch<2>("affine", out, {&out, &x}, AffineOp<T>{dptr<scalar_t>(out), dptr<scalar_t>(x), a, b});
  });
}

void clamp(const Tensor& out, const Tensor& a, std::optional<double> lo, std::optional<double> hi) {
  TALLY_DISPATCH_ALL(a.dtype(), "clamp", [&] {
    using T = dev_t<scalar_t>;
    launch<2>("clamp", out, {&out, &a},
              ClampOp<T>{dptr<scalar_t>(out), dptr<scalar_t>(a), lo.has_value(), hi.has_value(),
                         lo.value_or(0.0), hi.value_or(0.0)});
  });
}

void where(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  TALLY_DISPATCH_ALL(out.dtype(), "where", [&] {
    using T = dev_t<scalar_t>;
    launch<4>("where", out, {&out, &cond, &a, &b},
              WhereOp<T>{dptr<scalar_t>(out), static_cast<const bool*>(cond.storage().data()),
                         dptr<scalar_t>(a), dptr<scalar_t>(b)});
  });
}

void lerp(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& w, double w_scalar) {
  TALLY_DISPATCH_FLOAT(out.dtype(), "lerp", [&] {
    using T = dev_t<scalar_t>;
    if (w.defined())
      launch<4>("lerp", out, {&out, &a, &b, &w},
                LerpOp<T, true>{dptr<scalar_t>(out), dptr<scalar_t>(a), dptr<scalar_t>(b),
                                dptr<scalar_t>(w), 0.0});
    else
      launch<3>("lerp", out, {&out, &a, &b},
                LerpOp<T, false>{dptr<scalar_t>(out), dptr<scalar_t>(a), dptr<scalar_t>(b), nullptr,
                                 w_scalar});
  });
}

// ------------------------------------------------------------------ sum

// The sum of every thread's `v` over a block of kThreads threads, in a fixed order (warp trees,
// then a tree over the warps' sums); valid in thread 0. `red` holds kThreads / 32 values in
// shared memory; every thread of the block must make the call.
template <typename Acc>
__device__ __forceinline__ Acc block_sum(Acc v, Acc* red) {
  for (int s = 16; s > 0; s >>= 1) v += __shfl_down_sync(0xffffffffu, v, s);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  Acc w = 0;
  if (threadIdx.x < 32) {
    w = threadIdx.x < kThreads / 32 ? red[threadIdx.x] : Acc(0);
    for (int s = 16; s > 0; s >>= 1) w += __shfl_down_sync(0xffffffffu, w, s);
  }
  return w;
}

// Reduces `rsize` elements per output: block (k, split) sums its share of output k's
// elements (input offset = kept offset + reduced offset) and adds it atomically.
template <typename T, typename Acc>
__global__ void sum_kernel(const T* in, Acc* acc, int64_t ksize, int64_t rsize, Indexer<1> kept,
                           Indexer<1> red, int splits) {
  __shared__ Acc shared[kThreads / 32];
  for (int64_t k = blockIdx.x; k < ksize; k += gridDim.x) {
    int64_t koff;
    kept.get(k, &koff);
    Acc local = 0;
    for (int64_t r = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rsize;
         r += static_cast<int64_t>(splits) * blockDim.x) {
      int64_t roff;
      red.get(r, &roff);
      local += static_cast<Acc>(load(in[koff + roff]));
    }
    const Acc v = block_sum(local, shared);
    if (threadIdx.x == 0) {
      if constexpr (std::is_same_v<Acc, long long>)
        atomicAdd(reinterpret_cast<unsigned long long*>(acc + k),
                  static_cast<unsigned long long>(v));
      else
        atomicAdd(acc + k, v);
    }
    __syncthreads();
  }
}

// ---- the fast paths of a contiguous input viewed as [R, K]: the reduced dims are the
// outer R (column sums: a Linear's bias gradient, sum_to over batch and time) or, with
// K == 1, everything (a full sum). Block (column tile, split) adds rows split, split +
// splits, ... of its kSumCols columns (threads along x read neighbouring columns, so every
// load coalesces; 16-byte loads when 4 columns are aligned), reduces over y in shared memory
// and writes one partial per column in double; sum_partials_2d_kernel adds the splits per
// column in a fixed order. Deterministic, no atomics.
// A thread accumulates 16-bit values in float over chunks of kSumChunk rows, each chunk then
// added in double; wider types in double throughout.
// A float sum of 16 bfloat16 (float16) values is exact unless their magnitudes span more
// than 2^12 (2^9); past that it rounds at float's precision, the float32 result's own. On the
// H200 (a probe, b2b) the main kernel of GPT-2's [16384, 3072] bf16 bias gradient went from
// 33.7 us (a double add per element) to 28.4 (floor 23.4): float-to-double conversions cost.
constexpr int kSumCols = 32, kSumRows = 8;  // block: 32 columns x 8 row lanes
constexpr int kSumChunk = 16;

template <typename T, int V>
__global__ void __launch_bounds__(kSumCols* kSumRows)
    column_sum_kernel(const T* __restrict__ in, double* __restrict__ part, int64_t R, int64_t K,
                      int splits) {
  // Thread x owns columns col0 .. col0 + V - 1 (one V-wide vector load a row).
  __shared__ double red[kSumRows][kSumCols * V];
  struct alignas(sizeof(T) * V) P {
    T v[V];
  };
  const int64_t col0 = (blockIdx.x * static_cast<int64_t>(kSumCols) + threadIdx.x) * V;
  double acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0;
  if (col0 < K) {
    const int64_t step = static_cast<int64_t>(splits) * kSumRows;
    int64_t r = blockIdx.y * static_cast<int64_t>(kSumRows) + threadIdx.y;
    auto row = [&](int64_t rr) {
      if constexpr (V == 1) {
        P pk;
        pk.v[0] = in[rr * K + col0];
        return pk;
      } else {
        return *reinterpret_cast<const P*>(in + rr * K + col0);
      }
    };
    if constexpr (sizeof(T) == 2) {
      using F = dacc_t<T>;
      for (; r + (kSumChunk - 1) * step < R; r += kSumChunk * step) {  // whole chunks
        F f[V];
#pragma unroll
        for (int j = 0; j < V; ++j) f[j] = 0;
#pragma unroll  // the chunk's loads all in flight (see sum_fast's grid)
        for (int i = 0; i < kSumChunk; ++i) {
          const P pk = row(r + i * step);
#pragma unroll
          for (int j = 0; j < V; ++j) f[j] += load(pk.v[j]);
        }
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += static_cast<double>(f[j]);
      }
      F f[V];  // the last, partial chunk
#pragma unroll
      for (int j = 0; j < V; ++j) f[j] = 0;
      for (; r < R; r += step) {
        const P pk = row(r);
#pragma unroll
        for (int j = 0; j < V; ++j) f[j] += load(pk.v[j]);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += static_cast<double>(f[j]);
    } else {
#pragma unroll 4
      for (; r < R; r += step) {
        const P pk = row(r);
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += static_cast<double>(load(pk.v[j]));
      }
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) red[threadIdx.y][threadIdx.x * V + j] = acc[j];
  __syncthreads();
  // The block's 32 * V columns, summed over y, one column a thread.
  const int64_t base = blockIdx.x * static_cast<int64_t>(kSumCols) * V;
  for (int c = threadIdx.y * kSumCols + threadIdx.x; c < kSumCols * V; c += kSumCols * kSumRows) {
    if (base + c >= K) continue;
    double v = 0;
    for (int y = 0; y < kSumRows; ++y) v += red[y][c];
    part[blockIdx.y * K + base + c] = v;
  }
}

// A full sum of n contiguous elements: the n / V packs of V (one 16-byte load each when
// `in` is 16-byte aligned, else V = 1) grid-strided over the blocks, the n % V tail by block
// 0, in double; one partial per block.
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    flat_sum_kernel(const T* __restrict__ in, double* __restrict__ part, int64_t n) {
  __shared__ double red[kThreads / 32];
  struct alignas(sizeof(T) * V) P {
    T v[V];
  };
  double acc = 0;
  const int64_t packs = n / V;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
#pragma unroll 4
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < packs;
       i += stride) {
    const P pk = reinterpret_cast<const P*>(in)[i];
    if constexpr (sizeof(T) == 2) {  // a pack of 16-bit values summed in float (as the
      dacc_t<T> f = 0;               // column kernel's chunks), then added in double
#pragma unroll
      for (int j = 0; j < V; ++j) f += load(pk.v[j]);
      acc += static_cast<double>(f);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) acc += static_cast<double>(load(pk.v[j]));
    }
  }
  if (blockIdx.x == 0)
    for (int64_t i = packs * V + threadIdx.x; i < n; i += kThreads)
      acc += static_cast<double>(load(in[i]));
  const double v = block_sum(acc, red);
  if (threadIdx.x == 0) part[blockIdx.x] = v;
}

// out[k] = sum over s of part[s * K + k], s in a fixed order (out contiguous, K elements), for
// many columns: a block of 32 columns x 8 split lanes, lane y adding splits
// y, y + 8, ... (each warp reads 32 neighbouring columns of one split: coalesced), then the 8
// lanes in order. 2-4 us a call less than one thread a column on GPT-2's bias gradients.
template <typename T>
__global__ void __launch_bounds__(kSumCols* kSumRows)
    sum_partials_2d_kernel(T* __restrict__ out, const double* __restrict__ part, int64_t K,
                           int splits) {
  __shared__ double red[kSumRows][kSumCols + 1];
  const int64_t k = blockIdx.x * static_cast<int64_t>(kSumCols) + threadIdx.x;
  double v = 0;
  if (k < K)
    for (int sp = threadIdx.y; sp < splits; sp += kSumRows)
      v += part[static_cast<int64_t>(sp) * K + k];
  red[threadIdx.y][threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.y == 0 && k < K) {
    double total = 0;
    for (int y = 0; y < kSumRows; ++y) total += red[y][threadIdx.x];
    out[k] = store<T>(total);
  }
}

// The same sum for few columns and many splits (a full sum: K = 1, one partial per block of
// the flat kernel): one block a column, threads taking splits s = tid, tid + 256, ... then a
// tree over the block, all in a fixed order. The one-thread loop above took 26 us over the 528
// partials of a GPT-2-sized bf16 sum on the H200 (each add waits on its load), 2.5x the
// 10 us of the flat kernel itself.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    sum_partials_tree_kernel(T* __restrict__ out, const double* __restrict__ part, int64_t K,
                             int splits) {
  __shared__ double red[kThreads / 32];
  for (int64_t k = blockIdx.x; k < K; k += gridDim.x) {
    double v = 0;
    for (int s = threadIdx.x; s < splits; s += kThreads) v += part[static_cast<int64_t>(s) * K + k];
    const double total = block_sum(v, red);
    if (threadIdx.x == 0) out[k] = store<T>(total);
    __syncthreads();  // red is reused by the next column
  }
}

// The [R, K] view of `t` when it is contiguous and out keeps exactly its innermost dims
// (K = their product; K = 1 for a full sum). False otherwise.
bool outer_sum_shape(const Tensor& out, const Tensor& t, int64_t& R, int64_t& K) {
  if (out.dim() != t.dim() || !t.is_contiguous() || !out.is_contiguous() || t.numel() == 0)
    return false;
  int64_t d = t.dim();
  K = 1;
  while (d > 0 &&
         out.sizes()[static_cast<size_t>(d - 1)] == t.sizes()[static_cast<size_t>(d - 1)]) {
    K *= t.sizes()[static_cast<size_t>(d - 1)];
    --d;
  }
  for (int64_t i = 0; i < d; ++i)  // the rest must all be reduced (size 1 in out)
    if (out.sizes()[static_cast<size_t>(i)] != 1 && t.sizes()[static_cast<size_t>(i)] != 1)
      return false;
  R = t.numel() / K;
  return R > 1 || K == 1;
}

// The fast paths above; false when they do not apply (the general kernel runs). out may be
// any floating dtype (ops::sum's dtype): the partials are double, rounded once into out.
bool sum_fast(const Tensor& out, const Tensor& t) {
  int64_t R = 0, K = 0;
  if (!is_floating(t.dtype()) || !is_floating(out.dtype()) || !outer_sum_shape(out, t, R, K))
    return false;
  const int dev = t.device().index;
  const bool flat = K == 1;
  // Columns a thread: one 16-byte load a row when K and the base allow (8 halves, 4 floats).
  const int vec = static_cast<int>(16 / dtype_size(t.dtype()));
  const bool wide = !flat && K % vec == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  const int64_t cols_per_block = kSumCols * (wide ? vec : 1);
  const int64_t col_tiles = flat ? 1 : (K + cols_per_block - 1) / cols_per_block;
  if (col_tiles > 65535) return false;
  int64_t splits;
  if (flat) {
    splits = std::clamp<int64_t>((R + kThreads * 8 - 1) / (kThreads * 8), 1,
                                 static_cast<int64_t>(sm_count(dev)) * 4);
  } else {
    // A full SM (8 blocks of 256 threads) over the tiles, at least a chunk of rows a thread;
    // half of one for 16-bit input, whose chunks keep 16 loads in flight a thread: a probe on
    // the H200 (GPT-2's bf16 bias gradients, [16384, N] into float32, both kernels back to
    // back) took N = 768 / 2304 / 3072 from 9.4 / 29.5 / 37.5 us (chunk loop unrolled 4 ways,
    // 8 blocks an SM) to 8.9 / 24.4 / 31.1 (floors 5.9 / 17.6 / 23.4); 2, 3 and 6 blocks an
    // SM and 32-row chunks were slower.
    const int64_t per_sm = dtype_size(t.dtype()) == 2 ? 4 : 8;
    const int64_t want_blocks = static_cast<int64_t>(sm_count(dev)) * per_sm;
    splits = std::clamp<int64_t>(
        want_blocks / col_tiles, 1,
        std::max<int64_t>(1, (R + kSumRows * kSumChunk - 1) / (kSumRows * kSumChunk)));
    splits = std::min<int64_t>(splits, 65535);
  }
  const Tensor part = alloc_scratch(splits * K, DType::float64, t.device());
  double* pp = static_cast<double*>(part.data_ptr());
  TALLY_DISPATCH_FLOAT(t.dtype(), "sum", [&] {
    using T = dev_t<scalar_t>;
    const T* in = dptr<scalar_t>(t) + t.storage_offset();
    if (flat) {
      const bool aligned = reinterpret_cast<uintptr_t>(in) % 16 == 0;
      const unsigned blocks = static_cast<unsigned>(splits);
      if (!aligned)
        flat_sum_kernel<T, 1><<<blocks, kThreads, 0, stream(dev)>>>(in, pp, R);
      else if (vec == 8)
        flat_sum_kernel<T, 8><<<blocks, kThreads, 0, stream(dev)>>>(in, pp, R);
      else if (vec == 4)
        flat_sum_kernel<T, 4><<<blocks, kThreads, 0, stream(dev)>>>(in, pp, R);
      else
        flat_sum_kernel<T, 2><<<blocks, kThreads, 0, stream(dev)>>>(in, pp, R);
    } else {
      const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(splits)),
          block(kSumCols, kSumRows);
      const int sp = static_cast<int>(splits);
      if (!wide)
        column_sum_kernel<T, 1><<<grid, block, 0, stream(dev)>>>(in, pp, R, K, sp);
      else if (vec == 8)
        column_sum_kernel<T, 8><<<grid, block, 0, stream(dev)>>>(in, pp, R, K, sp);
      else if (vec == 4)
        column_sum_kernel<T, 4><<<grid, block, 0, stream(dev)>>>(in, pp, R, K, sp);
      else
        column_sum_kernel<T, 2><<<grid, block, 0, stream(dev)>>>(in, pp, R, K, sp);
    }
    check_launch("sum");
  });
  TALLY_DISPATCH_FLOAT(out.dtype(), "sum", [&] {
    using O = dev_t<scalar_t>;
    O* po = dptr<scalar_t>(out) + out.storage_offset();
    if (flat) {  // one column, many partials: a block adds them
      sum_partials_tree_kernel<O>
          <<<1, kThreads, 0, stream(dev)>>>(po, pp, K, static_cast<int>(splits));
    } else {
      const unsigned g2 = static_cast<unsigned>((K + kSumCols - 1) / kSumCols);
      sum_partials_2d_kernel<O>
          <<<g2, dim3(kSumCols, kSumRows), 0, stream(dev)>>>(po, pp, K, static_cast<int>(splits));
    }
    check_launch("sum (partials)");
  });
  return true;
}

// One thread per output, its rsize elements added in order in double (deterministic, no
// atomics), written to out in out's dtype: for many outputs of few elements each, such as an
// expand's backward (grouped-query attention's key and value heads, [B, Hkv, G, S, D] summed
// over G), where sum_kernel's block per output leaves all but G of its threads idle: that
// took 14 ms per tensor for LLaMA-1B's [8, 8, 4, 2048, 64] on the H100.
template <typename T>
__global__ void sum_per_thread_kernel(const T* in, T* out, int64_t ksize, int64_t rsize,
                                      Indexer<2> kept, Indexer<1> red) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < ksize;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t off[2];
    kept.get(k, off);
    double a = 0;
    for (int64_t r = 0; r < rsize; ++r) {
      int64_t roff;
      red.get(r, &roff);
      a += static_cast<double>(load(in[off[0] + roff]));
    }
    out[off[1]] = store<T>(a);
  }
}

// Outputs enough to fill the GPU with a thread each, and few enough elements per output that
// a thread's serial loop stays short.
constexpr int64_t kPerThreadMinOutputs = int64_t{1} << 16, kPerThreadMaxReduced = 64;

void sum(const Tensor& out, const Tensor& t) {
  NvtxRange range("sum");
  DeviceGuard g(t.device().index);
  if (sum_fast(out, t)) return;
  const bool integral = !is_floating(t.dtype());
  // Split the input's dims into kept (size > 1 in out) and reduced.
  Shape ksz, kst, rsz, rst;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const auto ud = static_cast<size_t>(d);
    if (out.sizes()[ud] == 1 && t.sizes()[ud] != 1) {
      rsz.push_back(t.sizes()[ud]);
      rst.push_back(t.strides()[ud]);
    } else {
      ksz.push_back(t.sizes()[ud]);
      kst.push_back(t.strides()[ud]);
    }
  }
  const int64_t ksize = shape_numel(ksz), rsize = shape_numel(rsz);
  if (!integral && out.dtype() == t.dtype() && ksize >= kPerThreadMinOutputs && rsize > 0 &&
      rsize <= kPerThreadMaxReduced) {
    Shape okst;  // out's strides over the kept dims
    for (int64_t d = 0; d < t.dim(); ++d) {
      const auto ud = static_cast<size_t>(d);
      if (!(out.sizes()[ud] == 1 && t.sizes()[ud] != 1)) okst.push_back(out.strides()[ud]);
    }
    const Indexer<2> kept2 =
        make_indexer<2>(ksz, {&kst, &okst}, {t.storage_offset(), out.storage_offset()});
    const Indexer<1> red = make_indexer<1>(rsz, {&rst}, {0});
    const int64_t blocks = std::min<int64_t>((ksize + kThreads - 1) / kThreads, 65535 * 8);
    TALLY_DISPATCH_FLOAT(t.dtype(), "sum", [&] {
      using T = dev_t<scalar_t>;
      sum_per_thread_kernel<T>
          <<<static_cast<unsigned>(blocks), kThreads, 0, stream(t.device().index)>>>(
              dptr<scalar_t>(t), dptr<scalar_t>(out), ksize, rsize, kept2, red);
    });
    check_launch("sum");
    return;
  }
  const Indexer<1> kept = make_indexer<1>(ksz, {&kst}, {t.storage_offset()});
  const Indexer<1> red = make_indexer<1>(rsz, {&rst}, {0});
  Tensor acc = alloc_scratch(ksize, integral ? DType::int64 : DType::float64, out.device());
  fill(acc, 0.0);
  const int64_t want = (rsize + kThreads * 4 - 1) / (kThreads * 4);
  const int splits = static_cast<int>(want < 1 ? 1 : (want > 1024 ? 1024 : want));
  const dim3 grid(static_cast<unsigned>(ksize < 65535 ? (ksize > 0 ? ksize : 1) : 65535),
                  static_cast<unsigned>(splits));
  if (ksize > 0 && rsize > 0) {
    TALLY_DISPATCH_ALL(t.dtype(), "sum", [&] {
      using T = dev_t<scalar_t>;
      if (integral) {
        sum_kernel<T, long long><<<grid, kThreads, 0, stream(t.device().index)>>>(
            dptr<scalar_t>(t), static_cast<long long*>(acc.data_ptr()), ksize, rsize, kept, red,
            splits);
      } else {
        sum_kernel<T, double><<<grid, kThreads, 0, stream(t.device().index)>>>(
            dptr<scalar_t>(t), static_cast<double*>(acc.data_ptr()), ksize, rsize, kept, red,
            splits);
      }
    });
    check_launch("sum");
  }
  copy_device(out, ops::view(acc, out.sizes()));
}

}  // namespace

const ElementwiseKernels elementwise_kernels{TALLY_ELEMENTWISE_KERNELS};

}  // namespace tally::cuda
