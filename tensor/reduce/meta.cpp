// Meta kernels of the reduce family (tensor/meta/target.h): neither backend's reductions
// along dims allocate scratch; each costs the bytes it reads and writes.
#include "tensor/meta/target.h"
#include "tensor/reduce/kernels.h"

namespace tally::meta {

const ReduceKernels reduce_kernels = all_nothing<ReduceKernels>();

}  // namespace tally::meta
