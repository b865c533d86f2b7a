// The fused recurrent cells (lstm_cell_gates, gru_cell_gates), one file for every device
// (tests/testing/devices.h). On each device (the CPU in test_rnn, CUDA in test_rnn_cuda): the
// fused step against the same step composed from sigmoid, tanh, add and mul, float64 gradient
// checks of every input, and errors naming the op and the shapes. On CUDA only, against the
// CPU kernels: forward and backward over float32, float64, float16 and bfloat16. The
// whole-layer cuDNN route takes nothing off CUDA (tests/nn/test_recurrent_cudnn_cuda.cpp
// tests it on CUDA).
#include "autograd/node.h"
#include "tensor/rnn/autograd.h"
#include "tensor/rnn/ops.h"
#include "tensor/shape/autograd.h"
#include "testing/cuda_testing.h"
#include "testing/devices.h"

namespace tally {
namespace {

using namespace testing;

// The LSTM step from unfused ops: gates (i, f, g, o) in PyTorch's order.
std::pair<Tensor, Tensor> lstm_reference(const Tensor& gx, const Tensor& gh, const Tensor& c0) {
  const int64_t H = c0.size(1);
  const Tensor pre = add(gx, gh);
  const Tensor i = sigmoid(pre.narrow(1, 0, H)), f = sigmoid(pre.narrow(1, H, H));
  const Tensor g = tanh(pre.narrow(1, 2 * H, H)), o = sigmoid(pre.narrow(1, 3 * H, H));
  const Tensor c = add(mul(f, c0), mul(i, g));
  return {mul(o, tanh(c)), c};
}

// The GRU step from unfused ops: gates (r, z, n), n = tanh(x_n + r * h_n).
Tensor gru_reference(const Tensor& gx, const Tensor& gh, const Tensor& h0) {
  const int64_t H = h0.size(1);
  auto part = [H](const Tensor& t, int k) { return t.narrow(1, k * H, H); };
  const Tensor r = sigmoid(add(part(gx, 0), part(gh, 0)));
  const Tensor z = sigmoid(add(part(gx, 1), part(gh, 1)));
  const Tensor n = tanh(add(part(gx, 2), mul(r, part(gh, 2))));
  // (1 - z) * n + z * h0 = n + z * (h0 - n)
  return add(n, mul(z, sub(h0, n)));
}

class RnnCell : public OnDevice {};

TEST_P(RnnCell, LstmStepMatchesTheComposedOps) {
  const Tensor gx = put(rand_tensor({3, 20}, DType::float64, 1));
  const Tensor gh = put(rand_tensor({3, 20}, DType::float64, 2));
  const Tensor c0 = put(rand_tensor({3, 5}, DType::float64, 3));
  auto [h, c] = lstm_cell_gates(gx, gh, c0);
  auto [rh, rc] = lstm_reference(gx, gh, c0);
  EXPECT_TRUE(values_near(h.to(kCpu), ops::to_vector(rh.to(kCpu)), 1e-12));
  EXPECT_TRUE(values_near(c.to(kCpu), ops::to_vector(rc.to(kCpu)), 1e-12));
  EXPECT_EQ(h.device(), dev());
}

TEST_P(RnnCell, GruStepMatchesTheComposedOps) {
  const Tensor gx = put(rand_tensor({4, 9}, DType::float64, 4));
  const Tensor gh = put(rand_tensor({4, 9}, DType::float64, 5));
  const Tensor h0 = put(rand_tensor({4, 3}, DType::float64, 6));
  const Tensor h = gru_cell_gates(gx, gh, h0);
  EXPECT_TRUE(values_near(h.to(kCpu), ops::to_vector(gru_reference(gx, gh, h0).to(kCpu)), 1e-12));
}

TEST_P(RnnCell, LstmGradcheck) {
  const Tensor gx = rand_input({2, 12}, -2, 2, 7), gh = rand_input({2, 12}, -2, 2, 8);
  const Tensor c0 = rand_input({2, 3}, -1, 1, 9);
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& in) {
                             auto [h, c] = lstm_cell_gates(in[0], in[1], in[2]);
                             return cat({h, c}, 1);
                           },
                           {gx, gh, c0}));
  // Only h used: c's gradient arrives as zeros.
  EXPECT_TRUE(gradcheck_on(
      dev(), [](const TensorList& in) { return lstm_cell_gates(in[0], in[1], in[2]).first; },
      {gx, gh, c0}));
}

TEST_P(RnnCell, GruGradcheck) {
  const Tensor gx = rand_input({3, 6}, -2, 2, 10), gh = rand_input({3, 6}, -2, 2, 11);
  const Tensor h0 = rand_input({3, 2}, -1, 1, 12);
  EXPECT_TRUE(gradcheck_on(dev(),
                           [](const TensorList& in) { return gru_cell_gates(in[0], in[1], in[2]); },
                           {gx, gh, h0}));
}

TEST_P(RnnCell, ErrorsNameTheOpAndShapes) {
  const Tensor g = put(ops::zeros({2, 8}));
  try {
    (void)ops::lstm_cell_gates(g, g, put(ops::zeros({2, 3})));
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("lstm_cell_gates: c_prev must be [2, 2]"),
              std::string::npos)
        << e.what();
  }
  try {
    (void)ops::gru_cell_gates(put(ops::zeros({2, 7})), g, put(ops::zeros({2, 2})));
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("gru_cell_gates: gates must be 2-D"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(
      (void)ops::gru_cell_gates(put(ops::zeros({2, 6})), put(ops::zeros({2, 6}, DType::float64)),
                                put(ops::zeros({2, 2}))),
      std::invalid_argument);
}

TALLY_ON_DEVICES(RnnCell);

class RnnCellVsCpu : public VsCpu {};

TEST_P(RnnCellVsCpu, ForwardAndBackwardMatchTheCpu) {
  uint64_t seed = 20;
  for (const Shape& bh : {Shape{1, 1}, Shape{3, 17}, Shape{64, 650}}) {
    const int64_t B = bh[0], H = bh[1];
    for (DType d : kFloatDtypes) {
      const double tol = pointwise_tol(d) * 4;
      const Pair gx = both({B, 4 * H}, d, ++seed), gh = both({B, 4 * H}, d, ++seed);
      const Pair c0 = both({B, H}, d, ++seed), dh = both({B, H}, d, ++seed),
                 dc = both({B, H}, d, ++seed);
      auto [h_g, c_g, ws_g] = ops::lstm_cell_gates(gx.gpu, gh.gpu, c0.gpu);
      auto [h_c, c_c, ws_c] = ops::lstm_cell_gates(gx.cpu, gh.cpu, c0.cpu);
      EXPECT_TRUE(close_to_cpu(h_g, h_c, tol, case_label("lstm h", bh, d)));
      EXPECT_TRUE(close_to_cpu(c_g, c_c, tol, case_label("lstm c", bh, d)));
      EXPECT_TRUE(close_to_cpu(ws_g, ws_c, tol, case_label("lstm workspace", bh, d)));
      auto [gg_g, gcp_g] = ops::lstm_cell_gates_backward(dh.gpu, dc.gpu, c0.gpu, c_g, ws_g);
      auto [gg_c, gcp_c] = ops::lstm_cell_gates_backward(dh.cpu, dc.cpu, c0.cpu, c_c, ws_c);
      EXPECT_TRUE(close_to_cpu(gg_g, gg_c, tol, case_label("lstm grad_gates", bh, d)));
      EXPECT_TRUE(close_to_cpu(gcp_g, gcp_c, tol, case_label("lstm grad_c_prev", bh, d)));
      // No gradient for c (undefined): the kernels read zeros.
      auto [gg2_g, gcp2_g] = ops::lstm_cell_gates_backward(dh.gpu, Tensor(), c0.gpu, c_g, ws_g);
      auto [gg2_c, gcp2_c] = ops::lstm_cell_gates_backward(dh.cpu, Tensor(), c0.cpu, c_c, ws_c);
      EXPECT_TRUE(close_to_cpu(gg2_g, gg2_c, tol, case_label("lstm grad_gates no dc", bh, d)));

      const Pair rx = both({B, 3 * H}, d, ++seed), rh = both({B, 3 * H}, d, ++seed);
      auto [gh_g, gws_g] = ops::gru_cell_gates(rx.gpu, rh.gpu, c0.gpu);
      auto [gh_c, gws_c] = ops::gru_cell_gates(rx.cpu, rh.cpu, c0.cpu);
      EXPECT_TRUE(close_to_cpu(gh_g, gh_c, tol, case_label("gru h", bh, d)));
      EXPECT_TRUE(close_to_cpu(gws_g, gws_c, tol, case_label("gru workspace", bh, d)));
      auto [gx_g, ghh_g, ghp_g] = ops::gru_cell_gates_backward(dh.gpu, c0.gpu, gws_g);
      auto [gx_c, ghh_c, ghp_c] = ops::gru_cell_gates_backward(dh.cpu, c0.cpu, gws_c);
      EXPECT_TRUE(close_to_cpu(gx_g, gx_c, tol, case_label("gru grad_gates_x", bh, d)));
      EXPECT_TRUE(close_to_cpu(ghh_g, ghh_c, tol, case_label("gru grad_gates_h", bh, d)));
      EXPECT_TRUE(close_to_cpu(ghp_g, ghp_c, tol, case_label("gru grad_h_prev", bh, d)));
    }
  }
}

TALLY_VS_CPU(RnnCellVsCpu);

// The whole-layer route (cudnn_rnn) exists on CUDA only: on the CPU and the meta device it
// takes nothing and computes nothing, so nn::LSTM / nn::GRU run their per-timestep path.
TEST(CudnnRnnRoute, TakesNothingOffCuda) {
  CudnnRnnSpec spec;
  spec.input_size = 2;
  spec.hidden_size = 3;
  for (Device d : {Device::cpu(), Device::meta()}) {
    const TensorOptions o = TensorOptions{}.with_device(d);
    const TensorList w = {zeros({12, 2}, o), zeros({12, 3}, o), zeros({12}, o), zeros({12}, o)};
    EXPECT_FALSE(cudnn_rnn(spec, zeros({4, 1, 2}, o), Tensor(), Tensor(), w).has_value());
  }
}

// Bad arguments are errors naming the op and the shapes, on every device, before any work.
TEST(CudnnRnnRoute, ErrorsNameTheOpAndShapes) {
  CudnnRnnSpec spec;
  spec.input_size = 2;
  spec.hidden_size = 3;
  const TensorList w = {zeros({12, 2}), zeros({12, 3}), zeros({12}), zeros({12})};
  auto message = [&](const Tensor& x, const Tensor& h0, const TensorList& ws) {
    try {
      (void)cudnn_rnn(spec, x, h0, Tensor(), ws);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(zeros({4, 1, 5}), Tensor(), w)
                .find("cudnn_rnn: x must be [T, B, input_size=2], got [4, 1, 5]"),
            std::string::npos);
  EXPECT_NE(message(zeros({4, 1, 2}), zeros({1, 2, 3}), w)
                .find("cudnn_rnn: h0 must be [1, 1, 3], got [1, 2, 3]"),
            std::string::npos);
  EXPECT_NE(message(zeros({4, 1, 2}), Tensor(), {w[0], w[1]}).find("cudnn_rnn: expected 4 weights"),
            std::string::npos);
  EXPECT_NE(message(zeros({4, 1, 2}), Tensor(), {w[1], w[1], w[2], w[3]})
                .find("w_ih of cell 0 must be [12, 2]"),
            std::string::npos);
}

}  // namespace
}  // namespace tally
