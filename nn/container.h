// Containers (torch.nn.Sequential, torch.nn.ModuleList): children named "0", "1", ...
#pragma once

#include <initializer_list>

#include "nn/module.h"

namespace tally::nn {

// Calls its children in order, each under its own module path ("layer1.0", ...).
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  Sequential(std::initializer_list<std::shared_ptr<Module>> modules);
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

}  // namespace tally::nn
