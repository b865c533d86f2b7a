// tally.profiler: `with tally.profiler.profile(...) as prof:` (torch.profiler.profile), its
// Chrome trace, operator table and memory timeline, schedule() and record_function.
#include "profiler/profiler.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "common.h"
#include "profiler/key_averages.h"

namespace tally::python {

namespace {

using profiler::ProfilerActivity;

class PyProfile {
 public:
  // on_trace_ready(prof) is called with this object's Python wrapper.
  PyProfile(profiler::ProfilerOptions o, py::object on_trace_ready)
      : on_trace_ready_(std::move(on_trace_ready)) {
    if (!on_trace_ready_.is_none())
      o.on_trace_ready = [this](profiler::Profiler&) {
        on_trace_ready_(py::cast(this, py::return_value_policy::reference));
      };
    prof_ = std::make_unique<profiler::Profiler>(std::move(o));
  }
  profiler::Profiler& get() { return *prof_; }

 private:
  py::object on_trace_ready_;
  std::unique_ptr<profiler::Profiler> prof_;
};

class PyRecordFunction {
 public:
  explicit PyRecordFunction(std::string name) : name_(std::move(name)) {}
  void enter() { range_ = std::make_unique<profiler::record_function>(name_); }
  void exit() { range_.reset(); }

 private:
  std::string name_;
  std::unique_ptr<profiler::record_function> range_;
};

py::dict row_dict(const profiler::FunctionEventAvg& r) {
  py::dict d;
  d["key"] = r.key;
  d["input_shapes"] = r.input_shapes;
  d["count"] = r.count;
  d["cpu_time_total"] = r.cpu_time_total;
  d["self_cpu_time_total"] = r.self_cpu_time_total;
  d["cuda_time_total"] = r.cuda_time_total;
  d["self_cuda_time_total"] = r.self_cuda_time_total;
  d["cpu_memory_usage"] = r.cpu_memory_usage;
  d["self_cpu_memory_usage"] = r.self_cpu_memory_usage;
  d["cuda_memory_usage"] = r.cuda_memory_usage;
  d["self_cuda_memory_usage"] = r.self_cuda_memory_usage;
  return d;
}

// A Profiler export as a method: export(path) with device=None (the profiled device), else
// export(path, device).
template <void (profiler::Profiler::*to_default)(const std::string&) const,
          void (profiler::Profiler::*to_given)(const std::string&, memory::Device) const>
void export_to_device(PyProfile& p, const std::string& path, py::object device) {
  if (device.is_none())
    (p.get().*to_default)(path);
  else
    (p.get().*to_given)(path, to_device(device));
}

}  // namespace

void bind_profiler(py::module_& m, py::module_& prof) {
  (void)m;
  py::enum_<ProfilerActivity>(prof, "ProfilerActivity")
      .value("CPU", ProfilerActivity::cpu)
      .value("CUDA", ProfilerActivity::cuda);
  py::enum_<profiler::ProfilerAction>(prof, "ProfilerAction")
      .value("NONE", profiler::ProfilerAction::none)
      .value("WARMUP", profiler::ProfilerAction::warmup)
      .value("RECORD", profiler::ProfilerAction::record)
      .value("RECORD_AND_SAVE", profiler::ProfilerAction::record_and_save);
  prof.def("schedule", &profiler::schedule, py::kw_only(), py::arg("wait"), py::arg("warmup"),
           py::arg("active"), py::arg("repeat") = 0, py::arg("skip_first") = 0);

  py::class_<profiler::EventList>(prof, "EventList")
      .def("table", &profiler::EventList::table, py::arg("sort_by") = "",
           py::arg("row_limit") = 100, py::arg("max_name_column_width") = 55,
           py::arg("max_shapes_column_width") = 80)
      .def("__len__", &profiler::EventList::size)
      .def("__getitem__",
           [](const profiler::EventList& l, size_t i) {
             if (i >= l.size()) throw py::index_error("EventList index out of range");
             return row_dict(l[i]);
           })
      .def_property_readonly("rows",
                             [](const profiler::EventList& l) {
                               py::list out;
                               for (const auto& r : l.rows()) out.append(row_dict(r));
                               return out;
                             })
      .def("self_cpu_time_total", &profiler::EventList::self_cpu_time_total)
      .def("__str__", [](const profiler::EventList& l) { return l.table(); });

  py::class_<PyProfile>(prof, "profile", "torch.profiler.profile as a context manager")
      .def(py::init([](py::object activities, py::object schedule, py::object on_trace_ready,
                       bool record_shapes, bool profile_memory, bool with_stack) {
             profiler::ProfilerOptions o;
             if (!activities.is_none()) {
               o.activities.clear();
               for (py::handle a : activities) {
                 if (py::isinstance<py::str>(a)) {
                   const std::string s = a.cast<std::string>();
                   if (s == "cpu" || s == "CPU")
                     o.activities.insert(ProfilerActivity::cpu);
                   else if (s == "cuda" || s == "CUDA")
                     o.activities.insert(ProfilerActivity::cuda);
                   else
                     throw py::value_error("activity '" + s + "': expected cpu or cuda");
                 } else {
                   o.activities.insert(a.cast<ProfilerActivity>());
                 }
               }
             }
             if (!schedule.is_none()) o.schedule = schedule.cast<profiler::Schedule>();
             o.record_shapes = record_shapes;
             o.profile_memory = profile_memory;
             o.with_stack = with_stack;
             return std::make_unique<PyProfile>(o, on_trace_ready);
           }),
           py::arg("activities") = py::none(), py::arg("schedule") = py::none(),
           py::arg("on_trace_ready") = py::none(), py::arg("record_shapes") = false,
           py::arg("profile_memory") = false, py::arg("with_stack") = false)
      .def("__enter__",
           [](py::object self) {
             self.cast<PyProfile&>().get().start();
             return self;
           })
      .def("__exit__",
           [](PyProfile& p, py::args) {
             p.get().stop();
             return false;
           })
      .def("start", [](PyProfile& p) { p.get().start(); })
      .def("stop", [](PyProfile& p) { p.get().stop(); })
      .def("step", [](PyProfile& p) { p.get().step(); })
      .def_property_readonly("step_num", [](PyProfile& p) { return p.get().step_num(); })
      .def(
          "key_averages",
          [](PyProfile& p, bool by_shape) { return p.get().key_averages(by_shape); },
          py::arg("group_by_input_shape") = false)
      .def("key_averages_by_module", [](PyProfile& p) { return p.get().key_averages_by_module(); })
      .def(
          "export_chrome_trace",
          [](PyProfile& p, const std::string& path) { p.get().export_chrome_trace(path); },
          py::arg("path"), "A Chrome trace (open in Perfetto or chrome://tracing)")
      .def("export_memory_timeline",
           &export_to_device<&profiler::Profiler::export_memory_timeline,
                             &profiler::Profiler::export_memory_timeline>,
           py::arg("path"), py::arg("device") = py::none(), "'.json' or '.html'")
      .def("export_memory_snapshot",
           &export_to_device<&profiler::Profiler::export_memory_snapshot,
                             &profiler::Profiler::export_memory_snapshot>,
           py::arg("path"), py::arg("device") = py::none());

  def_enter_exit(
      py::class_<PyRecordFunction>(prof, "record_function", "A user range in the profile")
          .def(py::init<std::string>(), py::arg("name")));
}

}  // namespace tally::python
