// tally.memory: PyTorch's memory functions (memory_allocated, memory_stats, memory_summary,
// record_memory_history, dump_snapshot, ...), the allocation context as a context manager
// (tally.memory.context), and the estimator (estimate, DryRun: a dry run on a meta device).
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "base/json.h"
#include "common.h"
#include "memory/category.h"
#include "memory/context.h"
#include "memory/estimate.h"
#include "memory/meta.h"
#include "nn/parameter_split.h"

namespace tally::python {

namespace {

using memory::Category;

Category to_category(const std::string& name) {
  if (auto c = memory::parse_category(name)) return *c;
  std::string known;
  for (Category c : memory::kAllCategories)
    known += (known.empty() ? "" : ", ") + std::string(memory::category_name(c));
  throw py::value_error("unknown memory category '" + name + "' (known: " + known + ")");
}

// `with tally.memory.context(category="activation", module="encoder"):` tags everything
// allocated inside (memory/context.h's scopes); module names nest as nn.Module's do.
class Context {
 public:
  Context(std::optional<std::string> category, std::optional<std::string> module,
          std::optional<std::string> op, std::optional<std::string> phase)
      : module_(std::move(module)), op_(std::move(op)), phase_(std::move(phase)) {
    if (category) category_ = to_category(*category);
  }
  void enter() {
    if (open_) throw py::value_error("this memory context is already open");
    if (category_) category_scope_.emplace(*category_);
    if (module_) module_scope_.emplace(*module_);
    if (op_) op_scope_.emplace(*op_);
    if (phase_) phase_scope_.emplace(*phase_);
    open_ = true;
  }
  void exit() {
    phase_scope_.reset();
    op_scope_.reset();
    module_scope_.reset();
    category_scope_.reset();
    open_ = false;
  }

 private:
  std::optional<Category> category_;
  std::optional<std::string> module_, op_, phase_;
  std::optional<memory::CategoryScope> category_scope_;
  std::optional<memory::ModuleScope> module_scope_;
  std::optional<memory::OpScope> op_scope_;
  std::optional<memory::PhaseScope> phase_scope_;
  bool open_ = false;
};

py::dict category_dict(const std::array<int64_t, memory::kNumCategories>& bytes) {
  py::dict d;
  for (size_t i = 0; i < memory::kNumCategories; ++i)
    d[py::str(std::string(memory::category_name(memory::kAllCategories[i])))] = bytes[i];
  return d;
}

memory::EstimateOptions estimate_options(const std::string& target, py::object capacity,
                                         size_t max_history) {
  memory::EstimateOptions o;
  o.target = target;
  if (!capacity.is_none())
    o.capacity = py::isinstance<py::str>(capacity)
                     ? memory::parse_bytes(capacity.cast<std::string>(), "capacity")
                     : capacity.cast<size_t>();
  o.max_history = max_history;
  return o;
}

// `with tally.memory.DryRun("h200") as dry: ... (on dry.device)`, then dry.estimate.
class PyDryRun {
 public:
  explicit PyDryRun(const memory::EstimateOptions& o) : dry_(std::make_unique<memory::DryRun>(o)) {}
  Device device() const { return dry_->device(); }
  void phase(const std::string& name) { dry_->phase(name); }
  memory::Estimate finish(const std::string& oom) {
    estimate_ = dry_->finish(oom);
    return *estimate_;
  }
  py::object estimate() const { return estimate_ ? py::cast(*estimate_) : py::none(); }

 private:
  std::unique_ptr<memory::DryRun> dry_;
  std::optional<memory::Estimate> estimate_;
};

// mem.NAME(device=None) for each memory::NAME(Device) of `fns` (None: the default device).
template <typename R>
void def_per_device(py::module_& mem,
                    std::initializer_list<std::pair<const char*, R (*)(Device)>> fns) {
  for (const auto& f : fns) {
    R (*fn)(Device) = f.second;
    mem.def(
        f.first, [fn](py::object d) { return fn(to_device(d)); }, py::arg("device") = py::none());
  }
}

}  // namespace

void bind_memory(py::module_& m, py::module_& mem) {
  (void)m;
  auto dev = [](py::object d) { return to_device(d); };
  const auto device_arg = py::arg("device") = py::none();

  mem.def("cuda_available", &memory::cuda_available, "Whether this build has CUDA and a GPU");
  mem.def("device_count", &memory::cuda_device_count);
  mem.def("default_device", &memory::default_device, "cuda:0 when present, else cpu");
  def_per_device<size_t>(mem, {{"memory_allocated", &memory::memory_allocated},
                               {"max_memory_allocated", &memory::max_memory_allocated},
                               {"memory_reserved", &memory::memory_reserved},
                               {"max_memory_reserved", &memory::max_memory_reserved}});
  def_per_device<void>(mem, {{"reset_peak_memory_stats", &memory::reset_peak_memory_stats},
                             {"empty_cache", &memory::empty_cache},
                             {"synchronize", &memory::synchronize}});
  mem.def(
      "memory_stats", [dev](py::object d) { return memory::memory_stats(dev(d)); }, device_arg,
      "PyTorch's keys (allocated_bytes.all.current, ...) and Tally's "
      "category.<name>.{current,peak,at_peak}");
  mem.def(
      "memory_by_category",
      [dev](py::object d, const std::string& which) {
        const auto stats = memory::memory_stats(dev(d));
        py::dict out;
        for (Category c : memory::kAllCategories) {
          const std::string name(memory::category_name(c));
          auto it = stats.find("category." + name + "." + which);
          out[py::str(name)] = it == stats.end() ? 0 : it->second;
        }
        return out;
      },
      device_arg, py::arg("which") = "current",
      "Bytes per category: which = current, peak or at_peak (when allocated memory peaked)");
  mem.def("categories", []() {
    std::vector<std::string> out;
    for (Category c : memory::kAllCategories) out.emplace_back(memory::category_name(c));
    return out;
  });
  mem.def(
      "category_color",
      [](const std::string& name) {
        return std::string(memory::category_color(to_category(name)));
      },
      py::arg("category"), "The category's colour on Tally's pages (CSS #rrggbb)");
  mem.def(
      "memory_summary",
      [dev](py::object d, bool abbreviated, py::object model) {
        if (model.is_none()) return memory::memory_summary(dev(d), abbreviated);
        return nn::memory_summary(model.cast<const nn::Module&>(), dev(d), abbreviated);
      },
      device_arg, py::arg("abbreviated") = false, py::arg("model") = py::none(),
      "PyTorch's table and Tally's categories; with model=, the parameter row split into its "
      "trainable and frozen parameters");
  mem.def(
      "record_memory_history",
      [dev](py::object enabled, size_t max_entries, py::object d) {
        bool on = true;
        if (enabled.is_none())
          on = false;
        else if (py::isinstance<py::str>(enabled)) {
          const std::string e = enabled.cast<std::string>();
          if (e != "all" && e != "state" && e != "none")
            throw py::value_error(
                "record_memory_history: enabled must be 'all', 'state', "
                "None, True or False, got '" +
                e + "'");
          on = e != "none";
        } else
          on = enabled.cast<bool>();
        memory::record_memory_history(on, max_entries, dev(d));
      },
      py::arg("enabled") = "all", py::arg("max_entries") = 100000, device_arg,
      "Start (enabled='all' or True) or stop (None or False) recording allocator history");
  mem.def(
      "dump_snapshot",
      [dev](const std::string& path, py::object d) { memory::dump_snapshot(path, dev(d)); },
      py::arg("path"), device_arg, "The memory_viz snapshot (a pickle) of the device's allocator");
  mem.def(
      "set_per_process_memory_fraction",
      [dev](double f, py::object d) { memory::set_per_process_memory_fraction(f, dev(d)); },
      py::arg("fraction"), device_arg);
  mem.def(
      "parse_bytes", [](const std::string& s) { return memory::parse_bytes(s); }, py::arg("text"),
      "'6GiB', '900MiB', '1.5GB' or plain bytes -> bytes");

  def_enter_exit(
      py::class_<Context>(mem, "context",
                          "with tally.memory.context(category='input', module='loader'): tags "
                          "every allocation inside")
          .def(py::init<std::optional<std::string>, std::optional<std::string>,
                        std::optional<std::string>, std::optional<std::string>>(),
               py::arg("category") = py::none(), py::arg("module") = py::none(),
               py::arg("op") = py::none(), py::arg("phase") = py::none()));
  mem.def("current_context", []() {
    const memory::AllocTag t = memory::current_tag();
    py::dict d;
    d["category"] = std::string(memory::category_name(t.category));
    d["module"] = memory::interned(t.module);
    d["op"] = memory::interned(t.op);
    d["phase"] = memory::interned(t.phase);
    return d;
  });

  // ---- the estimator ----
  py::class_<memory::ModuleBytes>(mem, "ModuleBytes")
      .def_readonly("module", &memory::ModuleBytes::module)
      .def_readonly("bytes", &memory::ModuleBytes::bytes)
      .def("__repr__", [](const memory::ModuleBytes& b) {
        return "ModuleBytes('" + b.module + "', " + std::to_string(b.bytes) + ")";
      });
  py::class_<memory::PhasePeak>(mem, "PhasePeak")
      .def_readonly("phase", &memory::PhasePeak::phase)
      .def_readonly("peak_allocated", &memory::PhasePeak::peak_allocated)
      .def_readonly("peak_reserved", &memory::PhasePeak::peak_reserved)
      .def("__repr__", [](const memory::PhasePeak& p) {
        return "PhasePeak('" + p.phase + "', peak_allocated=" + std::to_string(p.peak_allocated) +
               ", peak_reserved=" + std::to_string(p.peak_reserved) + ")";
      });
  py::class_<memory::Estimate>(mem, "Estimate", "A dry run's prediction (memory/estimate.h)")
      .def_property_readonly("target", [](const memory::Estimate& e) { return e.target.name; })
      .def_property_readonly("target_description",
                             [](const memory::Estimate& e) { return e.target.description; })
      .def_property_readonly("capacity",
                             [](const memory::Estimate& e) { return e.target.capacity; })
      .def_readonly("device", &memory::Estimate::device)
      .def_readonly("peak_allocated", &memory::Estimate::peak_allocated)
      .def_readonly("peak_reserved", &memory::Estimate::peak_reserved)
      .def_property_readonly("at_peak",
                             [](const memory::Estimate& e) { return category_dict(e.at_peak); })
      .def_readonly("activations_at_peak", &memory::Estimate::activations_at_peak)
      .def_readonly("allocations", &memory::Estimate::allocations)
      .def_readonly("seconds", &memory::Estimate::seconds)
      .def_readonly("predicted_seconds", &memory::Estimate::predicted_seconds)
      .def_readonly("out_of_memory", &memory::Estimate::out_of_memory)
      .def_readonly("unreplayed", &memory::Estimate::unreplayed)
      .def_readonly("phases", &memory::Estimate::phases)
      .def_property_readonly("fits", &memory::Estimate::fits)
      .def("report", &memory::Estimate::report, py::arg("top_modules") = 8)
      .def("__str__", [](const memory::Estimate& e) { return e.report(); })
      .def("__repr__",
           [](const memory::Estimate& e) {
             return "Estimate(target='" + e.target.name +
                    "', peak_allocated=" + std::to_string(e.peak_allocated) +
                    ", peak_reserved=" + std::to_string(e.peak_reserved) + ")";
           })
      .def("_repr_html_", [](const memory::Estimate& e) {
        return "<pre>" + base::html_escape(e.report()) + "</pre>";
      });
  mem.def(
      "estimate",
      [](py::function fn, const std::string& target, py::object capacity, size_t max_history) {
        return memory::estimate([fn](Device d) { fn(d); },
                                estimate_options(target, capacity, max_history));
      },
      py::arg("fn"), py::arg("target") = "cpu", py::arg("capacity") = py::none(),
      py::arg("max_history") = 1000000,
      "Runs fn(device) on a fresh meta device replaying `target` (cpu, h100, h200, cuda): shapes "
      "and "
      "allocations, no data. Returns the predicted peaks and categories.");
  mem.def("meta_targets", &memory::meta_target_names);
  py::class_<PyDryRun>(mem, "DryRun",
                       "with tally.memory.DryRun('cpu') as dry: run on dry.device; then "
                       "dry.estimate")
      .def(py::init([](const std::string& target, py::object capacity, size_t max_history) {
             return std::make_unique<PyDryRun>(estimate_options(target, capacity, max_history));
           }),
           py::arg("target") = "cpu", py::arg("capacity") = py::none(),
           py::arg("max_history") = 1000000)
      .def_property_readonly("device", &PyDryRun::device)
      .def("phase", &PyDryRun::phase, py::arg("name"),
           "From now on the run is in phase `name` (before the first call: 'setup'); the "
           "estimate names each phase's peaks")
      .def_property_readonly("estimate", &PyDryRun::estimate)
      .def("finish", &PyDryRun::finish, py::arg("out_of_memory") = "")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyDryRun& d, py::object type, py::object value, py::object) {
        // A dry run that ran out of the target's memory is a result, not an error.
        py::object oom = py::module_::import("tally._C").attr("OutOfMemoryError");
        if (!type.is_none() && PyObject_IsSubclass(type.ptr(), oom.ptr()) == 1) {
          d.finish(py::str(value));
          return true;
        }
        if (type.is_none()) d.finish("");
        return false;
      });
}

}  // namespace tally::python
