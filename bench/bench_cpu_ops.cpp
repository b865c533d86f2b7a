// CPU matrix products: Tally's matmul / linear against a direct cblas_sgemm on the same
// buffers, so the difference is what Tally adds (checks, dispatch, output allocation from
// the caching allocator, autograd bookkeeping). The GFLOP/s counter is 2*M*N*K per
// iteration over wall time. Run with `--benchmark_filter=/512` for the 512x512x512 case.
#include <benchmark/benchmark.h>
#include <cblas.h>

#include "tensor/linalg/autograd.h"

using namespace tally;

namespace {

void set_flops(benchmark::State& state, int64_t m, int64_t n, int64_t k) {
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(m * n * k) * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

struct Operands {
  Tensor a, b, c;
  explicit Operands(int64_t n)
      : a(ops::randn({n, n}, DType::float32)),
        b(ops::randn({n, n}, DType::float32)),
        c(ops::zeros({n, n}, DType::float32)) {}
};

// The baseline: one cblas_sgemm on buffers Tally allocated (same alignment), C preallocated;
// b as it is or transposed (CblasTrans, the baseline for a @ b^T).
void cblas_sgemm_loop(benchmark::State& state, CBLAS_TRANSPOSE trans_b) {
  const int n = static_cast<int>(state.range(0));
  Operands o(n);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, trans_b, n, n, n, 1.0f, o.a.data<float>(), n,
                o.b.data<float>(), n, 0.0f, o.c.data<float>(), n);
    benchmark::ClobberMemory();
  }
  set_flops(state, n, n, n);
}

void BM_CblasSgemm(benchmark::State& state) {
  cblas_sgemm_loop(state, CblasNoTrans);
}
void BM_CblasSgemmTransB(benchmark::State& state) {
  cblas_sgemm_loop(state, CblasTrans);
}

// One Tally product per iteration on the state's n x n operands: product() returns the
// output, kept until the end of the iteration.
template <class Product>
void tally_loop(benchmark::State& state, Product&& product) {
  for (auto _ : state) {
    Tensor c = product();
    benchmark::DoNotOptimize(c.data_ptr());
  }
  const int64_t n = state.range(0);
  set_flops(state, n, n, n);
}

// Raw op: checks, dispatch, a fresh output from the caching allocator (a cache hit).
void BM_TallyOpsMatmul(benchmark::State& state) {
  const Operands o(state.range(0));
  tally_loop(state, [&] { return ops::matmul(o.a, o.b); });
}

// The differentiable API with grad required: plus recording the node and saving operands.
void BM_TallyMatmulAutograd(benchmark::State& state) {
  Operands o(state.range(0));
  o.a.requires_grad_();
  o.b.requires_grad_();
  tally_loop(state, [&] { return tally::matmul(o.a, o.b); });
}

// a @ b^T through a transposed view: passed as CblasTrans, no copy.
void BM_TallyMatmulTransposedView(benchmark::State& state) {
  const Operands o(state.range(0));
  const Tensor bt = ops::transpose(o.b, 0, 1);
  tally_loop(state, [&] { return ops::matmul(o.a, bt); });
}

// linear: x W^T + bias (bias broadcast into the output, then a beta = 1 GEMM).
void BM_TallyLinear(benchmark::State& state) {
  const Operands o(state.range(0));
  const Tensor bias = ops::randn({state.range(0)}, DType::float32);
  tally_loop(state, [&] { return ops::linear(o.a, o.b, bias); });
}

}  // namespace

BENCHMARK(BM_CblasSgemm)->Arg(64)->Arg(512)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_TallyOpsMatmul)->Arg(64)->Arg(512)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_TallyMatmulAutograd)->Arg(64)->Arg(512)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_CblasSgemmTransB)->Arg(64)->Arg(512)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_TallyMatmulTransposedView)
    ->Arg(64)
    ->Arg(512)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_TallyLinear)->Arg(64)->Arg(512)->Unit(benchmark::kMicrosecond)->UseRealTime();

BENCHMARK_MAIN();
