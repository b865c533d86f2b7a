// Grad mode: whether ops record the autograd graph (thread-local), and PyTorch's guards.
#pragma once

#include "base/scope_guard.h"

namespace tally {

struct GradMode {
  static bool is_enabled();
  static void set_enabled(bool enabled);
};

// c10::AutoGradMode: grad mode set to `enabled` inside, the previous mode restored on exit.
class AutoGradMode : base::ScopeGuard<bool> {
 public:
  explicit AutoGradMode(bool enabled) : ScopeGuard(GradMode::is_enabled()) {
    GradMode::set_enabled(enabled);
  }
  ~AutoGradMode() { GradMode::set_enabled(saved_); }
};

// torch.no_grad(): ops inside record nothing.
class NoGradGuard : public AutoGradMode {
 public:
  NoGradGuard() : AutoGradMode(false) {}
};

// torch.enable_grad(): recording on again inside a no_grad region.
class EnableGradGuard : public AutoGradMode {
 public:
  EnableGradGuard() : AutoGradMode(true) {}
};

}  // namespace tally
