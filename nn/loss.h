// Loss modules (torch.nn.CrossEntropyLoss).
#pragma once

#include <string>

#include "nn/module.h"

namespace tally::nn {

// Class-index targets; reduction "mean" | "sum" | "none"; rows whose target is
// ignore_index contribute nothing; label_smoothing in [0, 1].
class CrossEntropyLoss : public Module {
 public:
  explicit CrossEntropyLoss(int64_t ignore_index = -100, std::string reduction = "mean",
                            double label_smoothing = 0.0);
  Tensor forward(const Tensor& input, const Tensor& target);
  Tensor operator()(const Tensor& input, const Tensor& target,
                    const std::source_location& site = std::source_location::current()) {
    return call([&] { return forward(input, target); }, site);
  }
  std::string extra_repr() const override;

  int64_t ignore_index;
  std::string reduction;
  double label_smoothing;
};

}  // namespace tally::nn
