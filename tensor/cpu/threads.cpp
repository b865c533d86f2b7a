#include "tensor/cpu/threads.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace tally::cpu {

int num_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void set_num_threads(int n) {
#if defined(_OPENMP)
  if (n >= 1) omp_set_num_threads(n);
#else
  (void)n;
#endif
}

}  // namespace tally::cpu
