#include "optim/step_in_backward.h"

#include <fmt/format.h>

#include <set>
#include <stdexcept>

#include "autograd/node.h"

namespace tally::optim {

StepInBackward::StepInBackward(Optimizer& opt) : opt_(opt) {
  std::set<const void*> seen;
  size_t index = 0;
  for (const ParamGroup& g : opt.param_groups())
    for (const Tensor& p : g.params) {
      if (!p.requires_grad())
        throw std::invalid_argument(
            fmt::format("StepInBackward({}): parameter {} of shape {} does not require grad",
                        opt.name(), index, p.shape_string()));
      if (!seen.insert(p.storage().key()).second)
        throw std::invalid_argument(fmt::format(
            "StepInBackward({}): parameter {} appears twice in the optimizer", opt.name(), index));
      ++index;
    }
  index = 0;
  try {
    for (const ParamGroup& g : opt.param_groups())
      for (const Tensor& p : g.params) {
        const size_t i = index++;
        const uint64_t h =
            autograd::register_post_accumulate_grad_hook(p, [this, i](const Tensor& leaf) {
              opt_.step_param(i);
              ++updates_;
              leaf.set_grad(Tensor());  // the gradient is spent: free it now
            });
        hooks_.emplace_back(p, h);
      }
  } catch (...) {
    for (auto& [p, h] : hooks_) autograd::remove_post_accumulate_grad_hook(p, h);
    throw;
  }
}

StepInBackward::~StepInBackward() {
  for (auto& [p, h] : hooks_) autograd::remove_post_accumulate_grad_hook(p, h);
}

}  // namespace tally::optim
