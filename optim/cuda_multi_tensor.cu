// Fused multi-tensor optimizer kernels, the CUDA table of optim/multi_tensor.h: each is ONE
// launch over the whole tensor list (PyTorch's multi_tensor_apply). The host packs every
// tensor's pointers and length, plus the list of (tensor, chunk) work items, into one table,
// copies it to the device with one cudaMemcpyAsync into a `temporary` block from the caching
// allocator, and each thread block walks one chunk (AdamW8bit's, one quantization block of a
// chunk). Nothing here waits for the device.
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "memory/context.h"
#include "optim/multi_tensor.h"
#include "optim/update_math.h"
#include "tensor/cuda/graph.h"
#include "tensor/cuda/runtime.h"
#include "tensor/ops.h"

namespace tally::optim::cuda {
namespace {

using tally::cuda::check;
using tally::cuda::check_launch;
using tally::cuda::DeviceGuard;
using tally::cuda::keep_for_replay;
using tally::cuda::NvtxRange;
using tally::cuda::stream;

constexpr int kThreads = 512;

using Entry = ChunkEntry;  // optim/multi_tensor.h: the table's layout, shared with the meta kernels

// The table on the device; the block returns to the allocator when this goes out of scope
// (the caching allocator reuses it only in stream order, after the launch).
struct DeviceTable {
  Storage storage;
  const Entry* entries = nullptr;
  const Chunk* chunks = nullptr;
  int64_t num_chunks = 0;
};

DeviceTable upload(const TensorLists& l, const char* op) {
  if (l.device.type != DeviceType::cuda)
    throw std::invalid_argument(std::string(op) + ": fused CUDA kernel called with tensors on " +
                                l.device.str());
  DeviceTable t;
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < l.size(); ++i) {
    const int64_t n = (l.numels[i] + kChunkSize - 1) / kChunkSize;
    if (n > INT32_MAX)
      throw std::invalid_argument(std::string(op) + ": tensor too large for the chunk table");
    for (int64_t c = 0; c < n; ++c)
      chunks.push_back({static_cast<int32_t>(i), static_cast<int32_t>(c)});
  }
  t.num_chunks = static_cast<int64_t>(chunks.size());
  if (t.num_chunks == 0) return t;
  if (t.num_chunks > INT32_MAX)
    throw std::invalid_argument(std::string(op) + ": too many chunks for one launch");
  const size_t entry_bytes = l.size() * sizeof(Entry);
  const size_t bytes = entry_bytes + chunks.size() * sizeof(Chunk);
  std::vector<unsigned char> host(bytes);
  for (size_t i = 0; i < l.size(); ++i) {
    Entry e{};
    for (int k = 0; k < kMaxListDepth; ++k) e.ptr[k] = l.ptrs[i][k];
    e.numel = l.numels[i];
    std::memcpy(host.data() + i * sizeof(Entry), &e, sizeof(Entry));
  }
  std::memcpy(host.data() + entry_bytes, chunks.data(), chunks.size() * sizeof(Chunk));
  {
    memory::CategoryScope category(memory::Category::temporary);
    t.storage = Storage::allocate(bytes, l.device);
  }
  // From pageable memory: returns once the bytes are staged, so `host` may go. A capture copies
  // from a pinned copy its graph keeps (every replay copies the table again).
  const void* from = keep_for_replay(l.device.index, host.data(), bytes);
  check(cudaMemcpyAsync(t.storage.data(), from ? from : host.data(), bytes, cudaMemcpyHostToDevice,
                        stream(l.device.index)),
        op);
  t.entries = static_cast<const Entry*>(t.storage.data());
  t.chunks = reinterpret_cast<const Chunk*>(static_cast<const unsigned char*>(t.storage.data()) +
                                            entry_bytes);
  return t;
}

struct Range {
  int64_t begin, end;
};
__device__ __forceinline__ Range chunk_range(const Entry& e, const Chunk& c) {
  const int64_t b = static_cast<int64_t>(c.chunk) * kChunkSize;
  const int64_t end = b + kChunkSize < e.numel ? b + kChunkSize : e.numel;
  return {b, end};
}

template <typename T>
__global__ void sgd_kernel(const Entry* entries, const Chunk* chunks, detail::SGDScalars<T> s,
                           bool has_buf, const double* lr, const float* found_inf) {
  if (found_inf && *found_inf != 0.0f) return;  // a capturable GradScaler's skip
  if (lr) s.set_lr(*lr);
  const Chunk c = chunks[blockIdx.x];
  const Entry& e = entries[c.tensor];
  const Range r = chunk_range(e, c);
  T* p = static_cast<T*>(e.ptr[0]);
  const T* g = static_cast<const T*>(e.ptr[1]);
  T* buf = has_buf ? static_cast<T*>(e.ptr[2]) : nullptr;
  for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x)
    detail::sgd_element(s, p[i], g[i], buf ? buf + i : nullptr);
}

// Capturable Adam: each tensor's step (a float32 on the device, list `slot`) += 1, before the
// update reads it.
__global__ void step_increment_kernel(const Entry* entries, int64_t n, int slot,
                                      const float* found_inf) {
  if (found_inf && *found_inf != 0.0f) return;  // the update is skipped: no step
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) *static_cast<float*>(entries[i].ptr[slot]) += 1.0f;
}

__global__ void update_scale_kernel(float* scale, int64_t* growth_tracker, const float* found_inf,
                                    float growth_factor, float backoff_factor,
                                    int64_t growth_interval) {
  detail::update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                       growth_interval);
}

// step_slot >= 0 (capturable): the bias corrections come from the tensor's step in that list.
template <typename T>
__global__ void adam_kernel(const Entry* entries, const Chunk* chunks, detail::AdamScalars<T> s,
                            bool has_max, int step_slot, const double* lr, const float* found_inf) {
  if (found_inf && *found_inf != 0.0f) return;  // a capturable GradScaler's skip
  const Chunk c = chunks[blockIdx.x];
  const Entry& e = entries[c.tensor];
  const Range r = chunk_range(e, c);
  if (lr) s.set_lr(*lr);
  if (step_slot >= 0) s.set_step(static_cast<double>(*static_cast<const float*>(e.ptr[step_slot])));
  T* p = static_cast<T*>(e.ptr[0]);
  const T* g = static_cast<const T*>(e.ptr[1]);
  T* m = static_cast<T*>(e.ptr[2]);
  T* v = static_cast<T*>(e.ptr[3]);
  T* vmax = has_max ? static_cast<T*>(e.ptr[4]) : nullptr;
  int64_t tail = r.begin;
  if constexpr (std::is_same_v<T, float>) {
    // float32 without amsgrad, the four lists 16-byte aligned (a chunk starts at a multiple of
    // kChunkSize elements): 16-byte loads and stores, four elements a thread a step, so more
    // bytes are in flight (the update is the same function of each element).
    auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
    if (!vmax && aligned(p) && aligned(g) && aligned(m) && aligned(v)) {
      tail = r.begin + (r.end - r.begin) / 4 * 4;
      for (int64_t i = r.begin + 4 * static_cast<int64_t>(threadIdx.x); i < tail;
           i += 4 * static_cast<int64_t>(blockDim.x)) {
        float4 pp = *reinterpret_cast<const float4*>(p + i);
        const float4 gg = *reinterpret_cast<const float4*>(g + i);
        float4 mm = *reinterpret_cast<const float4*>(m + i);
        float4 vv = *reinterpret_cast<const float4*>(v + i);
        detail::adam_element(s, pp.x, gg.x, mm.x, vv.x, static_cast<float*>(nullptr));
        detail::adam_element(s, pp.y, gg.y, mm.y, vv.y, static_cast<float*>(nullptr));
        detail::adam_element(s, pp.z, gg.z, mm.z, vv.z, static_cast<float*>(nullptr));
        detail::adam_element(s, pp.w, gg.w, mm.w, vv.w, static_cast<float*>(nullptr));
        *reinterpret_cast<float4*>(p + i) = pp;
        *reinterpret_cast<float4*>(m + i) = mm;
        *reinterpret_cast<float4*>(v + i) = vv;
      }
    }
  }
  for (int64_t i = tail + threadIdx.x; i < r.end; i += blockDim.x)
    detail::adam_element(s, p[i], g[i], m[i], v[i], vmax ? vmax + i : nullptr);
}

// AdamW8bit: thread block (x, y) updates quantization block y of chunk x (the chunk table is
// Adam's; kChunkSize is a multiple of every block size), blockDim = min(block_size,
// k8bitThreads) threads holding up to k8bitPerThread elements each in registers between the
// update and the requantization. The code books are copied to shared memory first (the binary
// search reads them at data-dependent indices).
constexpr int k8bitThreads = 256;
constexpr int k8bitPerThread = static_cast<int>(kMax8bitBlock) / k8bitThreads;

// Both running maxima across the thread block (max is exact in any order: the CPU's loop and
// this agree bit for bit). Every thread returns the block's values.
__device__ void block_absmax2(float& a, float& b) {
  __shared__ float sa[k8bitThreads / 32], sb[k8bitThreads / 32];
  for (int o = 16; o > 0; o >>= 1) {
    a = detail::absmax_step(a, __shfl_xor_sync(0xffffffffu, a, o));
    b = detail::absmax_step(b, __shfl_xor_sync(0xffffffffu, b, o));
  }
  const int warp = static_cast<int>(threadIdx.x) / 32;
  if (threadIdx.x % 32 == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  a = sa[0];
  b = sb[0];
  for (int w = 1; w < static_cast<int>(blockDim.x) / 32; ++w) {
    a = detail::absmax_step(a, sa[w]);
    b = detail::absmax_step(b, sb[w]);
  }
}

// The code books into shared memory, for every thread of the block (the binary search reads
// them at data-dependent indices).
__device__ __forceinline__ void load_maps(DynamicMaps& sh, const DynamicMaps& maps) {
  for (int i = static_cast<int>(threadIdx.x); i < 256; i += static_cast<int>(blockDim.x)) {
    sh.signed_map[i] = maps.signed_map[i];
    sh.unsigned_map[i] = maps.unsigned_map[i];
  }
  __syncthreads();
}

// An AdamW8bit entry's lists: the parameter, its gradient, the two moments' codes and their
// block scales.
struct Adam8bitLists {
  float* p;
  const float* g;
  uint8_t* qm;
  uint8_t* qv;
  float* am;
  float* av;
  __device__ explicit Adam8bitLists(const Entry& e)
      : p(static_cast<float*>(e.ptr[0])),
        g(static_cast<const float*>(e.ptr[1])),
        qm(static_cast<uint8_t*>(e.ptr[2])),
        qv(static_cast<uint8_t*>(e.ptr[3])),
        am(static_cast<float*>(e.ptr[4])),
        av(static_cast<float*>(e.ptr[5])) {}

  // Element i updated from its codes (block scales scale_m, scale_v): m and v receive the new
  // moments, folded into the block's running maxima.
  __device__ __forceinline__ void update(const detail::AdamScalars<float>& s,
                                         const DynamicMaps& maps, int64_t i, float scale_m,
                                         float scale_v, float& m, float& v, float& max_m,
                                         float& max_v) const {
    detail::adam8bit_element(s, maps, p[i], g[i], qm[i], qv[i], scale_m, scale_v, m, v);
    max_m = detail::absmax_step(max_m, m);
    max_v = detail::absmax_step(max_v, v);
  }
  // Element i's new codes, in the block's new scales.
  __device__ __forceinline__ void requantize(const DynamicMaps& maps, int64_t i, float m, float v,
                                             float max_m, float max_v) const {
    qm[i] = detail::quantize8(maps.signed_map, m, max_m);
    qv[i] = detail::quantize8(maps.unsigned_map, v, max_v);
  }
};

__global__ void __launch_bounds__(k8bitThreads)
    adamw8bit_kernel(const Entry* entries, const Chunk* chunks, detail::AdamScalars<float> s,
                     DynamicMaps maps, int block_size) {
  const Chunk c = chunks[blockIdx.x];
  const Entry& e = entries[c.tensor];
  const int64_t begin =
      static_cast<int64_t>(c.chunk) * kChunkSize + static_cast<int64_t>(blockIdx.y) * block_size;
  if (begin >= e.numel) return;  // the tensor's last chunk is short: the whole block leaves
  const int64_t end = begin + block_size < e.numel ? begin + block_size : e.numel;
  const int64_t b = begin / block_size;
  __shared__ DynamicMaps sh;
  load_maps(sh, maps);
  const Adam8bitLists l(e);
  const float scale_m = l.am[b], scale_v = l.av[b];
  const int per_thread = block_size / static_cast<int>(blockDim.x);
  float m[k8bitPerThread], v[k8bitPerThread];
  float max_m = 0.f, max_v = 0.f;
#pragma unroll
  for (int k = 0; k < k8bitPerThread; ++k) {
    const int64_t i = begin + threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (k < per_thread && i < end) {
      l.update(s, sh, i, scale_m, scale_v, m[k], v[k], max_m, max_v);
    }
  }
  block_absmax2(max_m, max_v);  // its barrier orders every read of am[b], av[b] before the write
  if (threadIdx.x == 0) {
    l.am[b] = max_m;
    l.av[b] = max_v;
  }
#pragma unroll
  for (int k = 0; k < k8bitPerThread; ++k) {
    const int64_t i = begin + threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (k < per_thread && i < end) {
      l.requantize(sh, i, m[k], v[k], max_m, max_v);
    }
  }
}

// AdamW8bit for quantization blocks of up to k8bitWarpMaxBlock elements (the default 256 among
// them): thread block (x, y) walks span y of chunk x, k8bitSpanBlocks quantization blocks, each
// warp one quantization block at a time (E = block_size / 32 elements a lane, in registers), so
// the code books are copied to shared memory once per span and the block scale is a warp
// reduction, with no barrier. One thread block per quantization block (the kernel above) copied
// the books and crossed two barriers for every 256 elements: 10x the update's memory floor on
// GPT-2. A span, not a whole chunk, so that one parameter's update (step-in-backward launches
// one per parameter) still has thread blocks for every SM.
constexpr int k8bitWarpMaxBlock = 512;
constexpr int k8bitSpanBlocks = 4 * (k8bitThreads / 32);

template <int E>
__global__ void __launch_bounds__(k8bitThreads)
    adamw8bit_warp_kernel(const Entry* entries, const Chunk* chunks, detail::AdamScalars<float> s,
                          DynamicMaps maps) {
  constexpr int kBlock = 32 * E;
  constexpr int64_t kSpan = int64_t{kBlock} * k8bitSpanBlocks;
  const Chunk c = chunks[blockIdx.x];
  const Entry& e = entries[c.tensor];
  const int64_t span_begin = static_cast<int64_t>(c.chunk) * kChunkSize + blockIdx.y * kSpan;
  if (span_begin >= e.numel) return;  // the tensor's last chunk is short: the whole block leaves
  const int64_t span_end = span_begin + kSpan < e.numel ? span_begin + kSpan : e.numel;
  __shared__ DynamicMaps sh;
  load_maps(sh, maps);
  const Adam8bitLists l(e);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int warps = static_cast<int>(blockDim.x) / 32;
  for (int64_t begin = span_begin + static_cast<int64_t>(warp) * kBlock; begin < span_end;
       begin += static_cast<int64_t>(warps) * kBlock) {
    const int64_t end = begin + kBlock < span_end ? begin + kBlock : span_end;
    const int64_t b = begin / kBlock;
    const float scale_m = l.am[b], scale_v = l.av[b];
    float m[E], v[E];
    float max_m = 0.f, max_v = 0.f;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int64_t i = begin + lane + 32 * k;
      if (i < end) {
        l.update(s, sh, i, scale_m, scale_v, m[k], v[k], max_m, max_v);
      }
    }
    // Every lane has read am[b], av[b] (their values fed the updates) before the shuffles.
    for (int o = 16; o > 0; o >>= 1) {
      max_m = detail::absmax_step(max_m, __shfl_xor_sync(0xffffffffu, max_m, o));
      max_v = detail::absmax_step(max_v, __shfl_xor_sync(0xffffffffu, max_v, o));
    }
    if (lane == 0) {
      l.am[b] = max_m;
      l.av[b] = max_v;
    }
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int64_t i = begin + lane + 32 * k;
      if (i < end) {
        l.requantize(sh, i, m[k], v[k], max_m, max_v);
      }
    }
  }
}

// Combines a value into the block's accumulator: sum, or NaN-propagating max (p = inf).
__device__ __forceinline__ double combine(double a, double b, bool is_max) {
  return is_max ? detail::nan_max(a, b) : a + b;
}

__device__ double block_reduce(double v, bool is_max) {
  __shared__ double sh[kThreads];
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) sh[threadIdx.x] = combine(sh[threadIdx.x], sh[threadIdx.x + w], is_max);
    __syncthreads();
  }
  return sh[0];
}

template <typename T>
__global__ void norm_partial_kernel(const Entry* entries, const Chunk* chunks, double p,
                                    double* partials) {
  const Chunk c = chunks[blockIdx.x];
  const Entry& e = entries[c.tensor];
  const Range r = chunk_range(e, c);
  const bool is_max = isinf(p);
  const T* x = static_cast<const T*>(e.ptr[0]);
  double acc = 0;
  for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x)
    acc = combine(acc, detail::norm_term(static_cast<double>(x[i]), p), is_max);
  acc = block_reduce(acc, is_max);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

template <typename T>
__global__ void norm_finish_kernel(const double* partials, int64_t n, double p, T* out) {
  const bool is_max = isinf(p);
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc = combine(acc, partials[i], is_max);
  acc = block_reduce(acc, is_max);
  if (threadIdx.x == 0) *out = static_cast<T>(detail::finish_norm(acc, p));
}

template <typename T>
__global__ void clip_scale_kernel(const Entry* entries, const Chunk* chunks, const T* total,
                                  T max_norm) {
  const Chunk c = chunks[blockIdx.x];
  const Entry& e = entries[c.tensor];
  const Range r = chunk_range(e, c);
  const T coef = detail::clip_coef(*total, max_norm);
  T* x = static_cast<T*>(e.ptr[0]);
  for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) x[i] *= coef;
}

template <typename T>
__global__ void unscale_kernel(const Entry* entries, const Chunk* chunks, T inv_scale,
                               const float* scale, float* found_inf) {
  if (scale) inv_scale = static_cast<T>(static_cast<float>(1.0 / static_cast<double>(*scale)));
  const Chunk c = chunks[blockIdx.x];
  const Entry& e = entries[c.tensor];
  const Range r = chunk_range(e, c);
  T* x = static_cast<T*>(e.ptr[0]);
  bool bad = false;
  for (int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    const T v = x[i];
    if (!isfinite(v)) bad = true;
    x[i] = v * inv_scale;
  }
  if (bad) *found_inf = 1.0f;  // every writer writes the same value
}

template <typename F>
void for_dtype(DType d, const char* op, F f) {
  if (d == DType::float32)
    f(float{});
  else if (d == DType::float64)
    f(double{});
  else
    throw std::invalid_argument(std::string(op) +
                                ": parameters and gradients must be float32 or float64, got " +
                                dtype_name(d));
}

unsigned grid(const DeviceTable& t) {
  return static_cast<unsigned>(t.num_chunks);
}

// The element-wise launcher (updates, clipping, unscaling): the lists' table uploaded (`op` names
// it), then launch(T{}, table, stream) for the lists' dtype T. `range` names the NVTX range,
// `launch_name` the launch in its error.
template <typename Launch>
void launch_update(const TensorLists& l, const char* range, const char* op, const char* launch_name,
                   Launch launch) {
  NvtxRange nvtx(range);
  DeviceGuard guard(l.device.index);
  const DeviceTable t = upload(l, op);
  if (t.num_chunks == 0) return;
  for_dtype(l.dtype, op, [&](auto zero) { launch(zero, t, stream(l.device.index)); });
  check_launch(launch_name);
}

void sgd(const TensorLists& l, const SGDHyper& h) {
  launch_update(l, "optim::sgd (multi-tensor)", "SGD.step", "SGD.step (multi-tensor)",
                [&](auto zero, const DeviceTable& t, cudaStream_t s) {
                  using T = decltype(zero);
                  sgd_kernel<T><<<grid(t), kThreads, 0, s>>>(t.entries, t.chunks,
                                                             detail::SGDScalars<T>(h), l.depth > 2,
                                                             h.lr_device, h.found_inf);
                });
}

void adam(const TensorLists& l, const AdamHyper& h) {
  launch_update(l, "optim::adam (multi-tensor)", "Adam.step", "Adam.step (multi-tensor)",
                [&](auto zero, const DeviceTable& t, cudaStream_t s) {
                  using T = decltype(zero);
                  const int slot = h.capturable ? l.depth - 1 : -1;
                  if (h.capturable) {
                    const auto n = static_cast<int64_t>(l.size());
                    step_increment_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, s>>>(
                        t.entries, n, slot, h.found_inf);
                  }
                  adam_kernel<T><<<grid(t), kThreads, 0, s>>>(t.entries, t.chunks,
                                                              detail::AdamScalars<T>(h), h.amsgrad,
                                                              slot, h.lr_device, h.found_inf);
                });
}

void adamw8bit(const TensorLists& l, const AdamW8bitHyper& h) {
  NvtxRange range("optim::adamw8bit (multi-tensor)");
  DeviceGuard guard(l.device.index);
  if (l.dtype != DType::float32)
    throw std::invalid_argument(
        std::string("AdamW8bit: parameters and gradients must be float32, got ") +
        dtype_name(l.dtype));
  const DeviceTable t = upload(l, "AdamW8bit.step");
  if (t.num_chunks == 0) return;
  const int bs = static_cast<int>(h.block_size);
  if (bs <= k8bitWarpMaxBlock) {
    const detail::AdamScalars<float> s(h.adam);
    const auto launch = [&](auto kernel) {
      const dim3 spans(static_cast<unsigned>(t.num_chunks),
                       static_cast<unsigned>(kChunkSize / (int64_t{bs} * k8bitSpanBlocks)));
      kernel<<<spans, k8bitThreads, 0, stream(l.device.index)>>>(t.entries, t.chunks, s,
                                                                 dynamic_maps());
    };
    // The warp kernel of E = bs / 32 codes a lane, for the block sizes 64 to 512.
    const auto launch_of = [&]<int... E>(std::integer_sequence<int, E...>) {
      return ((bs == 32 * E && (launch(adamw8bit_warp_kernel<E>), true)) || ...);
    };
    if (!launch_of(std::integer_sequence<int, 2, 4, 8, 16>{}))
      throw std::invalid_argument("AdamW8bit.step: block size " + std::to_string(bs) +
                                  " is not a power of two from 64 to 4096");
    check_launch("AdamW8bit.step (multi-tensor)");
    return;
  }
  const dim3 grid8(static_cast<unsigned>(t.num_chunks), static_cast<unsigned>(kChunkSize / bs));
  const unsigned threads = static_cast<unsigned>(bs < k8bitThreads ? bs : k8bitThreads);
  adamw8bit_kernel<<<grid8, threads, 0, stream(l.device.index)>>>(
      t.entries, t.chunks, detail::AdamScalars<float>(h.adam), dynamic_maps(), bs);
  check_launch("AdamW8bit.step (multi-tensor)");
}

Tensor total_norm(const TensorLists& l, double norm_type) {
  NvtxRange range("optim::total_norm (multi-tensor)");
  DeviceGuard guard(l.device.index);
  memory::CategoryScope category(memory::Category::temporary);
  Tensor out = ops::zeros({}, l.dtype, l.device);
  const DeviceTable t = upload(l, "clip_grad_norm_");
  if (t.num_chunks == 0) return out;
  Tensor partials = ops::empty({t.num_chunks}, DType::float64, l.device);
  for_dtype(l.dtype, "clip_grad_norm_", [&](auto zero) {
    using T = decltype(zero);
    norm_partial_kernel<T><<<grid(t), kThreads, 0, stream(l.device.index)>>>(
        t.entries, t.chunks, norm_type, partials.data<double>());
    check_launch("clip_grad_norm_ (partial norms)");
    norm_finish_kernel<T><<<1, kThreads, 0, stream(l.device.index)>>>(
        partials.data<double>(), t.num_chunks, norm_type, out.data<T>());
    check_launch("clip_grad_norm_ (total norm)");
  });
  return out;
}

void clip_scale(const TensorLists& l, const Tensor& total_norm, double max_norm) {
  if (total_norm.dtype() != l.dtype || !(total_norm.device() == l.device))
    throw std::invalid_argument(
        "clip_grad_norm_: the total norm must have the gradients' dtype and device");
  launch_update(l, "optim::clip_scale (multi-tensor)", "clip_grad_norm_", "clip_grad_norm_ (scale)",
                [&](auto zero, const DeviceTable& t, cudaStream_t s) {
                  using T = decltype(zero);
                  clip_scale_kernel<T><<<grid(t), kThreads, 0, s>>>(
                      t.entries, t.chunks, total_norm.data<T>(), static_cast<T>(max_norm));
                });
}

void unscale(const TensorLists& l, float inv_scale, const float* scale, const Tensor& found_inf) {
  if (found_inf.dtype() != DType::float32 || found_inf.numel() != 1 ||
      !(found_inf.device() == l.device))
    throw std::invalid_argument(
        "GradScaler.unscale_: found_inf must be one float32 on the gradients' device");
  launch_update(
      l, "optim::unscale (multi-tensor)", "GradScaler.unscale_",
      "GradScaler.unscale_ (multi-tensor)", [&](auto zero, const DeviceTable& t, cudaStream_t s) {
        using T = decltype(zero);
        unscale_kernel<T><<<grid(t), kThreads, 0, s>>>(
            t.entries, t.chunks, static_cast<T>(inv_scale), scale, found_inf.data<float>());
      });
}

void update_scale(const Tensor& scale, const Tensor& growth_tracker, const Tensor& found_inf,
                  double growth_factor, double backoff_factor, int64_t growth_interval) {
  NvtxRange range("optim::update_scale");
  DeviceGuard guard(scale.device().index);
  update_scale_kernel<<<1, 1, 0, stream(scale.device().index)>>>(
      scale.data<float>(), growth_tracker.data<int64_t>(), found_inf.data<float>(),
      static_cast<float>(growth_factor), static_cast<float>(backoff_factor), growth_interval);
  check_launch("GradScaler.update (_amp_update_scale_)");
}

}  // namespace

const MultiTensorKernels multi_tensor_kernels{TALLY_MULTI_TENSOR_KERNELS};

}  // namespace tally::optim::cuda
