// Elementwise maps added with docs/architecture.md's walk-through: tally.sin, tally.cos,
// tally.erf, tally.lerp and the Tensor methods of the same names (torch's argument names).
#include "common.h"

namespace tally::python {

void bind_elementwise(py::module_& m) {
  using T = const Tensor&;
  m.def(
      "sin", [](T a) { return sin(a); }, py::arg("input"));
  m.def(
      "cos", [](T a) { return cos(a); }, py::arg("input"));
  m.def(
      "erf", [](T a) { return erf(a); }, py::arg("input"));
  // Tensor weight first: a Python float never converts to a Tensor, so the double overload
  // takes floats and ints.
  m.def(
      "lerp", [](T a, T end, T w) { return lerp(a, end, w); }, py::arg("input"), py::arg("end"),
      py::arg("weight"));
  m.def(
      "lerp", [](T a, T end, double w) { return lerp(a, end, w); }, py::arg("input"),
      py::arg("end"), py::arg("weight"));

  auto cls = py::reinterpret_borrow<py::class_<Tensor>>(m.attr("Tensor"));
  cls.def("sin", [](T a) { return sin(a); });
  cls.def("cos", [](T a) { return cos(a); });
  cls.def("erf", [](T a) { return erf(a); });
  cls.def(
      "lerp", [](T a, T end, T w) { return lerp(a, end, w); }, py::arg("end"), py::arg("weight"));
  cls.def(
      "lerp", [](T a, T end, double w) { return lerp(a, end, w); }, py::arg("end"),
      py::arg("weight"));
}

}  // namespace tally::python
