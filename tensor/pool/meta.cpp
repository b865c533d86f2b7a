// Meta kernels of the pool family (tensor/meta/target.h): neither backend's pooling
// kernels allocate scratch; each costs the bytes it reads and writes.
#include "tensor/meta/target.h"
#include "tensor/pool/kernels.h"

namespace tally::meta {

const PoolKernels pool_kernels = all_nothing<PoolKernels>();

}  // namespace tally::meta
