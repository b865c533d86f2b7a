// Meta kernels of the recurrent-cell family (tensor/meta/target.h): neither backend's cell
// kernels allocate scratch; each costs the bytes it reads and writes. No whole-layer (cuDNN)
// entries.
#include "tensor/meta/target.h"
#include "tensor/rnn/kernels.h"

namespace tally::meta {

namespace {
constexpr RnnKernels table() {
  RnnKernels t = all_nothing<RnnKernels>();
  // No whole-layer kernel: a meta run replays the per-timestep path, whose allocations differ
  // from cuDNN's (docs/cudnn_rnn.md).
  t.cudnn_rnn_forward = nullptr;
  t.cudnn_rnn_backward = nullptr;
  return t;
}
}  // namespace

const RnnKernels rnn_kernels = table();

}  // namespace tally::meta
