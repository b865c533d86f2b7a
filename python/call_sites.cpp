// Allocations made from Python name the Python line that asked for them: a hook
// (memory::set_user_site_hook) reads the innermost Python frame outside the tally package
// when a library call site opens, so snapshots, traces and the leak detector show
// `train.py:42` rather than the binding's C++ line. It costs a few atomic loads per call unless
// history is being recorded or an allocation observer (the profiler, the leak detector) is
// installed. A module called from Python runs under the phase "forward" when no phase is open.
#include <Python.h>
#include <frameobject.h>

#include <string>
#include <string_view>

#include "common.h"
#include "memory/caching_allocator.h"
#include "memory/user_site.h"

namespace tally::python {

namespace {

std::string* g_package_dir = nullptr;  // ".../tally/": frames in it are the package's own

const char* interned_cstr(std::string_view s) {
  return memory::interned(memory::intern(s)).c_str();
}

bool python_site(memory::SourceLoc& site) {
  if (!memory::any_history_recording() && memory::allocation_observer() == nullptr) return false;
    // A C++ thread (the DataLoader's), the GIL released, or the interpreter gone (a tensor freed
    // at exit): no Python frame to read.
#if PY_VERSION_HEX >= 0x030D0000
  PyThreadState* ts = PyThreadState_GetUnchecked();
#else
  PyThreadState* ts = _PyThreadState_UncheckedGet();
#endif
  if (ts == nullptr || !Py_IsInitialized() || !PyGILState_Check()) return false;
  PyFrameObject* frame = PyEval_GetFrame();
  if (frame == nullptr) return false;
  Py_INCREF(frame);
  bool found = false;
  while (frame != nullptr && !found) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    Py_ssize_t n = 0;
    const char* file = PyUnicode_AsUTF8AndSize(code->co_filename, &n);
    if (file == nullptr) {
      PyErr_Clear();
    } else if (std::string_view f(file, static_cast<size_t>(n));
               g_package_dir == nullptr || !f.starts_with(*g_package_dir)) {
      const char* fn = PyUnicode_AsUTF8(code->co_name);
      if (fn == nullptr) PyErr_Clear();
      site.file = interned_cstr(f);
      site.function = fn ? interned_cstr(fn) : "";
      const int line = PyFrame_GetLineNumber(frame);
      site.line = static_cast<uint32_t>(line > 0 ? line : 1);
      found = true;
    }
    Py_DECREF(code);
    PyFrameObject* back = found ? nullptr : PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  return found;
}

}  // namespace

ForwardPhase::ForwardPhase() {
  if (memory::current_tag().phase == 0) scope_.emplace("forward");
}

void bind_call_sites(py::module_& m) {
  m.def(
      "_enable_python_call_sites",
      [](const std::string& package_dir) {
        if (g_package_dir == nullptr) g_package_dir = new std::string();
        *g_package_dir = package_dir.ends_with('/') ? package_dir : package_dir + "/";
        memory::set_user_site_hook(&python_site);
      },
      py::arg("package_dir"),
      "Allocations name the Python line outside package_dir that asked for them");
  m.def(
      "_disable_python_call_sites", []() { memory::set_user_site_hook(nullptr); },
      "Allocations name the bindings' C++ lines again");
}

}  // namespace tally::python
