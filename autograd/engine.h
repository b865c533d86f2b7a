// The backward engine: runs the graph from the roots in dependency order, sums gradients
// that meet at a node, and frees saved tensors as nodes finish (unless retain_graph).
#pragma once

#include "autograd/node.h"

namespace tally::autograd {

// Backpropagate `grad_roots` (ones for scalar roots when undefined) from `roots`.
void backward(const TensorList& roots, const TensorList& grad_roots = {},
              bool retain_graph = false);

// Gradients of `outputs` w.r.t. `inputs` (torch.autograd.grad), without touching .grad.
TensorList grad(const TensorList& outputs, const TensorList& inputs,
                const TensorList& grad_outputs = {}, bool retain_graph = false);

// Queue `callback` to run once the current backward pass has finished (after every node,
// hook and gradient accumulation; PyTorch's Variable._execution_engine.queue_callback).
// Callbacks run in queue order on the thread that called backward; one queued inside a
// nested backward runs when the outermost one finishes. Throws std::logic_error outside a
// backward pass. If the backward pass throws, queued callbacks are dropped.
void queue_callback(std::function<void()> callback);

}  // namespace tally::autograd
