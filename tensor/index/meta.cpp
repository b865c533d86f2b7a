// Meta kernels of the index family (tensor/meta/target.h): no kernel of either backend
// allocates scratch (the ops allocate what they need, the mask positions included); each
// costs the bytes it reads and writes.
#include "tensor/index/kernels.h"
#include "tensor/meta/target.h"

namespace tally::meta {

const IndexKernels index_kernels = all_nothing<IndexKernels>();

}  // namespace tally::meta
