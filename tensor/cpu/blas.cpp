#include "tensor/cpu/blas.h"

#include <cblas.h>

#include <algorithm>
#include <type_traits>

#include "tensor/cpu/parallel.h"

namespace tally::cpu {

namespace {

#if defined(_OPENMP)
// At load: OpenBLAS's own threads spin a while after their last product before they sleep.
const bool openblas_single_threaded = (openblas_set_num_threads(1), true);
#endif

// FLOPs below which a panel is not worth a thread (about 0.1 ms of one core's products).
constexpr double kPanelFlops = 4e6;

template <typename T>
void blas(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  const auto ta = trans_a ? CblasTrans : CblasNoTrans;
  const auto tb = trans_b ? CblasTrans : CblasNoTrans;
  const auto i = [](int64_t v) { return static_cast<blasint>(std::max<int64_t>(v, 1)); };
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, ta, tb, i(m), i(n), i(k), alpha, a, i(lda), b, i(ldb), beta, c,
                i(ldc));
  else
    cblas_dgemm(CblasRowMajor, ta, tb, i(m), i(n), i(k), alpha, a, i(lda), b, i(ldb), beta, c,
                i(ldc));
}

}  // namespace

template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {  // an empty sum: C = beta * C
    for (int64_t r = 0; r < m; ++r)
      for (int64_t col = 0; col < n; ++col)
        c[r * ldc + col] = beta == T(0) ? T(0) : beta * c[r * ldc + col];
    return;
  }
  // Panels of the longer side, each at least kPanelFlops (parallel_for keeps a small product in
  // this thread).
  const double per_row = 2.0 * static_cast<double>(std::min(m, n)) * static_cast<double>(k);
  const int64_t grain = std::max<int64_t>(8, static_cast<int64_t>(kPanelFlops / per_row) + 1);
  if (m >= n) {
    parallel_for(m, grain, [&](int64_t r0, int64_t r1) {
      blas<T>(trans_a, trans_b, r1 - r0, n, k, alpha, a + (trans_a ? r0 : r0 * lda), lda, b, ldb,
              beta, c + r0 * ldc, ldc);
    });
  } else {
    parallel_for(n, grain, [&](int64_t c0, int64_t c1) {
      blas<T>(trans_a, trans_b, m, c1 - c0, k, alpha, a, lda, b + (trans_b ? c0 * ldb : c0), ldb,
              beta, c + c0, ldc);
    });
  }
}

template void gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                          const float*, int64_t, float, float*, int64_t);
template void gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*, int64_t,
                           const double*, int64_t, double, double*, int64_t);

}  // namespace tally::cpu
