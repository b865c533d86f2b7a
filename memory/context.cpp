#include "memory/context.h"

#include <atomic>
#include <deque>
#include <filesystem>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>

#include "memory/user_site.h"

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
  SourceLoc site;  // the innermost CallSiteScope's user line (line 0: none open)
};

thread_local ThreadContext tls;

std::atomic<ContextObserver*> g_context_observer{nullptr};
std::atomic<UserSiteHook> g_user_site_hook{nullptr};

}  // namespace

void set_context_observer(ContextObserver* observer) {
  g_context_observer.store(observer);
}
void set_user_site_hook(UserSiteHook hook) {
  g_user_site_hook.store(hook);
}
bool hooked_user_site(SourceLoc& site) {
  const UserSiteHook hook = g_user_site_hook.load(std::memory_order_acquire);
  return hook != nullptr && hook(site);
}

ContextObserver* context_observer() {
  return g_context_observer.load(std::memory_order_acquire);
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
  tag.loc = tls.site;
  return tag;
}

std::string_view relative_source_path(const char* file) {
  std::string_view p = file ? file : "";
  constexpr std::string_view root = TALLY_SOURCE_DIR "/";
  if (p.starts_with(root)) {
    p.remove_prefix(root.size());
  } else if (!p.starts_with('/')) {
    // A relative path is relative to the build folder (ccache's base_dir rewrites them so):
    // "../nn/linear.cpp" -> "nn/linear.cpp".
    while (p.starts_with("../") || p.starts_with("./")) p.remove_prefix(p.find('/') + 1);
  }
  return p;
}

std::string_view display_source_path(const char* file) {
  const std::string_view p = relative_source_path(file);
  if (!p.starts_with('/')) return p;
  static const std::string cwd = [] {
    std::error_code ec;
    std::string d = std::filesystem::current_path(ec).string();
    if (ec || d == "/") return std::string();
    return d.ends_with('/') ? d : d + '/';
  }();
  if (!cwd.empty() && p.starts_with(cwd)) return p.substr(cwd.size());
  return p;
}

bool is_library_source(const char* file) {
  const std::string_view rel = relative_source_path(file);
  if (rel.starts_with('/')) return false;  // not under the source root
  for (std::string_view dir : {"memory/", "tensor/", "autograd/", "nn/", "optim/", "profiler/",
                               "distributed/", "python/"}) {
    if (rel.starts_with(dir)) return true;
  }
  return false;
}

CallSiteScope::CallSiteScope(const std::source_location& site) : ScopeGuard(tls.site) {
  // Library frames keep the user's line; the first user line, or a deeper one, replaces it.
  // With no line open yet (a module's constructor building its parameters, an op called
  // from Tally's own code) the outermost library line stands in until a user line opens.
  // A site's file is a string literal, so the last answer is kept by its address: ops
  // called in a loop from one file pay one comparison.
  thread_local const char* last_file = nullptr;
  thread_local bool last_is_library = false;
  const char* file = site.file_name();
  if (file != last_file) {
    last_is_library = is_library_source(file);
    last_file = file;
  }
  if (!last_is_library) {
    tls.site = SourceLoc::from(site);
  } else if (SourceLoc user; hooked_user_site(user)) {
    tls.site = user;  // the interpreter's innermost user line (Python calling the library)
  } else if (tls.site.line == 0) {
    tls.site = SourceLoc::from(site);
  }
}

CallSiteScope::~CallSiteScope() {
  tls.site = saved_;
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
ModuleScope::ModuleScope(AbsolutePath, std::string_view path) : ScopeGuard(tls.module) {
  const StrId id = path.empty() ? 0 : intern(path);
  if (id == tls.module) return;
  tls.module = id;
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
