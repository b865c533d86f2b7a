#include "nn/module_select.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <stdexcept>

#include "nn/module.h"

namespace tally::nn {

std::string ModuleSelector::str() const {
  std::string s;
  if (!type.empty()) s = "type:" + type;
  if (!name.empty()) s += (s.empty() ? "" : ",") + std::string("name:") + name;
  if (predicate) s += (s.empty() ? "" : ",") + (label.empty() ? std::string("custom") : label);
  if (s.empty()) s = "all";
  if (every > 1) s += fmt::format("/{}", every);
  return s;
}

std::vector<std::pair<std::string, Module*>> ModuleSelector::select(Module& model) const {
  if (every < 1)
    throw std::invalid_argument(fmt::format("module policy {}: every must be >= 1", str()));
  std::vector<std::pair<std::string, Module*>> out;
  int matched = 0;
  for (auto& [n, m] : model.named_modules()) {
    if (!type.empty() && m->type_name() != type) continue;
    if (!name.empty() && !glob_match(name, n)) continue;
    if (predicate && !predicate(n, *m)) continue;
    if (matched++ % every == 0) out.emplace_back(n, m);
  }
  return out;
}

bool is_module_selector(std::string_view s) {
  return s.starts_with("type:") || s.starts_with("name:");
}

ModuleSelector parse_module_selector(std::string_view spec, std::string_view flag) {
  auto bad = [&](std::string_view why) {
    return std::invalid_argument(fmt::format(
        "{}: '{}' {}: expected type:TYPE or name:GLOB, each optionally /K for every K-th match "
        "(e.g. type:Block, name:blocks.*/2)",
        flag, spec, why));
  };
  ModuleSelector sel;
  std::string_view body = spec;
  if (const size_t slash = body.rfind('/'); slash != std::string_view::npos) {
    const std::string_view k = body.substr(slash + 1);
    if (k.empty() || k.size() > 6 || k.find_first_not_of("0123456789") != std::string_view::npos)
      throw bad("has a bad /K");
    sel.every = std::stoi(std::string(k));
    if (sel.every < 1) throw bad("has /0");
    body = body.substr(0, slash);
  }
  if (body.starts_with("type:")) {
    sel.type = std::string(body.substr(5));
    if (sel.type.empty()) throw bad("names no type");
  } else if (body.starts_with("name:")) {
    sel.name = std::string(body.substr(5));
    if (sel.name.empty()) throw bad("names no pattern");
  } else {
    throw bad("is not a module policy");
  }
  return sel;
}

bool glob_match(std::string_view p, std::string_view s) {
  // Dynamic programming over (pattern position, name position): linear in each, so a pattern
  // of many stars costs no more than its length times the name's.
  const size_t n = s.size();
  std::vector<char> row(n + 1, 0), next(n + 1, 0);
  row[0] = 1;  // the empty pattern matches the empty prefix
  size_t i = 0;
  while (i < p.size()) {
    std::fill(next.begin(), next.end(), 0);
    if (p.compare(i, 2, "**") == 0) {  // any run of characters, dots included
      char any = 0;
      for (size_t j = 0; j <= n; ++j) next[j] = any = static_cast<char>(any | row[j]);
      i += 2;
    } else if (p[i] == '*') {  // any run without a dot
      char any = 0;
      for (size_t j = 0; j <= n; ++j) {
        if (j > 0 && s[j - 1] == '.') any = 0;
        next[j] = any = static_cast<char>(any | row[j]);
      }
      ++i;
    } else {
      for (size_t j = 0; j < n; ++j)
        if (row[j] && (p[i] == '?' ? s[j] != '.' : p[i] == s[j])) next[j + 1] = 1;
      ++i;
    }
    row.swap(next);
  }
  return row[n] != 0;
}

std::vector<std::pair<std::string, int>> repeated_module_types(Module& model) {
  std::vector<std::pair<std::string, int>> out;
  std::map<std::string, size_t> at;
  for (auto& [n, m] : model.named_modules()) {
    if (m == &model || m->named_children().empty()) continue;
    auto [it, added] = at.emplace(m->type_name(), out.size());
    if (added) out.emplace_back(m->type_name(), 0);
    ++out[it->second].second;
  }
  std::erase_if(out, [](const auto& t) { return t.second < 2; });
  return out;
}

}  // namespace tally::nn
