// One training step annotated as torch.profiler's recipe annotates it, for hand-written loops
// that profile a model and its update (examples/profile_demo, tests/profiler/tiny_cnn.h).
#pragma once

#include <functional>
#include <source_location>

#include "tensor/tensor.h"

namespace tally::profiler {

// `forward` (it returns the loss) inside record_function("## Forward Pass ##"), the loss's
// backward inside "## Backward Pass ##" (the engine's phase "backward"), then `optimizer_step`
// inside "## Optimizer ##", memory phase "optimizer" and no-grad mode. The ranges carry the
// caller's source location. Returns the loss.
Tensor annotated_training_step(const std::function<Tensor()>& forward,
                               const std::function<void()>& optimizer_step,
                               std::source_location loc = std::source_location::current());

}  // namespace tally::profiler
