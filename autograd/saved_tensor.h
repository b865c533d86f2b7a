// SavedTensor: the one way autograd keeps a tensor for backward. Saving is where
// activation memory is decided, so it is also where it is accounted: a saved block that
// was a temporary is re-tagged `activation` while anything saves it, and back when the
// last saved reference is released.
//
// Pack/unpack hooks (thread-local, stackable, like torch.autograd.graph.saved_tensors_hooks)
// replace what is kept: checkpointing keeps nothing and recomputes; CPU offload keeps a
// host copy.
#pragma once

#include <any>
#include <functional>
#include <memory>

#include "base/scope_guard.h"
#include "tensor/tensor.h"

namespace tally {

struct SavedTensorHooks {
  std::function<std::any(const Tensor&)> pack;
  std::function<Tensor(const std::any&)> unpack;
  // Optional: the output of each product (linear, matmul, mm, bmm, conv2d) inside the scope
  // comes from product(compute), compute() making it. Selective checkpointing
  // (nn/checkpoint.cpp) notes the outputs in forward and hands the kept ones back in its
  // recompute instead of multiplying again (PyTorch's selective checkpoint replays them too).
  std::function<Tensor(const std::function<Tensor()>& compute)> product;
};

// A product's output: through the innermost hooks' `product` where it has one, else compute().
Tensor product_output(const std::function<Tensor()>& compute);

// RAII: hooks for every tensor saved inside the scope on this thread.
class SavedTensorHooksScope : base::ScopeGuard<void> {
 public:
  explicit SavedTensorHooksScope(SavedTensorHooks hooks);
  ~SavedTensorHooksScope();
};

class SavedTensor {
 public:
  SavedTensor() = default;
  // Save `t` (undefined is allowed and unpacks to undefined). `what` names the op for
  // errors.
  SavedTensor(const Tensor& t, const char* what);
  // With apply_hooks false the tensor is held as is, whatever hooks are installed (a hook
  // that keeps some tensors, e.g. checkpointing's, stores them this way so that they are
  // accounted as `activation` like any saved tensor).
  SavedTensor(const Tensor& t, const char* what, bool apply_hooks);
  ~SavedTensor();
  SavedTensor(SavedTensor&&) noexcept;
  SavedTensor& operator=(SavedTensor&&) noexcept;
  SavedTensor(const SavedTensor&) = delete;
  SavedTensor& operator=(const SavedTensor&) = delete;

  // The saved tensor (detached). Throws if released, or if it was modified in place since.
  Tensor unpack() const;
  void release();
  bool defined() const { return state_ != State::empty; }
  bool released() const { return state_ == State::released; }
  // The storage held (for memory accounting); undefined when packed by hooks.
  const Tensor& held() const { return data_; }

 private:
  enum class State { empty, held, packed, released };
  State state_ = State::empty;
  Tensor data_;
  std::any packed_;
  std::shared_ptr<SavedTensorHooks> hooks_;
  uint64_t version_ = 0;
  const char* what_ = "";
  bool counted_ = false;
};

}  // namespace tally
