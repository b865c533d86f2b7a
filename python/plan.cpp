// tally.memory.plan: the memory planner for any model and step (optim/plan_training.h).
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "common.h"
#include "memory/estimate.h"
#include "nn/checkpoint.h"
#include "nn/module.h"
#include "optim/plan_training.h"

namespace tally::python {

namespace {

std::string amp_name(const std::optional<DType>& amp) {
  return amp ? std::string(dtype_name(*amp)) : std::string("float32");
}

std::optional<DType> amp_arg(py::handle h) {
  if (h.is_none()) return std::nullopt;
  const std::string s = py::str(h);
  if (s == "off" || s == "fp32" || s == "float32" || s == "tally.float32") return std::nullopt;
  if (s == "bf16" || s == "bfloat16" || s == "tally.bfloat16") return DType::bfloat16;
  if (s == "fp16" || s == "float16" || s == "tally.float16") return DType::float16;
  throw py::value_error("plan: precisions: expected None, 'fp32', 'bf16' or 'fp16', got '" + s +
                        "'");
}

}  // namespace

void bind_plan(py::module_& mem) {
  py::class_<nn::PlanCandidate>(mem, "PlanCandidate", "One combination of the memory levers")
      .def_property_readonly("checkpoint",
                             [](const nn::PlanCandidate& c) { return c.checkpoint.str(); })
      .def_property_readonly("amp",
                             [](const nn::PlanCandidate& c) -> py::object {
                               if (!c.amp) return py::none();
                               return py::str(amp_name(c.amp));
                             })
      .def_property_readonly("offload", [](const nn::PlanCandidate& c) { return c.offload.str(); })
      .def_readonly("optimizer", &nn::PlanCandidate::optimizer)
      .def_readonly("step_in_backward", &nn::PlanCandidate::step_in_backward)
      .def_readonly("micro_batches", &nn::PlanCandidate::micro_batches)
      .def_readonly("fused_classifier", &nn::PlanCandidate::fused_classifier)
      .def("__str__", &nn::PlanCandidate::str)
      .def("__repr__", [](const nn::PlanCandidate& c) { return "PlanCandidate(" + c.str() + ")"; });
  py::class_<nn::PlannedCandidate>(mem, "PlannedCandidate")
      .def_readonly("candidate", &nn::PlannedCandidate::candidate)
      .def_readonly("estimate", &nn::PlannedCandidate::estimate)
      .def_readonly("step_seconds", &nn::PlannedCandidate::step_seconds)
      .def_readonly("fits", &nn::PlannedCandidate::fits)
      .def_readonly("error", &nn::PlannedCandidate::error);
  py::class_<nn::MemoryPlan>(mem, "MemoryPlan", "The planner's grid and its choice")
      .def_readonly("chosen", &nn::MemoryPlan::chosen)
      .def_readonly("candidates", &nn::MemoryPlan::candidates)
      .def_readonly("budget", &nn::MemoryPlan::budget)
      .def_readonly("target", &nn::MemoryPlan::target)
      .def("report", &nn::MemoryPlan::report)
      .def("__str__", &nn::MemoryPlan::report)
      .def("__repr__", &nn::MemoryPlan::report);
  mem.def(
      "plan",
      [](py::object model, py::object loss_fn, std::vector<Tensor> batch, py::object budget,
         const std::string& target, py::object eval_fn, py::object checkpoints,
         py::object precisions, std::vector<std::string> optimizers,
         std::optional<std::vector<std::string>> offloads, std::vector<bool> step_in_backward,
         std::vector<int64_t> micro_batches, std::vector<bool> fused_classifier, double lr,
         int64_t steps) {
        nn::TrainingPlanOptions o;
        o.target = target;
        o.budget = py::isinstance<py::str>(budget)
                       ? memory::parse_bytes(budget.cast<std::string>(), "budget")
                       : budget.cast<size_t>();
        if (!checkpoints.is_none())
          for (py::handle h : checkpoints)
            o.checkpoints.push_back(nn::parse_checkpoint_spec(py::str(h)));
        if (!precisions.is_none())
          for (py::handle h : precisions) o.precisions.push_back(amp_arg(h));
        o.optimizers = std::move(optimizers);
        if (offloads)
          for (const std::string& s : *offloads) o.offloads.push_back(nn::parse_offload_spec(s));
        o.step_in_backward = std::move(step_in_backward);
        o.micro_batches = std::move(micro_batches);
        o.fused_classifier = std::move(fused_classifier);
        o.adam.lr = lr;
        o.steps = steps;
        if (!eval_fn.is_none())
          o.eval = [eval_fn](nn::Module& m, const std::vector<Tensor>& b) {
            eval_fn(py::cast(m, py::return_value_policy::reference), b);
          };
        const bool asks_fused = std::find(o.fused_classifier.begin(), o.fused_classifier.end(),
                                          true) != o.fused_classifier.end();
        // A factory that asks for the fused classifier is called with fused_classifier=;
        // otherwise with no arguments.
        auto factory = [model, asks_fused](const nn::PlanCandidate& c) {
          py::object m =
              asks_fused ? model(py::arg("fused_classifier") = c.fused_classifier) : model();
          // The Python object lives as long as the model: a subclass's forward is its method.
          auto module = m.cast<std::shared_ptr<nn::Module>>();
          auto* keep = new py::object(std::move(m));
          return std::shared_ptr<nn::Module>(module.get(), [keep, module](nn::Module*) {
            py::gil_scoped_acquire gil;
            delete keep;
          });
        };
        auto loss = [loss_fn](nn::Module& m, const std::vector<Tensor>& b) {
          return loss_fn(py::cast(m, py::return_value_policy::reference), b).cast<Tensor>();
        };
        return nn::plan_memory(factory, loss, batch, o);
      },
      py::arg("model"), py::arg("loss_fn"), py::arg("batch"), py::arg("budget"),
      py::arg("target") = "cpu", py::kw_only(), py::arg("eval_fn") = py::none(),
      py::arg("checkpoints") = py::none(), py::arg("precisions") = py::none(),
      py::arg("optimizers") = std::vector<std::string>{"adamw", "adamw8bit"},
      py::arg("offloads") = py::none(),
      py::arg("step_in_backward") = std::vector<bool>{false, true},
      py::arg("micro_batches") = std::vector<int64_t>{},
      py::arg("fused_classifier") = std::vector<bool>{false}, py::arg("lr") = 1e-3,
      py::arg("steps") = 3,
      "The memory planner for any model: model() builds it (on the dry run's device; with "
      "fused_classifier=[False, True] it is called as model(fused_classifier=...)), "
      "loss_fn(model, batch) is one (micro-)batch's loss, eval_fn(model, batch) the evaluation "
      "after training. Dry-runs every combination of checkpoint policy, precision, optimizer, "
      "offload, step-in-backward, micro-batches and fused classifier on `target` and returns the "
      "MemoryPlan whose .chosen is the fastest predicted to fit `budget` (bytes or '40MiB'). "
      "micro_batches=[] (the default) climbs 1, 2, 4, ... up to the batch for each candidate "
      "while it is over the budget; a list dry-runs each count it names.");
}

}  // namespace tally::python
