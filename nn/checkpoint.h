// Recompute-based activation checkpointing, PyTorch's torch.utils.checkpoint in its
// non-reentrant form: checkpoint, checkpoint_sequential and selective checkpointing.
// How the recompute works, early stop, nesting and selective checkpointing: docs/notes.md §5.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "autograd/ops.h"
#include "nn/module_select.h"

namespace tally::nn {

// What a selective-checkpoint policy sees about a tensor being saved.
struct SavedTensorInfo {
  std::string_view op;  // the op that allocated its storage ("linear", "relu", ...)
  Shape shape;
  DType dtype = DType::float32;
  size_t nbytes = 0;
};

// true: keep the tensor (PyTorch's MUST_SAVE); false: drop it and recompute.
using CheckpointPolicy = std::function<bool(const SavedTensorInfo&)>;

// Keep the tensors produced by any of `ops` (e.g. {"linear", "matmul", "mm", "bmm",
// "conv2d"}): the usual "save the matmuls, recompute the cheap elementwise and norms".
CheckpointPolicy save_ops(std::vector<std::string> ops);

struct CheckpointOptions {
  bool preserve_rng_state = true;
  bool early_stop = true;   // stop the recompute once backward has all it needs
  CheckpointPolicy policy;  // empty: keep nothing (plain checkpointing)
};

// Runs fn(inputs) without keeping what its ops save for backward; backward recomputes it.
// Under no_grad it simply runs fn.
Tensor checkpoint(std::function<Tensor(const TensorList&)> fn, const TensorList& inputs,
                  CheckpointOptions options = {});
Tensor checkpoint(std::function<Tensor(const Tensor&)> fn, const Tensor& input,
                  CheckpointOptions options = {});

// torch.utils.checkpoint.checkpoint_sequential: the stages split into `segments` runs of
// stages.size() / segments stages; all but the last run are checkpointed, the last run
// (with the remaining stages) is not. 1 <= segments <= stages.size().
Tensor checkpoint_sequential(std::vector<std::function<Tensor(const Tensor&)>> stages, int segments,
                             Tensor input, CheckpointOptions options = {});

// Counters on this thread since the last reset (tests, reports).
struct CheckpointStats {
  int64_t segments = 0;            // checkpointed forwards
  int64_t recomputations = 0;      // segments recomputed in backward
  int64_t tensors_dropped = 0;     // saved tensors replaced by a handle in forward
  int64_t tensors_kept = 0;        // saved tensors a policy kept
  int64_t tensors_recomputed = 0;  // dropped tensors restored by a recompute
  int64_t early_stops = 0;         // recomputes that stopped before the segment's end
  int64_t products_replayed = 0;   // products a recompute took from kept outputs
};
CheckpointStats checkpoint_stats();
void reset_checkpoint_stats();

// torch.utils.checkpoint.checkpoint_sequential over a Sequential's children, in order.
class Sequential;
Tensor checkpoint_sequential(const Sequential& functions, int segments, Tensor input,
                             CheckpointOptions options = {});

// The transformer models' checkpointed blocks: checkpoint_sequential over a ModuleList's
// modules, each run under the list's module scope (its allocations carry "transformer.h.0...",
// as the list's own calls do), with `segments` capped at the list's length.
class ModuleList;
Tensor checkpoint_sequential(ModuleList& list, int segments, Tensor input);

// ---- checkpointing a model from the command line (--checkpoint) ----
class Module;

// "none" | "blocks" (every residual block / transformer block) | "N-blocks" (the first N
// blocks, in forward order: the partial plans the memory planner searches) | "N-segments"
// (checkpoint_sequential over the model's stages: ResNet's layer1..layer4 when N <= 4, its
// blocks otherwise; GPT's blocks) | "selective" (every block, keeping the outputs of the
// matrix products and convolutions: selective_policy()) | a module policy for any model:
// "type:Block", "name:blocks.*", each optionally "/K" (every K-th match) and "+selective"
// ("type:Block/2+selective"; nn/module_select.h, docs/notes.md).
struct CheckpointSpec {
  enum class Kind { none, blocks, segments, selective, modules };
  Kind kind = Kind::none;
  int segments = 0;
  int blocks = 0;               // Kind::blocks: checkpoint only the first `blocks` (0: every block)
  ModuleSelector modules = {};  // Kind::modules: which modules
  bool selective = false;       // Kind::modules: keep what selective_policy() keeps
  std::string str() const;
};
// The module policy `check_fn` (FSDP's apply_activation_checkpointing(check_fn)) as a spec;
// `label` names it in reports.
CheckpointSpec checkpoint_modules(ModulePredicate check_fn, std::string label = "custom",
                                  int every = 1, bool selective = false);
// Throws std::invalid_argument naming the accepted spellings.
CheckpointSpec parse_checkpoint_spec(const std::string& s);
// The selective policy of --checkpoint selective: keep what linear, matmul, mm, bmm,
// conv2d and attention produced; recompute norms, activations and elementwise ops.
CheckpointPolicy selective_policy();
// Applies `spec` to a ResNet, ResNetTiny or GPT (and any model whose blocks are BasicBlock,
// Bottleneck or GPT Block modules), or a module policy to any model (each selected module's
// single-tensor forward runs under checkpoint); replaces what an earlier call set. Throws for
// "N-segments" on a model without a stage list, and for a module policy nothing matches.
void enable_checkpointing(Module& model, const CheckpointSpec& spec);
// The blocks "blocks" and "N-blocks" choose from (residual or transformer blocks).
int checkpoint_block_count(Module& model);

}  // namespace tally::nn
