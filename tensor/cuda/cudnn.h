// cuDNN plumbing shared by the CUDA kernels that call it: the calling thread's handle per
// device (bound to Tally's stream), status checks that name the call, RAII descriptors,
// Tally dtype -> cuDNN dtype, and the `benchmark` switch (torch.backends.cudnn.benchmark).
#pragma once

#include <cudnn.h>

#include <string>

#include "tensor/dtype.h"

namespace tally::cuda {

// When on, convolutions time every algorithm once per (shapes, dtype, params) key with
// cudnnFind*AlgorithmEx (a host-blocking measurement, done once per key) and keep the
// fastest; when off (the default), cuDNN's heuristics (cudnnGet*Algorithm_v7) choose.
void set_cudnn_benchmark(bool enabled);
bool cudnn_benchmark();

// PyTorch's torch.backends.cudnn.allow_tf32: whether float32 convolutions may run on TF32
// tensor cores (CUDNN_DEFAULT_MATH) instead of exact FMA math (CUDNN_FMA_MATH). On by
// default, as in PyTorch (unlike matmul's allow_tf32, which is off): ~2x faster fp32
// convolutions at TF32's 10-bit mantissa. The test suite and equivalence_dump turn it off.
void set_cudnn_allow_tf32(bool allow);
bool cudnn_allow_tf32();

// Throws std::runtime_error "`call`: <cuDNN's message> (<context>)" unless status is success.
void check_cudnn(cudnnStatus_t status, const char* call, const std::string& context = {});

// The calling thread's cuDNN handle for `device`, with its stream set to Tally's stream
// for that device. Created on first use (with `device` current) and kept for the life of
// the process (handles are intentionally never destroyed: tearing them down during
// static destruction can outlive the CUDA context).
cudnnHandle_t cudnn_handle(int device);

// float32 -> CUDNN_DATA_FLOAT, float64 -> DOUBLE, float16 -> HALF, bfloat16 -> BFLOAT16.
cudnnDataType_t cudnn_data_type(DType dtype);

// RAII owner of a cuDNN descriptor: made by Create (`create_call` names it in the error),
// released by Destroy.
template <typename Desc, cudnnStatus_t (*Create)(Desc*), cudnnStatus_t (*Destroy)(Desc)>
class OwnedDescriptor {
 public:
  explicit OwnedDescriptor(const char* create_call) { check_cudnn(Create(&desc_), create_call); }
  ~OwnedDescriptor() { Destroy(desc_); }
  OwnedDescriptor(const OwnedDescriptor&) = delete;
  OwnedDescriptor& operator=(const OwnedDescriptor&) = delete;
  Desc get() const { return desc_; }

 protected:
  Desc desc_ = nullptr;
};

class TensorDescriptor
    : public OwnedDescriptor<cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor,
                             cudnnDestroyTensorDescriptor> {
 public:
  TensorDescriptor() : OwnedDescriptor("cudnnCreateTensorDescriptor") {}
  // 4-D with explicit strides (cudnnSetTensor4dDescriptorEx).
  void set(cudnnDataType_t dt, const int dims[4], const int strides[4]);
};

class FilterDescriptor
    : public OwnedDescriptor<cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor,
                             cudnnDestroyFilterDescriptor> {
 public:
  FilterDescriptor() : OwnedDescriptor("cudnnCreateFilterDescriptor") {}
  // [out, in / groups, kH, kW]: NCHW in memory, or NHWC ([out, kH, kW, in / groups]).
  void set(cudnnDataType_t dt, const int dims[4], bool nhwc);
};

class ConvolutionDescriptor
    : public OwnedDescriptor<cudnnConvolutionDescriptor_t, cudnnCreateConvolutionDescriptor,
                             cudnnDestroyConvolutionDescriptor> {
 public:
  ConvolutionDescriptor() : OwnedDescriptor("cudnnCreateConvolutionDescriptor") {}
  // Cross-correlation (PyTorch's conv2d) with `groups` and the given compute type.
  void set(const int pad[2], const int stride[2], const int dilation[2], int groups,
           cudnnDataType_t compute_type, cudnnMathType_t math);
  void set_math(cudnnMathType_t math);
};

}  // namespace tally::cuda
