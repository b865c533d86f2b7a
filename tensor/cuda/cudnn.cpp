#include "tensor/cuda/cudnn.h"

#include <fmt/format.h>

#include <atomic>
#include <stdexcept>
#include <vector>

#include "tensor/cuda/runtime.h"

namespace tally::cuda {

namespace {
std::atomic<bool> g_benchmark{false};
std::atomic<bool> g_allow_tf32{true};
}  // namespace

void set_cudnn_allow_tf32(bool allow) {
  g_allow_tf32.store(allow);
}
bool cudnn_allow_tf32() {
  return g_allow_tf32.load();
}

void set_cudnn_benchmark(bool enabled) {
  g_benchmark.store(enabled);
}
bool cudnn_benchmark() {
  return g_benchmark.load();
}

void check_cudnn(cudnnStatus_t status, const char* call, const std::string& context) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  throw std::runtime_error(fmt::format("{}: cuDNN error {} ({}){}{}", call,
                                       static_cast<int>(status), cudnnGetErrorString(status),
                                       context.empty() ? "" : ": ", context));
}

cudnnHandle_t cudnn_handle(int device) {
  // One handle per (thread, device): a cuDNN handle must not be used by two threads at
  // once. Never destroyed (see the header).
  thread_local std::vector<cudnnHandle_t> handles;
  cudnnHandle_t h = per_device(handles, device, "cudnn_handle", [&] {
    cudnnHandle_t created = nullptr;
    check_cudnn(cudnnCreate(&created), "cudnnCreate", fmt::format("device {}", device));
    return created;
  });
  check_cudnn(cudnnSetStream(h, stream(device)), "cudnnSetStream");
  return h;
}

cudnnDataType_t cudnn_data_type(DType dtype) {
  return floating_code(
      dtype, {CUDNN_DATA_FLOAT, CUDNN_DATA_HALF, CUDNN_DATA_BFLOAT16, CUDNN_DATA_DOUBLE}, "cuDNN");
}

void TensorDescriptor::set(cudnnDataType_t dt, const int dims[4], const int strides[4]) {
  check_cudnn(cudnnSetTensor4dDescriptorEx(desc_, dt, dims[0], dims[1], dims[2], dims[3],
                                           strides[0], strides[1], strides[2], strides[3]),
              "cudnnSetTensor4dDescriptorEx",
              fmt::format("dims [{}, {}, {}, {}], strides [{}, {}, {}, {}]", dims[0], dims[1],
                          dims[2], dims[3], strides[0], strides[1], strides[2], strides[3]));
}

void FilterDescriptor::set(cudnnDataType_t dt, const int dims[4], bool nhwc) {
  check_cudnn(cudnnSetFilter4dDescriptor(desc_, dt, nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                         dims[0], dims[1], dims[2], dims[3]),
              "cudnnSetFilter4dDescriptor",
              fmt::format("dims [{}, {}, {}, {}]{}", dims[0], dims[1], dims[2], dims[3],
                          nhwc ? ", NHWC" : ""));
}

void ConvolutionDescriptor::set(const int pad[2], const int stride[2], const int dilation[2],
                                int groups, cudnnDataType_t compute_type, cudnnMathType_t math) {
  const std::string ctx =
      fmt::format("padding [{}, {}], stride [{}, {}], dilation [{}, {}], groups {}", pad[0], pad[1],
                  stride[0], stride[1], dilation[0], dilation[1], groups);
  check_cudnn(
      cudnnSetConvolution2dDescriptor(desc_, pad[0], pad[1], stride[0], stride[1], dilation[0],
                                      dilation[1], CUDNN_CROSS_CORRELATION, compute_type),
      "cudnnSetConvolution2dDescriptor", ctx);
  check_cudnn(cudnnSetConvolutionGroupCount(desc_, groups), "cudnnSetConvolutionGroupCount", ctx);
  set_math(math);
}
void ConvolutionDescriptor::set_math(cudnnMathType_t math) {
  check_cudnn(cudnnSetConvolutionMathType(desc_, math), "cudnnSetConvolutionMathType");
}

}  // namespace tally::cuda
