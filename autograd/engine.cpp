#include "autograd/engine.h"

#include <fmt/format.h>

#include <optional>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "tensor/ops.h"

namespace tally::autograd {
namespace {

struct NodeTask {
  Node* node;
  bool operator<(const NodeTask& o) const {  // latest op first, as PyTorch does
    return node->sequence_nr < o.node->sequence_nr;
  }
};

Tensor materialize(const OutputMeta& m) {
  return ops::zeros(m.shape, m.dtype, m.device);
}

void accumulate(Tensor& slot, const Tensor& g) {
  if (!g.defined()) return;
  if (!slot.defined()) {
    slot = g;
  } else {
    slot = ops::add(slot, g);
  }
}

// A gradient on its way to a leaf's AccumulateGrad (which runs as soon as it is ready) that will
// become the leaf's .grad (it has none yet) is `gradient` from the moment it arrives, not a
// `temporary`: a block held by this tensor alone is re-tagged, a sum of two contributions is
// allocated as `gradient`. (One added into an existing .grad stays `temporary`.)
bool becomes_grad(const Node* n) {
  const auto* acc = dynamic_cast<const AccumulateGrad*>(n);
  return acc && !acc->variable().grad().defined();
}

void accumulate_leaf(Tensor& slot, const Tensor& g) {
  if (!g.defined()) return;
  memory::CategoryScope cat(memory::Category::gradient);
  if (!slot.defined() && g.use_count() == 1 && g.storage().use_count() == 1 &&
      g.storage().category() != memory::Category::gradient)
    g.storage().retag(memory::Category::gradient);
  accumulate(slot, g);
}

// The callbacks queued during the outermost backward pass on this thread.
struct CallbackQueue {
  int depth = 0;
  std::vector<std::function<void()>> callbacks;
};
thread_local CallbackQueue tls_callbacks;

// Marks a run; the outermost one runs the queued callbacks when it finishes normally.
class RunScope {
 public:
  RunScope() { ++tls_callbacks.depth; }
  ~RunScope() {
    if (--tls_callbacks.depth == 0) tls_callbacks.callbacks.clear();  // dropped on an exception
  }
  void finish() {
    if (tls_callbacks.depth != 1) return;
    // A callback may queue more callbacks: index, don't iterate.
    for (size_t i = 0; i < tls_callbacks.callbacks.size(); ++i) {
      std::function<void()> cb = std::move(tls_callbacks.callbacks[i]);
      cb();
    }
    tls_callbacks.callbacks.clear();
  }
};

// Runs the graph. With `capture` non-null, gradients arriving at the given edges are
// stored there instead of being propagated to AccumulateGrad.
void run(const std::vector<Edge>& roots, const TensorList& root_grads, bool retain_graph,
         const std::unordered_map<Node*, std::vector<std::pair<uint32_t, size_t>>>* capture,
         TensorList* captured) {
  RunScope run_scope;
  // Dependencies: how many edges point at each node.
  std::unordered_map<Node*, int> deps;
  std::unordered_map<Node*, std::shared_ptr<Node>> keep;  // keep nodes alive while running
  std::vector<Node*> stack;
  std::unordered_set<Node*> seen;
  for (const Edge& e : roots) {
    if (e.fn && seen.insert(e.fn.get()).second) {
      stack.push_back(e.fn.get());
      keep[e.fn.get()] = e.fn;
    }
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges) {
      if (!e.fn) continue;
      ++deps[e.fn.get()];
      if (seen.insert(e.fn.get()).second) {
        stack.push_back(e.fn.get());
        keep[e.fn.get()] = e.fn;
      }
    }
  }

  std::unordered_map<Node*, TensorList> buffers;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Edge& e = roots[i];
    if (!e.fn) continue;
    TensorList& buf = buffers[e.fn.get()];
    buf.resize(e.fn->outputs.size());
    accumulate(buf[e.input_nr], root_grads[i]);
  }
  std::priority_queue<NodeTask> ready;
  for (const Edge& e : roots)
    if (e.fn && deps[e.fn.get()] == 0) ready.push({e.fn.get()});
  std::unordered_set<Node*> queued;

  // A micro-batch's backward ("backward.0", gradient accumulation) keeps its phase.
  const std::string& outer = memory::interned(memory::current_tag().phase);
  memory::PhaseScope phase(outer.starts_with("backward.") ? std::string_view(outer) : "backward");
  while (!ready.empty()) {
    Node* n = ready.top().node;
    ready.pop();
    if (!queued.insert(n).second) continue;
    TensorList grads = std::move(buffers[n]);
    buffers.erase(n);
    grads.resize(n->outputs.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      for (const Hook& h : n->output_hooks[i]) {
        if (!grads[i].defined()) continue;
        Tensor r = h(grads[i]);
        if (r.defined()) grads[i] = r;
      }
    }
    if (capture) {
      auto it = capture->find(n);
      if (it != capture->end()) {
        for (auto [input_nr, slot] : it->second) accumulate((*captured)[slot], grads[input_nr]);
      }
      if (dynamic_cast<AccumulateGrad*>(n)) continue;  // autograd.grad leaves .grad alone
    }
    // A leaf's gradient converted to its dtype is still its gradient.
    std::optional<memory::CategoryScope> leaf_cat;
    if (becomes_grad(n)) leaf_cat.emplace(memory::Category::gradient);
    TensorList out;
    bool any = false;
    for (const Tensor& g : grads) any = any || g.defined();
    if (any) {
      for (size_t i = 0; i < grads.size(); ++i) {
        if (!grads[i].defined()) {
          grads[i] = materialize(n->outputs[i]);
        } else if (grads[i].dtype() != n->outputs[i].dtype) {
          // As PyTorch's validate_outputs: a gradient arrives in its tensor's dtype (with
          // autocast, gradients summed from float32 and 16-bit consumers promote).
          grads[i] = ops::to(grads[i], n->outputs[i].dtype);
        }
      }
      out = n->apply(grads);
    } else {
      out.resize(n->next_edges.size());
    }
    if (!retain_graph) n->release_saved();
    for (size_t i = 0; i < n->next_edges.size(); ++i) {
      const Edge& e = n->next_edges[i];
      if (!e.fn) continue;
      TensorList& buf = buffers[e.fn.get()];
      buf.resize(e.fn->outputs.size());
      if (i < out.size()) {
        if (!capture && becomes_grad(e.fn.get()))
          accumulate_leaf(buf[e.input_nr], out[i]);
        else
          accumulate(buf[e.input_nr], out[i]);
      }
      if (--deps[e.fn.get()] == 0) ready.push({e.fn.get()});
    }
  }
  run_scope.finish();
}

std::vector<Edge> root_edges(const TensorList& roots, const TensorList& grad_roots,
                             TensorList& grads, const char* what) {
  std::vector<Edge> edges;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    if (!r.requires_grad())
      throw std::runtime_error(fmt::format(
          "{}: element {} of tensors does not require grad and does not have a grad_fn", what, i));
    Tensor g = i < grad_roots.size() ? grad_roots[i] : Tensor();
    if (!g.defined()) {
      if (r.numel() != 1)
        throw std::runtime_error(
            fmt::format("{}: grad can be implicitly created only for scalar outputs (got shape {})",
                        what, r.shape_string()));
      g = ops::ones(r.sizes(), r.dtype(), r.device());
    } else if (g.sizes() != r.sizes()) {
      throw std::invalid_argument(fmt::format("{}: gradient of shape {} for a tensor of shape {}",
                                              what, g.shape_string(), r.shape_string()));
    }
    grads.push_back(g);
    edges.push_back(gradient_edge(r));
  }
  return edges;
}

}  // namespace

void queue_callback(std::function<void()> callback) {
  if (tls_callbacks.depth == 0)
    throw std::logic_error("queue_callback: no backward pass is running on this thread");
  tls_callbacks.callbacks.push_back(std::move(callback));
}

void backward(const TensorList& roots, const TensorList& grad_roots, bool retain_graph) {
  TensorList grads;
  const std::vector<Edge> edges = root_edges(roots, grad_roots, grads, "backward");
  run(edges, grads, retain_graph, nullptr, nullptr);
}

TensorList grad(const TensorList& outputs, const TensorList& inputs, const TensorList& grad_outputs,
                bool retain_graph) {
  TensorList grads;
  const std::vector<Edge> edges = root_edges(outputs, grad_outputs, grads, "autograd::grad");
  std::unordered_map<Node*, std::vector<std::pair<uint32_t, size_t>>> capture;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Edge e = gradient_edge(inputs[i]);
    if (!e.fn)
      throw std::runtime_error(fmt::format("autograd::grad: input {} does not require grad", i));
    capture[e.fn.get()].push_back({e.input_nr, i});
  }
  TensorList result(inputs.size());
  run(edges, grads, retain_graph, &capture, &result);
  return result;
}

}  // namespace tally::autograd
