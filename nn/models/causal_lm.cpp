#include "nn/models/causal_lm.h"

#include <fmt/format.h>

#include <stdexcept>

#include "tensor/softmax/autograd.h"

namespace tally::nn {

void CausalLM::check_targets(const Tensor& idx, const Tensor& targets) const {
  if (targets.defined() && targets.sizes() != idx.sizes())
    throw std::invalid_argument(fmt::format("{}: targets {} do not match idx {}", type_name(),
                                            targets.shape_string(), idx.shape_string()));
}

std::pair<Tensor, Tensor> CausalLM::classify(const Tensor& x, const Tensor& targets, bool fused,
                                             int64_t chunk_bytes) {
  if (fused && targets.defined()) {
    // lm_head's product and the loss in one op, under lm_head's scope as its call would be.
    Tensor loss = lm_head->call([&] {
      return linear_cross_entropy(x.reshape({-1, x.size(-1)}), lm_head->weight,
                                  targets.reshape({-1}), -1, "mean", 0, chunk_bytes);
    });
    return {Tensor(), loss};
  }
  Tensor logits = (*lm_head)(x);
  Tensor loss;
  if (targets.defined())
    loss = cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}), -1);
  return {logits, loss};
}

}  // namespace tally::nn
