// CUDA-only settings and test hooks of 2-D convolution through cuDNN (CUDA builds only).
// The kernels themselves are reached through the family's table (tensor/conv/kernels.h:
// cuda::conv_kernels); this header holds what users and tests call besides: the cuDNN
// switches (re-exported from tensor/cuda/cudnn.h), the algorithm/plan caches, and the
// batch-split hook. See tensor/conv/cuda_conv.cpp for how algorithms are chosen.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tensor/conv/kernels.h"
#include "tensor/cuda/cudnn.h"  // set_cudnn_benchmark, set_cudnn_allow_tf32

namespace tally::cuda {

// The number of (key -> ranked algorithms) entries of the legacy API cached so far, of
// execution plans of the backend route (the default with cudnn_benchmark() off), and a way
// to drop both.
size_t conv_algorithm_cache_size();
size_t conv_plan_cache_size();
void clear_conv_algorithm_cache();
// The calls planned so far on the default route, each with its plan's workspace: what
// bench/record_workspaces writes into a CUDA target's table for the meta kernels.
std::vector<ConvWorkspace> conv_planned_workspaces();

// cuDNN's legacy API takes int-sized tensors: a batch whose input or output has more than
// this many elements runs as several calls over slices of the batch (default INT32_MAX).
// Exposed so tests can exercise the split on small tensors; n <= 0 restores the default.
void set_conv_max_call_elements(int64_t n);

}  // namespace tally::cuda
