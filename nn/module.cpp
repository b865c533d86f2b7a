// Module: registration, PyTorch-ordered introspection, in-place device/dtype moves, state
// dicts and the error context of a forward.
#include "nn/module.h"

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

#include "memory/caching_allocator.h"
#include "nn/checkpoint.h"

namespace tally::nn {

namespace {
thread_local bool tls_skip_init = false;

// register_parameter / register_buffer: replaces the entry called `name`, or appends one.
Tensor& set_named(NamedTensors& list, const std::string& name, Tensor t) {
  for (auto& [n, v] : list)
    if (n == name) {
      v = std::move(t);
      return v;
    }
  list.emplace_back(name, std::move(t));
  return list.back().second;
}

class ModuleOutOfMemoryError : public memory::OutOfMemoryError, public ModuleErrorMarker {
 public:
  using memory::OutOfMemoryError::OutOfMemoryError;
};
}  // namespace

SkipInitGuard::SkipInitGuard() : ScopeGuard(tls_skip_init) {
  tls_skip_init = true;
}
SkipInitGuard::~SkipInitGuard() {
  tls_skip_init = saved_;
}
bool SkipInitGuard::active() {
  return tls_skip_init;
}

Module::Module(std::string type_name) : type_name_(std::move(type_name)) {}

Module::~Module() {
  for (auto& [n, c] : children_)
    if (c && c->parent_ == this) c->parent_ = nullptr;
}

namespace {
// `path` ends with the dotted path `tail` at a component boundary ("" ends every path).
bool ends_with_path(std::string_view path, std::string_view tail) {
  if (tail.empty()) return true;
  if (!path.ends_with(tail)) return false;
  return path.size() == tail.size() || path[path.size() - tail.size() - 1] == '.';
}
std::string join_path(std::string_view a, std::string_view b) {
  if (a.empty()) return std::string(b);
  if (b.empty()) return std::string(a);
  std::string s(a);
  s += '.';
  s += b;
  return s;
}
}  // namespace

std::string Module::scope_path() const {
  const std::string_view enclosing = memory::interned(memory::current_tag().module);
  if (!parent_) return join_path(enclosing, name_);
  // The names from this module up to (not including) its root: {"fc", "0", "blocks"}.
  std::vector<std::string_view> up;
  for (const Module* m = this; m->parent_; m = m->parent_) up.push_back(m->name_);
  // Try the parent first (the usual nesting), then each ancestor above it: the first whose
  // path relative to the root ends the enclosing path is the caller.
  for (size_t k = 1; k <= up.size(); ++k) {
    std::string ancestor;  // path of the ancestor k levels up, relative to the root
    for (size_t i = up.size(); i-- > k;) ancestor = join_path(ancestor, up[i]);
    if (!ends_with_path(enclosing, ancestor)) continue;
    std::string below;  // from that ancestor down to this module
    for (size_t i = k; i-- > 0;) below = join_path(below, up[i]);
    return join_path(enclosing, below);
  }
  return join_path(enclosing, name_);  // unreachable: the root's "" ends every path
}

Module& Module::get_submodule(const std::string& target) const {
  const Module* m = this;
  std::string walked;  // the parts found so far, for the message
  size_t start = 0;
  while (!target.empty()) {
    const size_t dot = std::min(target.find('.', start), target.size());
    const std::string part = target.substr(start, dot - start);
    const Module* next = nullptr;
    for (const auto& [n, c] : m->children_)
      if (n == part) next = c.get();
    if (!next)
      throw std::invalid_argument(fmt::format("get_submodule('{}'): {}{} has no submodule '{}'",
                                              target, walked.empty() ? "" : walked + " ",
                                              m->type_name_, part));
    walked = join_path(walked, part);
    m = next;
    if (dot == target.size()) break;
    start = dot + 1;
  }
  return const_cast<Module&>(*m);
}

std::string Module::submodule_type_error(const std::string& target, const Module& m) {
  return fmt::format("get_submodule('{}'): the module there is a {}, not the type asked for",
                     target, m.type_name());
}

void Module::set_checkpoint(bool enabled, std::function<bool(const SavedTensorInfo&)> policy) {
  checkpoint_ =
      enabled ? std::make_shared<std::function<bool(const SavedTensorInfo&)>>(std::move(policy))
              : nullptr;
}

Tensor Module::checkpointed_forward(const Tensor& x) {
  CheckpointOptions o;
  o.policy = *checkpoint_;
  return checkpoint([this](const Tensor& in) { return forward(in); }, x, o);
}

Tensor Module::checkpointed_call(const std::function<Tensor(const TensorList&)>& fn,
                                 const TensorList& inputs) {
  if (!checkpoint_) return fn(inputs);
  CheckpointOptions o;
  o.policy = *checkpoint_;
  return checkpoint(fn, inputs, o);
}

uint64_t Module::register_forward_pre_hook(std::function<void(Module&)> hook) {
  if (!hook)
    throw std::invalid_argument(
        fmt::format("{}.register_forward_pre_hook: the hook is empty", type_name_));
  forward_pre_hooks_.emplace_back(next_hook_, std::move(hook));
  return next_hook_++;
}

void Module::remove_forward_pre_hook(uint64_t handle) {
  std::erase_if(forward_pre_hooks_, [&](const auto& h) { return h.first == handle; });
}

void Module::run_forward_pre_hooks() {
  // A copy: a hook may remove itself or register another.
  const auto hooks = forward_pre_hooks_;
  for (const auto& [handle, hook] : hooks) hook(*this);
}

Tensor Module::forward(const Tensor&) {
  throw std::logic_error(fmt::format("{} has no single-tensor forward", type_name_));
}

void Module::rethrow_with_context() const {
  const std::string& path = memory::interned(memory::current_tag().module);
  auto msg = [&](const std::exception& e) {
    if (path.empty()) return fmt::format("{}: {}", type_name_, e.what());
    return fmt::format("{} ({}): {}", path, type_name_, e.what());
  };
  try {
    throw;
  } catch (const ModuleErrorMarker&) {
    throw;  // already carries the innermost module's path
  } catch (const memory::OutOfMemoryError& e) {
    throw ModuleOutOfMemoryError(msg(e), e.requested());
  } catch (const std::out_of_range& e) {
    throw ModuleError<std::out_of_range>(msg(e));
  } catch (const std::invalid_argument& e) {
    throw ModuleError<std::invalid_argument>(msg(e));
  } catch (const std::domain_error& e) {
    throw ModuleError<std::domain_error>(msg(e));
  } catch (const std::logic_error& e) {
    throw ModuleError<std::logic_error>(msg(e));
  } catch (const std::exception& e) {
    throw ModuleError<std::runtime_error>(msg(e));
  }
}

Tensor& Module::register_parameter(const std::string& name, Tensor t, bool requires_grad) {
  if (name.empty() || name.find('.') != std::string::npos)
    throw std::invalid_argument(fmt::format("{}: bad parameter name '{}'", type_name_, name));
  if (t.defined() && requires_grad && !t.requires_grad()) t.requires_grad_(true);
  if (t.defined() && t.storage().category() != memory::Category::parameter)
    t.storage().retag(memory::Category::parameter);
  return set_named(params_, name, std::move(t));
}

Tensor& Module::register_buffer(const std::string& name, Tensor t, bool persistent) {
  if (name.empty() || name.find('.') != std::string::npos)
    throw std::invalid_argument(fmt::format("{}: bad buffer name '{}'", type_name_, name));
  if (t.defined() && t.storage().category() != memory::Category::parameter)
    t.storage().retag(memory::Category::parameter);
  if (persistent)
    non_persistent_.erase(name);
  else
    non_persistent_.insert(name);
  return set_named(buffers_, name, std::move(t));
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> m) {
  if (!m)
    throw std::invalid_argument(
        fmt::format("{}: register_module('{}') with null", type_name_, name));
  if (name.empty() || name.find('.') != std::string::npos)
    throw std::invalid_argument(fmt::format("{}: bad module name '{}'", type_name_, name));
  m->name_ = name;
  if (!m->parent_) m->parent_ = this;
  for (auto& [n, c] : children_)
    if (n == name) {
      if (c->parent_ == this && c != m) c->parent_ = nullptr;
      c = std::move(m);
      return;
    }
  children_.emplace_back(name, std::move(m));
}

std::vector<std::pair<std::string, Module*>> Module::named_modules() const {
  std::vector<std::pair<std::string, Module*>> out;
  std::unordered_set<const Module*> seen;
  std::function<void(const std::string&, const Module*)> walk = [&](const std::string& prefix,
                                                                    const Module* m) {
    if (!seen.insert(m).second) return;
    out.emplace_back(prefix, const_cast<Module*>(m));
    for (const auto& [n, c] : m->children_) walk(prefix.empty() ? n : prefix + "." + n, c.get());
  };
  walk("", this);
  return out;
}

namespace {

// named_parameters / named_buffers: the defined tensors of `root`'s `list` (params_ or
// buffers_) and, with recurse, of every submodule's, named by module path; a tensor
// registered twice (a tied weight) is listed once, under its first name.
NamedTensors named_tensors(const Module& root, bool recurse, NamedTensors Module::*list) {
  NamedTensors out;
  std::unordered_set<const TensorImpl*> seen;
  auto add = [&](const std::string& prefix, const Module* m) {
    for (const auto& [n, t] : m->*list) {
      if (!t.defined() || !seen.insert(t.unsafe_impl()).second) continue;
      out.emplace_back(prefix.empty() ? n : prefix + "." + n, t);
    }
  };
  if (!recurse) {
    add("", &root);
    return out;
  }
  for (const auto& [prefix, m] : root.named_modules()) add(prefix, m);
  return out;
}

std::vector<Tensor> tensors_of(const NamedTensors& named) {
  std::vector<Tensor> out;
  for (const auto& [n, t] : named) out.push_back(t);
  return out;
}

}  // namespace

NamedTensors Module::named_parameters(bool recurse) const {
  return named_tensors(*this, recurse, &Module::params_);
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  return tensors_of(named_parameters(recurse));
}

NamedTensors Module::named_buffers(bool recurse) const {
  return named_tensors(*this, recurse, &Module::buffers_);
}

std::vector<Tensor> Module::buffers(bool recurse) const {
  return tensors_of(named_buffers(recurse));
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::named_children() const {
  return children_;
}

std::vector<std::shared_ptr<Module>> Module::children() const {
  std::vector<std::shared_ptr<Module>> out;
  for (const auto& [n, c] : children_) out.push_back(c);
  return out;
}

int64_t Module::num_parameters(bool trainable_only) const {
  int64_t n = 0;
  for (const auto& [name, p] : named_parameters())
    if (!trainable_only || p.requires_grad()) n += p.numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [n, c] : children_) c->train(on);
}

void set_data(const Tensor& t, const Tensor& n) {
  if (n.is_same(t)) return;
  TensorImpl* impl = t.unsafe_impl();
  impl->storage = n.storage();
  impl->sizes = n.sizes();
  impl->strides = n.strides();
  impl->offset = n.storage_offset();
  impl->dtype = n.dtype();
}

void Module::apply_to_tensors(const std::function<Tensor(const Tensor&)>& convert) {
  NoGradGuard ng;
  std::unordered_set<const TensorImpl*> seen;
  for (const auto& [prefix, m] : named_modules()) {
    for (auto* list : {&m->params_, &m->buffers_}) {
      for (auto& [n, t] : *list) {
        if (!t.defined() || !seen.insert(t.unsafe_impl()).second) continue;
        Tensor converted;
        {
          memory::CategoryScope cat(memory::Category::parameter);
          converted = convert(t);
        }
        Tensor g = t.grad();
        set_data(t, converted);
        if (g.defined()) {
          memory::CategoryScope cat(memory::Category::gradient);
          Tensor ng2 = convert(g);
          if (!ng2.is_same(g)) {
            t.set_grad(Tensor());
            t.set_grad(ng2);
          }
        }
      }
    }
  }
}

Module& Module::to(Device device, CallSite site) {
  memory::CallSiteScope call_site(site);
  // A channels_last tensor stays so on its new device.
  apply_to_tensors([&](const Tensor& t) {
    const Tensor moved = ops::to(t, device, t.dtype());
    return t.suggest_memory_format() == MemoryFormat::channels_last
               ? ops::contiguous(moved, MemoryFormat::channels_last)
               : moved;
  });
  return *this;
}

Module& Module::to(MemoryFormat f, CallSite site) {
  memory::CallSiteScope call_site(site);
  apply_to_tensors([&](const Tensor& t) {
    return t.dim() == 4 && is_floating(t.dtype()) ? ops::contiguous(t, f) : t;
  });
  return *this;
}

Module& Module::to(DType dtype, CallSite site) {
  memory::CallSiteScope call_site(site);
  if (!is_floating(dtype))
    throw std::invalid_argument(
        fmt::format("{}.to: dtype must be floating, got {}", type_name_, dtype_name(dtype)));
  apply_to_tensors(
      [&](const Tensor& t) { return is_floating(t.dtype()) ? ops::to(t, t.device(), dtype) : t; });
  return *this;
}

Module& Module::to(Device device, DType dtype, CallSite site) {
  memory::CallSiteScope call_site(site);
  to(device);
  return to(dtype);
}

Module& Module::apply(const std::function<void(Module&)>& fn) {
  for (auto& [name, child] : children_) child->apply(fn);
  fn(*this);
  return *this;
}

void Module::zero_grad(bool set_to_none) {
  NoGradGuard ng;
  for (const Tensor& p : parameters()) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    if (set_to_none)
      p.set_grad(Tensor());
    else
      ops::zero_(g);
  }
}

void Module::collect_state(const std::string& prefix, NamedTensors& out) const {
  for (const auto& [n, p] : params_)
    if (p.defined()) out.emplace_back(prefix + n, p.detach());
  for (const auto& [n, b] : buffers_)
    if (b.defined() && !non_persistent_.count(n)) out.emplace_back(prefix + n, b.detach());
  for (const auto& [n, c] : children_) c->collect_state(prefix + n + ".", out);
}

NamedTensors Module::state_dict() const {
  NamedTensors out;
  collect_state("", out);
  return out;
}

void Module::load_state_dict(const std::map<std::string, Tensor>& state, bool strict) {
  NamedTensors v(state.begin(), state.end());
  load_state_dict(v, strict);
}

void Module::load_state_dict(const NamedTensors& state, bool strict) {
  // Our tensors by name (the live ones, not detached copies).
  NamedTensors own;
  std::function<void(const std::string&, const Module*)> walk = [&](const std::string& prefix,
                                                                    const Module* m) {
    for (const auto& [n, p] : m->params_)
      if (p.defined()) own.emplace_back(prefix + n, p);
    for (const auto& [n, b] : m->buffers_)
      if (b.defined() && !m->non_persistent_.count(n)) own.emplace_back(prefix + n, b);
    for (const auto& [n, c] : m->children_) walk(prefix + n + ".", c.get());
  };
  walk("", this);
  std::map<std::string, Tensor> by_name(own.begin(), own.end());

  std::vector<std::string> unexpected, mismatched;
  std::set<std::string> provided;
  std::unordered_set<const TensorImpl*> loaded;
  for (const auto& [name, src] : state) {
    auto it = by_name.find(name);
    if (it == by_name.end()) {
      unexpected.push_back(name);
      continue;
    }
    const Tensor& dst = it->second;
    if (!src.defined() || src.sizes() != dst.sizes()) {
      mismatched.push_back(fmt::format(
          "size mismatch for {}: copying a param with shape {} from checkpoint, the shape in "
          "current model is {}.",
          name, src.defined() ? src.shape_string() : std::string("<undefined>"),
          dst.shape_string()));
      continue;
    }
    provided.insert(name);
  }
  std::vector<std::string> missing;
  if (mismatched.empty() && (!strict || unexpected.empty())) {
    NoGradGuard ng;
    for (const auto& [name, src] : state) {
      if (!provided.count(name)) continue;
      const Tensor& dst = by_name[name];
      ops::copy_(dst, src);
      loaded.insert(dst.unsafe_impl());
    }
  } else {
    for (const auto& [name, src] : state)
      if (provided.count(name)) loaded.insert(by_name[name].unsafe_impl());
  }
  for (const auto& [name, t] : own)
    if (!provided.count(name) && !loaded.count(t.unsafe_impl())) missing.push_back(name);

  auto join = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", \"" : "\"") + v[i] + "\"";
    return s;
  };
  std::string err;
  if (strict && !missing.empty())
    err += fmt::format("\n\tMissing key(s) in state_dict: {}.", join(missing));
  if (strict && !unexpected.empty())
    err += fmt::format("\n\tUnexpected key(s) in state_dict: {}.", join(unexpected));
  for (const auto& m : mismatched) err += "\n\t" + m;
  if (!err.empty())
    throw std::runtime_error(
        fmt::format("Error(s) in loading state_dict for {}:{}", type_name_, err));
}

std::string Module::repr() const {
  std::ostringstream os;
  os << type_name_ << "(" << extra_repr();
  if (!children_.empty()) {
    os << "\n";
    for (const auto& [n, c] : children_) {
      std::string child = c->repr();
      std::string indented;
      for (char ch : child) {
        indented += ch;
        if (ch == '\n') indented += "  ";
      }
      os << "  (" << n << "): " << indented << "\n";
    }
  }
  os << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Module& m) {
  return os << m.repr();
}

}  // namespace tally::nn
