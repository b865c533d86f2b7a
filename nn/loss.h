// Loss modules (torch.nn): CrossEntropyLoss; MSELoss, L1Loss, SmoothL1Loss, HuberLoss,
// BCEWithLogitsLoss, NLLLoss, KLDivLoss over nn/functional.h and the softmax family.
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
  using Module::forward;  // the single-tensor one, which throws: a loss takes (input, target)
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

// A loss of (input, target) with a `reduction`: "mean" | "sum" | "none" (KLDivLoss also
// "batchmean"), checked when the loss is built.
class PairLoss : public Module {
 public:
  PairLoss(std::string type_name, std::string reduction, bool batchmean = false);
  using Module::forward;  // the single-tensor one, which throws: a loss takes (input, target)
  virtual Tensor forward(const Tensor& input, const Tensor& target) = 0;
  Tensor operator()(const Tensor& input, const Tensor& target,
                    const std::source_location& site = std::source_location::current()) {
    return call([&] { return forward(input, target); }, site);
  }
  std::string extra_repr() const override;
  std::string reduction;
};

class MSELoss : public PairLoss {
 public:
  explicit MSELoss(std::string reduction = "mean") : PairLoss("MSELoss", std::move(reduction)) {}
  Tensor forward(const Tensor& input, const Tensor& target) override;
};

class L1Loss : public PairLoss {
 public:
  explicit L1Loss(std::string reduction = "mean") : PairLoss("L1Loss", std::move(reduction)) {}
  Tensor forward(const Tensor& input, const Tensor& target) override;
};

class SmoothL1Loss : public PairLoss {
 public:
  explicit SmoothL1Loss(std::string reduction = "mean", double beta = 1.0);
  Tensor forward(const Tensor& input, const Tensor& target) override;
  std::string extra_repr() const override;
  double beta;
};

class HuberLoss : public PairLoss {
 public:
  explicit HuberLoss(std::string reduction = "mean", double delta = 1.0);
  Tensor forward(const Tensor& input, const Tensor& target) override;
  std::string extra_repr() const override;
  double delta;
};

// weight and pos_weight (undefined: none) are registered as buffers, as PyTorch does.
class BCEWithLogitsLoss : public PairLoss {
 public:
  explicit BCEWithLogitsLoss(Tensor weight = {}, std::string reduction = "mean",
                             Tensor pos_weight = {});
  Tensor forward(const Tensor& input, const Tensor& target) override;
  Tensor weight, pos_weight;
};

// Log-probabilities and class indices; rows whose target is ignore_index count for nothing.
class NLLLoss : public PairLoss {
 public:
  explicit NLLLoss(int64_t ignore_index = -100, std::string reduction = "mean");
  Tensor forward(const Tensor& input, const Tensor& target) override;
  std::string extra_repr() const override;
  int64_t ignore_index;
};

class KLDivLoss : public PairLoss {
 public:
  explicit KLDivLoss(std::string reduction = "mean", bool log_target = false);
  Tensor forward(const Tensor& input, const Tensor& target) override;
  std::string extra_repr() const override;
  bool log_target;
};

}  // namespace tally::nn
