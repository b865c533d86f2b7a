// ScopeGuard<T>: the base of Tally's RAII scopes and guards (CategoryScope, NoGradGuard,
// autocast::StateScope, ...). Each saves some thread-local state when it opens and puts it
// back when it closes; the base holds what was saved and makes the guard non-copyable, so
// that the state is restored exactly once. The derived guard's constructor sets the new
// state and its destructor restores `saved_`.
#pragma once

#include <utility>

namespace tally::base {

template <typename T>
class ScopeGuard {
 public:
  ScopeGuard(const ScopeGuard&) = delete;
  ScopeGuard& operator=(const ScopeGuard&) = delete;

 protected:
  explicit ScopeGuard(T saved) : saved_(std::move(saved)) {}
  ~ScopeGuard() = default;

  T saved_;
};

// A guard with nothing to save (it pushes onto a stack and pops in its destructor).
template <>
class ScopeGuard<void> {
 public:
  ScopeGuard(const ScopeGuard&) = delete;
  ScopeGuard& operator=(const ScopeGuard&) = delete;

 protected:
  ScopeGuard() = default;
  ~ScopeGuard() = default;
};

}  // namespace tally::base
