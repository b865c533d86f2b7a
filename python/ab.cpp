// tally._C._ab: the A/B runner in process (ab/ab.h, tally::ab::run). python/tally/ab.py's
// run() turns its arguments into these: the model (a registry name, a Module, or a factory),
// the step and eval functions (Python callables of (model, (input, target))), the batches and
// the levers' lists.
#include "ab/ab.h"

#include <fmt/format.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "common.h"
#include "memory/estimate.h"

namespace tally::python {

namespace {

using nn::Module;
using ModulePtr = std::shared_ptr<Module>;

// (input, target) or an object with .input/.target: an Example of tensors (numpy arrays and
// lists are copied). A bare tensor is an input without a target.
data::Example example_of(py::handle b, const std::string& what) {
  auto tensor = [](py::handle h) { return h.is_none() ? Tensor() : to_tensor(h); };
  if (py::isinstance<py::tuple>(b) || py::isinstance<py::list>(b)) {
    const py::sequence s = py::reinterpret_borrow<py::sequence>(b);
    if (s.size() != 1 && s.size() != 2)
      throw py::value_error(fmt::format("{}: expected (input, target), got {} items", what,
                                        static_cast<size_t>(s.size())));
    return {tensor(s[0]), s.size() == 2 ? tensor(s[1]) : Tensor()};
  }
  if (py::hasattr(b, "input")) return {tensor(b.attr("input")), tensor(b.attr("target"))};
  return {tensor(b), Tensor()};
}

py::tuple batch_of(const data::Example& e) {
  return py::make_tuple(e.input, tensor_or_none(e.target));
}

ab::Results run(py::object model, py::object step, py::object eval, py::object data,
                const py::dict& kw) {
  ab::Options o;
  o.verbose = false;
  if (py::isinstance<py::str>(model)) {
    o.model = model.cast<std::string>();
  } else if (py::isinstance<Module>(model)) {
    o.module = model.cast<ModulePtr>();
  } else if (PyCallable_Check(model.ptr())) {
    o.factory = [model](Device) -> ModulePtr {
      py::object m = model();
      if (!py::isinstance<Module>(m))
        throw py::type_error(
            fmt::format("tally.ab.run: model(): the factory returned {}, not a tally.nn.Module",
                        py::str(py::type::of(m).attr("__name__")).cast<std::string>()));
      // The module lives as long as the C++ side holds it, its Python part too.
      ModulePtr p = m.cast<ModulePtr>();
      return ModulePtr(p.get(), [keep = std::make_shared<py::object>(m), p](Module*) mutable {
        py::gil_scoped_acquire gil;
        p.reset();
        keep.reset();
      });
    };
  } else {
    throw py::type_error(fmt::format(
        "tally.ab.run: model: expected a registry name, a tally.nn.Module or a factory, got {}",
        py::str(py::type::of(model).attr("__name__")).cast<std::string>()));
  }
  if (!step.is_none())
    o.loss = [step](Module& m, const data::Example& b) -> Tensor {
      py::object loss = step(py::cast(&m, py::return_value_policy::reference), batch_of(b));
      if (!py::isinstance<Tensor>(loss))
        throw py::type_error("tally.ab.run: step(model, batch) must return the loss tensor");
      return loss.cast<Tensor>();
    };
  if (!eval.is_none())
    o.eval = [eval](Module& m, const data::Example& b) {
      eval(py::cast(&m, py::return_value_policy::reference), batch_of(b));
    };
  if (!data.is_none()) {
    if (PyCallable_Check(data.ptr()))
      o.batches = [data](int64_t s) { return example_of(data(s), "tally.ab.run: data(step)"); };
    else
      for (py::handle b : data) o.data.push_back(example_of(b, "tally.ab.run: data"));
  }
  auto list = [&](const char* key, auto& field) {
    using V = std::decay_t<decltype(field)>;
    if (kw.contains(key) && !kw[key].is_none()) field = kw[key].cast<V>();
  };
  list("checkpoint", o.checkpoint);
  list("precision", o.precision);
  list("offload", o.offload);
  list("optimizer", o.optimizer);
  list("step_in_backward", o.step_in_backward);
  list("grad_accum", o.grad_accum);
  list("alloc_conf", o.alloc_conf);
  list("steps", o.steps);
  list("batch", o.batch);
  list("seed", o.seed);
  list("lr", o.lr);
  list("rounds", o.rounds);
  list("estimate", o.estimate);
  list("out", o.out);
  list("title", o.title);
  list("verbose", o.verbose);
  list("preset", o.model_options.preset);
  list("image_size", o.model_options.image_size);
  list("seq", o.model_options.seq);
  list("num_classes", o.model_options.num_classes);
  list("in_channels", o.model_options.in_channels);
  list("fused_classifier", o.model_options.fused_classifier);
  if (kw.contains("device") && !kw["device"].is_none()) o.device = to_device(kw["device"]);
  if (kw.contains("memory_budget") && !kw["memory_budget"].is_none()) {
    const py::object b = kw["memory_budget"];
    if (py::isinstance<py::str>(b)) {
      o.memory_budget = memory::parse_bytes(b.cast<std::string>(), "memory_budget");
    } else {
      const auto n = b.cast<int64_t>();
      if (n <= 0) throw py::value_error(fmt::format("tally.ab.run: memory_budget: {} bytes", n));
      o.memory_budget = static_cast<size_t>(n);
    }
  }
  return ab::run(o);
}

}  // namespace

void bind_ab(py::module_& m) {
  py::module_ ab = m.def_submodule("_ab", "the A/B memory runner in process (tally.ab.run)");
  py::class_<ab::ConfigResult>(ab, "ConfigResult")
      .def_readonly("name", &ab::ConfigResult::name)
      .def_readonly("settings", &ab::ConfigResult::settings)
      .def_readonly("peak_allocated", &ab::ConfigResult::peak_allocated)
      .def_readonly("peak_reserved", &ab::ConfigResult::peak_reserved)
      .def_readonly("median_ms", &ab::ConfigResult::median_ms)
      .def_readonly("min_ms", &ab::ConfigResult::min_ms)
      .def_readonly("max_ms", &ab::ConfigResult::max_ms)
      .def_readonly("round_ms", &ab::ConfigResult::round_ms)
      .def_readonly("final_loss", &ab::ConfigResult::final_loss)
      .def_readonly("phase_peaks", &ab::ConfigResult::phase_peaks);
  py::class_<ab::Results>(ab, "Results")
      .def_readonly("configs", &ab::Results::configs)
      .def_readonly("out", &ab::Results::out)
      .def_readonly("report", &ab::Results::report)
      .def_readonly("table", &ab::Results::table)
      .def_readonly("headlines", &ab::Results::headlines)
      .def_readonly("diffs", &ab::Results::diffs);
  ab.def("run", &run, py::arg("model"), py::arg("step"), py::arg("eval"), py::arg("data"),
         py::arg("options"),
         "tally::ab::run: every combination of the levers in `options` (checkpoint, precision, "
         "offload, optimizer, step_in_backward, grad_accum, alloc_conf lists; steps, batch, "
         "seed, lr, rounds, device, estimate, out, title, preset, memory_budget, ...)");
}

}  // namespace tally::python
