// Design rule 2 for real models, shared by the CPU and CUDA invariant tests: one training
// step (forward under PhaseScope("forward"), backward, optimizer step) of a Module, with the
// allocator's category bytes reconciled against what the model, the graph and the optimizer
// actually hold — after forward, after backward, after the step and at the recorded peak —
// and the allocator's history scanned for `unknown` allocations and forward allocations
// without a module path.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/node.h"
#include "memory/invariants.h"
#include "memory/memory.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/models/gpt.h"
#include "nn/models/resnet.h"
#include "nn/module.h"
#include "optim/adam.h"
#include "optim/optimizer.h"
#include "optim/sgd.h"

namespace tally::invariants {

using memory::Category;

inline memory::CachingAllocator& allocator_of(Device d) {
  return memory::get_allocator(d);
}
inline int64_t current(Device d, Category c) {
  return allocator_of(d).stats().cat_bytes(c).current;
}
inline int64_t at_peak(Device d, Category c) {
  return allocator_of(d).stats().category_at_peak[static_cast<size_t>(c)];
}

// Block bytes of distinct storages (each allocator block counted once, as the allocator
// counts it) on one device.
class StorageBytes {
 public:
  explicit StorageBytes(Device d) : alloc_(&allocator_of(d)) {}
  // Adds t's block unless already counted or not this allocator's; returns whether it did.
  bool add(const Tensor& t) {
    if (!t.defined()) return false;
    const Storage& s = t.storage();
    if (s.allocator() != alloc_ || s.data() == nullptr) return false;
    if (!seen_.insert(s.key()).second) return false;
    bytes_ += static_cast<int64_t>(s.block_bytes());
    ++count_;
    return true;
  }
  int64_t bytes() const { return bytes_; }
  int64_t count() const { return count_; }

 private:
  memory::CachingAllocator* alloc_;
  std::unordered_set<const void*> seen_;
  int64_t bytes_ = 0;
  int64_t count_ = 0;
};

// Parameters AND buffers (running statistics): what the model itself holds.
inline int64_t model_state_bytes(const nn::Module& m, Device d) {
  StorageBytes b(d);
  for (const Tensor& t : m.parameters()) b.add(t);
  for (const Tensor& t : m.buffers()) b.add(t);
  return b.bytes();
}

inline int64_t grad_bytes(const nn::Module& m, Device d) {
  StorageBytes b(d);
  for (const Tensor& t : m.parameters()) b.add(t.grad());
  return b.bytes();
}

inline int64_t optimizer_state_bytes(const optim::Optimizer& opt, Device d) {
  StorageBytes b(d);
  for (size_t i = 0; i < opt.num_params(); ++i)
    for (const auto& [name, t] : opt.state(i).tensors) b.add(t);
  return b.bytes();
}

// The bytes of the input batch(es).
inline int64_t tensors_bytes(const TensorList& ts, Device d) {
  StorageBytes b(d);
  for (const Tensor& t : ts) b.add(t);
  return b.bytes();
}

// What the graph behind `root` holds in saved tensors, by category of the block, each storage
// once. Tensors packed by saved-tensor hooks (checkpointing) are not visible here: `packed`
// counts them.
struct SavedBytes {
  int64_t activation = 0;
  int64_t autocast_cache = 0;  // cached weight casts saved by the lower-precision ops
  int64_t parameter = 0;       // parameters saved as they are (not activations)
  int64_t input = 0;
  int64_t packed = 0;
  int64_t other = 0;  // any other category: a bug (reported with the node's name)

  // The counter of category `c`, or nullptr for a category no saved tensor should have.
  int64_t* of(Category c) {
    const std::pair<Category, int64_t SavedBytes::*> kSlots[] = {
        {Category::activation, &SavedBytes::activation},
        {Category::autocast_cache, &SavedBytes::autocast_cache},
        {Category::parameter, &SavedBytes::parameter},
        {Category::input, &SavedBytes::input}};
    for (const auto& [cat, member] : kSlots)
      if (cat == c) return &(this->*member);
    return nullptr;
  }
};

inline SavedBytes saved_bytes(const Tensor& root, Device d) {
  SavedBytes out;
  StorageBytes seen(d);
  std::unordered_set<autograd::Node*> visited;
  std::vector<autograd::Node*> stack;
  if (root.autograd_meta()) stack.push_back(root.autograd_meta()->grad_fn.get());
  while (!stack.empty()) {
    autograd::Node* n = stack.back();
    stack.pop_back();
    if (!n || !visited.insert(n).second) continue;
    for (const SavedTensor* s : n->saved_tensors()) {
      if (!s->defined() || s->released()) continue;
      const Tensor& t = s->held();
      if (!t.defined()) {
        ++out.packed;
        continue;
      }
      const int64_t before = seen.bytes();
      if (!seen.add(t)) continue;
      const int64_t b = seen.bytes() - before;
      int64_t* slot = out.of(t.storage().category());
      if (slot) {
        *slot += b;
      } else {
        out.other += b;
        ADD_FAILURE() << n->name() << " saved a block tagged "
                      << memory::category_name(t.storage().category()) << " (" << b << " B)";
      }
    }
    for (const autograd::Edge& e : n->next_edges) stack.push_back(e.fn.get());
  }
  return out;
}

// The weight casts autocast caches for `m`: every floating parameter of a Linear or Conv2d
// (the lower-precision ops that see parameters directly), each tensor once (GPT's lm_head
// shares wte's weight), at 2 bytes an element, as the allocator rounds them.
struct CastBytes {
  int64_t bytes = 0;
  int64_t count = 0;
};
inline CastBytes expected_autocast_casts(const nn::Module& m, Device d) {
  CastBytes out;
  std::unordered_set<const TensorImpl*> seen;
  for (const auto& [name, mod] : m.named_modules()) {
    if (!dynamic_cast<nn::Linear*>(mod) && !dynamic_cast<nn::Conv2d*>(mod)) continue;
    for (const Tensor& p : mod->parameters(/*recurse=*/false)) {
      if (!p.requires_grad() || p.dtype() != DType::float32 || !seen.insert(p.unsafe_impl()).second)
        continue;
      out.bytes +=
          static_cast<int64_t>(allocator_of(d).round_size(static_cast<size_t>(p.numel()) * 2));
      ++out.count;
    }
  }
  return out;
}

// The ops a model's root runs at its own level: the loss (GPT computes it in its own forward;
// for ResNet the training loop calls the criterion on the logits) and, under autocast, the
// float32 cast of the logits that cross_entropy asks for. A root module's path is "" (the
// name named_modules() gives the root, as PyTorch's), so by design these allocations carry
// no module path; every other forward allocation must.
inline std::set<std::string> root_ops(bool autocast) {
  if (autocast) return {"cross_entropy", "to"};
  return {"cross_entropy"};
}

// Restart the allocator's history (dropping what it had) with room for a whole step.
inline constexpr size_t kHistoryEntries = 200'000;
inline void restart_history(Device d) {
  allocator_of(d).record_memory_history(false);
  allocator_of(d).record_memory_history(true, kHistoryEntries);
}

// What the history says about the step.
struct HistoryScan {
  int64_t allocs = 0;
  std::map<std::string, int64_t> allocs_by_phase;
  std::vector<std::string> unknown;           // "alloc op=... phase=... module=..." lines
  std::vector<std::string> forward_unscoped;  // forward allocations, not input, without a module
  int64_t forward_root = 0;                   // of which by the root's own ops (root_ops)
  std::set<std::string> forward_modules;      // module paths of allocations in forward
  std::set<std::string> recompute_modules;    // module paths of allocations in the recompute phase
  int64_t recompute_casts = 0;                // autocast_cache allocations in the recompute phase
  int64_t workspace_allocs = 0;
  int64_t workspace_frees = 0;
  std::set<std::string> workspace_ops;
};

inline std::string describe(const memory::TraceEntry& e) {
  return fmt::format("{} {} B category={} op='{}' phase='{}' module='{}' at {}:{}",
                     memory::trace_action_name(e.action), e.size,
                     memory::category_name(e.tag.category), memory::interned(e.tag.op),
                     memory::interned(e.tag.phase), memory::interned(e.tag.module), e.tag.loc.file,
                     e.tag.loc.line);
}

inline HistoryScan scan_history(Device d, const std::set<std::string>& root) {
  HistoryScan s;
  std::unordered_set<uint64_t> live_workspace;
  const std::vector<memory::TraceEntry> history = allocator_of(d).history();
  EXPECT_LT(history.size(), kHistoryEntries)
      << "the history ring filled up: the step is not all there";
  for (const memory::TraceEntry& e : history) {
    const std::string phase = memory::interned(e.tag.phase);
    if (e.action == memory::TraceAction::alloc || e.action == memory::TraceAction::retag) {
      if (e.tag.category == Category::unknown) s.unknown.push_back(describe(e));
    }
    if (e.action == memory::TraceAction::alloc) {
      ++s.allocs;
      ++s.allocs_by_phase[phase];
      if (phase == "forward" && e.tag.category != Category::input && e.tag.module == 0) {
        if (root.count(memory::interned(e.tag.op)))
          ++s.forward_root;
        else
          s.forward_unscoped.push_back(describe(e));
      }
      if (phase == "forward" && e.tag.module != 0)
        s.forward_modules.insert(memory::interned(e.tag.module));
      if (phase == "recompute") {
        s.recompute_modules.insert(memory::interned(e.tag.module));
        if (e.tag.category == Category::autocast_cache) ++s.recompute_casts;
      }
      if (e.tag.category == Category::workspace) {
        ++s.workspace_allocs;
        live_workspace.insert(e.addr);
        s.workspace_ops.insert(memory::interned(e.tag.op));
      }
    }
    if (e.action == memory::TraceAction::free_requested && live_workspace.erase(e.addr))
      ++s.workspace_frees;
  }
  return s;
}

inline std::string join(const std::vector<std::string>& v, size_t max = 20) {
  std::string out;
  for (size_t i = 0; i < v.size() && i < max; ++i) out += "\n  " + v[i];
  if (v.size() > max) out += fmt::format("\n  ... and {} more", v.size() - max);
  return out;
}

struct StepOptions {
  bool autocast = false;
  DType autocast_dtype = DType::bfloat16;
  bool set_to_none = true;  // zero_grad(set_to_none) before the step
  bool checkpointed = false;
};

// What one checked step measured (for comparisons between runs).
struct StepReport {
  int64_t activation_after_forward = 0;
  int64_t activation_at_peak = 0;  // activation bytes when allocated bytes peaked
  int64_t activation_peak = 0;     // the activation category's own peak in the step
  int64_t allocated_peak = 0;
  HistoryScan history;
  double loss = 0;
};

// One training step of `model` with every invariant checked. `forward` computes the loss
// (the model call and, for a classifier, the criterion); `inputs` is the batch (already
// allocated under Category::input). `step_index` 0 is the optimizer's first step (its state
// is created during it).
inline StepReport checked_step(nn::Module& model, optim::Optimizer& opt,
                               const std::function<Tensor()>& forward, const TensorList& inputs,
                               Device d, const StepOptions& o, int step_index) {
  StepReport r;
  memory::CachingAllocator& alloc = allocator_of(d);
  opt.zero_grad(o.set_to_none);
  memory::synchronize(d);
  const int64_t params = model_state_bytes(model, d);
  const int64_t input = tensors_bytes(inputs, d);
  const int64_t state_before = optimizer_state_bytes(opt, d);
  const int64_t grads_before = grad_bytes(model, d);
  EXPECT_EQ(current(d, Category::parameter), params) << "parameter == parameters + buffers";
  EXPECT_EQ(current(d, Category::input), input) << "input == the batch";
  EXPECT_EQ(current(d, Category::activation), 0) << "no activation before forward";
  EXPECT_EQ(current(d, Category::optimizer_state), state_before);
  EXPECT_EQ(current(d, Category::gradient), grads_before);
  restart_history(d);
  alloc.reset_peak_memory_stats();

  // ---- forward ----
  Tensor loss;
  {
    std::optional<AutocastGuard> ac;
    if (o.autocast) ac.emplace(d.type, o.autocast_dtype);
    memory::PhaseScope phase("forward");
    loss = forward();
    if (o.autocast) {
      // Inside the region the cache holds one cast of every Linear / Conv2d parameter.
      const CastBytes want = expected_autocast_casts(model, d);
      EXPECT_GT(want.count, 0);
      EXPECT_EQ(static_cast<int64_t>(autocast_cache_size()), want.count)
          << "one cached cast per weight";
      EXPECT_EQ(current(d, Category::autocast_cache), want.bytes)
          << "autocast_cache == the cached casts";
    }
  }
  {
    const SavedBytes saved = saved_bytes(loss, d);
    r.activation_after_forward = current(d, Category::activation);
    EXPECT_GT(r.activation_after_forward, 0);
    if (o.checkpointed) {
      // The checkpointed blocks' saved tensors are packed by hooks (handles, no memory); what
      // is held is what the unchecked ops saved plus each segment's input (held by the
      // checkpoint frame, outside the graph's nodes): at least the graph's own part.
      EXPECT_GT(saved.packed, 0) << "checkpointed segments pack their saved tensors";
      EXPECT_GE(r.activation_after_forward, saved.activation);
    } else {
      EXPECT_EQ(saved.packed, 0);
      EXPECT_EQ(r.activation_after_forward, saved.activation)
          << "activation == bytes held by saved tensors";
    }
    // After the autocast region the cache is dropped: what stays is what backward needs.
    EXPECT_EQ(current(d, Category::autocast_cache), saved.autocast_cache)
        << "autocast_cache after the region == the casts saved for backward";
    if (!o.autocast) {
      EXPECT_EQ(saved.autocast_cache, 0);
    }
    EXPECT_EQ(current(d, Category::parameter), params);
  }
  r.loss = loss.item();

  // ---- backward ----
  loss.backward();
  memory::synchronize(d);
  EXPECT_EQ(current(d, Category::activation), 0) << "no activation left after backward";
  EXPECT_EQ(current(d, Category::autocast_cache), 0) << "no cast left after backward";
  const int64_t grads = grad_bytes(model, d);
  int64_t param_only = 0;
  {
    StorageBytes b(d);
    for (const Tensor& p : model.parameters()) b.add(p);
    param_only = b.bytes();
  }
  EXPECT_EQ(grads, param_only) << "every parameter has a gradient of its own size";
  EXPECT_EQ(current(d, Category::gradient), grads) << "gradient == the gradients";
  for (const Tensor& p : model.parameters())
    EXPECT_EQ(p.grad().storage().category(), Category::gradient);

  // ---- optimizer step ----
  opt.step();
  memory::synchronize(d);
  const int64_t state = optimizer_state_bytes(opt, d);
  EXPECT_GT(state, 0);
  EXPECT_EQ(current(d, Category::optimizer_state), state) << "optimizer_state == the state tensors";
  EXPECT_EQ(current(d, Category::gradient), grads) << "gradient == the gradients (after step)";
  EXPECT_EQ(current(d, Category::parameter), params)
      << "parameter == parameters + buffers (after step)";
  EXPECT_EQ(current(d, Category::temporary), static_cast<int64_t>(loss.storage().block_bytes()))
      << "only the loss is left as a temporary";
  loss = Tensor();
  // Everything allocated now is the model, its gradients, the optimizer state and the batch.
  EXPECT_EQ(static_cast<int64_t>(alloc.memory_allocated()), params + grads + state + input)
      << "allocated == parameters + gradients + optimizer state + input after the step";
  memory::testing::expect_consistent(alloc);

  // ---- at the peak ----
  const memory::DeviceStats st = alloc.stats();
  r.allocated_peak = st.allocated_bytes[memory::kAllPools].peak;
  r.activation_at_peak = at_peak(d, Category::activation);
  r.activation_peak = st.cat_bytes(Category::activation).peak;
  EXPECT_EQ(at_peak(d, Category::unknown), 0) << "unknown at the peak";
  EXPECT_EQ(at_peak(d, Category::parameter), params) << "parameter at the peak";
  // The batch, plus what a model makes as `input` in its forward (GPT's position indices).
  EXPECT_GE(at_peak(d, Category::input), input) << "input at the peak";
  // (The peak may also fall in the first optimizer step, when the state is created while
  // every gradient is alive and the activations are gone: then activation at the peak is 0.)
  // Without checkpointing activations are only made in forward; backward only releases them.
  // (Checkpointed, a recompute in backward makes a block's activations again while the
  // segment inputs are still held: the comparison is against an unchecked run instead.)
  if (!o.checkpointed) {
    EXPECT_LE(r.activation_at_peak, r.activation_after_forward)
        << "activations are made in forward";
    EXPECT_EQ(r.activation_peak, r.activation_after_forward)
        << "activations peak at the end of forward";
  }
  if (step_index > 0) {
    EXPECT_EQ(at_peak(d, Category::optimizer_state), state)
        << "the state exists for the whole step";
  } else {
    EXPECT_TRUE(at_peak(d, Category::optimizer_state) == 0 ||
                at_peak(d, Category::optimizer_state) == state);
  }
  if (!o.set_to_none && step_index > 0) {
    EXPECT_EQ(at_peak(d, Category::gradient), grads)
        << "zero_grad(false): the gradients live all step";
  } else {
    EXPECT_LE(at_peak(d, Category::gradient), grads);
  }
  EXPECT_EQ(at_peak(d, Category::communication), 0);

  // ---- the history ----
  r.history = scan_history(d, root_ops(o.autocast));
  EXPECT_GT(r.history.allocs_by_phase["forward"], 0);
  EXPECT_GT(r.history.allocs_by_phase["backward"], 0);
  EXPECT_TRUE(r.history.unknown.empty())
      << r.history.unknown.size() << " allocations tagged unknown:" << join(r.history.unknown);
  EXPECT_TRUE(r.history.forward_unscoped.empty())
      << r.history.forward_unscoped.size()
      << " forward allocations without a module path:" << join(r.history.forward_unscoped);
  // Module paths are the model's own names (named_modules(), PyTorch's dotted paths).
  std::set<std::string> names;
  for (const auto& [name, m] : model.named_modules()) names.insert(name);
  for (const auto* paths : {&r.history.forward_modules, &r.history.recompute_modules})
    for (const std::string& path : *paths)
      EXPECT_TRUE(names.count(path)) << "an allocation under module path '" << path
                                     << "', which is not one of the model's named_modules()";
  EXPECT_EQ(r.history.workspace_allocs, r.history.workspace_frees) << "every workspace is returned";
  EXPECT_EQ(current(d, Category::workspace), 0);
  allocator_of(d).record_memory_history(false);
  return r;
}

// ---------------------------------------------------------------- the models

// A model with its batch and loss, as a training loop holds them.
struct Case {
  std::shared_ptr<nn::Module> model;
  TensorList inputs;
  std::function<Tensor()> forward;
};

inline Case resnet_case(Device d) {
  manual_seed(11);
  auto m = nn::resnet_tiny({.num_classes = 10, .in_channels = 3});
  m->to(d);
  Case c;
  Tensor x, y;
  {
    memory::CategoryScope input(Category::input);
    x = ops::to(ops::randn({4, 3, 16, 16}), d, DType::float32);
    y = ops::to(ops::randint(0, 10, {4}), d, DType::int64);
  }
  c.model = m;
  c.inputs = {x, y};
  // The criterion runs outside the model, as in a training loop: its allocations carry no
  // module path (see root_ops).
  c.forward = [m, x, y] { return cross_entropy((*m)(x), y); };
  return c;
}

// GPT "tiny" (dropout 0 as the preset has it, or `dropout` in every Dropout and the attention),
// a batch of B sequences of T tokens (T <= 64, the preset's block size).
inline Case gpt_case(Device d, double dropout = 0.0, int64_t B = 2, int64_t T = 16) {
  manual_seed(12);
  nn::GPTConfig cfg = nn::GPTConfig::preset("tiny");
  cfg.dropout = dropout;
  auto m = std::make_shared<nn::GPT>(cfg);
  m->to(d);
  Case c;
  Tensor idx, targets;
  {
    memory::CategoryScope input(Category::input);
    idx = ops::to(ops::randint(0, 256, {B, T}), d, DType::int64);
    targets = ops::to(ops::randint(0, 256, {B, T}), d, DType::int64);
  }
  c.model = m;
  c.inputs = {idx, targets};
  c.forward = [m, idx, targets] { return (*m)(idx, targets).second; };
  return c;
}

inline std::unique_ptr<optim::Optimizer> make_sgd(nn::Module& m) {
  return std::make_unique<optim::SGD>(m.parameters(),
                                      optim::SGDOptions{.lr = 0.01, .momentum = 0.9});
}
inline std::unique_ptr<optim::Optimizer> make_adamw(nn::Module& m) {
  return std::make_unique<optim::AdamW>(m.parameters(),
                                        optim::AdamOptions{.lr = 1e-3, .weight_decay = 0.01});
}

// Two steps: the first creates the optimizer state (zero_grad(set_to_none)), the second
// runs with the state present and the gradients kept (zero_grad(false)), so at its peak the
// parameters, gradients and optimizer state are all there, to the byte.
inline std::vector<StepReport> two_steps(const Case& c, optim::Optimizer& opt, StepOptions o,
                                         Device d) {
  std::vector<StepReport> out;
  o.set_to_none = true;
  {
    SCOPED_TRACE("step 1");
    out.push_back(checked_step(*c.model, opt, c.forward, c.inputs, d, o, 0));
  }
  o.set_to_none = false;
  {
    SCOPED_TRACE("step 2");
    out.push_back(checked_step(*c.model, opt, c.forward, c.inputs, d, o, 1));
  }
  return out;
}

// Checkpointing every block: the same model and batch, one step without and one with; at
// the peak fewer bytes are activations, the recompute phase shows up in the history with
// the blocks' module paths, and every other invariant still holds.
inline void checkpoint_comparison(const Case& c, optim::Optimizer& opt,
                                  const std::string& block_prefix, Device d, StepOptions o = {}) {
  StepReport plain, ckpt;
  {
    SCOPED_TRACE("warm-up step (creates the optimizer state)");
    checked_step(*c.model, opt, c.forward, c.inputs, d, o, 0);
  }
  {
    SCOPED_TRACE("without checkpointing");
    plain = checked_step(*c.model, opt, c.forward, c.inputs, d, o, 1);
  }
  EXPECT_GT(plain.activation_at_peak, 0)
      << "with the state in place the peak is in forward/backward";
  EXPECT_EQ(plain.history.allocs_by_phase.count("recompute"), 0u);
  nn::enable_checkpointing(*c.model, nn::parse_checkpoint_spec("blocks"));
  nn::reset_checkpoint_stats();
  {
    SCOPED_TRACE("with checkpointing");
    o.checkpointed = true;
    ckpt = checked_step(*c.model, opt, c.forward, c.inputs, d, o, 2);
  }
  const nn::CheckpointStats cs = nn::checkpoint_stats();
  EXPECT_GT(cs.segments, 0);
  EXPECT_EQ(cs.recomputations, cs.segments) << "each segment recomputed once";
  EXPECT_LT(ckpt.activation_after_forward, plain.activation_after_forward);
  EXPECT_LT(ckpt.activation_peak, plain.activation_peak)
      << "checkpointing lowers the activations' peak (one block recomputed at a time)";
  // At the allocator's peak: for these small models (a few hundred KiB of activations
  // against the parameters, gradients and optimizer state) the peak can fall late in
  // backward, where both runs hold the same activations (the first block's, recomputed or
  // kept, and the embedding's): lower or equal, and never more allocated in all.
  EXPECT_LE(ckpt.activation_at_peak, plain.activation_at_peak)
      << "after forward: " << ckpt.activation_after_forward << " vs "
      << plain.activation_after_forward;
  EXPECT_LE(ckpt.allocated_peak, plain.allocated_peak);
  EXPECT_GT(ckpt.history.allocs_by_phase["recompute"], 0)
      << "the recompute phase appears in the history";
  EXPECT_FALSE(ckpt.history.recompute_modules.empty());
  if (o.autocast) {
    EXPECT_GT(ckpt.history.recompute_casts, 0)
        << "the recompute runs under the forward's autocast state";
  } else {
    EXPECT_EQ(ckpt.history.recompute_casts, 0);
  }
  for (const std::string& m : ckpt.history.recompute_modules)
    EXPECT_EQ(m.rfind(block_prefix, 0), 0u)
        << "a recompute allocation under module '" << m << "', expected inside a block ("
        << block_prefix << "...)";
  nn::enable_checkpointing(*c.model, nn::parse_checkpoint_spec("none"));
}

}  // namespace tally::invariants
