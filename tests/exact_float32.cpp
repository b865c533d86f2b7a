// Linked into every test binary: the suite runs float32 exactly on CUDA, so GPU results
// compare with the CPU kernels at float32 tolerance. cuDNN's TF32 (on by default in the
// library, like PyTorch's torch.backends.cudnn.allow_tf32) is switched off before any test
// runs; matmul's TF32 is already off by default. A test that wants TF32 turns it on for its
// own scope (see test_conv_cuda's Float32IsExactUnlessTf32IsAllowed).
#if defined(TALLY_WITH_CUDA)
#include "tensor/cuda/cudnn.h"

namespace {
const bool kExactFloat32 = [] {
  tally::cuda::set_cudnn_allow_tf32(false);
  return true;
}();
}  // namespace
#endif
