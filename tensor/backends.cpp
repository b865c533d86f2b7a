// The one registration point: every op family's kernel tables, by backend. Each family
// declares its kernel-table type and the backends' tables in tensor/<family>/kernels.h;
// each backend defines its table in its own files (cpu.cpp, cuda.cu), and a build without a
// backend gets nullptr from TALLY_CUDA_TABLE (tensor/dispatch.h). The fused optimizer
// kernels, a layer above, register the same way in optim/multi_tensor.cpp.
//
// Adding a backend: add its slot to Backends (tensor/dispatch.h) and one argument to each
// line below; see docs/architecture.md.
#include "tensor/attention/kernels.h"
#include "tensor/conv/kernels.h"
#include "tensor/elementwise/kernels.h"
#include "tensor/index/kernels.h"
#include "tensor/linalg/kernels.h"
#include "tensor/norm/kernels.h"
#include "tensor/pool/kernels.h"
#include "tensor/reduce/kernels.h"
#include "tensor/rnn/kernels.h"
#include "tensor/softmax/kernels.h"

namespace tally {

// clang-format off
const Backends<AttentionKernels>   attention_backends  {&cpu::attention_kernels,   TALLY_CUDA_TABLE(cuda::attention_kernels), &meta::attention_kernels};
const Backends<ConvKernels>        conv_backends       {&cpu::conv_kernels,        TALLY_CUDA_TABLE(cuda::conv_kernels), &meta::conv_kernels};
const Backends<ElementwiseKernels> elementwise_backends{&cpu::elementwise_kernels, TALLY_CUDA_TABLE(cuda::elementwise_kernels), &meta::elementwise_kernels};
const Backends<IndexKernels>       index_backends      {&cpu::index_kernels,       TALLY_CUDA_TABLE(cuda::index_kernels), &meta::index_kernels};
const Backends<LinalgKernels>      linalg_backends     {&cpu::linalg_kernels,      TALLY_CUDA_TABLE(cuda::linalg_kernels), &meta::linalg_kernels};
const Backends<NormKernels>        norm_backends       {&cpu::norm_kernels,        TALLY_CUDA_TABLE(cuda::norm_kernels), &meta::norm_kernels};
const Backends<PoolKernels>        pool_backends       {&cpu::pool_kernels,        TALLY_CUDA_TABLE(cuda::pool_kernels), &meta::pool_kernels};
const Backends<ReduceKernels>      reduce_backends     {&cpu::reduce_kernels,      TALLY_CUDA_TABLE(cuda::reduce_kernels), &meta::reduce_kernels};
const Backends<SoftmaxKernels>     softmax_backends    {&cpu::softmax_kernels,     TALLY_CUDA_TABLE(cuda::softmax_kernels), &meta::softmax_kernels};
const Backends<RnnKernels>         rnn_backends        {&cpu::rnn_kernels,         TALLY_CUDA_TABLE(cuda::rnn_kernels), &meta::rnn_kernels};
// clang-format on

}  // namespace tally
