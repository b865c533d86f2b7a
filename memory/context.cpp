#include "memory/context.h"

#include <atomic>
#include <deque>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>

namespace tally::memory {
namespace {

struct StringTable {
  std::shared_mutex mu;
  std::deque<std::string> strings{std::string()};  // deque: references stay valid
  std::unordered_map<std::string_view, StrId> ids{{std::string_view(), 0}};
};

StringTable& table() {
  static StringTable* t = new StringTable();  // never destroyed: used from static dtors
  return *t;
}

struct ThreadContext {
  Category category = Category::unknown;
  StrId module = 0;
  StrId op = 0;
  StrId phase = 0;
};

thread_local ThreadContext tls;

std::atomic<ContextObserver*> g_context_observer{nullptr};

}  // namespace

void set_context_observer(ContextObserver* observer) {
  g_context_observer.store(observer);
}
ContextObserver* context_observer() {
  return g_context_observer.load(std::memory_order_relaxed);
}

StrId intern(std::string_view s) {
  if (s.empty()) return 0;
  StringTable& t = table();
  {
    std::shared_lock lock(t.mu);
    auto it = t.ids.find(s);
    if (it != t.ids.end()) return it->second;
  }
  std::unique_lock lock(t.mu);
  auto it = t.ids.find(s);
  if (it != t.ids.end()) return it->second;
  const auto id = static_cast<StrId>(t.strings.size());
  const std::string& stored = t.strings.emplace_back(s);
  t.ids.emplace(std::string_view(stored), id);
  return id;
}

const std::string& interned(StrId id) {
  StringTable& t = table();
  std::shared_lock lock(t.mu);
  return t.strings.at(id);
}

AllocTag current_tag() {
  AllocTag tag;
  tag.category = tls.category;
  tag.module = tls.module;
  tag.op = tls.op;
  tag.phase = tls.phase;
  return tag;
}

CategoryScope::CategoryScope(Category c) : ScopeGuard(tls.category) {
  tls.category = c;
}
CategoryScope::~CategoryScope() {
  tls.category = saved_;
}

ModuleScope::ModuleScope(std::string_view name) : ScopeGuard(tls.module) {
  if (name.empty()) return;
  if (tls.module == 0) {
    tls.module = intern(name);
  } else {
    std::string path = interned(tls.module);
    path += '.';
    path += name;
    tls.module = intern(path);
  }
  if (ContextObserver* o = context_observer()) o->on_module_enter(tls.module);
}
ModuleScope::~ModuleScope() {
  if (tls.module != saved_)
    if (ContextObserver* o = context_observer()) o->on_module_exit(tls.module);
  tls.module = saved_;
}

OpScope::OpScope(std::string_view op) : ScopeGuard(tls.op) {
  tls.op = intern(op);
}
OpScope::OpScope(StrId op) : ScopeGuard(tls.op) {
  tls.op = op;
}
OpScope::~OpScope() {
  tls.op = saved_;
}

PhaseScope::PhaseScope(std::string_view phase) : ScopeGuard(tls.phase) {
  tls.phase = intern(phase);
  if (ContextObserver* o = context_observer()) o->on_phase_enter(tls.phase);
}
PhaseScope::~PhaseScope() {
  if (ContextObserver* o = context_observer()) o->on_phase_exit(tls.phase);
  tls.phase = saved_;
}

AllocContextScope::AllocContextScope(Category c, std::string_view module, std::string_view op,
                                     std::string_view phase)
    : ScopeGuard(current_tag()) {
  tls.category = c;
  if (!module.empty()) tls.module = intern(module);
  if (!op.empty()) tls.op = intern(op);
  if (!phase.empty()) tls.phase = intern(phase);
}
AllocContextScope::~AllocContextScope() {
  tls.category = saved_.category;
  tls.module = saved_.module;
  tls.op = saved_.op;
  tls.phase = saved_.phase;
}

}  // namespace tally::memory
