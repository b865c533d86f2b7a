// Sequential and ModuleList.
#include "nn/container.h"

#include <fmt/format.h>

#include <stdexcept>

namespace tally::nn {

Sequential::Sequential(std::initializer_list<std::shared_ptr<Module>> modules)
    : Module("Sequential") {
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

}  // namespace tally::nn
