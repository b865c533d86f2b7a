// Activation modules over the differentiable ops (nn/activation.h).
#include "nn/activation.h"

#include <fmt/format.h>

#include "nn/functional.h"

namespace tally::nn {

Tensor SiLU::forward(const Tensor& x) {
  return silu(x);
}
Tensor Tanh::forward(const Tensor& x) {
  return tanh(x);
}
Tensor Sigmoid::forward(const Tensor& x) {
  return sigmoid(x);
}

// torch.nn.functional._get_softmax_dim: the dim a Softmax built without one reads.
int64_t SoftmaxOverDim::dim_for(const Tensor& x) const {
  if (dim) return *dim;
  return (x.dim() == 0 || x.dim() == 1 || x.dim() == 3) ? 0 : 1;
}
std::string SoftmaxOverDim::extra_repr() const {
  return dim ? fmt::format("dim={}", *dim) : "dim=None";
}

Tensor Softmax::forward(const Tensor& x) {
  return softmax(x, dim_for(x));
}
Tensor LogSoftmax::forward(const Tensor& x) {
  return log_softmax(x, dim_for(x));
}

LeakyReLU::LeakyReLU(double slope) : Module("LeakyReLU"), negative_slope(slope) {}
Tensor LeakyReLU::forward(const Tensor& x) {
  return functional::leaky_relu(x, negative_slope);
}
std::string LeakyReLU::extra_repr() const {
  return fmt::format("negative_slope={}", negative_slope);
}

}  // namespace tally::nn
