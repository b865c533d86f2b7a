// scaled_dot_product_attention: values against a hand composition, causal and explicit
// masks, dropout, gradients in float64.
#include "autograd/attention.h"
#include "autograd/softmax.h"
#include "gradcheck.h"

namespace tally {
namespace {

using namespace testing;

TEST(Attention, MatchesTheDefinition) {
  const Tensor q = rand_input({2, 3, 4}, -1, 1, 1), k = rand_input({2, 5, 4}, -1, 1, 2),
               v = rand_input({2, 5, 6}, -1, 1, 3);
  const Tensor out = scaled_dot_product_attention(q, k, v);
  EXPECT_EQ(out.sizes(), (Shape{2, 3, 6}));
  const Tensor ref = matmul(softmax(matmul(q, k.transpose(1, 2)) * 0.5, -1), v);
  EXPECT_TRUE(values_near(out, ref.tolist(), 1e-12));
}

TEST(Attention, CausalMaskKeepsThePast) {
  // With v = identity rows, row i of the output is the attention distribution: zero for j > i.
  const Tensor q = rand_input({4, 3}, -1, 1, 4), k = rand_input({4, 3}, -1, 1, 5);
  const Tensor v = ops::to(from_vector({1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1}, {4, 4}), DType::float64);
  const std::vector<double> p = scaled_dot_product_attention(q, k, v, {}, 0.0, true).tolist();
  for (int i = 0; i < 4; ++i) {
    double row = 0;
    for (int j = 0; j < 4; ++j) {
      if (j > i) {
        EXPECT_EQ(p[static_cast<size_t>(i * 4 + j)], 0.0);
      }
      row += p[static_cast<size_t>(i * 4 + j)];
    }
    EXPECT_NEAR(row, 1.0, 1e-12);
  }
  EXPECT_NEAR(p[0], 1.0, 1e-12);  // the first query sees only the first key
  // A bool mask equal to the causal one gives the same result.
  const Tensor mask = from_vector({1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1}, {4, 4},
                                  TensorOptions{}.with_dtype(DType::bool_));
  EXPECT_TRUE(values_near(scaled_dot_product_attention(q, k, v, mask), p, 1e-12));
  EXPECT_THROW(scaled_dot_product_attention(q, k, v, mask, 0.0, true), std::invalid_argument);
  EXPECT_THROW(scaled_dot_product_attention(q, rand_input({4, 2}), v), std::invalid_argument);
}

TEST(Attention, Gradients) {
  const Tensor q = rand_input({2, 3, 4}, -1, 1, 6), k = rand_input({2, 3, 4}, -1, 1, 7),
               v = rand_input({2, 3, 2}, -1, 1, 8);
  EXPECT_TRUE(gradcheck([](const TensorList& x) { return scaled_dot_product_attention(x[0], x[1], x[2]); }, {q, k, v}));
  EXPECT_TRUE(gradcheck([](const TensorList& x) {
    return scaled_dot_product_attention(x[0], x[1], x[2], {}, 0.0, true);
  }, {q, k, v}));
  const Tensor bias = ops::to(from_vector({0, -1, 2, 0.5, 0, -3, 1, 1, 0}, {3, 3}), DType::float64);
  EXPECT_TRUE(gradcheck([&](const TensorList& x) {
    return scaled_dot_product_attention(x[0], x[1], x[2], bias, 0.0, false, 0.3);
  }, {q, k, v}));
}

TEST(Attention, DropoutReplaysWithTheSameGenerator) {
  const Tensor q = rand_input({8, 4}, -1, 1, 9), k = rand_input({8, 4}, -1, 1, 10), v = rand_input({8, 4}, -1, 1, 11);
  Generator g1(3), g2(3);
  const Tensor a = scaled_dot_product_attention(q, k, v, {}, 0.5, false, std::nullopt, &g1);
  const Tensor b = scaled_dot_product_attention(q, k, v, {}, 0.5, false, std::nullopt, &g2);
  EXPECT_TRUE(values_near(a, b.tolist(), 0));
  EXPECT_FALSE(values_near(a, scaled_dot_product_attention(q, k, v).tolist(), 1e-9));
}

}  // namespace
}  // namespace tally
