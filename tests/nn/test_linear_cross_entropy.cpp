// linear_cross_entropy (tensor/softmax/autograd.h), the fused and chunked lm_head +
// cross-entropy, and GPT's fused_classifier: the loss and both gradients equal the unfused
// cross_entropy(linear(...)) in float64 and float32 for every chunking (one that does not
// divide N included), ignored rows, mean and sum; a float64 gradient check; GPT-tiny fused
// against unfused (float32 and bf16 autocast); the peak memory it saves on the CPU; a dry run
// on the meta device reaching the CPU run's peak; the chunk-size rule; bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "autograd/autocast.h"
#include "memory/estimate.h"
#include "memory/memory.h"
#include "nn/models/gpt.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using memory::Category;
using testing::expect_error;

// max |a - b| / max(1, max |b|): the error of a against the reference b.
double max_err(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = ops::to_vector(ops::to(a, DType::float64));
  const std::vector<double> y = ops::to_vector(ops::to(b, DType::float64));
  if (x.size() != y.size()) return INFINITY;
  double d = 0, n = 1;
  for (size_t i = 0; i < x.size(); ++i) {
    d = std::max(d, std::abs(x[i] - y[i]));
    n = std::max(n, std::abs(y[i]));
  }
  return d / n;
}

// sqrt(sum (a - b)^2 / sum b^2): the norm-wise relative error of a against b.
double rel_err(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = ops::to_vector(ops::to(a, DType::float64));
  const std::vector<double> y = ops::to_vector(ops::to(b, DType::float64));
  if (x.size() != y.size()) return INFINITY;
  double d = 0, n = 0;
  for (size_t i = 0; i < x.size(); ++i) d += (x[i] - y[i]) * (x[i] - y[i]), n += y[i] * y[i];
  return n > 0 ? std::sqrt(d / n) : std::sqrt(d);
}

// Random targets in [0, V), every `every`-th one set to ignore_index.
Tensor targets(int64_t N, int64_t V, int64_t ignore_index, int64_t every, uint64_t seed) {
  Generator g(seed);
  Tensor t = ops::randint(0, V, {N}, DType::int64, Device::cpu(), &g);
  if (every > 0)
    for (int64_t i = 0; i < N; i += every) ops::fill_(ops::select(t, 0, i), double(ignore_index));
  return t;
}

Tensor leaf(const Shape& shape, DType dtype, uint64_t seed, double scale = 1.0) {
  Generator g(seed);
  Tensor t = ops::to(ops::mul(ops::randn(shape, DType::float64, Device::cpu(), &g), scale), dtype);
  t.requires_grad_(true);
  return t;
}

struct Result {
  Tensor loss, grad_h, grad_w;
};

// loss, d(hidden), d(weight) of `f` on fresh copies of h and w.
Result run(const Tensor& h0, const Tensor& w0,
           const std::function<Tensor(const Tensor&, const Tensor&)>& f) {
  Tensor h = ops::clone(h0), w = ops::clone(w0);
  h.requires_grad_(true);
  w.requires_grad_(true);
  Tensor loss = f(h, w);
  loss.backward();
  return {loss.detach(), h.grad(), w.grad()};
}

// ------------------------------------------------------------------ equal to the unfused pair

struct Case {
  DType dtype;
  int64_t chunk_rows;
  std::string reduction;
  int64_t ignore_index;
  int64_t V;  // 11, 257: not multiples of 64, so the logits live in padded buffers; 64: not
};

class MatchesUnfused : public ::testing::TestWithParam<Case> {};

TEST_P(MatchesUnfused, LossAndGradients) {
  const Case c = GetParam();
  const int64_t N = 13, C = 6, V = c.V;
  const Tensor h = leaf({N, C}, c.dtype, 1);
  const Tensor w = leaf({V, C}, c.dtype, 2, 0.5);
  // Every 4th row ignored; ignore_index 3 is also a class some rows would have.
  const Tensor t = targets(N, V, c.ignore_index, 4, 3);
  const Result ref = run(h, w, [&](const Tensor& x, const Tensor& y) {
    return cross_entropy(linear(x, y), t, c.ignore_index, 0.0, c.reduction);
  });
  const Result got = run(h, w, [&](const Tensor& x, const Tensor& y) {
    return linear_cross_entropy(x, y, t, c.ignore_index, c.reduction, c.chunk_rows);
  });
  const double tol = c.dtype == DType::float64 ? 1e-12 : 2e-6;
  EXPECT_EQ(got.loss.dtype(), c.dtype);
  EXPECT_EQ(got.loss.dim(), 0);
  EXPECT_LE(max_err(got.loss, ref.loss), tol) << got.loss.item() << " vs " << ref.loss.item();
  ASSERT_TRUE(got.grad_h.defined() && got.grad_w.defined());
  EXPECT_EQ(got.grad_h.dtype(), c.dtype);
  EXPECT_EQ(got.grad_w.dtype(), c.dtype);
  EXPECT_LE(max_err(got.grad_h, ref.grad_h), tol);
  EXPECT_LE(max_err(got.grad_w, ref.grad_w), tol);
  // The loss alone (no graph) is the same.
  NoGradGuard ng;
  const Tensor plain = linear_cross_entropy(h, w, t, c.ignore_index, c.reduction, c.chunk_rows);
  EXPECT_FALSE(plain.requires_grad());
  EXPECT_LE(max_err(plain, ref.loss), tol);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (DType d : {DType::float64, DType::float32})
    for (int64_t rows : {0, 1, 4, 5, 13, 100})  // 0: chosen (one chunk); 4, 5 do not divide 13
      for (const char* red : {"mean", "sum"})
        for (int64_t ignore : {-100, 3})
          for (int64_t V : {11, 64, 257}) out.push_back({d, rows, red, ignore, V});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Chunks, MatchesUnfused, ::testing::ValuesIn(cases()),
                         [](const auto& info) {
                           const Case& c = info.param;
                           return std::string(dtype_name(c.dtype)) + "_rows" +
                                  std::to_string(c.chunk_rows) + "_" + c.reduction + "_ignore" +
                                  (c.ignore_index < 0 ? "neg" : std::to_string(c.ignore_index)) +
                                  "_V" + std::to_string(c.V);
                         });

TEST(LinearCrossEntropy, OnlyOneInputRequiresGradSavesOnlyItsGradient) {
  const Tensor t = targets(9, 7, -100, 3, 4);
  Tensor h = leaf({9, 5}, DType::float64, 5);
  Tensor w = ops::randn({7, 5}, DType::float64);  // frozen
  Tensor loss = linear_cross_entropy(h, w, t, -100, "mean", 4);
  const std::vector<Tensor> saved = testing::saved_by(loss);
  ASSERT_EQ(saved.size(), 1u);
  EXPECT_EQ(saved[0].sizes(), (Shape{9, 5}));
  loss.backward();
  Tensor hr = ops::clone(h);
  hr.requires_grad_(true);
  cross_entropy(linear(hr, w), t).backward();
  EXPECT_LE(max_err(h.grad(), hr.grad()), 1e-12);
}

TEST(LinearCrossEntropy, SavesOnlyTheGradientsTaggedActivation) {
  const Tensor h = leaf({10, 4}, DType::float32, 6);
  const Tensor w = leaf({9, 4}, DType::float32, 7);
  Tensor loss = linear_cross_entropy(h, w, targets(10, 9, -100, 0, 8), -100, "mean", 3);
  const std::vector<Tensor> saved = testing::saved_by(loss);
  ASSERT_EQ(saved.size(), 2u);
  EXPECT_EQ(saved[0].sizes(), (Shape{10, 4}));
  EXPECT_EQ(saved[1].sizes(), (Shape{9, 4}));
  for (const Tensor& s : saved) EXPECT_EQ(s.storage().category(), Category::activation);
  EXPECT_EQ(loss.autograd_meta()->grad_fn->name(), "LinearCrossEntropyBackward");
}

// Under bfloat16 autocast a float32 weight's gradient is saved (and delivered) in float32,
// straight from the float32 accumulator, as linear's GEMM writes it; a bfloat16 weight's stays
// bfloat16.
TEST(LinearCrossEntropy, Float32WeightKeepsAFloat32GradientUnderAutocast) {
  const Tensor t = targets(12, 70, -100, 2, 90);
  for (const DType wd : {DType::float32, DType::bfloat16}) {
    SCOPED_TRACE(dtype_name(wd));
    const Tensor h = leaf({12, 8}, DType::float32, 91);
    const Tensor w = leaf({70, 8}, wd, 92, 0.5);
    Tensor loss;
    {
      AutocastGuard autocast(DeviceType::cpu, DType::bfloat16, true);
      loss = linear_cross_entropy(h, w, t, -100, "mean", 5);
    }
    const std::vector<Tensor> saved = testing::saved_by(loss);
    ASSERT_EQ(saved.size(), 2u);
    EXPECT_EQ(saved[1].dtype(), wd);
    loss.backward();
    ASSERT_TRUE(w.grad().defined());
    EXPECT_EQ(w.grad().dtype(), wd);
    Tensor wr = ops::clone(w);
    wr.requires_grad_(true);
    {
      AutocastGuard autocast(DeviceType::cpu, DType::bfloat16, true);
      Tensor lr = cross_entropy(linear(ops::clone(h), wr), t);
      lr.backward();
    }
    EXPECT_LE(rel_err(w.grad(), wr.grad()), 2e-2);
    // A loss gradient other than 1 scales d(weight) (with the mean's 1 / count the backward
    // applies to a float32 one) and d(hidden) alike.
    const Tensor h2 = leaf({12, 8}, DType::float32, 91);
    const Tensor w2 = leaf({70, 8}, wd, 92, 0.5);
    {
      AutocastGuard autocast(DeviceType::cpu, DType::bfloat16, true);
      Tensor l2 = linear_cross_entropy(h2, w2, t, -100, "mean", 5);
      l2.backward(ops::full({}, 2.5, l2.dtype()));
    }
    EXPECT_LE(rel_err(w2.grad(), ops::mul(w.grad(), 2.5)), 1e-6);
    // d(hidden) is 16-bit and scaled there: the product rounds again.
    EXPECT_LE(rel_err(h2.grad(), ops::mul(h.grad(), 2.5)), 1e-2);
  }
}

TEST(LinearCrossEntropy, EveryRowIgnoredMeanIsNaN) {
  const Tensor h = leaf({4, 3}, DType::float64, 9);
  const Tensor w = leaf({5, 3}, DType::float64, 10);
  const Tensor t = ops::full({4}, -100.0, DType::int64);
  EXPECT_TRUE(std::isnan(linear_cross_entropy(h, w, t).item()));
  EXPECT_EQ(linear_cross_entropy(h, w, t, -100, "sum").item(), 0.0);
  // No rows at all: sum 0, mean NaN, gradients of the right shapes.
  Tensor h0 = leaf({0, 3}, DType::float64, 11);
  Tensor loss = linear_cross_entropy(h0, w, ops::zeros({0}, DType::int64), -100, "sum");
  EXPECT_EQ(loss.item(), 0.0);
  loss.backward();
  EXPECT_EQ(w.grad().sizes(), (Shape{5, 3}));
  EXPECT_EQ(ops::item(ops::sum(ops::unary(ops::UnaryOp::abs, w.grad()))), 0.0);
}

// ------------------------------------------------------------------ gradient check

TEST(LinearCrossEntropy, GradcheckFloat64) {
  const Tensor t = ops::from_vector({2, 0, -1, 3, 1, 3, 2}, {7}, DType::int64);
  for (const char* red : {"mean", "sum"}) {
    const Tensor h = testing::rand_input({7, 3}, -1, 1, 21);
    const Tensor w = testing::rand_input({4, 3}, -1, 1, 22);
    EXPECT_TRUE(testing::gradcheck(
        [&](const TensorList& in) { return linear_cross_entropy(in[0], in[1], t, -1, red, 3); },
        {h, w}))
        << red;
  }
}

// ------------------------------------------------------------------ GPT

// GPT-tiny twice with the same weights, one with the fused classifier (chunk_bytes: its
// budget), trained one forward/backward on the same batch; loss and every gradient compared.
void compare_gpt(int64_t chunk_bytes, bool bf16, double loss_tol, double grad_tol) {
  manual_seed(11);
  nn::GPTConfig cfg = nn::GPTConfig::preset("tiny");
  nn::GPT ref(cfg);
  cfg.fused_classifier = true;
  cfg.fused_classifier_chunk_bytes = chunk_bytes;
  nn::GPT fused(cfg);
  fused.load_state_dict(ref.state_dict());
  Generator g(12);
  const Tensor idx = ops::randint(0, 256, {2, 24}, DType::int64, Device::cpu(), &g);
  Tensor tgt = ops::randint(0, 256, {2, 24}, DType::int64, Device::cpu(), &g);
  ops::fill_(ops::narrow(ops::select(tgt, 0, 1), 0, 20, 4), -1.0);  // ignored (nanoGPT's -1)
  Tensor lr, lf, logits_f;
  {
    AutocastGuard autocast(DeviceType::cpu, DType::bfloat16, bf16);
    lr = ref(idx, tgt).second;
    auto [l, loss] = fused(idx, tgt);
    logits_f = l;
    lf = loss;
  }
  EXPECT_FALSE(logits_f.defined());
  EXPECT_EQ(lf.dtype(), DType::float32);
  EXPECT_LE(max_err(lf, lr), loss_tol) << lf.item() << " vs " << lr.item();
  lr.backward();
  lf.backward();
  const auto pr = ref.named_parameters(), pf = fused.named_parameters();
  ASSERT_EQ(pr.size(), pf.size());
  for (size_t i = 0; i < pr.size(); ++i) {
    ASSERT_TRUE(pf[i].second.grad().defined()) << pf[i].first;
    EXPECT_EQ(pf[i].second.grad().dtype(), DType::float32) << pf[i].first;
    EXPECT_LE(rel_err(pf[i].second.grad(), pr[i].second.grad()), grad_tol) << pf[i].first;
  }
  // The tied weight is one tensor in both, and got both its gradients (embedding + head).
  EXPECT_TRUE(fused.lm_head->weight.is_same(fused.transformer->wte->weight));
  // Without targets the fused model returns logits, equal to the plain model's.
  NoGradGuard ng;
  auto [lg, none] = fused(idx);
  EXPECT_FALSE(none.defined());
  EXPECT_LE(max_err(lg, ref(idx).first), 1e-6);
}

TEST(GPTFusedClassifier, MatchesUnfusedOneChunk) {
  compare_gpt(nn::GPTConfig{}.fused_classifier_chunk_bytes, false, 1e-6, 1e-5);
}

TEST(GPTFusedClassifier, MatchesUnfusedManyChunks) {
  // 8 KiB: 8 rows of 256 float32 logits (their gradient overwrites them), 6 chunks of the
  // 48 rows.
  EXPECT_EQ(linear_cross_entropy_chunk_rows(48, 256, 4, 0, 8 << 10), 8);
  compare_gpt(8 << 10, false, 1e-6, 1e-5);
}

TEST(GPTFusedClassifier, MatchesUnfusedUnderBf16Autocast) {
  // bf16 logits and gradients both ways; they differ by roundings (the fused mean scale is
  // applied in float32, the weight gradient summed over chunks).
  compare_gpt(8 << 10, true, 2e-3, 3e-2);
}

TEST(GPTFusedClassifier, AllocationsCarryLmHead) {
  const Device cpu = Device::cpu();
  manual_seed(13);
  nn::GPTConfig cfg = nn::GPTConfig::preset("tiny");
  cfg.fused_classifier = true;
  nn::GPT gpt(cfg);
  const Tensor idx = ops::randint(0, 256, {2, 8}, DType::int64);
  memory::record_memory_history(true, 1000000, cpu);
  Tensor loss = gpt(idx, idx).second;
  bool saw_head_logits = false, saw_saved = false;
  for (const memory::TraceEntry& e : memory::get_allocator(cpu).history()) {
    const std::string module = memory::interned(e.tag.module);
    const std::string op = memory::interned(e.tag.op);
    if (e.action == memory::TraceAction::alloc && module == "lm_head" && op == "mm" &&
        e.tag.category == Category::temporary)
      saw_head_logits = true;
    if (e.action == memory::TraceAction::retag && module == "lm_head" &&
        e.tag.category == Category::activation)
      saw_saved = true;
  }
  memory::record_memory_history(false, 0, cpu);
  EXPECT_TRUE(saw_head_logits);
  EXPECT_TRUE(saw_saved);
}

// ------------------------------------------------------------------ peak memory

// The peak bytes allocated on the CPU above what was allocated before `f`.
int64_t cpu_peak_of(const std::function<void()>& f) {
  const Device cpu = Device::cpu();
  const int64_t base = static_cast<int64_t>(memory::memory_allocated(cpu));
  memory::reset_peak_memory_stats(cpu);
  f();
  return static_cast<int64_t>(memory::max_memory_allocated(cpu)) - base;
}

TEST(LinearCrossEntropyMemory, OpPeakSmallerByAtLeastTheLogits) {
  const int64_t N = 1024, C = 32, V = 2048;
  const int64_t logits_bytes = N * V * 4;  // 8 MiB
  Tensor h = leaf({N, C}, DType::float32, 31);
  Tensor w = leaf({V, C}, DType::float32, 32);
  const Tensor t = targets(N, V, -100, 7, 33);
  const int64_t unfused = cpu_peak_of([&] { cross_entropy(linear(h, w), t).backward(); });
  h.set_grad(Tensor());
  w.set_grad(Tensor());
  const int64_t fused =
      cpu_peak_of([&] { linear_cross_entropy(h, w, t, -100, "mean", 64).backward(); });
  std::printf(
      "linear_cross_entropy N=%lld C=%lld V=%lld float32: peak unfused %lld B, fused "
      "(64-row chunks) %lld B, logits %lld B\n",
      (long long)N, (long long)C, (long long)V, (long long)unfused, (long long)fused,
      (long long)logits_bytes);
  EXPECT_LE(fused + logits_bytes, unfused);
}

// Each chunk keeps one [rows, Vp] buffer (the gradient overwrites the logits in place), padded
// (V = 1000, Vp = 1024, plus a zero-padded [Vp, C] copy of the weight) or not (V = 1024): the
// peak holds the buffer, the two gradients and the copy, and less than a second buffer more.
TEST(LinearCrossEntropyMemory, OneBufferAChunk) {
  const int64_t N = 512, C = 32, rows = 64, Vp = 1024;
  const int64_t buffer = rows * Vp * 4;    // one chunk's [64, 1024] float32
  const int64_t grads = (N + Vp) * C * 4;  // d(hidden) [N, C], d(weight) [Vp, C]
  for (const int64_t V : {int64_t{1000}, Vp}) {
    Tensor h = leaf({N, C}, DType::float32, 51);
    Tensor w = leaf({V, C}, DType::float32, 52);
    const Tensor t = targets(N, V, -100, 5, 53);
    const int64_t peak =
        cpu_peak_of([&] { linear_cross_entropy(h, w, t, -100, "mean", rows).backward(); });
    const int64_t copy = V == Vp ? 0 : Vp * C * 4;  // the padded weight
    std::printf("linear_cross_entropy N=%lld C=%lld V=%lld rows %lld: peak %lld B\n", (long long)N,
                (long long)C, (long long)V, (long long)rows, (long long)peak);
    EXPECT_GE(peak, buffer + grads + copy) << V;
    EXPECT_LT(peak, 2 * buffer + grads + copy) << V;
  }
}

// GPT-tiny with a 4096-token vocabulary, batch 4 x 64: logits [256, 4096] float32 (4 MiB).
nn::GPTConfig memory_config(bool fused) {
  nn::GPTConfig cfg = nn::GPTConfig::preset("tiny");
  cfg.vocab_size = 4096;
  cfg.fused_classifier = fused;
  cfg.fused_classifier_chunk_bytes = 256 << 10;  // 8 rows a chunk
  return cfg;
}

void gpt_step(Device d, bool fused) {
  manual_seed(14);
  std::shared_ptr<nn::GPT> gpt;
  {
    nn::BuildOnDevice on(d);
    gpt = std::make_shared<nn::GPT>(memory_config(fused));
  }
  Tensor x, y;
  {
    memory::CategoryScope input(Category::input);
    x = ops::randint(0, 4096, {4, 64}, DType::int64, d);
    y = ops::randint(0, 4096, {4, 64}, DType::int64, d);
  }
  (*gpt)(x, y).second.backward();
}

TEST(LinearCrossEntropyMemory, GptPeakSmallerByAtLeastTheLogits) {
  const int64_t logits_bytes = int64_t{4} * 64 * 4096 * 4;
  const int64_t unfused = cpu_peak_of([] { gpt_step(Device::cpu(), false); });
  const int64_t fused = cpu_peak_of([] { gpt_step(Device::cpu(), true); });
  std::printf(
      "GPT tiny, vocab 4096, batch 4x64, float32: peak unfused %lld B, fused %lld B, "
      "logits %lld B\n",
      (long long)unfused, (long long)fused, (long long)logits_bytes);
  EXPECT_LE(fused + logits_bytes, unfused);
}

// ------------------------------------------------------------------ dry run (meta device)

// 300 rows of 16 features (h) and a 1000-class weight (w), both requiring grad, and targets
// (t), drawn on `d` from Generator(seed).
struct DryRunOperands {
  DryRunOperands(Device d, DType dtype, uint64_t seed) : g(seed) {
    h = ops::randn({300, 16}, dtype, d, &g).requires_grad_(true);
    w = ops::randn({1000, 16}, dtype, d, &g).requires_grad_(true);
    t = ops::randint(0, 1000, {300}, DType::int64, d, &g);
  }
  Generator g;
  Tensor h, w, t;
};

TEST(LinearCrossEntropyMemory, DryRunPeakEqualsCpuPeak) {
  auto op_step = [](Device d) {
    const DryRunOperands x(d, DType::float32, 41);
    linear_cross_entropy(x.h, x.w, x.t, -100, "mean", 0, 200 << 10).backward();  // 25-row chunks
  };
  for (const auto& entry : std::vector<std::pair<std::string, std::function<void(Device)>>>{
           {"op", op_step}, {"gpt", [](Device d) { gpt_step(d, true); }}}) {
    // Named variables, not a structured binding: clang 14 (CI's ASan build) refuses to capture
    // a binding in a lambda.
    const std::string& name = entry.first;
    const std::function<void(Device)>& step = entry.second;
    const int64_t real = cpu_peak_of([&] { step(Device::cpu()); });
    const memory::Estimate e = memory::estimate(step, {.target = "cpu"});
    ASSERT_TRUE(e.fits()) << e.out_of_memory;
    EXPECT_EQ(e.peak_allocated, real) << name;
    std::printf("%s: dry-run peak %lld B, CPU peak %lld B\n", name.c_str(),
                (long long)e.peak_allocated, (long long)real);
  }
  // The CUDA path replays on any machine too (the H200 target).
  const memory::Estimate h200 =
      memory::estimate([](Device d) { gpt_step(d, true); }, {.target = "h200"});
  EXPECT_TRUE(h200.fits()) << h200.out_of_memory;
}

// bfloat16 operands with a padded vocabulary (16-bit logits in [rows, Vp] buffers, the mean's
// scale in float32, d(weight) summed in float32): the unfused bfloat16 pair's numbers.
TEST(LinearCrossEntropy, PaddedVocabularyBf16MatchesUnfused) {
  const int64_t N = 37, C = 24, V = 257;
  const Tensor h = leaf({N, C}, DType::bfloat16, 61);
  const Tensor w = leaf({V, C}, DType::bfloat16, 62, 0.5);
  const Tensor t = targets(N, V, -100, 6, 63);
  for (const char* red : {"mean", "sum"}) {
    SCOPED_TRACE(red);
    const Result ref = run(h, w, [&](const Tensor& x, const Tensor& y) {
      return cross_entropy(linear(x, y), t, -100, 0.0, red);
    });
    const Result got = run(h, w, [&](const Tensor& x, const Tensor& y) {
      return linear_cross_entropy(x, y, t, -100, red, 8);  // 5 chunks, the last of 5 rows
    });
    EXPECT_EQ(got.grad_h.dtype(), DType::bfloat16);
    EXPECT_EQ(got.grad_w.dtype(), DType::bfloat16);
    EXPECT_LE(max_err(got.loss, ref.loss), 1e-2);
    EXPECT_LE(rel_err(got.grad_h, ref.grad_h), 1e-2);
    EXPECT_LE(rel_err(got.grad_w, ref.grad_w), 1e-2);
  }
}

// The padded path's ops replay on the meta device for the CUDA target too (mm_out's cuBLASLt
// workspace, nothing for its output).
TEST(LinearCrossEntropyMemory, PaddedDryRunOnTheH200Target) {
  const memory::Estimate e = memory::estimate(
      [](Device d) {
        const DryRunOperands x(d, DType::bfloat16, 71);
        linear_cross_entropy(x.h, x.w, x.t, -100, "mean", 64).backward();
      },
      {.target = "h200"});
  EXPECT_TRUE(e.fits()) << e.out_of_memory;
  EXPECT_GT(e.peak_allocated, 64 * 1024 * 2);  // at least one padded chunk buffer
}

// ------------------------------------------------------------------ chunk size and errors

TEST(LinearCrossEntropy, ChunkRowsRule) {
  // One [rows, Vp] buffer a chunk, Vp = V rounded up to 64. GPT-2's vocabulary in bfloat16:
  // 256 MiB / (50304 * 2) = 2668 -> 2624.
  EXPECT_EQ(linear_cross_entropy_chunk_rows(8192, 50257, 2), 2624);
  EXPECT_EQ(linear_cross_entropy_chunk_rows(8192, 50257, 4), 1280);       // 1334
  EXPECT_EQ(linear_cross_entropy_chunk_rows(8192, 50304, 4), 1280);       // the same Vp
  EXPECT_EQ(linear_cross_entropy_chunk_rows(100, 50257, 2), 100);         // at most N
  EXPECT_EQ(linear_cross_entropy_chunk_rows(100, 1000, 4, 0, 40000), 9);  // < 64: as is
  EXPECT_EQ(linear_cross_entropy_chunk_rows(100, 1000, 4, 0, 1), 1);      // at least 1
  EXPECT_EQ(linear_cross_entropy_chunk_rows(100, 1000, 4, 7), 7);         // given
  EXPECT_EQ(linear_cross_entropy_chunk_rows(100, 1000, 4, 700), 100);
  EXPECT_THROW(linear_cross_entropy_chunk_rows(100, 1000, 4, -1), std::invalid_argument);
  EXPECT_THROW(linear_cross_entropy_chunk_rows(100, 1000, 4, 0, 0), std::invalid_argument);
}

TEST(LinearCrossEntropy, BadInputErrors) {
  const Tensor h = leaf({6, 4}, DType::float32, 51);
  const Tensor w = leaf({5, 4}, DType::float32, 52);
  const Tensor t = targets(6, 5, -100, 0, 53);
  using IA = std::invalid_argument;
  expect_error<IA>([&] { linear_cross_entropy(ops::reshape(h, {24}), w, t); },
                   {"linear_cross_entropy", "hidden [24]", "weight [5, 4]", "target [6]"});
  expect_error<IA>([&] { linear_cross_entropy(h, ops::narrow(w, 1, 0, 3), t); },
                   {"linear_cross_entropy", "4 features", "expects 3", "[5, 3]"});
  expect_error<IA>([&] { linear_cross_entropy(h, w, ops::narrow(t, 0, 0, 5)); },
                   {"linear_cross_entropy", "5 targets for 6 rows", "hidden [6, 4]"});
  expect_error<IA>(
      [&] {
        linear_cross_entropy(h, w, ops::reshape(t, {2, 3}));
      },
      {"linear_cross_entropy", "target [2, 3]"});
  expect_error<IA>([&] { linear_cross_entropy(h, w, ops::to(t, DType::float32)); },
                   {"linear_cross_entropy", "int64", "float32"});
  expect_error<IA>([&] { linear_cross_entropy(h, ops::to(w, DType::float64), t); },
                   {"linear_cross_entropy", "float32 [6, 4]", "float64 [5, 4]"});
  expect_error<IA>(
      [&] { linear_cross_entropy(ops::to(h, DType::int64), ops::to(w, DType::int64), t); },
      {"linear_cross_entropy", "floating"});
  expect_error<IA>([&] { linear_cross_entropy(h, w, t, -100, "none"); },
                   {"linear_cross_entropy", "'none' is not supported"});
  expect_error<IA>([&] { linear_cross_entropy(h, w, t, -100, "avg"); },
                   {"linear_cross_entropy", "'avg'"});
  expect_error<IA>([&] { linear_cross_entropy(h, w, t, -100, "mean", -1); },
                   {"linear_cross_entropy", "chunk_rows", "-1"});
  expect_error<IA>([&] { linear_cross_entropy(h, w, t, -100, "mean", 0, 0); },
                   {"linear_cross_entropy", "max_chunk_bytes"});
  expect_error<IA>([&] { linear_cross_entropy(h, w, Tensor()); },
                   {"linear_cross_entropy", "defined"});
  // cross_entropy's target check, in every chunk, named with the op and the shapes.
  const Tensor bad = ops::from_vector({0, 1, 2, 3, 4, 5}, {6}, DType::int64);
  expect_error<std::out_of_range>(
      [&] { linear_cross_entropy(h, w, bad, -100, "mean", 4); },
      {"linear_cross_entropy", "target 5 is out of bounds for 5 classes", "hidden [6, 4]",
       "weight [5, 4]", "target [6]"});
  const Tensor negative = ops::from_vector({0, -3, 2, 3, 4, 1}, {6}, DType::int64);
  expect_error<std::out_of_range>([&] { linear_cross_entropy(h, w, negative); },
                                  {"linear_cross_entropy", "-3"});
  // A meta operand with CPU ones: the devices must agree.
  memory::DryRun dry;
  const Tensor hm = ops::randn({6, 4}, DType::float32, dry.device());
  expect_error<IA>([&] { linear_cross_entropy(hm, w, t); }, {"linear_cross_entropy"});
}

}  // namespace
}  // namespace tally
