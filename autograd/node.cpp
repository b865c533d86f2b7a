#include "autograd/node.h"

#include <atomic>

#include "tensor/ops.h"

namespace tally::autograd {

namespace {
thread_local bool tls_grad_enabled = true;
// Op nodes count from 1. AccumulateGrad nodes take the highest number (kRunWhenReadySeq), as
// PyTorch's do: the engine's ready queue runs the latest op first, so a leaf's gradient lands
// in .grad (and its post-accumulate-grad hooks run: CpuOffload's copies, step-in-backward, DDP)
// as soon as it is complete, not at the end of backward with every other gradient held until
// then. No op node ever ties with them.
std::atomic<uint64_t> g_sequence{1};
}  // namespace

uint64_t next_sequence_nr() {
  return g_sequence.fetch_add(1);
}

TensorList FunctionNode::apply(const TensorList& grad_outputs) {
  BackwardContext ctx(*this);
  TensorList grads = fn_(ctx, grad_outputs);
  if (grads.size() != next_edges.size())
    throw std::logic_error(name_ + ": backward returned " + std::to_string(grads.size()) +
                           " gradients for " + std::to_string(next_edges.size()) + " inputs");
  return grads;
}

void FunctionNode::release_saved() {
  for (SavedTensor& s : saved) s.release();
}

std::vector<const SavedTensor*> FunctionNode::saved_tensors() const {
  std::vector<const SavedTensor*> out;
  for (const SavedTensor& s : saved) out.push_back(&s);
  return out;
}

TensorList AccumulateGrad::apply(const TensorList& grad_outputs) {
  Tensor g = grad_outputs.at(0);
  AutogradMeta* meta = variable_.autograd_meta();
  if (!g.defined() || !meta) return {};
  for (const Hook& h : meta->hooks) {
    Tensor r = h(g);
    if (r.defined()) g = r;
  }
  memory::CategoryScope cat(memory::Category::gradient);
  if (!meta->grad.defined()) {
    // Steal the incoming buffer when nothing else holds it (the tensor is held here and by
    // the engine's list alone: a backward that hands one gradient to two inputs, as add's,
    // gives each leaf a copy, else the two .grads would share their memory); else copy it.
    // The .grad takes the variable's memory format (a channels_last parameter's is
    // channels_last), as PyTorch's does.
    const MemoryFormat f = variable_.suggest_memory_format();
    if (g.use_count() <= 2 && g.storage().use_count() == 1 && g.is_contiguous(f) &&
        g.sizes() == variable_.sizes() && g.dtype() == variable_.dtype()) {
      if (g.storage().category() != memory::Category::gradient)
        g.storage().retag(memory::Category::gradient);
      meta->grad = g;
    } else {
      meta->grad = ops::to(ops::expand(g, variable_.sizes()), variable_.device(), variable_.dtype(),
                           /*copy=*/true);
      if (!meta->grad.is_contiguous(f)) meta->grad = ops::contiguous(meta->grad, f);
    }
  } else {
    ops::add_(meta->grad, g);
  }
  // Copy the list: a hook may register or remove hooks.
  if (!meta->post_accumulate_grad_hooks.empty()) {
    const auto hooks = meta->post_accumulate_grad_hooks;
    for (const auto& [handle, hook] : hooks) hook(variable_);
  }
  return {};
}

bool needs_grad(std::initializer_list<Tensor> tensors) {
  if (!GradMode::is_enabled()) return false;
  for (const Tensor& t : tensors)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

bool needs_grad(const TensorList& tensors) {
  if (!GradMode::is_enabled()) return false;
  for (const Tensor& t : tensors)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

DType grad_dtype(const Tensor& t) {
  const AutogradMeta* meta = t.autograd_meta();
  if (meta && meta->grad_fn && meta->output_nr < meta->grad_fn->outputs.size())
    return meta->grad_fn->outputs[meta->output_nr].dtype;
  return t.dtype();
}

Edge gradient_edge(const Tensor& t) {
  AutogradMeta* meta = t.autograd_meta();
  if (!meta || !meta->requires_grad) return {};
  if (meta->grad_fn) return {meta->grad_fn, meta->output_nr};
  std::shared_ptr<Node> acc = meta->grad_accumulator.lock();
  if (!acc) {
    // The accumulator refers to the leaf tensor itself (shares its impl).
    acc = std::make_shared<AccumulateGrad>(t);
    acc->sequence_nr = kRunWhenReadySeq;
    acc->outputs.push_back({t.sizes(), t.dtype(), t.device()});
    acc->output_hooks.resize(1);
    meta->grad_accumulator = acc;
  }
  return {acc, 0};
}

std::shared_ptr<FunctionNode> record(const char* name, const TensorList& inputs,
                                     const TensorList& outputs, const TensorList& saved,
                                     BackwardFn fn) {
  return record_saved(name, inputs, outputs, save_inputs(name, inputs, saved), std::move(fn));
}

std::vector<SavedTensor> save_inputs(const char* name, const TensorList& inputs,
                                     const TensorList& saved) {
  std::vector<SavedTensor> out;
  if (!needs_grad(inputs)) return out;
  out.reserve(saved.size());
  for (const Tensor& s : saved) out.emplace_back(s, name);
  return out;
}

std::shared_ptr<FunctionNode> record_saved(const char* name, const TensorList& inputs,
                                           const TensorList& outputs,
                                           std::vector<SavedTensor> saved, BackwardFn fn) {
  if (!needs_grad(inputs)) return nullptr;
  auto node = std::make_shared<FunctionNode>(name, std::move(fn));
  node->sequence_nr = next_sequence_nr();
  for (const Tensor& in : inputs) {
    const bool req = in.defined() && in.requires_grad();
    node->needs_input_grad.push_back(req);
    node->next_edges.push_back(req ? gradient_edge(in) : Edge{});
  }
  node->saved = std::move(saved);
  uint32_t nr = 0;
  for (const Tensor& out : outputs) {
    node->outputs.push_back({out.sizes(), out.dtype(), out.device()});
    node->output_hooks.emplace_back();
    auto& meta = out.autograd_meta_ptr();
    if (!meta) meta = std::make_shared<AutogradMeta>();
    meta->requires_grad = is_floating(out.dtype());
    meta->grad_fn = meta->requires_grad ? node : nullptr;
    meta->output_nr = nr++;
  }
  return node;
}

}  // namespace tally::autograd

namespace tally {
bool GradMode::is_enabled() {
  return autograd::tls_grad_enabled;
}
void GradMode::set_enabled(bool enabled) {
  autograd::tls_grad_enabled = enabled;
}
}  // namespace tally
