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

}  // namespace tally::autograd
