// CPU parallelism of the kernels: OpenMP over large loops only. tally_tensor compiles with
// OpenMP when CMake finds it (and not under TSan, whose runtime does not see into libgomp);
// without it every loop here runs serially in the calling thread, with the same results.
//
// Results never depend on the number of threads: parallel_for hands out ranges of
// independent work (each output written by one thread, computed as the serial loop computes
// it), and block_partials cuts a reduction into blocks of a fixed size, whatever the thread
// count, whose partial results the caller combines in order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

// `#pragma omp simd` on a loop where OpenMP is on (vectorized whatever -O2's cost model
// says); nothing otherwise.
#if defined(_OPENMP)
#define TALLY_SIMD _Pragma("omp simd")
#else
#define TALLY_SIMD
#endif

namespace tally::cpu {

// Elements (or element-sized units of work) below which a loop stays serial: starting
// threads costs a few microseconds, what about 32K elements of a memory-bound op take.
inline constexpr int64_t kParallelGrain = 32768;

// The grain in units of `per_unit` elements each (rows of a norm, planes of a pool): at
// least 1.
inline int64_t grain_of(int64_t per_unit) {
  return std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(1, per_unit));
}

// Calls fn(begin, end) on disjoint ranges covering [0, n), in parallel when n is at least
// 2 * grain (each thread gets at least `grain` units), else once over [0, n) in this thread.
// fn must not depend on how [0, n) is split. An exception from fn is rethrown here after
// every range has finished: the one of the lowest range, which the serial loop would have
// thrown first.
template <typename F>
void parallel_for(int64_t n, int64_t grain, F&& fn) {
  if (n <= 0) return;
#if defined(_OPENMP)
  const int64_t most = n / std::max<int64_t>(grain, 1);
  const int64_t threads = std::min<int64_t>(omp_get_max_threads(), most);
  if (threads >= 2 && !omp_in_parallel()) {
    std::vector<std::exception_ptr> errors(static_cast<size_t>(threads));
#pragma omp parallel num_threads(static_cast <int>(threads))
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t chunk = (n + nt - 1) / nt;
      const int64_t begin = std::min(n, t * chunk), end = std::min(n, begin + chunk);
      if (begin < end) {
        try {
          fn(begin, end);
        } catch (...) {
          errors[static_cast<size_t>(t)] = std::current_exception();
        }
      }
    }
    for (const std::exception_ptr& e : errors)
      if (e) std::rethrow_exception(e);
    return;
  }
#else
  (void)grain;
#endif
  fn(int64_t{0}, n);
}

// A reduction over [0, n) cut into blocks of `block` units: returns partial[k] =
// fn(k * block, min(n, (k + 1) * block)) for each block k, computed in parallel when there
// are several. The blocks do not depend on the thread count, so neither does a result the
// caller combines from the partials in order; n <= block is one block, the serial loop.
template <typename R, typename F>
std::vector<R> block_partials(int64_t n, int64_t block, F&& fn) {
  const int64_t blocks = n <= 0 ? 0 : (n + block - 1) / block;
  std::vector<R> partial(static_cast<size_t>(blocks));
  parallel_for(blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      partial[static_cast<size_t>(b)] = fn(b * block, std::min(n, (b + 1) * block));
  });
  return partial;
}

}  // namespace tally::cpu
