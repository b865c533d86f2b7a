// Meta kernels of the pool family (tensor/meta/target.h): neither backend's pooling
// kernels allocate scratch.
#include "tensor/meta/target.h"
#include "tensor/pool/kernels.h"

namespace tally::meta {

const PoolKernels pool_kernels{.max_pool2d_forward = nothing,
                               .max_pool2d_backward = nothing,
                               .avg_pool2d_forward = nothing,
                               .avg_pool2d_backward = nothing,
                               .adaptive_avg_pool2d_forward = nothing,
                               .adaptive_avg_pool2d_backward = nothing};

}  // namespace tally::meta
