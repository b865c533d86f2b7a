// Sequential, ModuleList and ModuleDict.
#include "nn/container.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>

namespace tally::nn {

Sequential::Sequential(std::initializer_list<std::shared_ptr<Module>> modules)
    : Module("Sequential") {
  for (const auto& m : modules) push_back(m);
}

Sequential::Sequential(const std::vector<std::shared_ptr<Module>>& modules) : Module("Sequential") {
  for (const auto& m : modules) push_back(m);
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor y = x;
  for (const auto& m : children()) y = (*m)(y);
  return y;
}

std::shared_ptr<Module> Sequential::operator[](size_t i) const {
  auto c = children();
  if (i >= c.size())
    throw std::out_of_range(
        fmt::format("Sequential: index {} is out of range (size {})", i, c.size()));
  return c[i];
}

const std::shared_ptr<Module>& ModuleList::operator[](size_t i) const {
  if (i >= items_.size())
    throw std::out_of_range(
        fmt::format("ModuleList: index {} is out of range (size {})", i, items_.size()));
  return items_[i];
}

ModuleDict::ModuleDict(std::initializer_list<std::pair<std::string, std::shared_ptr<Module>>> items)
    : Module("ModuleDict") {
  for (const auto& [name, m] : items) insert(name, m);
}

std::shared_ptr<Module> ModuleDict::operator[](const std::string& name) const {
  for (auto& [n, m] : named_children())
    if (n == name) return m;
  throw std::out_of_range(
      fmt::format("ModuleDict: no module '{}' (keys: {})", name, fmt::join(keys(), ", ")));
}

bool ModuleDict::contains(const std::string& name) const {
  for (auto& [n, m] : named_children())
    if (n == name) return true;
  return false;
}

std::vector<std::string> ModuleDict::keys() const {
  std::vector<std::string> out;
  for (auto& [n, m] : named_children()) out.push_back(n);
  return out;
}

}  // namespace tally::nn
