// Activation modules over the differentiable ops (nn/activation.h).
#include "nn/activation.h"

#include <fmt/format.h>

#include "nn/functional.h"

namespace tally::nn {

namespace {
// torch.nn.functional._get_softmax_dim: the dim a Softmax built without one reads.
int64_t softmax_dim(std::optional<int64_t> dim, const Tensor& x) {
  if (dim) return *dim;
  return (x.dim() == 0 || x.dim() == 1 || x.dim() == 3) ? 0 : 1;
}
std::string dim_repr(std::optional<int64_t> dim) {
  return dim ? fmt::format("dim={}", *dim) : "dim=None";
}
}  // namespace

Tensor SiLU::forward(const Tensor& x) {
  return silu(x);
}
Tensor Tanh::forward(const Tensor& x) {
  return tanh(x);
}
Tensor Sigmoid::forward(const Tensor& x) {
  return sigmoid(x);
}

Softmax::Softmax(std::optional<int64_t> d) : Module("Softmax"), dim(d) {}
Tensor Softmax::forward(const Tensor& x) {
  return softmax(x, softmax_dim(dim, x));
}
std::string Softmax::extra_repr() const {
  return dim_repr(dim);
}

LogSoftmax::LogSoftmax(std::optional<int64_t> d) : Module("LogSoftmax"), dim(d) {}
Tensor LogSoftmax::forward(const Tensor& x) {
  return log_softmax(x, softmax_dim(dim, x));
}
std::string LogSoftmax::extra_repr() const {
  return dim_repr(dim);
}

LeakyReLU::LeakyReLU(double slope) : Module("LeakyReLU"), negative_slope(slope) {}
Tensor LeakyReLU::forward(const Tensor& x) {
  return functional::leaky_relu(x, negative_slope);
}
std::string LeakyReLU::extra_repr() const {
  return fmt::format("negative_slope={}", negative_slope);
}

}  // namespace tally::nn
