// Containers (torch.nn.Sequential, torch.nn.ModuleList): children named "0", "1", ...
#pragma once

#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nn/module.h"

namespace tally::nn {

// Calls its children in order, each under its own module path ("layer1.0", ...).
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  Sequential(std::initializer_list<std::shared_ptr<Module>> modules);
  explicit Sequential(const std::vector<std::shared_ptr<Module>>& modules);
  // Any number of modules of any types, so that std::make_shared<Sequential>(
  //     std::make_shared<Linear>(4, 8), std::make_shared<ReLU>()) works (make_shared cannot
  // forward a braced list).
  template <typename M, typename... Ms>
  explicit Sequential(std::shared_ptr<M> first, std::shared_ptr<Ms>... rest)
      : Module("Sequential") {
    push_back(std::move(first));
    (push_back(std::move(rest)), ...);
  }
  template <typename M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> m) {
    return register_module(std::to_string(size()), std::move(m));
  }
  Tensor forward(const Tensor& x) override;
  size_t size() const { return named_children().size(); }
  std::shared_ptr<Module> operator[](size_t i) const;
};

// Holds modules for a parent's forward to call; has no forward of its own.
class ModuleList : public Module {
 public:
  ModuleList() : Module("ModuleList") {}
  template <typename M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> m) {
    auto r = register_module(std::to_string(items_.size()), std::move(m));
    items_.push_back(r);
    return r;
  }
  size_t size() const { return items_.size(); }
  const std::shared_ptr<Module>& operator[](size_t i) const;
  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }

 private:
  std::vector<std::shared_ptr<Module>> items_;
};

// torch.nn.ModuleDict: children by name, in insertion order; no forward of its own. A
// parent's forward calls them by name (dict["encoder"]) and each runs under its full path
// ("layers.encoder"). Names follow register_module's rules (non-empty, no '.').
class ModuleDict : public Module {
 public:
  ModuleDict() : Module("ModuleDict") {}
  ModuleDict(std::initializer_list<std::pair<std::string, std::shared_ptr<Module>>> items);
  // Adds `m` under `name`, replacing the module there.
  template <typename M>
  std::shared_ptr<M> insert(const std::string& name, std::shared_ptr<M> m) {
    return register_module(name, std::move(m));
  }
  // The module called `name`; throws std::out_of_range naming it and the keys there are.
  std::shared_ptr<Module> operator[](const std::string& name) const;
  template <typename M>
  std::shared_ptr<M> get(const std::string& name) const {
    auto m = std::dynamic_pointer_cast<M>((*this)[name]);
    if (!m)
      throw std::invalid_argument("ModuleDict: '" + name + "' is a " + (*this)[name]->type_name() +
                                  ", not the type asked for");
    return m;
  }
  bool contains(const std::string& name) const;
  size_t size() const { return named_children().size(); }
  std::vector<std::string> keys() const;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> items() const {
    return named_children();
  }
};

}  // namespace tally::nn
