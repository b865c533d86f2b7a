// The device-neutral precision switches (tensor/precision.h): the CUDA backend's switches on a
// CUDA build, remembered values on a CPU-only one.
#include "tensor/precision.h"

#ifdef TALLY_WITH_CUDA
#include "tensor/attention/cuda.h"
#include "tensor/cuda/cudnn.h"
#include "tensor/linalg/cuda.h"
#else
#include <atomic>
#endif

namespace tally {

#ifdef TALLY_WITH_CUDA

void set_allow_tf32(bool allow) {
  cuda::set_allow_tf32(allow);
}
bool allow_tf32() {
  return cuda::allow_tf32();
}
void set_cudnn_allow_tf32(bool allow) {
  cuda::set_cudnn_allow_tf32(allow);
}
bool cudnn_allow_tf32() {
  return cuda::cudnn_allow_tf32();
}
void set_cudnn_benchmark(bool enabled) {
  cuda::set_cudnn_benchmark(enabled);
}
bool cudnn_benchmark() {
  return cuda::cudnn_benchmark();
}
void set_cudnn_sdp_enabled(bool enabled) {
  cuda::set_cudnn_sdp_enabled(enabled);
}
void set_tunable_enabled(bool enabled) {
  cuda::set_tunable_enabled(enabled);
}
bool tunable_enabled() {
  return cuda::tunable_enabled();
}
bool cudnn_sdp_enabled() {
  return cuda::cudnn_sdp_enabled();
}

#else

namespace {
// PyTorch's defaults.
std::atomic<bool> g_allow_tf32{false};
std::atomic<bool> g_cudnn_allow_tf32{true};
std::atomic<bool> g_cudnn_benchmark{false};
std::atomic<bool> g_cudnn_sdp{true};
std::atomic<bool> g_tunable{false};
}  // namespace

void set_allow_tf32(bool allow) {
  g_allow_tf32 = allow;
}
bool allow_tf32() {
  return g_allow_tf32;
}
void set_cudnn_allow_tf32(bool allow) {
  g_cudnn_allow_tf32 = allow;
}
bool cudnn_allow_tf32() {
  return g_cudnn_allow_tf32;
}
void set_cudnn_benchmark(bool enabled) {
  g_cudnn_benchmark = enabled;
}
bool cudnn_benchmark() {
  return g_cudnn_benchmark;
}
void set_cudnn_sdp_enabled(bool enabled) {
  g_cudnn_sdp = enabled;
}
bool cudnn_sdp_enabled() {
  return g_cudnn_sdp;
}
void set_tunable_enabled(bool enabled) {
  g_tunable = enabled;
}
bool tunable_enabled() {
  return g_tunable;
}

#endif

}  // namespace tally
