// The extension tally._C: the bindings of each area (python/*.cpp) in the submodules the
// package tally re-exports (python/tally/__init__.py), and Tally's errors as Python
// exceptions carrying Tally's message.
#include <pybind11/pybind11.h>

#include "common.h"
#include "inspect/unpickle.h"
#include "memory/caching_allocator.h"
#include "tally/version.h"

namespace py = pybind11;
using namespace tally::python;

// tally.nn.LSTM, tally.nn.GRU (python/rnn.cpp) and tally.nn.lora (python/lora.cpp).
namespace tally::python {
void bind_rnn(py::module_& nn);
void bind_models(py::module_& nn);
void bind_lora(py::module_& nn);
}  // namespace tally::python

PYBIND11_MODULE(_C, m) {
  m.doc() = "Tally: a C++20/CUDA training framework with an instrumented caching allocator";
  m.attr("__version__") = TALLY_VERSION;
#ifdef TALLY_WITH_CUDA
  m.attr("_built_with_cuda") = true;
#else
  m.attr("_built_with_cuda") = false;
#endif
#ifdef TALLY_AB_MEMORY_PATH
  m.attr("_ab_memory_path") = TALLY_AB_MEMORY_PATH;
#else
  m.attr("_ab_memory_path") = py::none();
#endif

  // Tally's errors: std::invalid_argument, std::domain_error and std::length_error arrive as
  // ValueError, std::out_of_range as IndexError, running out of memory as
  // tally.OutOfMemoryError (a RuntimeError, as torch.OutOfMemoryError), a bad snapshot file
  // as tally.UnpickleError (a ValueError), the rest as RuntimeError; the message is Tally's.
  py::register_exception<tally::memory::OutOfMemoryError>(m, "OutOfMemoryError",
                                                          PyExc_RuntimeError);
  py::register_exception<tally::inspect::UnpickleError>(m, "UnpickleError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::logic_error& e) {
      // std::logic_error's other children (invalid_argument, domain_error, length_error,
      // out_of_range) are pybind11's; the rest (a profiler started twice, a module without a
      // single-tensor forward) are misuse: RuntimeError.
      if (dynamic_cast<const std::invalid_argument*>(&e) ||
          dynamic_cast<const std::domain_error*>(&e) || dynamic_cast<const std::length_error*>(&e))
        PyErr_SetString(PyExc_ValueError, e.what());
      else if (dynamic_cast<const std::out_of_range*>(&e))
        PyErr_SetString(PyExc_IndexError, e.what());
      else
        PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  py::module_ nn = m.def_submodule("nn", "torch.nn: modules, layers, models");
  py::module_ functional = nn.def_submodule("functional", "torch.nn.functional");
  py::module_ optim = m.def_submodule("optim", "torch.optim");
  py::module_ amp = m.def_submodule("amp", "torch.amp: autocast, GradScaler");
  py::module_ memory = m.def_submodule("memory", "the allocator's figures, snapshots, estimates");
  py::module_ profiler = m.def_submodule("profiler", "torch.profiler");
  py::module_ cuda = m.def_submodule("cuda", "torch.cuda's CUDA graphs");

  bind_tensor(m);
  bind_functional(m, functional);
  bind_elementwise(m);
  bind_ops(m, functional);
  bind_nn(m, nn);
  bind_layers(m, nn, functional);
  bind_data(m);
  bind_optim(m, optim, amp);
  bind_memory(m, memory);
  bind_plan(memory);
  bind_profiler(m, profiler);
  bind_cuda(cuda);
  bind_backends(m);
  bind_call_sites(m);
  bind_attention(m, nn);
  bind_rnn(nn);
  bind_models(nn);
  bind_lora(nn);
  bind_ab(m);
}
