// CUDA normalization kernels: layer_norm / rms_norm over rows, batch_norm over channels,
// group_norm over (sample, group) rows, forward and backward. Twins of tensor/norm/cpu.cpp
// (same formulas, same order of the elementwise arithmetic in the statistics dtype A: float
// for float32 and the 16-bit types, double for float64).
//
// Rows (layer_norm, rms_norm): one block per row, 32..512 threads by row length, block-wide
// reductions in A. The backward accumulates dweight/dbias per block in shared memory (or,
// for very long rows, in the block's own slice of the scratch), writes one partial row per
// block into an A-typed scratch from the caching allocator, and a second kernel sums the
// partials per column: deterministic, no atomics, no host synchronisation.
//
// Channels (batch_norm): the N * spatial elements of a channel are split over a few blocks
// (enough blocks in all to fill the device), each summing in double (the statistics shifted
// by the channel's first element, so one pass gives an accurate variance); a finalize
// kernel combines the partials per channel. The elementwise passes run one thread a pack of
// 4 elements (one vector load; when the plane size allows, else one element) with a
// grid-stride loop.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "tensor/cuda/device_types.cuh"
#include "tensor/cuda/runtime.h"
#include "tensor/norm/kernels.h"
#include "tensor/norm/launch.h"
#include "tensor/norm/math.h"
#include "tensor/norm/ops.h"
#include "tensor/op_alloc.h"

namespace tally::cuda {
namespace {

constexpr int kRowMaxThreads = norm_launch::kRowMaxThreads;
constexpr int kBnThreads = norm_launch::kBnThreads;
constexpr int kEltThreads = 256;
constexpr int64_t kMaxGrid = 1 << 20;      // blocks of a grid-stride launch
constexpr size_t kMaxSmemAcc = 32 * 1024;  // shared dweight/dbias accumulators

// Element pointer of a tensor (offset included), null when undefined.
template <typename T>
T* ptr(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr;
}

// The statistics dtype for inputs of `dtype` (ops::norm_stat_dtype).
DType stat_dtype(DType dtype) {
  return dtype == DType::float64 ? DType::float64 : DType::float32;
}

using Named = std::pair<const Tensor*, const char*>;

// Defined tensors of `ts` must have `dtype` (the raw op guarantees it; this guards misuse).
void expect_dtype(const char* op, DType dtype, std::initializer_list<Named> ts) {
  for (const auto& [t, what] : ts)
    if (t->defined() && t->dtype() != dtype)
      throw std::invalid_argument(std::string(op) + " (CUDA): " + what + " has dtype " +
                                  dtype_name(t->dtype()) + ", expected " + dtype_name(dtype));
}

// Defined tensors of `ts` must live on cuda:device.
void expect_cuda(const char* op, int device, std::initializer_list<Named> ts) {
  for (const auto& [t, what] : ts)
    if (t->defined() && (!t->is_cuda() || t->device().index != device))
      throw std::invalid_argument(std::string(op) + " (CUDA): " + what + " is on " +
                                  t->device().str() + ", expected cuda:" + std::to_string(device));
}

// The argument checks of both forward launchers: every defined tensor on cuda:device; out in
// `out_dtype`, the rest in the input's statistics dtype. `stat` is rstd or invstd.
void expect_forward(const char* op, int device, DType out_dtype, const Tensor& out, const Tensor& x,
                    const Tensor& mean, Named stat, const Tensor& weight, const Tensor& bias) {
  expect_cuda(
      op, device,
      {{&out, "out"}, {&x, "input"}, {&mean, "mean"}, stat, {&weight, "weight"}, {&bias, "bias"}});
  expect_dtype(op, out_dtype, {{&out, "out"}});
  expect_dtype(op, stat_dtype(x.dtype()),
               {{&mean, "mean"}, stat, {&weight, "weight"}, {&bias, "bias"}});
}

// The argument checks of both backward launchers: every defined tensor on cuda:device; dx and
// input in `dtype`, grad_output in dy_dtype; the rest in dtype's statistics dtype. `stat` is
// rstd (layer_norm) or invstd (batch_norm).
void expect_backward(const char* op, int device, DType dtype, DType dy_dtype, const Tensor& dx,
                     const Tensor& dweight, const Tensor& dbias, const Tensor& dy, const Tensor& x,
                     const Tensor& mean, Named stat, const Tensor& weight) {
  expect_cuda(op, device,
              {{&dx, "dx"},
               {&dweight, "dweight"},
               {&dbias, "dbias"},
               {&dy, "grad_output"},
               {&x, "input"},
               {&mean, "mean"},
               stat,
               {&weight, "weight"}});
  expect_dtype(op, dtype, {{&dx, "dx"}, {&x, "input"}});
  expect_dtype(op, dy_dtype, {{&dy, "grad_output"}});
  expect_dtype(
      op, stat_dtype(dtype),
      {{&dweight, "dweight"}, {&dbias, "dbias"}, {&mean, "mean"}, stat, {&weight, "weight"}});
}

// Threads of a row block: about 4 elements a thread, a multiple of 32 in [32, 512].
int row_threads(int64_t cols) {
  return norm_launch::row_threads(cols);
}

unsigned elt_blocks(int64_t n) {
  const int64_t b = (n + kEltThreads - 1) / kEltThreads;
  return static_cast<unsigned>(std::clamp<int64_t>(b, 1, 65535 * 8));
}

// Blocks of kEltThreads for one warp per item.
unsigned warp_blocks(int64_t items) {
  constexpr int64_t per_block = kEltThreads / 32;
  return static_cast<unsigned>(
      std::clamp<int64_t>((items + per_block - 1) / per_block, 1, 65535 * 8));
}

// ------------------------------------------------------------------ reductions

template <typename C>
__device__ __forceinline__ C warp_sum(C v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sums a and b over the block (blockDim.x a multiple of 32); every thread gets the totals.
// red: >= 64 shared values. Every warp reduces the per-warp sums itself, in the same order,
// so all threads see the same bits. Must be reached by every thread of the block.
template <typename C>
__device__ __forceinline__ void block_sum2(C& a, C& b, C* red) {
  a = warp_sum(a);
  b = warp_sum(b);
  const int nw = static_cast<int>(blockDim.x >> 5);
  if (nw == 1) return;
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  __syncthreads();  // earlier readers of red are done
  if (lane == 0) {
    red[warp] = a;
    red[32 + warp] = b;
  }
  __syncthreads();
  a = warp_sum(lane < nw ? red[lane] : C(0));
  b = warp_sum(lane < nw ? red[32 + lane] : C(0));
}

template <typename C>
__device__ __forceinline__ C block_sum(C a, C* red) {
  C b = 0;
  block_sum2(a, b, red);
  return a;
}

// A block's partial sums s1, s2 (block_sum2 over red) into p[0], p[1] by thread 0.
__device__ __forceinline__ void store_partial(double s1, double s2, double* red, double* p) {
  block_sum2(s1, s2, red);
  if (threadIdx.x == 0) {
    p[0] = s1;
    p[1] = s2;
  }
}

// The finalize kernels' channel loop, one warp a channel (grid-stride): the warp sums channel
// ch's partials part[ch][0, splits)[2] (lanes strided over the splits, then a butterfly sum),
// and lane 0 calls body(ch, sum of [0]s, sum of [1]s).
template <typename Body>
__device__ __forceinline__ void for_each_channel_sums(const double* __restrict__ part, int64_t c,
                                                      int splits, Body&& body) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t ch = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5; ch < c;
       ch += warps) {
    double s1 = 0, s2 = 0;
    for (int p = lane; p < splits; p += 32) {
      s1 += part[(ch * splits + p) * 2];
      s2 += part[(ch * splits + p) * 2 + 1];
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    if (lane == 0) body(ch, s1, s2);
  }
}

// V consecutive elements loaded/stored at once (one 16-byte access for 4 floats, 8 bytes for
// 4 halves); the pointer is aligned to a pack and i counts packs.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};
template <int V, typename T>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p, int64_t i) {
  return reinterpret_cast<const Pack<T, V>*>(p)[i];
}
template <int V, typename T>
__device__ __forceinline__ void store_pack(T* p, int64_t i, const Pack<T, V>& v) {
  reinterpret_cast<Pack<T, V>*>(p)[i] = v;
}

// ------------------------------------------------------------------ layer_norm / rms_norm

// out = (x - mean) * rstd * w + b per row; mean null: rms_norm (no centering). out in O: T,
// or a 16-bit type beside a float T (autocast's cast, fused).
template <typename T, typename O, typename A>
__global__ void __launch_bounds__(kRowMaxThreads)
    layer_norm_fwd_kernel(O* __restrict__ out, A* __restrict__ mean, A* __restrict__ rstd,
                          const T* __restrict__ x, const A* __restrict__ w, const A* __restrict__ b,
                          int64_t rows, int64_t cols, A eps) {
  __shared__ A red[64];
  const bool center = mean != nullptr;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    O* orow = out + row * cols;
    A mu = 0;
    if (center) {
      A s = 0;
      for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) s += static_cast<A>(load(xr[j]));
      s = block_sum(s, red);
      mu = cols > 0 ? s / static_cast<A>(cols) : A(0);
    }
    A ss = 0;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      const A d = static_cast<A>(load(xr[j])) - mu;
      ss += d * d;
    }
    ss = block_sum(ss, red);
    const A var = cols > 0 ? ss / static_cast<A>(cols) : A(0);
    const A r = A(1) / sqrt(var + eps);
    if (threadIdx.x == 0) {
      if (center) mean[row] = mu;
      rstd[row] = r;
    }
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      orow[j] =
          store<O>(math::scale_shift(math::xhat(static_cast<A>(load(xr[j])), mu, r), w, b, j));
    }
  }
}

// One block visits rows blockIdx.x, blockIdx.x + gridDim.x, ...:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w (rms_norm: no mean(g));
// and, when part is non-null, accumulates dweight = sum dy * xhat and dbias = sum dy over its
// rows into part[blockIdx.x] ([2][cols]: dweight then dbias). Column j is owned by thread
// j % blockDim.x throughout, so the accumulators need no synchronisation. smem: accumulate
// in dynamic shared memory (2 * cols values) and write the partial row once at the end;
// otherwise accumulate in the partial row itself. dy in G: T, or a 16-bit type beside a float T.
template <typename T, typename G, typename A>
__global__ void __launch_bounds__(kRowMaxThreads)
    layer_norm_bwd_kernel(T* __restrict__ dx, A* __restrict__ part, bool smem,
                          const G* __restrict__ dy, const T* __restrict__ x,
                          const A* __restrict__ mean, const A* __restrict__ rstd,
                          const A* __restrict__ w, int64_t rows, int64_t cols,
                          const T* __restrict__ dxa, G* __restrict__ dxl) {
  __shared__ A red[64];
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  const bool center = mean != nullptr;
  A* prow = part ? part + static_cast<int64_t>(blockIdx.x) * 2 * cols : nullptr;
  A* acc = part ? (smem ? reinterpret_cast<A*>(dyn_smem) : prow) : nullptr;
  if (acc) {
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      acc[j] = A(0);
      acc[cols + j] = A(0);
    }
  }
  const A inv_n = cols > 0 ? A(1) / static_cast<A>(cols) : A(0);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    const G* gr = dy + row * cols;
    const A m = center ? mean[row] : A(0);
    const A r = rstd[row];
    A sg = 0, sgx = 0;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      const A xh = math::xhat(static_cast<A>(load(xr[j])), m, r);
      const A g = static_cast<A>(load(gr[j]));
      if (acc) {
        acc[j] += g * xh;
        acc[cols + j] += g;
      }
      const A gw = w ? g * w[j] : g;
      sg += gw;
      sgx += gw * xh;
    }
    if (!dx) continue;  // uniform over the block
    block_sum2(sg, sgx, red);
    const A mg = center ? sg * inv_n : A(0);
    const A mgx = sgx * inv_n;
    T* dr = dx + row * cols;
    const T* ar = dxa ? dxa + row * cols : nullptr;
    G* lr = dxl ? dxl + row * cols : nullptr;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      const A xh = math::xhat(static_cast<A>(load(xr[j])), m, r);
      const A g = static_cast<A>(load(gr[j]));
      const A gw = w ? g * w[j] : g;
      const A d = math::norm_input_grad(r, gw, mg, xh, mgx);
      const T v = store<T>(ar ? d + static_cast<A>(load(ar[j])) : d);
      dr[j] = v;
      if (lr) lr[j] = store<G>(static_cast<A>(load(v)));
    }
  }
  if (acc && smem) {
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      prow[j] = acc[j];
      prow[cols + j] = acc[cols + j];
    }
  }
}

// layer_norm_bwd_kernel for rows of at most kRowMaxThreads packs of V elements (16 bytes of T),
// every row aligned to a pack: thread t owns columns [t * V, t * V + V) of every row, so a row
// is read once into registers (one 16-byte load of x, one pack of dy), the weights are loaded
// once, and the dweight/dbias sums stay in registers until the block writes its partial row
// (part non-null). GPT-2's 768 float32 columns: 192 threads, 4 columns each.
template <typename T, typename G, typename A, int V>
__global__ void __launch_bounds__(kRowMaxThreads)
    layer_norm_bwd_pack_kernel(T* __restrict__ dx, A* __restrict__ part, const G* __restrict__ dy,
                               const T* __restrict__ x, const A* __restrict__ mean,
                               const A* __restrict__ rstd, const A* __restrict__ w, int64_t rows,
                               int cols, const T* __restrict__ dxa, G* __restrict__ dxl) {
  __shared__ A red[64];
  const bool center = mean != nullptr;
  const int t = static_cast<int>(threadIdx.x);
  const bool active = t * V < cols;
  A wv[V], aw[V], ab[V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    wv[e] = active && w ? w[t * V + e] : A(1);
    aw[e] = A(0);
    ab[e] = A(0);
  }
  const A inv_n = A(1) / static_cast<A>(cols);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const A m = center ? mean[row] : A(0);
    const A r = rstd[row];
    A xh[V], gw[V];
    A sg = 0, sgx = 0;
    if (active) {
      const Pack<T, V> xp = load_pack<V>(x + row * cols, t);
      const Pack<G, V> gp = load_pack<V>(dy + row * cols, t);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        xh[e] = math::xhat(static_cast<A>(load(xp.v[e])), m, r);
        const A g = static_cast<A>(load(gp.v[e]));
        aw[e] += g * xh[e];
        ab[e] += g;
        gw[e] = g * wv[e];
        sg += gw[e];
        sgx += gw[e] * xh[e];
      }
    }
    if (!dx) continue;  // uniform over the block
    block_sum2(sg, sgx, red);
    const A mg = center ? sg * inv_n : A(0);
    const A mgx = sgx * inv_n;
    if (active) {
      Pack<T, V> o, a;
      if (dxa) a = load_pack<V>(dxa + row * cols, t);  // the residual's gradient, added
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const A d = math::norm_input_grad(r, gw[e], mg, xh[e], mgx);
        o.v[e] = store<T>(dxa ? d + static_cast<A>(load(a.v[e])) : d);
      }
      store_pack<V>(dx + row * cols, t, o);
      if (dxl) {  // the 16-bit copy, from the rounded values (to(dx, G)'s bits)
        Pack<G, V> l;
#pragma unroll
        for (int e = 0; e < V; ++e) l.v[e] = store<G>(static_cast<A>(load(o.v[e])));
        store_pack<V>(dxl + row * cols, t, l);
      }
    }
  }
  if (part && active) {
    A* prow = part + static_cast<int64_t>(blockIdx.x) * 2 * cols + t * V;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      prow[e] = aw[e];
      prow[cols + e] = ab[e];
    }
  }
}

// dweight[j] = sum over the partial rows of part[p][0][j], dbias[j] of part[p][1][j].
// Block (kTileCols, kTileParts): thread (tx, ty) sums column tx of its tile over the
// partial rows ty, ty + kTileParts, ... (coalesced across tx), then the kTileParts sums of
// a column are added in shared memory in a fixed order.
constexpr int kTileCols = 32, kTileParts = 16;

template <typename A>
__global__ void __launch_bounds__(kTileCols* kTileParts)
    layer_norm_bwd_params_kernel(A* __restrict__ dw, A* __restrict__ db, const A* __restrict__ part,
                                 int64_t nparts, int64_t cols) {
  __shared__ A sw_s[kTileParts][kTileCols];
  __shared__ A sb_s[kTileParts][kTileCols];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  for (int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTileCols; j0 < cols;
       j0 += static_cast<int64_t>(gridDim.x) * kTileCols) {
    const int64_t j = j0 + tx;
    A sw = 0, sb = 0;
    if (j < cols) {
      for (int64_t p = ty; p < nparts; p += kTileParts) {
        sw += part[p * 2 * cols + j];
        sb += part[p * 2 * cols + cols + j];
      }
    }
    sw_s[ty][tx] = sw;
    sb_s[ty][tx] = sb;
    __syncthreads();
    if (ty == 0 && j < cols) {
      A tw = 0, tb = 0;
      for (int k = 0; k < kTileParts; ++k) {
        tw += sw_s[k][tx];
        tb += sb_s[k][tx];
      }
      if (dw) dw[j] = tw;
      if (db) db[j] = tb;
    }
    __syncthreads();  // the tile's sums are read before the next tile overwrites them
  }
}

// ------------------------------------------------------------------ batch_norm

int bn_splits(int64_t c, int64_t count, int device) {
  return norm_launch::bn_splits(c, count, sm_count(device));
}

// True when every element offset of an (n, c, s) tensor, plus a grid stride, fits in 32 bits.
bool fits_u32(int64_t total) {
  return total < (int64_t{1} << 31);
}

// go(std::type_identity<I>{}) with the kernels' index type I: uint32_t when `small` (fits_u32),
// else int64_t.
template <typename F>
void with_index(bool small, F&& go) {
  if (small)
    go(std::type_identity<uint32_t>{});
  else
    go(std::type_identity<int64_t>{});
}

// The batch_norm kernels take packs (above) of V = 4 when the plane size S is a multiple of 4
// and every tensor they stream is aligned to 4 elements (so a pack never straddles two
// channels), else V = 1. Their index variables count packs. Channels-last tensors pass the
// channel count C for S: a pack is 4 channels of one position.
// The pack width for tensors of plane size s: 4 when s % 4 == 0 and all are 4-aligned.
int bn_width(int64_t s, size_t elem, std::initializer_list<const void*> ptrs) {
  if (s % 4 != 0) return 1;
  for (const void* p : ptrs)
    if (p && reinterpret_cast<uintptr_t>(p) % (elem * 4) != 0) return 1;
  return 4;
}

// Blocks of a channels_last elementwise kernel (NhwcWalk) over `packs` packs of cv column
// packs on `device`: one wave (8 blocks an SM), so that each thread walks many rows with the
// statistics it loaded once; fewer for small tensors, and at least one thread a column pack.
unsigned nhwc_walk_blocks(int64_t packs, int64_t cv, int device) {
  const int64_t wave = static_cast<int64_t>(sm_count(device)) * 8;
  const int64_t need = (cv + kEltThreads - 1) / kEltThreads;
  return static_cast<unsigned>(std::max<int64_t>(std::min<int64_t>(elt_blocks(packs), wave), need));
}

// The grid of a channels_last partial-sum kernel: column tiles of min(cv, kBnThreads) packs
// (NhwcTile) by splits.
dim3 nhwc_grid(int64_t cv, int splits) {
  const int64_t tc = std::min<int64_t>(cv, kBnThreads);
  return dim3(static_cast<unsigned>((cv + tc - 1) / tc), static_cast<unsigned>(splits));
}

// go(std::integral_constant<int, V>{}) with V = bn_width(s, elem, ptrs): the launch lambda
// instantiated for the pack width.
template <typename F>
void with_bn_width(int64_t s, size_t elem, std::initializer_list<const void*> ptrs, F&& go) {
  if (bn_width(s, elem, ptrs) == 4)
    go(std::integral_constant<int, 4>{});
  else
    go(std::integral_constant<int, 1>{});
}

// The channels_last launchers' pack width: 16 bytes of T (8 channels of a 16-bit type) when C
// is a multiple of it and every streamed tensor (`ptrs`, elements of `elem` bytes) is 16-byte
// aligned, else 4 channels, else 1.
template <typename F>
void with_bn_width_last(int64_t c, size_t elem, std::initializer_list<const void*> ptrs, F&& go) {
  auto aligned = [&](int v) {
    for (const void* p : ptrs)
      if (p && reinterpret_cast<uintptr_t>(p) % (elem * v) != 0) return false;
    return c % v == 0;
  };
  if (elem == 2 && aligned(8))
    go(std::integral_constant<int, 8>{});
  else if (aligned(4))
    go(std::integral_constant<int, 4>{});
  else
    go(std::integral_constant<int, 1>{});
}

// Block (ch, split): sum of (x - K) and (x - K)^2 over its share of channel ch's elements,
// K = x[0, ch, 0], into part[ch][split][2] (double).
template <typename T, typename I, int V>
__global__ void __launch_bounds__(kBnThreads)
    bn_stats_partial_kernel(double* __restrict__ part, const T* __restrict__ x, I n, I c, I s) {
  __shared__ double red[64];
  const I ch = blockIdx.x;
  const I split = blockIdx.y, splits = gridDim.y;
  const I sv = s / V, count = n * sv;  // in packs
  const double k0 = n * s > 0 ? static_cast<double>(load(x[ch * s])) : 0.0;
  double s1 = 0, s2 = 0;
  for (I e = split * blockDim.x + threadIdx.x; e < count; e += splits * blockDim.x) {
    const I b = e / sv, k = e - b * sv;
    const Pack<T, V> pk = load_pack<V>(x, (b * c + ch) * sv + k);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const double d = static_cast<double>(load(pk.v[j])) - k0;
      s1 += d;
      s2 += d * d;
    }
  }
  store_partial(s1, s2, red, part + (static_cast<int64_t>(ch) * splits + split) * 2);
}

// Channels-last (NHWC) partial sums: x read as [rows, c] (rows = N * H * W), packs of V
// channels. Block (tile, split): a tile of tc = min(c / V, kBnThreads) column packs, one a
// thread, and rpp = kBnThreads / tc rows at a time, over rows split, split + splits, ...
// of rpp-row groups. Each thread sums its V channels in double; the rpp row lanes of a column
// are then summed through shared memory, in order, into part[ch][split][2].
// What a channels_last partial-sum thread accumulates its own rows in: float for 16-bit
// inputs (values of 8-11 significant bits; a thread's rows are tens for ResNet-50's batch of
// 64, their float sum within 1e-5 relative of the double one), double otherwise; the block's
// and the splits' sums are double.
template <typename T>
using NhwcSum = std::conditional_t<sizeof(T) == 2, float, double>;

struct NhwcTile {
  int tc, rpp, tx, ty;
  __device__ NhwcTile(int64_t cv) {
    tc = static_cast<int>(cv < kBnThreads ? cv : kBnThreads);
    rpp = kBnThreads / tc;
    tx = static_cast<int>(threadIdx.x) % tc;
    ty = static_cast<int>(threadIdx.x) / tc;
  }
};

// Sums s[V][2] of every row lane of the block into part: the lanes' values go to shared
// memory, then each of the tile's tc * V * 2 sums is formed by one thread (the whole block
// shares them out), over the rpp row lanes in order. cv: column packs of the tensor.
template <int V, typename S>
__device__ __forceinline__ void nhwc_tile_store(double* __restrict__ part, S (&s)[V][2],
                                                const NhwcTile& t, int64_t cv, int64_t splits,
                                                int64_t split, double* red) {
  // red: kBnThreads * V * 2 doubles; lane (ty, tx) at [ty][(tx * V + j) * 2 + k].
  const int width = t.tc * V * 2;
  if (t.ty < t.rpp)
#pragma unroll
    for (int j = 0; j < V; ++j) {
      red[t.ty * width + (t.tx * V + j) * 2] = static_cast<double>(s[j][0]);
      red[t.ty * width + (t.tx * V + j) * 2 + 1] = static_cast<double>(s[j][1]);
    }
  __syncthreads();
  const int64_t ch0 = static_cast<int64_t>(blockIdx.x) * t.tc * V;  // the tile's first channel
  for (int e = static_cast<int>(threadIdx.x); e < width; e += kBnThreads) {
    const int64_t ch = ch0 + e / 2;
    if (ch >= cv * V) break;
    double a = 0;
    for (int r = 0; r < t.rpp; ++r) a += red[r * width + e];
    part[(ch * splits + split) * 2 + (e & 1)] = a;
  }
}

template <typename T, typename I, int V>
__global__ void __launch_bounds__(kBnThreads)
    bn_stats_partial_nhwc_kernel(double* __restrict__ part, const T* __restrict__ x, I rows, I c) {
  __shared__ double red[kBnThreads * V * 2];
  const I cv = c / V;
  const NhwcTile t(cv);
  const I split = blockIdx.y, splits = gridDim.y;
  const I cp = static_cast<I>(blockIdx.x) * t.tc + t.tx;  // this thread's column pack
  const bool col = t.ty < t.rpp && cp < cv;
  // A thread's own rows sum in NhwcSum<T> (float for 16-bit inputs), the rest in double.
  using S = NhwcSum<T>;
  S s[V][2] = {};
  if (col) {
    const Pack<T, V> k = load_pack<V>(x, cp);  // row 0: the shift K of each channel
    S k0[V];
#pragma unroll
    for (int j = 0; j < V; ++j) k0[j] = static_cast<S>(load(k.v[j]));
    for (I r = split * t.rpp + t.ty; r < rows; r += splits * t.rpp) {
      const Pack<T, V> pk = load_pack<V>(x, r * cv + cp);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const S d = static_cast<S>(load(pk.v[j])) - k0[j];
        s[j][0] += d;
        s[j][1] += d * d;
      }
    }
  }
  nhwc_tile_store<V>(part, s, t, cv, splits, split, red);
}

// One pack of V elements at off (in packs) of the backward's sums, in both layouts:
// add(j, dy_j, xhat_j, true) with xhat_j = xhat(j, x_j) where need_xhat, else
// add(j, dy_j, 0, false) (x not read).
template <int V, typename A, typename T, typename I, typename Xhat, typename Add>
__device__ __forceinline__ void add_bwd_pack(const T* __restrict__ dy, const T* __restrict__ x,
                                             I off, bool need_xhat, Xhat xhat, Add add) {
  const Pack<T, V> g = load_pack<V>(dy, off);
  if (need_xhat) {
    const Pack<T, V> xv = load_pack<V>(x, off);
#pragma unroll
    for (int j = 0; j < V; ++j)
      add(j, static_cast<A>(load(g.v[j])), xhat(j, static_cast<A>(load(xv.v[j]))), true);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) add(j, static_cast<A>(load(g.v[j])), A(0), false);
  }
}

// The backward's sums in channels_last: sum dy and (need_xhat) sum dy * xhat per channel.
template <typename T, typename A, typename I, int V>
__global__ void __launch_bounds__(kBnThreads)
    bn_bwd_partial_nhwc_kernel(double* __restrict__ part, const T* __restrict__ dy,
                               const T* __restrict__ x, const A* __restrict__ mean,
                               const A* __restrict__ invstd, bool need_xhat, I rows, I c) {
  __shared__ double red[kBnThreads * V * 2];
  const I cv = c / V;
  const NhwcTile t(cv);
  const I split = blockIdx.y, splits = gridDim.y;
  const I cp = static_cast<I>(blockIdx.x) * t.tc + t.tx;
  const bool col = t.ty < t.rpp && cp < cv;
  using S = NhwcSum<T>;
  S s[V][2] = {};
  if (col) {
    A r[V], m[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      r[j] = invstd[cp * V + j];
      m[j] = need_xhat ? mean[cp * V + j] : A(0);
    }
    for (I row = split * t.rpp + t.ty; row < rows; row += splits * t.rpp) {
      add_bwd_pack<V, A>(
          dy, x, row * cv + cp, need_xhat, [&](int j, A xv) { return math::xhat(xv, m[j], r[j]); },
          [&](int j, A gj, A xh, bool with_xhat) {
            s[j][0] += static_cast<S>(gj);
            if (with_xhat) s[j][1] += static_cast<S>(gj) * static_cast<S>(xh);
          });
    }
  }
  nhwc_tile_store<V>(part, s, t, cv, splits, split, red);
}

// Per channel: mean, biased var and invstd from the partial sums. One warp a channel: the
// lanes sum the splits (strided), then a butterfly sum.
// The shift K of channel ch is x[ch * k_stride] (its first element: k_stride = S for NCHW, 1
// for channels_last).
template <typename T, typename A>
__global__ void bn_stats_finalize_kernel(A* __restrict__ mean, A* __restrict__ var,
                                         A* __restrict__ invstd, const double* __restrict__ part,
                                         const T* __restrict__ x, int64_t n, int64_t c, int64_t s,
                                         int64_t k_stride, int splits, double eps,
                                         A* __restrict__ running_mean, A* __restrict__ running_var,
                                         double momentum) {
  const int64_t count = n * s;
  for_each_channel_sums(part, c, splits, [&](int64_t ch, double s1, double s2) {
    double mu = 0, v = 0;
    if (count > 0) {
      const double k0 = static_cast<double>(load(x[ch * k_stride]));
      const double dm = s1 / static_cast<double>(count);
      mu = k0 + dm;
      v = s2 / static_cast<double>(count) - dm * dm;
      if (v < 0) v = 0;
    }
    mean[ch] = static_cast<A>(mu);
    var[ch] = static_cast<A>(v);
    invstd[ch] = static_cast<A>(1.0 / sqrt(v + eps));
    if (running_mean && count > 0) {
      running_mean[ch] = static_cast<A>(math::running_stat(running_mean[ch], mu, momentum));
      running_var[ch] =
          static_cast<A>(math::running_stat(running_var[ch], math::unbiased(v, count), momentum));
    }
  });
}

// out = (x - mean[c]) * scale + shift, scale = invstd[c] * w[c], shift = b[c]. total and s
// in packs of V.
template <typename T, typename A, typename I, int V>
__global__ void bn_elemt_kernel(T* __restrict__ out, const T* __restrict__ x,
                                const A* __restrict__ mean, const A* __restrict__ invstd,
                                const A* __restrict__ w, const A* __restrict__ b, I total, I c,
                                I s) {
  for (I i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const I ch = (i / s) % c;
    const A scale = w ? invstd[ch] * w[ch] : invstd[ch];
    const A shift = b ? b[ch] : A(0);
    const A m = mean[ch];
    const Pack<T, V> in = load_pack<V>(x, i);
    Pack<T, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j)
      o.v[j] = store<T>(math::batch_norm_value(static_cast<A>(load(in.v[j])), m, scale, shift));
    store_pack<V>(out, i, o);
  }
}

// The channels_last elementwise kernels' threads: of the grid's threads, the first
// (threads / cv) * cv each keep one column pack cp = t % cv (V channels) and walk the rows
// t / cv, t / cv + threads / cv, ...: their channels' statistics are loaded once.
template <typename I>
struct NhwcWalk {
  I cp, row, step;
  bool active;
  __device__ NhwcWalk(I cv) {
    const I threads = static_cast<I>(gridDim.x) * blockDim.x;
    const I t = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x;
    step = threads / cv;
    active = t < step * cv;
    cp = t % cv;
    row = t / cv;
  }
};

// bn_elemt_kernel over channels_last x [rows, c] (cv = c / V column packs).
template <typename T, typename A, typename I, int V>
__global__ void bn_elemt_nhwc_kernel(T* __restrict__ out, const T* __restrict__ x,
                                     const A* __restrict__ mean, const A* __restrict__ invstd,
                                     const A* __restrict__ w, const A* __restrict__ b, I rows,
                                     I cv) {
  const NhwcWalk<I> k(cv);
  if (!k.active) return;
  A m[V], scale[V], shift[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const I ch = k.cp * V + j;
    m[j] = mean[ch];
    scale[j] = w ? invstd[ch] * w[ch] : invstd[ch];
    shift[j] = b ? b[ch] : A(0);
  }
  for (I row = k.row; row < rows; row += k.step) {
    const I i = row * cv + k.cp;
    const Pack<T, V> in = load_pack<V>(x, i);
    Pack<T, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j)
      o.v[j] =
          store<T>(math::batch_norm_value(static_cast<A>(load(in.v[j])), m[j], scale[j], shift[j]));
    store_pack<V>(out, i, o);
  }
}

// Block (ch, split): sum of dy and (when need_xhat) of dy * xhat over its share of channel
// ch's elements, xhat = (x - mean) * invstd, into part[ch][split][2] (double).
template <typename T, typename A, typename I, int V>
__global__ void __launch_bounds__(kBnThreads)
    bn_bwd_partial_kernel(double* __restrict__ part, const T* __restrict__ dy,
                          const T* __restrict__ x, const A* __restrict__ mean,
                          const A* __restrict__ invstd, bool need_xhat, I n, I c, I s) {
  __shared__ double red[64];
  const I ch = blockIdx.x;
  const I split = blockIdx.y, splits = gridDim.y;
  const I sv = s / V, count = n * sv;  // in packs
  const A r = invstd[ch];
  const A m = need_xhat ? mean[ch] : A(0);
  double s1 = 0, s2 = 0;
  for (I e = split * blockDim.x + threadIdx.x; e < count; e += splits * blockDim.x) {
    const I b = e / sv, k = e - b * sv;
    add_bwd_pack<V, A>(
        dy, x, (b * c + ch) * sv + k, need_xhat, [&](int, A xv) { return math::xhat(xv, m, r); },
        [&](int, A gj, A xh, bool with_xhat) {
          s1 += static_cast<double>(gj);
          if (with_xhat) s2 += static_cast<double>(gj) * static_cast<double>(xh);
        });
  }
  store_partial(s1, s2, red, part + (static_cast<int64_t>(ch) * splits + split) * 2);
}

// Per channel: dweight = sum dy * xhat, dbias = sum dy, and (coef non-null) the means
// coef[c] = {mean(dy), mean(dy * xhat)} the training dx needs. One warp a channel.
template <typename A>
__global__ void bn_bwd_finalize_kernel(A* __restrict__ dw, A* __restrict__ db, A* __restrict__ coef,
                                       const double* __restrict__ part, int64_t c, int splits,
                                       int64_t count) {
  const double inv_count = count > 0 ? 1.0 / static_cast<double>(count) : 0.0;
  for_each_channel_sums(part, c, splits, [&](int64_t ch, double sdy, double sdyx) {
    if (dw) dw[ch] = static_cast<A>(sdyx);
    if (db) db[ch] = static_cast<A>(sdy);
    if (coef) {
      coef[2 * ch] = static_cast<A>(sdy * inv_count);
      coef[2 * ch + 1] = static_cast<A>(sdyx * inv_count);
    }
  });
}

// training (coef non-null): dx = w * invstd * (dy - mean(dy) - xhat * mean(dy * xhat));
// eval: dx = w * invstd * dy. total and s in packs of V.
template <typename T, typename A, typename I, int V>
__global__ void bn_bwd_dx_kernel(T* __restrict__ dx, const T* __restrict__ dy,
                                 const T* __restrict__ x, const A* __restrict__ mean,
                                 const A* __restrict__ invstd, const A* __restrict__ w,
                                 const A* __restrict__ coef, I total, I c, I s) {
  for (I i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const I ch = (i / s) % c;
    const A r = invstd[ch];
    const A scale = w ? r * w[ch] : r;
    const Pack<T, V> g = load_pack<V>(dy, i);
    Pack<T, V> o;
    if (coef) {
      const A m = mean[ch], c0 = coef[2 * ch], c1 = coef[2 * ch + 1];
      const Pack<T, V> xv = load_pack<V>(x, i);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const A xh = math::xhat(static_cast<A>(load(xv.v[j])), m, r);
        o.v[j] = store<T>(math::norm_input_grad(scale, static_cast<A>(load(g.v[j])), c0, xh, c1));
      }
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) o.v[j] = store<T>(scale * static_cast<A>(load(g.v[j])));
    }
    store_pack<V>(dx, i, o);
  }
}

// bn_bwd_dx_kernel over channels_last dy, x, dx [rows, c] (cv = c / V column packs; the
// walk of bn_elemt_nhwc_kernel).
template <typename T, typename A, typename I, int V>
__global__ void bn_bwd_dx_nhwc_kernel(T* __restrict__ dx, const T* __restrict__ dy,
                                      const T* __restrict__ x, const A* __restrict__ mean,
                                      const A* __restrict__ invstd, const A* __restrict__ w,
                                      const A* __restrict__ coef, I rows, I cv) {
  const NhwcWalk<I> k(cv);
  if (!k.active) return;
  A r[V], scale[V], m[V], c0[V], c1[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const I ch = k.cp * V + j;
    r[j] = invstd[ch];
    scale[j] = w ? r[j] * w[ch] : r[j];
    m[j] = coef ? mean[ch] : A(0);
    c0[j] = coef ? coef[2 * ch] : A(0);
    c1[j] = coef ? coef[2 * ch + 1] : A(0);
  }
  for (I row = k.row; row < rows; row += k.step) {
    const I i = row * cv + k.cp;
    const Pack<T, V> g = load_pack<V>(dy, i);
    Pack<T, V> o;
    if (coef) {
      const Pack<T, V> xv = load_pack<V>(x, i);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const A xh = math::xhat(static_cast<A>(load(xv.v[j])), m[j], r[j]);
        o.v[j] = store<T>(
            math::norm_input_grad(scale[j], static_cast<A>(load(g.v[j])), c0[j], xh, c1[j]));
      }
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) o.v[j] = store<T>(scale[j] * static_cast<A>(load(g.v[j])));
    }
    store_pack<V>(dx, i, o);
  }
}

// layer_norm / rms_norm forward for rows of at most 32 * V * K elements (V = 16 bytes of T,
// cols % V == 0, 16-byte aligned rows): one warp a row, the row read once into registers
// (K 16-byte packs a lane), mean and variance by warp shuffles (two passes over the
// registers, as the block kernel's over memory), no shared memory or block barriers.
// out in O (a pack of V elements: 16 bytes of T, 8 of a 16-bit O beside a float T).
// With res non-null (R: T or O), the row is x + res, each sum rounded to T and written to
// sum (ops::add_layer_norm), then normalized from the registers.
template <typename T, typename O, typename A, int K, typename R>
__global__ void __launch_bounds__(256)
    layer_norm_fwd_warp_kernel(O* __restrict__ out, A* __restrict__ mean, A* __restrict__ rstd,
                               const T* __restrict__ x, const A* __restrict__ w,
                               const A* __restrict__ b, int64_t rows, int cols, A eps,
                               const R* __restrict__ res, T* __restrict__ sum) {
  constexpr int V = 16 / sizeof(T);
  using P = Pack<T, V>;
  const bool center = mean != nullptr;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       row < rows; row += warps) {
    const T* xr = x + row * cols;
    A v[K][V];
    A s = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = (k * 32 + lane) * V;
      if (c < cols) {
        const P pk = load_pack<V>(xr, c / V);
        if (res) {
          const Pack<R, V> rp = load_pack<V>(res + row * cols, c / V);
          P sp;
#pragma unroll
          for (int e = 0; e < V; ++e) {
            sp.v[e] = store<T>(static_cast<A>(load(pk.v[e])) + static_cast<A>(load(rp.v[e])));
            v[k][e] = static_cast<A>(load(sp.v[e]));
            s += v[k][e];
          }
          store_pack<V>(sum + row * cols, c / V, sp);
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) {
            v[k][e] = static_cast<A>(load(pk.v[e]));
            s += v[k][e];
          }
        }
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) v[k][e] = A(0);
      }
    }
    const A inv_n = A(1) / static_cast<A>(cols);
    const A mu = center ? warp_sum(s) * inv_n : A(0);
    A ss = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if ((k * 32 + lane) * V >= cols) continue;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const A d = v[k][e] - mu;
        ss += d * d;
      }
    }
    const A r = A(1) / sqrt(warp_sum(ss) * inv_n + eps);
    if (lane == 0) {
      if (center) mean[row] = mu;
      rstd[row] = r;
    }
    O* orow = out + row * cols;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = (k * 32 + lane) * V;
      if (c >= cols) continue;
      Pack<O, V> o;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        o.v[e] = store<O>(math::scale_shift(math::xhat(v[k][e], mu, r), w, b, c + e));
      }
      store_pack<V>(orow, c / V, o);
    }
  }
}

// sum = x + res elementwise, rounded to T: add_layer_norm's sum when the rows take the block
// kernel (which then normalizes sum).
template <typename T, typename R, typename A>
__global__ void add_rows_kernel(T* __restrict__ sum, const T* __restrict__ x,
                                const R* __restrict__ res, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    sum[i] = store<T>(static_cast<A>(load(x[i])) + static_cast<A>(load(res[i])));
}

// ------------------------------------------------------------------ group_norm
//
// A (sample, group) of x [N, C, *] is a contiguous row of d = C / groups channels of s
// elements. One block a row (grid-stride over the rows), packs of V elements (V > 1 only where
// group_norm_packed_applies: a pack then never straddles two channels).

// Forward: the row's mean, then its biased variance around it (the second and third reads of
// the row come from L2), then out = xhat * w[c] + b[c]: one kernel, x read once from memory.
template <typename T, typename O, typename A, int V>
__global__ void __launch_bounds__(kRowMaxThreads)
    group_norm_fwd_kernel(O* __restrict__ out, A* __restrict__ mean, A* __restrict__ rstd,
                          const T* __restrict__ x, const A* __restrict__ w, const A* __restrict__ b,
                          int64_t rows, int64_t groups, int64_t d, int64_t s, A eps) {
  __shared__ A red[64];
  const int64_t cols = d * s, packs = cols / V, sp = s / V;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    O* orow = out + row * cols;
    A sum = 0;
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      const Pack<T, V> pk = load_pack<V>(xr, i);
#pragma unroll
      for (int j = 0; j < V; ++j) sum += static_cast<A>(load(pk.v[j]));
    }
    sum = block_sum(sum, red);
    const A mu = cols > 0 ? sum / static_cast<A>(cols) : A(0);
    A ss = 0;
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      const Pack<T, V> pk = load_pack<V>(xr, i);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const A v = static_cast<A>(load(pk.v[j])) - mu;
        ss += v * v;
      }
    }
    ss = block_sum(ss, red);
    const A r = A(1) / sqrt((cols > 0 ? ss / static_cast<A>(cols) : A(0)) + eps);
    if (threadIdx.x == 0) {
      mean[row] = mu;
      rstd[row] = r;
    }
    const int64_t c0 = (row % groups) * d;
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      const int64_t ch = c0 + i / sp;
      const Pack<T, V> pk = load_pack<V>(xr, i);
      Pack<O, V> po;
#pragma unroll
      for (int j = 0; j < V; ++j)
        po.v[j] =
            store<O>(math::scale_shift(math::xhat(static_cast<A>(load(pk.v[j])), mu, r), w, b, ch));
      store_pack<V>(orow, i, po);
    }
  }
}

// Backward, one block a row: per channel of the row, sdx = sum dy * xhat and sdy = sum dy over
// its s elements (a warp a channel, or k = warps / d warps a channel when the row has fewer
// channels than the block has warps, their partials added in order); part[n][c] = {sdx, sdy}
// when part is non-null (dweight/dbias, summed over the samples by group_norm_params_kernel).
// Then, with g = dy * w[c]: mean(g) = sum_c w[c] sdy_c / (d s), mean(g xhat) likewise from
// sdx, and dx = rstd * (g - mean(g) - xhat * mean(g xhat)) when dx is non-null.
template <typename T, typename G, typename A, int V>
__global__ void __launch_bounds__(kRowMaxThreads)
    group_norm_bwd_kernel(T* __restrict__ dx, A* __restrict__ part, const G* __restrict__ dy,
                          const T* __restrict__ x, const A* __restrict__ mean,
                          const A* __restrict__ rstd, const A* __restrict__ w, int64_t rows,
                          int64_t groups, int64_t d, int64_t s) {
  __shared__ A seg[2][32];
  const int nw = static_cast<int>(blockDim.x >> 5);
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const int64_t cols = d * s, packs = cols / V, sp = s / V;
  const int64_t k = d >= nw ? 1 : nw / d;  // warps a channel
  const int64_t c = d * groups;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * cols, c0 = (row % groups) * d, n = row / groups;
    const A m = mean[row], r = rstd[row];
    A tg = 0, tgx = 0;  // k == 1: this warp's channels' sum of w * sdy and w * sdx
    for (int64_t q = warp; q < d * k; q += nw) {
      const int64_t ch = q / k, p = q - ch * k;
      const G* dyc = dy + base + ch * s;
      const T* xc = x + base + ch * s;
      A sdx = 0, sdy = 0;
      for (int64_t i = p * 32 + lane; i < sp; i += k * 32) {
        const Pack<G, V> pg = load_pack<V>(dyc, i);
        const Pack<T, V> px = load_pack<V>(xc, i);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const A g = static_cast<A>(load(pg.v[j]));
          sdy += g;
          sdx += g * math::xhat(static_cast<A>(load(px.v[j])), m, r);
        }
      }
      sdx = warp_sum(sdx);
      sdy = warp_sum(sdy);
      if (k == 1) {
        if (part && lane == 0) {
          part[(n * c + c0 + ch) * 2] = sdx;
          part[(n * c + c0 + ch) * 2 + 1] = sdy;
        }
        const A wc = w ? w[c0 + ch] : A(1);
        tg += wc * sdy;
        tgx += wc * sdx;
      } else if (lane == 0) {
        seg[0][q] = sdx;
        seg[1][q] = sdy;
      }
    }
    if (k == 1 && lane == 0) {
      seg[0][warp] = tgx;
      seg[1][warp] = tg;
    }
    __syncthreads();
    // Every thread adds the same values in the same order: the row's sum of g and g * xhat.
    A sg = 0, sgx = 0;
    if (k == 1) {
      for (int i = 0; i < nw; ++i) {
        sgx += seg[0][i];
        sg += seg[1][i];
      }
    } else {
      for (int64_t ch = 0; ch < d; ++ch) {
        A sdx = 0, sdy = 0;
        for (int64_t p = 0; p < k; ++p) {
          sdx += seg[0][ch * k + p];
          sdy += seg[1][ch * k + p];
        }
        if (part && threadIdx.x == ch) {
          part[(n * c + c0 + ch) * 2] = sdx;
          part[(n * c + c0 + ch) * 2 + 1] = sdy;
        }
        const A wc = w ? w[c0 + ch] : A(1);
        sg += wc * sdy;
        sgx += wc * sdx;
      }
    }
    __syncthreads();  // seg is free for the next row
    if (!dx) continue;
    const A inv = cols > 0 ? A(1) / static_cast<A>(cols) : A(0);
    const A mg = sg * inv, mgx = sgx * inv;
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      const int64_t ch = c0 + i / sp;
      const A wc = w ? w[ch] : A(1);
      const Pack<G, V> pg = load_pack<V>(dy + base, i);
      const Pack<T, V> px = load_pack<V>(x + base, i);
      Pack<T, V> po;
#pragma unroll
      for (int j = 0; j < V; ++j)
        po.v[j] =
            store<T>(math::norm_input_grad(r, static_cast<A>(load(pg.v[j])) * wc, mg,
                                           math::xhat(static_cast<A>(load(px.v[j])), m, r), mgx));
      store_pack<V>(dx + base, i, po);
    }
  }
}

// dweight[c] = sum over the samples of part[n][c][0], dbias[c] of part[n][c][1], in order.
template <typename A>
__global__ void group_norm_params_kernel(A* __restrict__ dw, A* __restrict__ db,
                                         const A* __restrict__ part, int64_t n, int64_t c) {
  for (int64_t ch = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; ch < c;
       ch += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    A sw = 0, sb = 0;
    for (int64_t b = 0; b < n; ++b) {
      sw += part[(b * c + ch) * 2];
      sb += part[(b * c + ch) * 2 + 1];
    }
    if (dw) dw[ch] = sw;
    if (db) db[ch] = sb;
  }
}

// ------------------------------------------------------------------ launchers

void layer_norm(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                const Tensor& weight, const Tensor& bias, int64_t rows, int64_t cols, double eps,
                const Tensor& residual, const Tensor& sum) {
  const char* name = mean.defined() ? "layer_norm" : "rms_norm";
  if (rows <= 0) return;
  NvtxRange range(name);
  const int dev = x.device().index;
  expect_forward(name, dev, out.dtype(), out, x, mean, {&rstd, "rstd"}, weight, bias);
  const bool add = residual.defined();
  if (add) {
    expect_cuda(name, dev, {{&residual, "residual"}, {&sum, "sum"}});
    if (sum.dtype() != x.dtype() ||
        (residual.dtype() != x.dtype() && residual.dtype() != out.dtype()))
      throw std::invalid_argument(std::string("add_layer_norm (CUDA): residual ") +
                                  dtype_name(residual.dtype()) + " and sum " +
                                  dtype_name(sum.dtype()) + " must have the input's dtype " +
                                  dtype_name(x.dtype()) + " (the residual may also have out's, " +
                                  dtype_name(out.dtype()) + ")");
  }
  DeviceGuard guard(dev);
  const int threads = row_threads(cols);
  const auto grid = static_cast<unsigned>(std::min(rows, kMaxGrid));
  dispatch_row_pair(x.dtype(), out.dtype(), name, [&]<typename HT, typename HO>() {
    using T = dev_t<HT>;
    using O = dev_t<HO>;
    using A = acc_t<HT>;
    // The residual in T or O (R), or none.
    auto with_residual = [&]<typename R>() {
      const R* res = add ? ptr<const R>(residual) : nullptr;
      T* sp = add ? ptr<T>(sum) : nullptr;
      // Rows that fit a warp's registers (GPT's 768): the one-read warp kernel.
      constexpr int V = static_cast<int>(16 / sizeof(T));
      const auto at = [](const void* p, size_t bytes) {
        return reinterpret_cast<uintptr_t>(p) % bytes == 0;
      };
      const bool aligned = at(x.data_ptr(), 16) && at(out.data_ptr(), sizeof(O) * V) &&
                           (!add || (at(res, sizeof(R) * V) && at(sp, 16)));
      if (aligned && cols > 0 && cols % V == 0 && cols <= 32 * V * 8) {
        const int64_t packs_per_lane = (cols / V + 31) / 32;
        const auto wgrid = static_cast<unsigned>(std::min<int64_t>((rows + 7) / 8, kMaxGrid));
        auto go = [&]<int K>() {
          layer_norm_fwd_warp_kernel<T, O, A, K, R><<<wgrid, 256, 0, stream(dev)>>>(
              ptr<O>(out), ptr<A>(mean), ptr<A>(rstd), ptr<const T>(x), ptr<const A>(weight),
              ptr<const A>(bias), rows, static_cast<int>(cols), static_cast<A>(eps), res, sp);
        };
        if (packs_per_lane <= 1)
          go.template operator()<1>();
        else if (packs_per_lane <= 2)
          go.template operator()<2>();
        else if (packs_per_lane <= 4)
          go.template operator()<4>();
        else
          go.template operator()<8>();
        check_launch(name);
        return;
      }
      const T* src = ptr<const T>(x);
      if (add) {  // the sum first, then the block kernel normalizes it
        const int64_t n = rows * cols;
        const auto agrid = static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, kMaxGrid));
        add_rows_kernel<T, R, A><<<agrid, 256, 0, stream(dev)>>>(sp, src, res, n);
        check_launch(name);
        src = sp;
      }
      layer_norm_fwd_kernel<T, O, A><<<grid, threads, 0, stream(dev)>>>(
          ptr<O>(out), ptr<A>(mean), ptr<A>(rstd), src, ptr<const A>(weight), ptr<const A>(bias),
          rows, cols, static_cast<A>(eps));
      check_launch(name);
    };
    if (!add || residual.dtype() == x.dtype())
      with_residual.template operator()<T>();
    else
      with_residual.template operator()<O>();
  });
}

void layer_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                         const Tensor& weight, int64_t rows, int64_t cols, const Tensor& dx_add,
                         const Tensor& dx_low) {
  const char* name = mean.defined() ? "layer_norm_backward" : "rms_norm_backward";
  const bool params = dweight.defined() || dbias.defined();
  if (!dx.defined() && !params) return;
  NvtxRange range(name);
  const int dev = x.device().index;
  const DType stat = stat_dtype(x.dtype());
  expect_backward(name, dev, x.dtype(), dy.dtype(), dx, dweight, dbias, dy, x, mean,
                  {&rstd, "rstd"}, weight);
  if (dx_add.defined()) {
    expect_cuda(name, dev, {{&dx_add, "dx_add"}});
    expect_dtype(name, x.dtype(), {{&dx_add, "dx_add"}});
  }
  if (dx_low.defined()) {
    expect_cuda(name, dev, {{&dx_low, "dx_low"}});
    expect_dtype(name, dy.dtype(), {{&dx_low, "dx_low"}});
  }
  DeviceGuard guard(dev);
  const cudaStream_t st = stream(dev);
  const int threads = row_threads(cols);
  dispatch_row_pair(x.dtype(), dy.dtype(), name, [&]<typename HT, typename HG>() {
    using T = dev_t<HT>;
    using G = dev_t<HG>;
    using A = acc_t<HT>;
    // dweight/dbias partials: one [2][cols] row per block of the row kernel.
    const bool want_params = params && cols > 0;
    int64_t nparts = 0;
    Tensor part;
    bool smem = false;
    size_t smem_bytes = 0;
    if (want_params && rows > 0) {
      nparts = norm_launch::layer_norm_backward_parts(rows, cols, sm_count(dev));
      part = alloc_scratch(nparts * 2 * cols, stat, x.device());
      smem_bytes = static_cast<size_t>(2 * cols) * sizeof(A);
      smem = smem_bytes <= kMaxSmemAcc;
      if (!smem) smem_bytes = 0;
    }
    if (rows > 0 && cols > 0) {
      const auto grid = static_cast<unsigned>(want_params ? nparts : std::min(rows, kMaxGrid));
      // Rows of whole 16-byte packs, one pack a thread: the register kernel.
      constexpr int V = static_cast<int>(16 / sizeof(T));
      const auto aligned = [](const Tensor& t, size_t bytes) {
        return !t.defined() || reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0;
      };
      const T* dxa = dx.defined() && dx_add.defined() ? ptr<const T>(dx_add) : nullptr;
      G* dxl = dx.defined() && dx_low.defined() ? ptr<G>(dx_low) : nullptr;
      if (cols % V == 0 && cols / V <= kRowMaxThreads && aligned(x, 16) && aligned(dx, 16) &&
          aligned(dy, sizeof(G) * V) && aligned(dx_add, 16) && aligned(dx_low, sizeof(G) * V)) {
        const int pack_threads = static_cast<int>((cols / V + 31) / 32 * 32);
        layer_norm_bwd_pack_kernel<T, G, A, V><<<grid, pack_threads, 0, st>>>(
            ptr<T>(dx), ptr<A>(part), ptr<const G>(dy), ptr<const T>(x), ptr<const A>(mean),
            ptr<const A>(rstd), ptr<const A>(weight), rows, static_cast<int>(cols), dxa, dxl);
      } else {
        layer_norm_bwd_kernel<T, G, A><<<grid, threads, smem_bytes, st>>>(
            ptr<T>(dx), ptr<A>(part), smem, ptr<const G>(dy), ptr<const T>(x), ptr<const A>(mean),
            ptr<const A>(rstd), ptr<const A>(weight), rows, cols, dxa, dxl);
      }
      check_launch(name);
    }
    if (want_params) {
      const auto tiles =
          static_cast<unsigned>(std::min<int64_t>((cols + kTileCols - 1) / kTileCols, 65535 * 8));
      layer_norm_bwd_params_kernel<A><<<tiles, dim3(kTileCols, kTileParts), 0, st>>>(
          ptr<A>(dweight), ptr<A>(dbias), ptr<const A>(part), nparts, cols);
      check_launch(name);
    }
  });
}

void batch_norm_stats(const Tensor& mean, const Tensor& var, const Tensor& invstd, const Tensor& x,
                      double eps, const Tensor& running_mean, const Tensor& running_var,
                      double momentum) {
  constexpr const char* name = "batch_norm_stats";
  const NCS d = ncs(x);
  const int64_t n = d.n, c = d.c, s = d.s;
  if (c == 0) return;
  NvtxRange range(name);
  const int dev = x.device().index;
  expect_cuda(name, dev, {{&mean, "mean"}, {&var, "var"}, {&invstd, "invstd"}, {&x, "input"}});
  expect_dtype(name, stat_dtype(x.dtype()), {{&mean, "mean"}, {&var, "var"}, {&invstd, "invstd"}});
  if (running_mean.defined() != running_var.defined())
    throw std::invalid_argument("batch_norm_stats: running_mean and running_var go together");
  expect_cuda(name, dev, {{&running_mean, "running_mean"}, {&running_var, "running_var"}});
  expect_dtype(name, stat_dtype(x.dtype()),
               {{&running_mean, "running_mean"}, {&running_var, "running_var"}});
  DeviceGuard guard(dev);
  const cudaStream_t st = stream(dev);
  const int64_t count = n * s;
  const bool last = bn_channels_last(x);
  const int splits =
      last ? norm_launch::bn_splits_nhwc(c, count, sm_count(dev)) : bn_splits(c, count, dev);
  const Tensor part = alloc_scratch(c * splits * 2, DType::float64, x.device());
  const dim3 grid(static_cast<unsigned>(c), static_cast<unsigned>(splits));
  TALLY_DISPATCH_FLOAT(x.dtype(), name, [&] {
    using T = dev_t<scalar_t>;
    using A = acc_t<scalar_t>;
    const bool small = fits_u32(n * c * s);
    auto go_last = [&](auto width) {
      constexpr int V = decltype(width)::value;
      with_index(small, [&](auto index) {
        using I = typename decltype(index)::type;
        bn_stats_partial_nhwc_kernel<T, I, V><<<nhwc_grid(c / V, splits), kBnThreads, 0, st>>>(
            ptr<double>(part), ptr<const T>(x), static_cast<I>(count), static_cast<I>(c));
      });
    };
    auto go = [&](auto width) {
      constexpr int V = decltype(width)::value;
      with_index(small, [&](auto index) {
        using I = typename decltype(index)::type;
        bn_stats_partial_kernel<T, I, V>
            <<<grid, kBnThreads, 0, st>>>(ptr<double>(part), ptr<const T>(x), static_cast<I>(n),
                                          static_cast<I>(c), static_cast<I>(s));
      });
    };
    if (last)
      with_bn_width_last(c, sizeof(T), {x.data_ptr()}, go_last);
    else
      with_bn_width(s, sizeof(T), {x.data_ptr()}, go);
    check_launch(name);
    bn_stats_finalize_kernel<T, A><<<warp_blocks(c), kEltThreads, 0, st>>>(
        ptr<A>(mean), ptr<A>(var), ptr<A>(invstd), ptr<const double>(part), ptr<const T>(x), n, c,
        s, last ? 1 : s, splits, eps, ptr<A>(running_mean), ptr<A>(running_var), momentum);
    check_launch(name);
  });
}

void batch_norm_elemt(const Tensor& out, const Tensor& x, const Tensor& mean, const Tensor& invstd,
                      const Tensor& weight, const Tensor& bias) {
  constexpr const char* name = "batch_norm_elemt";
  const NCS d = ncs(x);
  const int64_t c = d.c, s = d.s, total = d.n * d.c * d.s;
  if (total == 0) return;
  NvtxRange range(name);
  const int dev = x.device().index;
  expect_forward(name, dev, x.dtype(), out, x, mean, {&invstd, "invstd"}, weight, bias);
  DeviceGuard guard(dev);
  const cudaStream_t st = stream(dev);
  const bool last = bn_channels_last(x);
  if (last != bn_channels_last(out))
    throw std::invalid_argument("batch_norm_elemt (CUDA): input and out differ in layout");
  TALLY_DISPATCH_FLOAT(x.dtype(), name, [&] {
    using T = dev_t<scalar_t>;
    using A = acc_t<scalar_t>;
    auto go_last = [&](auto width) {
      constexpr int V = decltype(width)::value;
      const int64_t cv = c / V, rows = total / c;
      const unsigned blocks = nhwc_walk_blocks(total / V, cv, dev);
      with_index(fits_u32(total), [&](auto index) {
        using I = typename decltype(index)::type;
        bn_elemt_nhwc_kernel<T, A, I, V><<<blocks, kEltThreads, 0, st>>>(
            ptr<T>(out), ptr<const T>(x), ptr<const A>(mean), ptr<const A>(invstd),
            ptr<const A>(weight), ptr<const A>(bias), static_cast<I>(rows), static_cast<I>(cv));
      });
    };
    auto go = [&](auto width) {
      constexpr int V = decltype(width)::value;
      const int64_t tv = total / V, sv = s / V;  // in packs
      with_index(fits_u32(total), [&](auto index) {
        using I = typename decltype(index)::type;
        bn_elemt_kernel<T, A, I, V><<<elt_blocks(tv), kEltThreads, 0, st>>>(
            ptr<T>(out), ptr<const T>(x), ptr<const A>(mean), ptr<const A>(invstd),
            ptr<const A>(weight), ptr<const A>(bias), static_cast<I>(tv), static_cast<I>(c),
            static_cast<I>(sv));
      });
    };
    if (last)
      with_bn_width_last(c, sizeof(T), {out.data_ptr(), x.data_ptr()}, go_last);
    else
      with_bn_width(s, sizeof(T), {out.data_ptr(), x.data_ptr()}, go);
    check_launch(name);
  });
}

void batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& mean,
                         const Tensor& invstd, const Tensor& weight, bool training) {
  constexpr const char* name = "batch_norm_backward";
  const NCS d = ncs(dy);
  const int64_t n = d.n, c = d.c, s = d.s;
  if (c == 0 || (!dx.defined() && !dweight.defined() && !dbias.defined())) return;
  NvtxRange range(name);
  const int dev = dy.device().index;
  const DType stat = stat_dtype(dy.dtype());
  expect_backward(name, dev, dy.dtype(), dy.dtype(), dx, dweight, dbias, dy, x, mean,
                  {&invstd, "invstd"}, weight);
  const int64_t count = n * s, total = n * c * s;
  const bool need_xhat = dweight.defined() || (dx.defined() && training);
  const bool need_sums = dbias.defined() || need_xhat;
  if (need_xhat && (!x.defined() || !mean.defined()))
    throw std::invalid_argument(std::string(name) +
                                " (CUDA): the input and mean are needed for these gradients but "
                                "are undefined");
  DeviceGuard guard(dev);
  const cudaStream_t st = stream(dev);
  const bool small = fits_u32(total);
  const bool last = bn_channels_last(dy);
  for (const Tensor* t : {&dx, &x})
    if (t->defined() && bn_channels_last(*t) != last)
      throw std::invalid_argument(
          "batch_norm_backward (CUDA): grad_output, input and dx differ in layout");
  TALLY_DISPATCH_FLOAT(dy.dtype(), name, [&] {
    using T = dev_t<scalar_t>;
    using A = acc_t<scalar_t>;
    Tensor coef;  // [c][2] in A: mean(dy), mean(dy * xhat) (training dx only)
    if (need_sums) {
      const int splits =
          last ? norm_launch::bn_splits_nhwc(c, count, sm_count(dev)) : bn_splits(c, count, dev);
      const Tensor part = alloc_scratch(c * splits * 2, DType::float64, dy.device());
      if (dx.defined() && training) coef = alloc_scratch(c * 2, stat, dy.device());
      const dim3 grid(static_cast<unsigned>(c), static_cast<unsigned>(splits));
      auto go_last = [&](auto width) {
        constexpr int V = decltype(width)::value;
        with_index(small, [&](auto index) {
          using I = typename decltype(index)::type;
          bn_bwd_partial_nhwc_kernel<T, A, I, V><<<nhwc_grid(c / V, splits), kBnThreads, 0, st>>>(
              ptr<double>(part), ptr<const T>(dy), ptr<const T>(x), ptr<const A>(mean),
              ptr<const A>(invstd), need_xhat, static_cast<I>(count), static_cast<I>(c));
        });
      };
      auto go = [&](auto width) {
        constexpr int V = decltype(width)::value;
        with_index(small, [&](auto index) {
          using I = typename decltype(index)::type;
          bn_bwd_partial_kernel<T, A, I, V><<<grid, kBnThreads, 0, st>>>(
              ptr<double>(part), ptr<const T>(dy), ptr<const T>(x), ptr<const A>(mean),
              ptr<const A>(invstd), need_xhat, static_cast<I>(n), static_cast<I>(c),
              static_cast<I>(s));
        });
      };
      if (last)
        with_bn_width_last(c, sizeof(T), {dy.data_ptr(), need_xhat ? x.data_ptr() : nullptr},
                           go_last);
      else
        with_bn_width(s, sizeof(T), {dy.data_ptr(), need_xhat ? x.data_ptr() : nullptr}, go);
      check_launch(name);
      bn_bwd_finalize_kernel<A><<<warp_blocks(c), kEltThreads, 0, st>>>(
          ptr<A>(dweight), ptr<A>(dbias), ptr<A>(coef), ptr<const double>(part), c, splits, count);
      check_launch(name);
    }
    if (dx.defined() && total > 0) {
      auto go_last = [&](auto width) {
        constexpr int V = decltype(width)::value;
        const int64_t cv = c / V, rows = total / c;
        const unsigned blocks = nhwc_walk_blocks(total / V, cv, dev);
        with_index(small, [&](auto index) {
          using I = typename decltype(index)::type;
          bn_bwd_dx_nhwc_kernel<T, A, I, V><<<blocks, kEltThreads, 0, st>>>(
              ptr<T>(dx), ptr<const T>(dy), ptr<const T>(x), ptr<const A>(mean),
              ptr<const A>(invstd), ptr<const A>(weight), ptr<const A>(coef), static_cast<I>(rows),
              static_cast<I>(cv));
        });
      };
      auto go = [&](auto width) {
        constexpr int V = decltype(width)::value;
        const int64_t tv = total / V, sv = s / V;  // in packs
        with_index(small, [&](auto index) {
          using I = typename decltype(index)::type;
          bn_bwd_dx_kernel<T, A, I, V><<<elt_blocks(tv), kEltThreads, 0, st>>>(
              ptr<T>(dx), ptr<const T>(dy), ptr<const T>(x), ptr<const A>(mean),
              ptr<const A>(invstd), ptr<const A>(weight), ptr<const A>(coef), static_cast<I>(tv),
              static_cast<I>(c), static_cast<I>(sv));
        });
      };
      const std::initializer_list<const void*> streamed = {dx.data_ptr(), dy.data_ptr(),
                                                           coef.defined() ? x.data_ptr() : nullptr};
      if (last)
        with_bn_width_last(c, sizeof(T), streamed, go_last);
      else
        with_bn_width(s, sizeof(T), streamed, go);
      check_launch(name);
    }
  });
}

// The group_norm kernels' fast path: packs of V = 16 / (the widest streamed element) elements
// when the plane size s is a multiple of V (no pack straddles two channels) and every streamed
// tensor (pointer, element size) is aligned to its pack; otherwise one element at a time (odd
// planes such as 7x7 or 5x5, views off their allocation's start).
bool group_norm_packed_applies(int64_t s, int v,
                               std::initializer_list<std::pair<const void*, size_t>> ts) {
  if (s % v != 0) return false;
  for (const auto& [p, elem] : ts)
    if (p && reinterpret_cast<uintptr_t>(p) % (elem * static_cast<size_t>(v)) != 0) return false;
  return true;
}

// go(std::integral_constant<int, V>{}) with V = 16 / max(sizeof(T), sizeof(O)) where
// group_norm_packed_applies, else 1.
template <typename T, typename O, typename F>
void with_gn_width(int64_t s, std::initializer_list<std::pair<const void*, size_t>> ts, F&& go) {
  constexpr int kV = static_cast<int>(16 / std::max(sizeof(T), sizeof(O)));
  if (group_norm_packed_applies(s, kV, ts))
    go(std::integral_constant<int, kV>{});
  else
    go(std::integral_constant<int, 1>{});
}

void group_norm(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                const Tensor& weight, const Tensor& bias, int64_t groups, double eps) {
  constexpr const char* name = "group_norm";
  const NCS d = ncs(x);
  const int64_t rows = d.n * groups, per = d.c / groups;
  if (rows <= 0) return;
  NvtxRange range(name);
  const int dev = x.device().index;
  expect_forward(name, dev, out.dtype(), out, x, mean, {&rstd, "rstd"}, weight, bias);
  DeviceGuard guard(dev);
  const int threads = row_threads(per * d.s);
  const auto grid = static_cast<unsigned>(std::min(rows, kMaxGrid));
  dispatch_widened_pair(x.dtype(), out.dtype(), name, [&]<typename HT, typename HO>() {
    using T = dev_t<HT>;
    using O = dev_t<HO>;
    using A = acc_t<HT>;
    with_gn_width<T, O>(
        d.s, {{x.data_ptr(), sizeof(T)}, {out.data_ptr(), sizeof(O)}}, [&](auto width) {
          constexpr int V = decltype(width)::value;
          group_norm_fwd_kernel<T, O, A, V><<<grid, threads, 0, stream(dev)>>>(
              ptr<O>(out), ptr<A>(mean), ptr<A>(rstd), ptr<const T>(x), ptr<const A>(weight),
              ptr<const A>(bias), rows, groups, per, d.s, static_cast<A>(eps));
        });
    check_launch(name);
  });
}

void group_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                         const Tensor& weight, int64_t groups) {
  constexpr const char* name = "group_norm_backward";
  const NCS d = ncs(x);
  const int64_t rows = d.n * groups, per = d.c / groups;
  const bool params = dweight.defined() || dbias.defined();
  if (d.c == 0 || (!dx.defined() && !params)) return;
  NvtxRange range(name);
  const int dev = x.device().index;
  expect_backward(name, dev, x.dtype(), dy.dtype(), dx, dweight, dbias, dy, x, mean,
                  {&rstd, "rstd"}, weight);
  DeviceGuard guard(dev);
  const cudaStream_t st = stream(dev);
  dispatch_widened_pair(x.dtype(), dy.dtype(), name, [&]<typename HT, typename HG>() {
    using T = dev_t<HT>;
    using G = dev_t<HG>;
    using A = acc_t<HT>;
    Tensor part;
    if (params && rows > 0)
      part = alloc_scratch(norm_launch::group_norm_backward_partials(d.n, d.c),
                           stat_dtype(x.dtype()), x.device());
    if (rows > 0) {
      const int threads = row_threads(per * d.s);
      const auto grid = static_cast<unsigned>(std::min(rows, kMaxGrid));
      with_gn_width<T, G>(d.s,
                          {{dx.defined() ? dx.data_ptr() : nullptr, sizeof(T)},
                           {dy.data_ptr(), sizeof(G)},
                           {x.data_ptr(), sizeof(T)}},
                          [&](auto width) {
                            constexpr int V = decltype(width)::value;
                            group_norm_bwd_kernel<T, G, A, V><<<grid, threads, 0, st>>>(
                                ptr<T>(dx), ptr<A>(part), ptr<const G>(dy), ptr<const T>(x),
                                ptr<const A>(mean), ptr<const A>(rstd), ptr<const A>(weight), rows,
                                groups, per, d.s);
                          });
      check_launch(name);
    }
    if (params) {
      group_norm_params_kernel<A><<<elt_blocks(d.c), kEltThreads, 0, st>>>(
          ptr<A>(dweight), ptr<A>(dbias), ptr<const A>(part), d.n, d.c);
      check_launch(name);
    }
  });
}

}  // namespace

const NormKernels norm_kernels{TALLY_NORM_KERNELS};

}  // namespace tally::cuda
