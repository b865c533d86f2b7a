// CPU matrix products: Tally's matmul / linear against a direct cblas_sgemm on the same
// buffers, so the difference is what Tally adds (checks, dispatch, output allocation from
// the caching allocator, autograd bookkeeping). The GFLOP/s counter is 2*M*N*K per
// iteration over wall time. Run with `--benchmark_filter=/512` for the 512x512x512 case.
// Also the offloaded optimizer's host update of AdamW8bit (BM_HostAdamW8bit*, parameters a
// second): `--benchmark_filter=HostAdamW8bit --benchmark_repetitions=5
// --benchmark_enable_random_interleaving=true` for medians of alternating runs.
#include <benchmark/benchmark.h>
#include <cblas.h>

#include "optim/cpu_adam.h"
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

// CpuOffload(AdamW8bit)'s host update of n parameters with bfloat16 gradients, in place:
// float32 masters, 8-bit moments (block 256), the new weights rounded into the gradient's
// buffer. All over every OpenMP thread.
struct HostState8 {
  int64_t n;
  Tensor p, g, wide, qm, qv, am, av;
  explicit HostState8(int64_t size)
      : n(size),
        p(ops::randn({size})),
        g(ops::to(ops::randn({size}), DType::bfloat16)),
        wide(ops::empty({size})),
        qm(ops::zeros({size}, DType::uint8)),
        qv(ops::zeros({size}, DType::uint8)),
        am(ops::zeros({(size + 255) / 256})),
        av(ops::zeros({(size + 255) / 256})) {}
  optim::TensorLists lists(const Tensor& grad) const {
    optim::TensorLists l(Device::cpu(), DType::float32, 6);
    l.add(
        {p.data_ptr(), grad.data_ptr(), qm.data_ptr(), qv.data_ptr(), am.data_ptr(), av.data_ptr()},
        n);
    return l;
  }
};

const optim::AdamW8bitHyper kHost8{{.lr = 1e-3, .weight_decay = 0.1, .decoupled = true}, 256};

void host_update_loop(benchmark::State& state, void (*update)(const HostState8&)) {
  const HostState8 s(state.range(0));
  for (auto _ : state) {
    update(s);
    benchmark::ClobberMemory();
  }
  state.counters["params/s"] =
      benchmark::Counter(static_cast<double>(s.n), benchmark::Counter::kIsIterationInvariantRate);
}

// As CpuOffload did before parallel_adamw8bit_16_: the gradient widened into a float32 buffer,
// the float32 update (parallel_adamw8bit_), the master rounded into the gradient's buffer.
void BM_HostAdamW8bitWidened(benchmark::State& state) {
  host_update_loop(state, [](const HostState8& s) {
    ops::copy_(s.wide, s.g);
    optim::parallel_adamw8bit_(s.lists(s.wide), kHost8);
    ops::copy_(s.g, s.p);
  });
}

// In one pass: parallel_adamw8bit_16_ reads the bfloat16 gradient and writes the weights.
void BM_HostAdamW8bitOnePass(benchmark::State& state) {
  host_update_loop(state, [](const HostState8& s) {
    optim::parallel_adamw8bit_16_(s.lists(s.g), kHost8, DType::bfloat16, {s.g.data_ptr()});
  });
}

// The same with clip_grad_norm_'s coefficient folded in (CpuOffload::clip_grad_norm_): each
// gradient scaled and rounded to bfloat16 as it is widened.
void BM_HostAdamW8bitOnePassClipped(benchmark::State& state) {
  host_update_loop(state, [](const HostState8& s) {
    optim::parallel_adamw8bit_16_(s.lists(s.g), kHost8, DType::bfloat16, {s.g.data_ptr()}, 0.75f);
  });
}

// The same with the AVX2 code-book loops (on an AVX-512 CPU, what an AVX2-only host runs; the
// rest of the block stays in the AVX-512 clone).
void BM_HostAdamW8bitOnePassAvx2(benchmark::State& state) {
  const int before = optim::detail::set_host_simd_cap(1);
  host_update_loop(state, [](const HostState8& s) {
    optim::parallel_adamw8bit_16_(s.lists(s.g), kHost8, DType::bfloat16, {s.g.data_ptr()});
  });
  optim::detail::set_host_simd_cap(before);
}

}  // namespace

BENCHMARK(BM_HostAdamW8bitWidened)
    ->Arg(int64_t{64} << 20)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_HostAdamW8bitOnePass)
    ->Arg(int64_t{64} << 20)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_HostAdamW8bitOnePassClipped)
    ->Arg(int64_t{64} << 20)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_HostAdamW8bitOnePassAvx2)
    ->Arg(int64_t{64} << 20)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
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
