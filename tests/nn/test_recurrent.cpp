// nn::LSTM and nn::GRU: PyTorch's parameter names, shapes and initialisation bounds, the
// output and state shapes (batch_first, bidirectional, unbatched), the values against the
// recurrence written out with unfused ops, float64 gradient checks of a 2-layer
// bidirectional batch-first LSTM and GRU (input, initial state and every parameter), and
// the errors; a dry run on the meta device (and for a recorded GPU target, which notes that it
// replays the per-timestep path, not cuDNN's); on an accelerator, both modules against the CPU.
#include <gtest/gtest.h>

#include <cmath>

#include "autograd/ops.h"
#include "memory/meta.h"
#include "nn/layers.h"
#include "nn/rnn.h"
#include "testing/devices.h"
#include "testing/gradcheck.h"

namespace tally::nn {
namespace {

using testing::gradcheck;
using testing::rand_input;

// The float64 gradient check of `lstm` from input x and state (h0, c0): x, h0, c0 and every
// parameter against the output, h_n and c_n.
::testing::AssertionResult lstm_gradcheck(LSTM& lstm, const Tensor& x, const Tensor& h0,
                                          const Tensor& c0) {
  TensorList in = {x, h0, c0};
  for (const Tensor& p : lstm.parameters()) in.push_back(p);
  return gradcheck(
      [&](const TensorList& t) {
        auto [out, hc] = lstm(t[0], std::make_pair(t[1], t[2]));
        return cat({out.reshape({-1}), hc.first.reshape({-1}), hc.second.reshape({-1})}, 0);
      },
      in);
}

TEST(Recurrent, ParameterNamesShapesAndInit) {
  LSTM lstm(3, 5, 2, true, false, 0.0, true);
  const std::vector<std::string> want = {
      "weight_ih_l0",         "weight_hh_l0",         "bias_ih_l0",         "bias_hh_l0",
      "weight_ih_l0_reverse", "weight_hh_l0_reverse", "bias_ih_l0_reverse", "bias_hh_l0_reverse",
      "weight_ih_l1",         "weight_hh_l1",         "bias_ih_l1",         "bias_hh_l1",
      "weight_ih_l1_reverse", "weight_hh_l1_reverse", "bias_ih_l1_reverse", "bias_hh_l1_reverse"};
  const auto named = lstm.named_parameters();
  ASSERT_EQ(named.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(named[i].first, want[i]);
  EXPECT_EQ(named[0].second.sizes(), (Shape{20, 3}));
  EXPECT_EQ(named[1].second.sizes(), (Shape{20, 5}));
  EXPECT_EQ(named[8].second.sizes(), (Shape{20, 10}));  // layer 1 reads both directions
  const double bound = 1 / std::sqrt(5.0);
  for (const auto& [n, p] : named)
    for (double v : ops::to_vector(p)) EXPECT_LE(std::abs(v), bound) << n;

  GRU gru(4, 6, 1, false);
  const auto g = gru.named_parameters();
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0].first, "weight_ih_l0");
  EXPECT_EQ(g[0].second.sizes(), (Shape{18, 4}));
  EXPECT_EQ(gru.extra_repr(), "4, 6, bias=False");
}

TEST(Recurrent, ShapesBatchFirstBidirectionalUnbatched) {
  LSTM lstm(3, 4, 2, true, true, 0.0, true);
  auto [out, hc] = lstm(randn({2, 5, 3}));
  EXPECT_EQ(out.sizes(), (Shape{2, 5, 8}));
  EXPECT_EQ(hc.first.sizes(), (Shape{4, 2, 4}));
  EXPECT_EQ(hc.second.sizes(), (Shape{4, 2, 4}));
  GRU gru(3, 4);
  auto [o2, h2] = gru(randn({5, 3}));  // unbatched [T, I]
  EXPECT_EQ(o2.sizes(), (Shape{5, 4}));
  EXPECT_EQ(h2.sizes(), (Shape{1, 4}));
  // The last output of a unidirectional layer is its final state.
  EXPECT_TRUE(testing::values_near(o2.narrow(0, 4, 1).reshape({4}), ops::to_vector(h2), 0));
}

// A 1-layer LSTM or GRU (one direction) written out with unfused ops, from [T, B, I].
Tensor reference(bool lstm, const Tensor& x, const Tensor& w_ih, const Tensor& w_hh,
                 const Tensor& b_ih, const Tensor& b_hh, int64_t H, bool reverse) {
  const int64_t T = x.size(0), B = x.size(1);
  Tensor h = zeros({B, H}, TensorOptions{}.with_dtype(x.dtype()));
  Tensor c = h;
  TensorList out(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i) {
    const int64_t t = reverse ? T - 1 - i : i;
    const Tensor gi = linear(x.select(0, t), w_ih, b_ih), gh = linear(h, w_hh, b_hh);
    auto part = [H](const Tensor& g, int k) { return g.narrow(1, k * H, H); };
    if (lstm) {
      const Tensor p = add(gi, gh);
      c = add(mul(sigmoid(part(p, 1)), c), mul(sigmoid(part(p, 0)), tanh(part(p, 2))));
      h = mul(sigmoid(part(p, 3)), tanh(c));
    } else {
      const Tensor r = sigmoid(add(part(gi, 0), part(gh, 0)));
      const Tensor z = sigmoid(add(part(gi, 1), part(gh, 1)));
      const Tensor n = tanh(add(part(gi, 2), mul(r, part(gh, 2))));
      h = add(n, mul(z, sub(h, n)));
    }
    out[static_cast<size_t>(t)] = h;
  }
  return stack(out, 0);
}

TEST(Recurrent, ValuesMatchTheUnfusedRecurrence) {
  for (bool is_lstm : {true, false}) {
    std::shared_ptr<RNNBase> m;
    if (is_lstm)
      m = std::make_shared<LSTM>(3, 4, 1, true, false, 0.0, true);
    else
      m = std::make_shared<GRU>(3, 4, 1, true, false, 0.0, true);
    m->to(DType::float64);
    const Tensor x = ops::to(randn({5, 2, 3}), DType::float64);
    const Tensor out = (*m)(x);
    const auto p = m->named_parameters();
    auto w = [&](size_t i) { return p[i].second; };
    const Tensor ref = cat({reference(is_lstm, x, w(0), w(1), w(2), w(3), 4, false),
                            reference(is_lstm, x, w(4), w(5), w(6), w(7), 4, true)},
                           2);
    EXPECT_TRUE(testing::values_near(out, ops::to_vector(ref), 1e-12)) << is_lstm;
  }
}

TEST(Recurrent, LstmGradcheckTwoLayersBidirectionalBatchFirst) {
  LSTM lstm(3, 2, 2, true, true, 0.0, true);
  lstm.to(DType::float64);
  EXPECT_TRUE(lstm_gradcheck(lstm, rand_input({2, 3, 3}, -1, 1, 1), rand_input({4, 2, 2}, -1, 1, 2),
                             rand_input({4, 2, 2}, -1, 1, 3)));
}

TEST(Recurrent, GruGradcheckTwoLayersBidirectionalBatchFirst) {
  GRU gru(3, 2, 2, true, true, 0.0, true);
  gru.to(DType::float64);
  TensorList in = {rand_input({2, 3, 3}, -1, 1, 4), rand_input({4, 2, 2}, -1, 1, 5)};
  for (const Tensor& p : gru.parameters()) in.push_back(p);
  EXPECT_TRUE(gradcheck(
      [&](const TensorList& t) {
        auto [out, h] = gru(t[0], t[1]);
        return cat({out.reshape({-1}), h.reshape({-1})}, 0);
      },
      in));
}

TEST(Recurrent, DropoutBetweenLayersOnlyInTraining) {
  LSTM lstm(3, 4, 2, true, false, 0.5);
  const Tensor x = randn({4, 2, 3});
  lstm.eval();
  const Tensor a = lstm(x).first, b = lstm(x).first;
  EXPECT_TRUE(testing::values_near(a, ops::to_vector(b), 0));
}

// A dry run on the meta device: forward and backward allocate with the right shapes.
TEST(Recurrent, RunsOnTheMetaDevice) {
  const Device meta = Device::meta();
  BuildOnDevice on(meta);
  LSTM lstm(3, 4, 2, true, true, 0.0, true);
  GRU gru(8, 4);
  auto [out, hc] = lstm(ops::empty({2, 5, 3}, DType::float32, meta));
  EXPECT_EQ(out.sizes(), (Shape{2, 5, 8}));
  auto [o2, h2] = gru(out.transpose(0, 1));
  EXPECT_EQ(h2.sizes(), (Shape{1, 2, 4}));
  sum(o2).backward();
  EXPECT_EQ(lstm.parameters()[0].grad().device(), meta);
  EXPECT_EQ(lstm.parameters()[0].grad().sizes(), (Shape{16, 3}));
}

// A dry run for a GPU that is not this machine's (a recorded target) cannot ask cuDNN for its
// RNN's sizes: it replays the per-timestep path and notes so (docs/cudnn_rnn.md).
TEST(Recurrent, ARecordedGpuTargetNotesTheCudnnRoute) {
  const Device d = memory::new_meta_device(memory::meta_target("h200"));
  BuildOnDevice on(d);
  LSTM lstm(3, 4, 2, true, true);
  auto [out, hc] = lstm(ops::empty({2, 5, 3}, DType::float32, d));
  EXPECT_EQ(out.sizes(), (Shape{2, 5, 4}));
  sum(out).backward();
  EXPECT_EQ(lstm.parameters()[0].grad().sizes(), (Shape{16, 3}));
  const auto notes = memory::unreplayed(d);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].first.find("cudnn_rnn"), std::string::npos);
}

TEST(Recurrent, ErrorsNameTheModuleAndShapes) {
  LSTM lstm(3, 4);
  testing::expect_error<std::invalid_argument>(
      [&] {
        (void)lstm(randn({2, 5, 7}));
      },
      {"input.size(-1) must be equal to input_size. Expected 3, got 7"});
  testing::expect_error<std::invalid_argument>(
      [&] {
        (void)lstm(randn({2, 5, 3}), std::make_pair(zeros({2, 5, 4}), zeros({1, 5, 4})));
      },
      {"Expected hidden[0] size [1, 5, 4], got [2, 5, 4]"});
  EXPECT_THROW(GRU(3, 4, 1, true, false, 1.5), std::invalid_argument);
}

// proj_size: PyTorch's weight_hr_l{k} names and shapes, h of proj_size features (c keeps
// hidden_size), the first step against the projected recurrence, and a float64 gradcheck.
TEST(Recurrent, LstmProjSize) {
  LSTM lstm(3, 4, 2, true, false, 0.0, true, 2);
  const auto named = lstm.named_parameters();
  ASSERT_EQ(named.size(), 20u);
  EXPECT_EQ(named[4].first, "weight_hr_l0");
  EXPECT_EQ(named[4].second.sizes(), (Shape{2, 4}));
  EXPECT_EQ(named[1].second.sizes(), (Shape{16, 2}));   // weight_hh_l0 reads h
  EXPECT_EQ(named[10].second.sizes(), (Shape{16, 4}));  // weight_ih_l1 reads both h
  EXPECT_EQ(lstm.extra_repr(), "3, 4, num_layers=2, bidirectional=True, proj_size=2");
  auto [out, hc] = lstm(randn({5, 1, 3}));
  EXPECT_EQ(out.sizes(), (Shape{5, 1, 4}));
  EXPECT_EQ(hc.first.sizes(), (Shape{4, 1, 2}));
  EXPECT_EQ(hc.second.sizes(), (Shape{4, 1, 4}));
  EXPECT_THROW(LSTM(3, 4, 1, true, false, 0.0, false, 4), std::invalid_argument);

  LSTM one(3, 4, 1, true, false, 0.0, false, 2);
  one.to(DType::float64);
  const Tensor x = rand_input({1, 2, 3}, -1, 1, 6).detach();
  const auto p = one.named_parameters();
  const Tensor g = add(linear(x.select(0, 0), p[0].second, p[2].second), p[3].second);
  auto part = [](const Tensor& t, int k) { return t.narrow(1, k * 4, 4); };
  const Tensor c = mul(sigmoid(part(g, 0)), tanh(part(g, 2)));
  const Tensor h = linear(mul(sigmoid(part(g, 3)), tanh(c)), p[4].second, Tensor());
  EXPECT_TRUE(testing::values_near(one(x).first.select(0, 0), ops::to_vector(h), 1e-12));

  EXPECT_TRUE(lstm_gradcheck(one, rand_input({3, 2, 3}, -1, 1, 7), rand_input({1, 2, 2}, -1, 1, 8),
                             rand_input({1, 2, 4}, -1, 1, 9)));
}

}  // namespace
}  // namespace tally::nn

namespace tally::nn {
namespace {

// On an accelerator: a 2-layer bidirectional batch-first LSTM and GRU moved to the device
// give the CPU's outputs, final states and parameter gradients (float32, tolerance 1e-4).
class RecurrentVsCpu : public testing::VsCpu {};

void expect_close(const Tensor& got, const Tensor& want, const std::string& what) {
  const std::vector<double> a = ops::to_vector(got.to(Device::cpu())), b = ops::to_vector(want);
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-4) << what << " at " << i;
}

TEST_P(RecurrentVsCpu, LstmAndGruMatchTheCpu) {
  for (bool is_lstm : {true, false}) {
    Generator g1(5), g2(5);
    std::shared_ptr<RNNBase> cpu, dev_m;
    if (is_lstm) {
      cpu = std::make_shared<LSTM>(5, 7, 2, true, true, 0.0, true, &g1);
      dev_m = std::make_shared<LSTM>(5, 7, 2, true, true, 0.0, true, &g2);
    } else {
      cpu = std::make_shared<GRU>(5, 7, 2, true, true, 0.0, true, &g1);
      dev_m = std::make_shared<GRU>(5, 7, 2, true, true, 0.0, true, &g2);
    }
    dev_m->to(dev());
    const Tensor x = randn({3, 6, 5});
    const Tensor out_c = (*cpu)(x), out_d = (*dev_m)(x.to(dev()));
    expect_close(out_d, out_c, is_lstm ? "lstm output" : "gru output");
    sum(mul(out_c, out_c)).backward();
    sum(mul(out_d, out_d)).backward();
    const auto pc = cpu->named_parameters(), pd = dev_m->named_parameters();
    for (size_t i = 0; i < pc.size(); ++i)
      expect_close(pd[i].second.grad(), pc[i].second.grad(), pc[i].first);
  }
}

TALLY_VS_CPU(RecurrentVsCpu);

}  // namespace
}  // namespace tally::nn
