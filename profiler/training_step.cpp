#include "profiler/training_step.h"

#include "autograd/grad_mode.h"
#include "memory/context.h"
#include "profiler/profiler.h"

namespace tally::profiler {

Tensor annotated_training_step(const std::function<Tensor()>& forward,
                               const std::function<void()>& optimizer_step,
                               std::source_location loc) {
  Tensor loss;
  {
    record_function r("## Forward Pass ##", loc);
    loss = forward();
  }
  {
    record_function r("## Backward Pass ##", loc);
    loss.backward();
  }
  record_function r("## Optimizer ##", loc);
  memory::PhaseScope phase("optimizer");
  NoGradGuard no_grad;
  optimizer_step();
  return loss;
}

}  // namespace tally::profiler
