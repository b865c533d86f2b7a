// Which modules of a model a checkpoint or offload policy applies to, for any model: by type
// name (`type:Block`, FSDP's apply_activation_checkpointing(check_fn) idea), by dotted-name
// glob (`name:blocks.*`), every k-th of those (`/k`), or a predicate. Spelling: docs/notes.md
// (Policies for any model).
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tally::nn {

class Module;

// check_fn(name, module): true for a module the policy applies to (name is the dotted path).
using ModulePredicate = std::function<bool(const std::string& name, const Module& module)>;

struct ModuleSelector {
  std::string type;           // a type name, exactly ("Block"); empty: any
  std::string name;           // a dotted-name glob ("blocks.*"); empty: any
  ModulePredicate predicate;  // a check_fn; empty: any
  std::string label;          // how str() names the predicate ("custom" when empty)
  int every = 1;              // every k-th match in named_modules() order: the 1st, k+1-th, ...

  bool empty() const { return type.empty() && name.empty() && !predicate; }
  // "type:Block", "name:blocks.*/2", "custom"
  std::string str() const;
  // The modules of `model` (the root included) that match, every `every`-th, in
  // named_modules() order.
  std::vector<std::pair<std::string, Module*>> select(Module& model) const;
};

// "type:T[/k]" or "name:GLOB[/k]"; std::invalid_argument naming `flag` for anything else.
ModuleSelector parse_module_selector(std::string_view spec, std::string_view flag);
// Whether `s` starts a selector ("type:" or "name:").
bool is_module_selector(std::string_view spec);
// A dotted-name glob: `*` matches within one component (no dot), `**` across components,
// `?` one character other than a dot; anything else matches itself.
bool glob_match(std::string_view pattern, std::string_view name);
// The types that occur at least twice among `model`'s modules with children (repeated
// composite modules: a model's blocks), most frequent first: the planner's candidates.
std::vector<std::pair<std::string, int>> repeated_module_types(Module& model);

}  // namespace tally::nn
