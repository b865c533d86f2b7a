// Meta kernels of the reduce family (tensor/meta/target.h): neither backend's reductions
// along dims allocate scratch.
#include "tensor/meta/target.h"
#include "tensor/reduce/kernels.h"

namespace tally::meta {

const ReduceKernels reduce_kernels{.max_dim = nothing,
                                   .min_dim = nothing,
                                   .amax = nothing,
                                   .amin = nothing,
                                   .var = nothing,
                                   .logsumexp = nothing,
                                   .value_selecting_reduction_backward = nothing};

}  // namespace tally::meta
