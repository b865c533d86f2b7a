// tally.nn.lora (nn/lora.h): inject(model, targets, r=8, alpha=8, dropout=0.0), PEFT's
// LoraConfig(target_modules, r, lora_alpha, lora_dropout) applied in place, and
// trainable_summary(model), PEFT's print_trainable_parameters line.
#include "nn/lora.h"

#include <pybind11/stl.h>

#include "common.h"

namespace tally::python {

void bind_lora(py::module_& nn_mod) {
  py::module_ lora = nn_mod.def_submodule("lora", "LoRA adapters (nn/lora.h)");
  lora.def(
      "inject",
      [](const std::shared_ptr<nn::Module>& model, py::object targets, int64_t r, double alpha,
         double dropout) {
        std::vector<std::string> t;
        if (py::isinstance<py::str>(targets))
          t.push_back(targets.cast<std::string>());
        else
          t = targets.cast<std::vector<std::string>>();
        return nn::lora::inject(*model, t, r, alpha, dropout);
      },
      py::arg("model").none(false), py::arg("targets"), py::arg("r") = 8, py::arg("alpha") = 8.0,
      py::arg("dropout") = 0.0,
      "Adds a LoRA adapter to every Linear a target names (a dotted path, its last components, "
      "or a pattern with *), freezes every other parameter; returns the adapted paths.");
  lora.def("matches", &nn::lora::matches, py::arg("name"), py::arg("target"));
  lora.def(
      "trainable_summary",
      [](const std::shared_ptr<nn::Module>& model) { return nn::lora::trainable_summary(*model); },
      py::arg("model").none(false));
}

}  // namespace tally::python
