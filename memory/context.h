// The allocation context: a thread-local stack of (category, module path, op, phase)
// that RAII scopes push and pop. The allocator copies the top of the stack into each
// block it hands out, so every allocation is attributed without unwinding any stack.
//
// Strings (module paths, op names, phases) are interned once when a scope is opened;
// the hot path copies four small integers.
#pragma once

#include <cstdint>
#include <source_location>
#include <string>
#include <string_view>

#include "base/scope_guard.h"
#include "memory/category.h"

namespace tally::memory {

// Interned string id. 0 is the empty string.
using StrId = uint32_t;

StrId intern(std::string_view s);
// Stable for the life of the process.
const std::string& interned(StrId id);

// Where in C++ a public allocator call came from (std::source_location, flattened).
struct SourceLoc {
  const char* file = "";
  const char* function = "";
  uint32_t line = 0;

  static SourceLoc from(const std::source_location& l) {
    return SourceLoc{l.file_name(), l.function_name(), static_cast<uint32_t>(l.line())};
  }
};

// The logical stack an allocation carries: what it is, who asked, in which op and phase.
struct AllocTag {
  Category category = Category::unknown;
  StrId module = 0;  // dotted module path, e.g. "layer3.1.conv2"
  StrId op = 0;      // op name, e.g. "conv2d"
  StrId phase = 0;   // "forward", "backward", "optimizer", "recompute", ...
  // The user's line that asked for the work (the innermost open CallSiteScope); when none
  // is open, the C++ call site of the allocator's public API.
  SourceLoc loc;
};

// The current top of this thread's context stack.
AllocTag current_tag();

// Observer of module and phase scopes (the profiler): told the full module path / phase
// when a ModuleScope or PhaseScope opens and closes on the calling thread. When none is
// installed a scope pays one pointer check. Exits may arrive without their enter (the
// observer was installed inside the scope); observers ignore those.
struct ContextObserver {
  virtual ~ContextObserver() = default;
  virtual void on_module_enter(StrId path) = 0;
  virtual void on_module_exit(StrId path) = 0;
  virtual void on_phase_enter(StrId phase) = 0;
  virtual void on_phase_exit(StrId phase) = 0;
};
void set_context_observer(ContextObserver* observer);
ContextObserver* context_observer();

// RAII: allocations inside are tagged with `category`.
class CategoryScope : base::ScopeGuard<Category> {
 public:
  explicit CategoryScope(Category c);
  ~CategoryScope();
};

// RAII: appends `name` to the module path ("" + "layer1" -> "layer1", then "layer1.0"),
// or, given AbsolutePath, sets the whole path (nn::Module: a child called past its parent).
class ModuleScope : base::ScopeGuard<StrId> {
 public:
  struct AbsolutePath {};
  explicit ModuleScope(std::string_view name);
  ModuleScope(AbsolutePath, std::string_view path);
  ~ModuleScope();
};

// RAII: sets the op name for everything the op allocates.
class OpScope : base::ScopeGuard<StrId> {
 public:
  explicit OpScope(std::string_view op);
  explicit OpScope(StrId op);
  ~OpScope();
};

// RAII: sets the training phase ("forward", "backward", "optimizer", ...).
class PhaseScope : base::ScopeGuard<StrId> {
 public:
  explicit PhaseScope(std::string_view phase);
  ~PhaseScope();
};

// RAII: the user's call site for everything allocated inside. Module's call operators, the
// public factories (randn, zeros, ...), the differentiable ops (matmul, relu, cross_entropy,
// ...; C++ operators such as a + b cannot take one and keep the enclosing site), Tensor::to,
// backward() and Optimizer::step open one with std::source_location::current() defaulted
// at their caller, so snapshots, traces and the leak detector name the user's file and line
// without unwinding the stack. A site in Tally's own library sources (is_library_source)
// keeps the enclosing site: the innermost line of the user's code wins, and a model of
// Tally's own (nn/models/) called from `train.cpp:42` is attributed to train.cpp:42. With
// no site open, a library site is taken (the outermost: `nn/linear.cpp:31` for a Linear
// built outside any scope) until a user site opens inside it.
class CallSiteScope : base::ScopeGuard<SourceLoc> {
 public:
  explicit CallSiteScope(const std::source_location& site = std::source_location::current());
  ~CallSiteScope();
};

// True when `file` (a __FILE__ / source_location path) is one of Tally's library sources:
// memory/, tensor/, autograd/, nn/, optim/, profiler/ or distributed/ under the source
// root Tally was built from. Examples, tests, benchmarks and the user's own code are not.
bool is_library_source(const char* file);

// `file` relative to the source root Tally was built from when it lies under it
// ("/src/tally/examples/train_gpt.cpp" -> "examples/train_gpt.cpp"), else unchanged.
std::string_view relative_source_path(const char* file);

// How snapshots, traces and reports name a source file: relative_source_path under the
// source root ("examples/train_gpt.cpp"); else relative to the working directory when it
// lies under it (a user's project built against Tally and run from its folder:
// "/home/me/proj/train.cpp" run in /home/me/proj -> "train.cpp"); else the path unchanged.
// The working directory is the one at the first call. Null or "" gives "".
std::string_view display_source_path(const char* file);

// RAII: all four at once (category required, the rest optional/empty keeps the current).
class AllocContextScope : base::ScopeGuard<AllocTag> {
 public:
  AllocContextScope(Category c, std::string_view module = {}, std::string_view op = {},
                    std::string_view phase = {});
  ~AllocContextScope();
};

}  // namespace tally::memory
