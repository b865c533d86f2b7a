// Row-major matrix products through OpenBLAS, split over Tally's OpenMP threads.
//
// OpenBLAS runs single-threaded inside Tally (openblas_set_num_threads(1) when the library loads
// where tally_tensor has OpenMP): Debian's default OpenBLAS keeps pthreads of its own, and on a
// machine with as many cores as threads they and OpenMP's spinning threads took the cores from
// each other, a tiny MLP's training step measuring 57 ms at one thread and 88-320 ms at two.
// Here a large product is cut into row (or column) panels, one OpenBLAS call per thread; each
// output element is still one call's K-sum, so the bits do not depend on the thread count.
#pragma once

#include <cstdint>

namespace tally::cpu {

// C[m, n] = alpha * op(A) op(B) + beta * C, op = transpose where trans_a / trans_b; leading
// dimensions as BLAS takes them (row-major). k == 0 sets C = beta * C; m or n 0 does nothing.
template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
          int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

extern template void gemm<float>(bool, bool, int64_t, int64_t, int64_t, float, const float*,
                                 int64_t, const float*, int64_t, float, float*, int64_t);
extern template void gemm<double>(bool, bool, int64_t, int64_t, int64_t, double, const double*,
                                  int64_t, const double*, int64_t, double, double*, int64_t);

}  // namespace tally::cpu
