// The CUDA side of tensor/pinned.h: a host-to-device copy from pinned memory enqueued on
// Tally's stream, with the pinned block recorded as in use by that stream.
#pragma once

#include "tensor/tensor.h"

namespace tally::cuda {

// A new contiguous tensor on `device` (allocated under the current context), filled from
// the contiguous pinned CPU tensor `host` by cudaMemcpyAsync on Tally's stream.
Tensor copy_pinned_to_device(const Tensor& host, Device device);

}  // namespace tally::cuda
