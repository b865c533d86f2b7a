// Row reductions on the device, shared by the reduce and softmax families: a "row" is the
// set of elements reduced into one output (the reduced dims under one position of the kept
// dims). A block walks tiles of rows; each row of a tile is walked by a group of lanes:
//   thread  a thread walks a whole row (256 rows a tile): for strided rows with few
//           elements (the spatial [N, C, d] losses), neighbouring threads read
//           neighbouring rows, so the loads coalesce across the warp;
//   warp    a warp per row (8 rows a tile): short contiguous rows;
//   block   512 threads per row (1 row a tile): long contiguous rows (a 50257-wide
//           vocabulary);
//   column  16 lanes per row, 32 rows a tile, a warp holding one lane of 32 neighbouring
//           rows: strided rows (reducing a dim that is not the innermost), coalesced across
//           the warp, with 16-way parallelism along the row.
// Every block runs the same number of tiles (the loop bound is per block), so the block-wide
// group reductions are reached by all its threads; a row past the end is walked with no
// elements and writes nothing. Every group reduction leaves the result in all lanes of the
// group, identically (the combine ops are commutative and every lane combines the same
// tree), so lanes may branch on it.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "tensor/cuda/device_types.cuh"
#include "tensor/cuda/runtime.h"

namespace tally::cuda::rows {

enum class Mode { thread, warp, block, column };

inline constexpr int64_t kMaxGrid = 65535LL * 16;

template <Mode M>
struct Walk;

template <>
struct Walk<Mode::thread> {
  static constexpr int kThreads = 256, kRowsPerTile = 256, kLanes = 1;
  __device__ static int row_in_tile() { return static_cast<int>(threadIdx.x); }
  __device__ static int lane() { return 0; }
};
template <>
struct Walk<Mode::warp> {
  static constexpr int kThreads = 256, kRowsPerTile = 8, kLanes = 32;
  __device__ static int row_in_tile() { return static_cast<int>(threadIdx.x / 32); }
  __device__ static int lane() { return static_cast<int>(threadIdx.x % 32); }
};
template <>
struct Walk<Mode::block> {
  static constexpr int kThreads = 512, kRowsPerTile = 1, kLanes = 512;
  __device__ static int row_in_tile() { return 0; }
  __device__ static int lane() { return static_cast<int>(threadIdx.x); }
};
template <>
struct Walk<Mode::column> {
  static constexpr int kThreads = 512, kRowsPerTile = 32, kLanes = 16;
  __device__ static int row_in_tile() { return static_cast<int>(threadIdx.x % 32); }
  __device__ static int lane() { return static_cast<int>(threadIdx.x / 32); }
};

// Contiguous rows up to this long get a warp, longer ones a block.
inline constexpr int64_t kWarpRowMax = 1024;

// How to walk `rows` rows of `n` elements; `inner_contiguous` when consecutive elements of
// a row are adjacent in memory (the innermost reduced stride is 1).
inline Mode choose(int64_t rows, int64_t n, bool inner_contiguous) {
  if (n <= 1) return Mode::thread;
  if (!inner_contiguous) {
    if (n <= 32 && rows >= 1024) return Mode::thread;
    if (rows >= 32) return Mode::column;
  }
  return n <= kWarpRowMax ? Mode::warp : Mode::block;
}

// Calls launch(std::integral_constant<Mode, M>, grid) for the chosen mode; the kernel,
// templated on M, is launched with Walk<M>::kThreads threads a block.
template <typename L>
void launch_rows(Mode mode, int64_t rows, L&& launch) {
  // Each mode's grid: enough tiles for the rows, within the grid cap.
  auto launch_if = [&](auto mode_c) {
    constexpr Mode M = decltype(mode_c)::value;
    if (mode != M) return;
    constexpr int64_t per_tile = Walk<M>::kRowsPerTile;
    launch(mode_c, static_cast<unsigned>(
                       std::clamp<int64_t>((rows + per_tile - 1) / per_tile, 1, kMaxGrid)));
  };
  launch_if(std::integral_constant<Mode, Mode::thread>{});
  launch_if(std::integral_constant<Mode, Mode::warp>{});
  launch_if(std::integral_constant<Mode, Mode::block>{});
  launch_if(std::integral_constant<Mode, Mode::column>{});
}

// The rows of this block's tiles: for (RowIter<M> it(nrows); it.more(); it.next()) with
// it.row (valid when it.active). The bound is the same for all threads of a block.
template <Mode M>
struct RowIter {
  int64_t nrows;
  int64_t tile;
  int64_t row;
  bool active;
  __device__ explicit RowIter(int64_t n) : nrows(n), tile(blockIdx.x) { set(); }
  __device__ bool more() const { return tile * Walk<M>::kRowsPerTile < nrows; }
  __device__ void next() {
    tile += gridDim.x;
    set();
  }
  __device__ void set() {
    row = tile * Walk<M>::kRowsPerTile + Walk<M>::row_in_tile();
    active = row < nrows;
  }
};

// The row loop of a row kernel: body(it, o, len) for each row of this block's tiles, with o
// the row's operand offsets from kept (zeros for a row past the end) and len its n elements
// (0 for a row past the end: its lanes walk nothing but still join the group reductions).
template <Mode M, int N, typename Body>
__device__ __forceinline__ void for_each_row(int64_t nrows, int64_t n, const Indexer<N>& kept,
                                             Body&& body) {
  for (RowIter<M> it(nrows); it.more(); it.next()) {
    int64_t o[N] = {};
    if (it.active) kept.get(it.row, o);
    body(it, o, it.active ? n : 0);
  }
}

// A value and the (row-linear) index it came from; i < 0: no element yet.
template <typename V>
struct Pair {
  V v;
  int64_t i;
};

template <typename V>
__device__ __forceinline__ V shfl_xor(V v, int mask) {
  if constexpr (std::is_same_v<V, bool>) {
    return __shfl_xor_sync(0xffffffffu, static_cast<int>(v), mask) != 0;
  } else if constexpr (std::is_integral_v<V> && sizeof(V) == 8) {
    return static_cast<V>(__shfl_xor_sync(0xffffffffu, static_cast<long long>(v), mask));
  } else if constexpr (std::is_integral_v<V> && sizeof(V) == 4) {
    return static_cast<V>(__shfl_xor_sync(0xffffffffu, static_cast<int>(v), mask));
  } else {
    return __shfl_xor_sync(0xffffffffu, v, mask);
  }
}

template <typename V>
__device__ __forceinline__ Pair<V> shfl_xor(Pair<V> p, int mask) {
  return {shfl_xor(p.v, mask), shfl_xor(p.i, mask)};
}

template <typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = op(v, shfl_xor(v, m));
  return v;
}

// Combines v across the lanes of a row's group; every lane of the group gets the result.
// In the block and column walks every thread of the block must call it (it synchronises).
template <Mode M, typename V, typename Op>
__device__ __forceinline__ V group_reduce(V v, Op op) {
  if constexpr (M == Mode::thread) {
    return v;
  } else if constexpr (M == Mode::warp) {
    return warp_reduce(v, op);
  } else if constexpr (M == Mode::block) {
    constexpr int kWarps = Walk<M>::kThreads / 32;
    __shared__ V partial[kWarps];
    v = warp_reduce(v, op);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    V r = partial[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) r = op(r, partial[w]);
    __syncthreads();  // the buffer may be reused by the next call
    return r;
  } else {
    constexpr int kLanes = Walk<M>::kLanes, kRows = Walk<M>::kRowsPerTile;
    __shared__ V partial[kLanes][kRows + 1];
    const int row = Walk<M>::row_in_tile(), lane = Walk<M>::lane();
    partial[lane][row] = v;
    __syncthreads();
    V r = partial[0][row];
#pragma unroll
    for (int l = 1; l < kLanes; ++l) r = op(r, partial[l][row]);
    __syncthreads();
    return r;
  }
}

// A whole block (of `Threads` threads) adds v up; every thread gets the sum.
template <int Threads, typename V>
__device__ __forceinline__ V block_sum(V v) {
  static_assert(Threads % 32 == 0 && Threads <= 1024, "whole warps");
  __shared__ V partial[Threads / 32];
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += shfl_xor(v, m);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  V r = partial[0];
#pragma unroll
  for (int w = 1; w < Threads / 32; ++w) r += partial[w];
  __syncthreads();
  return r;
}

struct SumOp {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const {
    return a + b;
  }
};

// max ignoring NaN operands on the right (the running max starts at -inf and only NaN-free
// values enter it, as the CPU's `if (v > m) m = v`).
struct MaxOp {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const {
    return b > a ? b : a;
  }
};

template <typename V>
__device__ __forceinline__ bool is_nan(V v) {
  if constexpr (std::is_floating_point_v<V>)
    return isnan(v);
  else
    return false;
}

// The CPU's sequential rule for max/min with indices, for a lane walking its elements in
// increasing index order: v replaces best unless best is NaN; a NaN replaces any number;
// ties keep the earlier element.
template <bool IsMax, typename V>
__device__ __forceinline__ bool replaces(V v, V best) {
  if (is_nan(best)) return false;
  if (is_nan(v)) return true;
  if constexpr (IsMax)
    return v > best;
  else
    return v < best;
}

// The same order between two lanes' selections: a NaN beats any number, a larger (smaller)
// value beats a smaller (larger) one, and between equals the smaller index wins. It is
// commutative and associative, so any combining tree selects what the CPU selects.
template <bool IsMax>
struct SelectOp {
  template <typename V>
  __device__ __forceinline__ Pair<V> operator()(Pair<V> a, Pair<V> b) const {
    if (a.i < 0) return b;
    if (b.i < 0) return a;
    const bool an = is_nan(a.v), bn = is_nan(b.v);
    if (an || bn) {
      if (an && bn) return a.i < b.i ? a : b;
      return an ? a : b;
    }
    if (a.v == b.v) return a.i < b.i ? a : b;
    if constexpr (IsMax)
      return a.v > b.v ? a : b;
    else
      return a.v < b.v ? a : b;
  }
};

// Element offsets inside a row from its linear index: one strided dim (the common case, no
// division) or several through an Indexer.
struct RowOffsets {
  Indexer<1> ix;  // base 0
  __device__ __forceinline__ int64_t operator()(int64_t i) const {
    if (ix.ndim == 1) return i * ix.strides[0][0];
    if (ix.ndim == 0) return 0;
    int64_t o;
    ix.get(i, &o);
    return o;
  }
  // Whether consecutive row elements are adjacent in memory.
  bool inner_contiguous() const { return ix.ndim == 0 || ix.strides[0][ix.ndim - 1] == 1; }
};

inline RowOffsets row_offsets(const Shape& sizes, const Shape& strides) {
  return {make_indexer<1>(sizes, {&strides}, {0})};
}

}  // namespace tally::cuda::rows
