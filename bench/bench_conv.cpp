// conv2d on the CPU (im2col + OpenBLAS GEMM): the ResNet stage-1 shape, input
// [32, 64, 56, 56], weight [64, 64, 3, 3], padding 1, float32: forward, and forward +
// backward (input and weight gradients). Reports GFLOP/s of the forward's 2*N*O*OH*OW*C*kH*kW.
#include <benchmark/benchmark.h>

#include "tensor/conv/autograd.h"

using namespace tally;

namespace {

constexpr int64_t kN = 32, kC = 64, kH = 56, kW = 56, kO = 64, kK = 3;

double forward_flops() {
  return 2.0 * kN * kO * kH * kW * kC * kK * kK;
}

void BM_Conv2dForward(benchmark::State& state) {
  Generator g(1);
  const Tensor x = ops::randn({kN, kC, kH, kW}, DType::float32, Device::cpu(), &g);
  const Tensor w = ops::randn({kO, kC, kK, kK}, DType::float32, Device::cpu(), &g);
  NoGradGuard no_grad;
  for (auto _ : state) {
    Tensor y = conv2d(x, w, {}, 1, 1);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      forward_flops() * static_cast<double>(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
}

void BM_Conv2dForwardBackward(benchmark::State& state) {
  Generator g(1);
  const Tensor x = ops::randn({kN, kC, kH, kW}, DType::float32, Device::cpu(), &g).requires_grad_();
  const Tensor w = ops::randn({kO, kC, kK, kK}, DType::float32, Device::cpu(), &g).requires_grad_();
  for (auto _ : state) {
    conv2d(x, w, {}, 1, 1).sum().backward();
    benchmark::DoNotOptimize(x.grad().data_ptr());
    x.set_grad(Tensor());
    w.set_grad(Tensor());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(3 * forward_flops() * static_cast<double>(state.iterations()) / 1e9,
                         benchmark::Counter::kIsRate);
}

}  // namespace

BENCHMARK(BM_Conv2dForward)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
BENCHMARK(BM_Conv2dForwardBackward)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);

BENCHMARK_MAIN();
