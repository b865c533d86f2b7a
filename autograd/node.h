// The autograd graph: nodes (one per differentiable op application), edges to the nodes
// that produced the inputs, and the per-tensor metadata that links a tensor to its node.
//
// A differentiable op is written in one place (tensor/<family>/autograd.cpp): it computes its
// outputs with ops:: kernels, then, when grad is needed, calls record() with the tensors
// it saves for backward and the backward formula as a lambda:
//
//   Tensor out = ops::mul(a, b);
//   record("MulBackward", {a, b}, {out}, {b, a},      // inputs, outputs, saved
//          [=](BackwardContext& ctx, const TensorList& g) -> TensorList {
//            return {ops::mul(g[0], ctx.saved(0)), ops::mul(g[0], ctx.saved(1))};
//          });
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "autograd/grad_mode.h"
#include "autograd/saved_tensor.h"
#include "tensor/tensor.h"

namespace tally::autograd {

class Node;
using Hook = std::function<Tensor(const Tensor&)>;
// Runs after a leaf's .grad has been accumulated, with the leaf itself
// (torch.Tensor.register_post_accumulate_grad_hook).
using PostAccumulateGradHook = std::function<void(const Tensor&)>;

struct Edge {
  std::shared_ptr<Node> fn;
  uint32_t input_nr = 0;
  bool valid() const { return fn != nullptr; }
};

struct AutogradMeta {
  bool requires_grad = false;
  Tensor grad;
  std::shared_ptr<Node> grad_fn;  // set for non-leaf tensors
  uint32_t output_nr = 0;
  std::weak_ptr<Node> grad_accumulator;  // leaf tensors
  std::vector<Hook> hooks;               // leaf tensors (non-leaf hooks live on grad_fn)
  // Leaf tensors: (handle, hook), run in registration order after .grad was accumulated.
  std::vector<std::pair<uint64_t, PostAccumulateGradHook>> post_accumulate_grad_hooks;
};

// Shape, dtype and device of a node's output, to materialise a zero gradient.
struct OutputMeta {
  Shape shape;
  DType dtype = DType::float32;
  Device device;
};

class Node : public std::enable_shared_from_this<Node> {
 public:
  virtual ~Node() = default;
  // Gradients w.r.t. each output -> gradients w.r.t. each input (next_edges order).
  virtual TensorList apply(const TensorList& grad_outputs) = 0;
  virtual std::string name() const = 0;
  // Free what was saved for backward (after backward without retain_graph).
  virtual void release_saved() {}
  // The tensors this node holds for backward (memory accounting, tests).
  virtual std::vector<const SavedTensor*> saved_tensors() const { return {}; }

  std::vector<Edge> next_edges;
  std::vector<OutputMeta> outputs;
  std::vector<std::vector<Hook>> output_hooks;  // per output, run before apply
  uint64_t sequence_nr = 0;
};

class BackwardContext;
using BackwardFn = std::function<TensorList(BackwardContext& ctx, const TensorList& grads)>;

// A node whose backward is a lambda over what it saved.
class FunctionNode final : public Node {
 public:
  FunctionNode(std::string name, BackwardFn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  TensorList apply(const TensorList& grad_outputs) override;
  std::string name() const override { return name_; }
  void release_saved() override;
  std::vector<const SavedTensor*> saved_tensors() const override;

  std::vector<SavedTensor> saved;
  std::vector<bool> needs_input_grad;

 private:
  std::string name_;
  BackwardFn fn_;
};

class BackwardContext {
 public:
  explicit BackwardContext(FunctionNode& node) : node_(node) {}
  // The i-th saved tensor (throws if released or modified in place).
  Tensor saved(size_t i) const { return node_.saved.at(i).unpack(); }
  bool needs_input_grad(size_t i) const { return node_.needs_input_grad.at(i); }

 private:
  FunctionNode& node_;
};

// Accumulates into a leaf's .grad (tagged `gradient`).
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(Tensor variable) : variable_(std::move(variable)) {}
  TensorList apply(const TensorList& grad_outputs) override;
  std::string name() const override { return "AccumulateGrad"; }
  const Tensor& variable() const { return variable_; }

 private:
  Tensor variable_;
};

// Whether any of `tensors` requires grad and grad mode is on.
bool needs_grad(std::initializer_list<Tensor> tensors);
bool needs_grad(const TensorList& tensors);

// The edge a gradient for `t` flows into: its grad_fn, or its leaf accumulator.
Edge gradient_edge(const Tensor& t);

// The dtype backward delivers t's gradient in: what t's grad_fn declares for that output (a
// tensor's own dtype, except autocast's cached weight casts, whose gradient goes back to the
// float32 parameter and is taken in float32: record_weight_cast), or t's own dtype for a leaf
// or a tensor that needs no gradient. An op may produce that dtype directly (linear's weight
// gradient: the GEMM writes float32 from 16-bit operands) instead of a 16-bit gradient the
// engine would convert.
DType grad_dtype(const Tensor& t);

// Build a FunctionNode for `outputs` computed from `inputs`, saving `saved` (undefined
// entries allowed) and attach it to the outputs (which become non-leaf, requires_grad).
// Does nothing when no input requires grad or grad mode is off.
std::shared_ptr<FunctionNode> record(const char* name, const TensorList& inputs,
                                     const TensorList& outputs, const TensorList& saved,
                                     BackwardFn fn);
// The same with `saved` made before the op computed (save_inputs).
std::shared_ptr<FunctionNode> record_saved(const char* name, const TensorList& inputs,
                                           const TensorList& outputs,
                                           std::vector<SavedTensor> saved, BackwardFn fn);
// For an op that saves only its inputs: the saved tensors made before it computes, as PyTorch's
// generated code makes them. Saving runs the saved-tensor hooks, so a checkpoint recompute that
// has every tensor backward needs stops here, before the op's work (nn/checkpoint.h: early
// stop); e.g. the last matrix product of a transformer block is never recomputed. Empty when
// record() would record nothing (no input requires grad, or grad mode is off).
std::vector<SavedTensor> save_inputs(const char* name, const TensorList& inputs,
                                     const TensorList& saved);

uint64_t next_sequence_nr();
// The priority of a node that only hands a leaf's gradient on (AccumulateGrad, autocast's weight
// casts): above every op node, so it runs as soon as its gradient is complete.
inline constexpr uint64_t kRunWhenReadySeq = UINT64_MAX;

// torch.Tensor.register_post_accumulate_grad_hook: on a leaf that requires grad, `hook(leaf)`
// runs after backward has accumulated into leaf.grad(). Returns a handle for removal.
uint64_t register_post_accumulate_grad_hook(const Tensor& leaf, PostAccumulateGradHook hook);
void remove_post_accumulate_grad_hook(const Tensor& leaf, uint64_t handle);

}  // namespace tally::autograd
