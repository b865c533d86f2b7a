// The number of threads the CPU kernels' parallel loops use (tensor/cpu/parallel.h), for
// tests and programs that want to choose it; OMP_NUM_THREADS sets it from outside.
#pragma once

namespace tally::cpu {

// OpenMP's thread count for the calling thread's parallel loops (OMP_NUM_THREADS, else the
// cores); 1 when tally_tensor was built without OpenMP.
int num_threads();

// Sets that count for the calling thread's later kernels (n >= 1); nothing without OpenMP.
void set_num_threads(int n);

}  // namespace tally::cpu
