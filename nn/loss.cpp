// CrossEntropyLoss over autograd's fused cross_entropy.
#include "nn/loss.h"

#include <fmt/format.h>

#include <stdexcept>

namespace tally::nn {

CrossEntropyLoss::CrossEntropyLoss(int64_t ignore, std::string red, double smoothing)
    : Module("CrossEntropyLoss"),
      ignore_index(ignore),
      reduction(std::move(red)),
      label_smoothing(smoothing) {
  if (reduction != "mean" && reduction != "sum" && reduction != "none")
    throw std::invalid_argument(
        fmt::format("CrossEntropyLoss: {} is not a valid value for reduction", reduction));
  if (label_smoothing < 0.0 || label_smoothing > 1.0)
    throw std::invalid_argument(fmt::format(
        "CrossEntropyLoss: label_smoothing must be in [0, 1], got {}", label_smoothing));
}

Tensor CrossEntropyLoss::forward(const Tensor& input, const Tensor& target) {
  return cross_entropy(input, target, ignore_index, label_smoothing, reduction);
}

std::string CrossEntropyLoss::extra_repr() const {
  return fmt::format("ignore_index={}, reduction='{}', label_smoothing={}", ignore_index, reduction,
                     label_smoothing);
}

}  // namespace tally::nn
