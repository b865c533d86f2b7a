// Meta kernels of the recurrent-cell family (tensor/meta/target.h): neither backend's cell
// kernels allocate scratch; each costs the bytes it reads and writes.
#include "tensor/meta/target.h"
#include "tensor/rnn/kernels.h"

namespace tally::meta {

const RnnKernels rnn_kernels = all_nothing<RnnKernels>();

}  // namespace tally::meta
