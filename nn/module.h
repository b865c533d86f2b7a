// Module: the base of every layer and model (torch.nn.Module). It owns named parameters,
// buffers and child modules in registration order, gives them PyTorch's dotted names
// ("layer3.1.conv2.weight"), moves them between devices and dtypes in place, saves and
// loads state dicts, and, when called, opens a memory::ModuleScope with its registered
// name so every byte its forward allocates carries its full module path. An exception
// escaping a forward is rethrown once with that path prepended:
//   "layer3.1.conv2 (Conv2d): conv2d: ..."
//
// Memory categories: parameters AND buffers (BatchNorm's running statistics) are allocated
// under Category::parameter — buffers are model state that lives as long as the model,
// like parameters, and PyTorch's reports count them with the parameters too. Gradients
// are tagged `gradient` by autograd when they are accumulated.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <source_location>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "autograd/offload.h"
#include "autograd/ops.h"
#include "base/scope_guard.h"
#include "memory/context.h"

namespace tally::nn {

struct SavedTensorInfo;  // nn/checkpoint.h

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// While alive (thread-local), layer and model constructors allocate their parameters
// without initialising them (the cheap path to count or shape a model, or to load a
// checkpoint into); a model that re-initialises everything anyway (GPT-2's and ResNet's
// schemes) builds its layers under it so that no weight is initialised twice.
// Normalisation layers still set their ones/zeros (cheap, no generator).
class SkipInitGuard : base::ScopeGuard<bool> {
 public:
  SkipInitGuard();
  ~SkipInitGuard();
  static bool active();
};

// The error a forward rethrows, with the module path prepended; the nesting levels above
// rethrow it unchanged. Derives from the original's standard base where it can (Base).
struct ModuleErrorMarker {
  virtual ~ModuleErrorMarker() = default;
};
template <typename Base>
class ModuleError : public Base, public ModuleErrorMarker {
 public:
  explicit ModuleError(const std::string& what) : Base(what) {}
};

class Module {
 public:
  explicit Module(std::string type_name = "Module");
  virtual ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // ---- the forward ----
  // Single-tensor forward; modules with other signatures add their own call operator and
  // wrap it with call().
  virtual Tensor forward(const Tensor& x);
  // With set_checkpoint, the forward runs under nn::checkpoint (its activations are
  // recomputed in backward instead of kept).
  // `site`, defaulted at the caller, is the user's line that allocations inside are
  // attributed to (memory::CallSiteScope).
  Tensor operator()(const Tensor& x,
                    const std::source_location& site = std::source_location::current()) {
    return call([&] { return checkpoint_ ? checkpointed_forward(x) : forward(x); }, site);
  }
  // Checkpoint this module's single-tensor forward (policy: selective; empty: keep nothing),
  // or stop checkpointing it (enabled = false).
  void set_checkpoint(bool enabled, std::function<bool(const SavedTensorInfo&)> policy = {});
  bool is_checkpointed() const { return checkpoint_ != nullptr; }
  // fn(inputs), under nn::checkpoint with this module's policy while set_checkpoint is on: how a
  // forward of several tensors (a U-Net's ResBlock(x, temb)) checkpoints as operator() does the
  // single-tensor one. Call it inside call().
  Tensor checkpointed_call(const std::function<Tensor(const TensorList&)>& fn,
                           const TensorList& inputs);
  // What nn::enable_checkpointing may do with this module, declared by the model itself:
  // a residual or transformer block is a unit `blocks` and `selective` checkpoint, and a
  // model with a stage list runs it under checkpoint_sequential with `n` segments (0 = off)
  // when it accepts set_checkpoint_segments (returns false: no stage list here).
  virtual bool is_checkpoint_block() const { return false; }
  virtual bool set_checkpoint_segments(int /*n*/) { return false; }
  // Offload what this module's forward saves for backward to host memory, through
  // `offloader` (null: stop); nn::offload_activations sets it on a model's blocks.
  void set_offload(std::shared_ptr<ActivationOffloader> offloader) {
    offload_ = std::move(offloader);
  }
  const std::shared_ptr<ActivationOffloader>& offloader() const { return offload_; }
  // Report this module's forward and backward to `offloader` without offloading its saves
  // (SaveOnCpu with copy false; null: stop): the link policy's prefetch sees how far backward
  // has come through the blocks it does not offload. A module that offloads ignores it.
  void set_offload_progress(std::shared_ptr<ActivationOffloader> offloader) {
    offload_progress_ = std::move(offloader);
  }
  const std::shared_ptr<ActivationOffloader>& offload_progress() const { return offload_progress_; }
  // Runs `fn` under this module's ModuleScope, error context and the caller's line
  // (memory::CallSiteScope: a site in Tally's own sources keeps the enclosing one), and
  // under SaveOnCpu when the module offloads.
  template <typename Fn>
  auto call(Fn&& fn, const std::source_location& site = std::source_location::current())
      -> decltype(fn()) {
    memory::CallSiteScope call_site(site);
    memory::ModuleScope scope(memory::ModuleScope::AbsolutePath{}, scope_path());
    try {
      if (!forward_pre_hooks_.empty()) run_forward_pre_hooks();
      if (offload_) {
        SaveOnCpu offload(offload_);
        return fn();
      }
      if (offload_progress_) {
        SaveOnCpu progress(offload_progress_, /*copy=*/false);
        return fn();
      }
      return fn();
    } catch (...) {
      rethrow_with_context();
    }
  }

  // torch.nn.Module.register_forward_pre_hook, without the inputs: hook(*this) runs at each
  // call of this module, before its forward (inside call(), so a throw carries the module's
  // path), in registration order. Returns the handle remove_forward_pre_hook takes (a handle
  // already removed is ignored). CpuOffload::overlap_with_forward finishes a layer's deferred
  // update this way.
  uint64_t register_forward_pre_hook(std::function<void(Module&)> hook);
  void remove_forward_pre_hook(uint64_t handle);

  // ---- registration ----
  // A parameter leaf (requires_grad set unless `requires_grad` is false). Registering
  // a name again replaces the tensor (weight tying: lm_head.weight = wte.weight). The
  // tensor's memory is re-tagged `parameter` (a buffer's too) whatever made it:
  // register_parameter("w", randn({4, 4}) * 0.02) is a parameter, not a temporary.
  Tensor& register_parameter(const std::string& name, Tensor t, bool requires_grad = true);
  // persistent = false (torch's register_buffer(..., persistent=False)): the buffer moves with
  // the module but is left out of state_dict() and not expected by load_state_dict().
  Tensor& register_buffer(const std::string& name, Tensor t, bool persistent = true);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    add_child(name, m);
    return m;
  }

  // ---- introspection (PyTorch's order: this module first, then children depth-first) ----
  // Parameters, each tensor once (a tied weight under its first name, as PyTorch dedups).
  NamedTensors named_parameters(bool recurse = true) const;
  std::vector<Tensor> parameters(bool recurse = true) const;  // the leaves themselves
  NamedTensors named_buffers(bool recurse = true) const;
  std::vector<Tensor> buffers(bool recurse = true) const;
  // ("", this), ("layer1", ...), ("layer1.0", ...), ...; each module once.
  std::vector<std::pair<std::string, Module*>> named_modules() const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> named_children() const;
  std::vector<std::shared_ptr<Module>> children() const;
  // torch.nn.Module.get_submodule: the module at a dotted path ("blocks.0.attn"; "" is
  // this one). Throws std::invalid_argument naming the first missing part. The typed form
  // also checks the module's class (std::invalid_argument naming both types).
  Module& get_submodule(const std::string& target) const;
  template <typename M>
  M& get_submodule(const std::string& target) const {
    Module& m = get_submodule(target);
    if (auto* typed = dynamic_cast<M*>(&m)) return *typed;
    throw std::invalid_argument(submodule_type_error(target, m));
  }
  int64_t num_parameters(bool trainable_only = false) const;

  // The name this module was registered under in its parent ("" for a root) and its type.
  const std::string& name() const { return name_; }
  // The module this one was first registered in (null for a root, or once it is gone).
  const Module* parent() const { return parent_; }
  const std::string& type_name() const { return type_name_; }

  // ---- modes and placement ----
  virtual void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // Move / convert every parameter, buffer (and existing gradient) in place: the Tensor
  // handles stay the same, like PyTorch's `param.data = ...`. to(DType) converts only
  // floating tensors (num_batches_tracked stays int64).
  // `site`, defaulted at the caller, is the line the moved tensors are attributed to.
  Module& to(Device device, CallSite site = CallSite::current());
  Module& to(DType dtype, CallSite site = CallSite::current());
  Module& to(Device device, DType dtype, CallSite site = CallSite::current());
  // Lays every 4-D floating parameter and buffer (and its gradient) out as `f`, like PyTorch's
  // model.to(memory_format=torch.channels_last): a convolution with a channels_last weight
  // runs channels_last (NHWC memory). Call it before creating the optimizer or loading its
  // state (the optimizer's state keeps the layout its parameters had then).
  Module& to(MemoryFormat f, CallSite site = CallSite::current());
  void zero_grad(bool set_to_none = true);
  // torch.nn.Module.apply: fn on every submodule, children first (depth-first, registration
  // order), then on this module; returns this module. Typical use: a custom initialisation.
  Module& apply(const std::function<void(Module&)>& fn);

  // ---- state dict ----
  // Parameters and buffers, every name (tied weights under each of their names), detached
  // handles sharing the module's storage.
  NamedTensors state_dict() const;
  // Copies values in (converting dtype and device). strict: missing or unexpected keys are
  // errors (a tied weight present under any of its names counts for all). A shape
  // mismatch is always an error. One exception lists every problem.
  void load_state_dict(const NamedTensors& state, bool strict = true);
  void load_state_dict(const std::map<std::string, Tensor>& state, bool strict = true);

  // "Conv2d(3, 64, kernel_size=(7, 7), ...)" for the repr; the tree printer uses it.
  virtual std::string extra_repr() const { return {}; }
  std::string repr() const;

 protected:
  void add_child(const std::string& name, std::shared_ptr<Module> m);
  [[noreturn]] void rethrow_with_context() const;
  // The module path this module's forward runs under: the enclosing path plus its name
  // when its parent (or a module the parent nests in) is the one calling it, so a child
  // called directly from an ancestor's forward, past a container that has no forward of
  // its own (ModuleList, ModuleDict) or past its own parent, still carries its full
  // dotted path ("blocks.0.fc", not "fc"). A root keeps the enclosing path.
  std::string scope_path() const;
  static std::string submodule_type_error(const std::string& target, const Module& m);

 private:
  void collect_state(const std::string& prefix, NamedTensors& out) const;
  void apply_to_tensors(const std::function<Tensor(const Tensor&)>& convert);

  Tensor checkpointed_forward(const Tensor& x);
  void run_forward_pre_hooks();

  std::shared_ptr<std::function<bool(const SavedTensorInfo&)>> checkpoint_;
  std::vector<std::pair<uint64_t, std::function<void(Module&)>>> forward_pre_hooks_;
  uint64_t next_hook_ = 0;
  std::shared_ptr<ActivationOffloader> offload_;
  std::shared_ptr<ActivationOffloader> offload_progress_;
  std::string type_name_;
  std::string name_;
  bool training_ = true;
  const Module* parent_ = nullptr;
  NamedTensors params_;
  NamedTensors buffers_;
  std::set<std::string> non_persistent_;  // buffers_ names left out of the state dict
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
};

// A model with a stage list (ResNet, ResNetTiny, GPT's transformer): it accepts
// set_checkpoint_segments, and its forward runs the stages under checkpoint_sequential
// when checkpoint_segments > 0.
class StagedModule : public Module {
 public:
  using Module::Module;
  bool set_checkpoint_segments(int n) override {
    checkpoint_segments = n;
    return true;
  }
  // > 0: the stages run under checkpoint_sequential with this many segments
  // (nn::enable_checkpointing sets it).
  int checkpoint_segments = 0;
};

std::ostream& operator<<(std::ostream& os, const Module& m);

// PyTorch's `t.data = values`: `t`'s TensorImpl takes the storage and layout of `values`, so
// every holder of `t` (a module, an optimizer's state) sees them; its autograd metadata stays.
void set_data(const Tensor& t, const Tensor& values);

}  // namespace tally::nn
