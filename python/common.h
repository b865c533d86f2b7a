// Shared pieces of the Python module's bindings (python/*.cpp): how a Python value names a
// dtype or a device, and the binding functions of each area, called once from module.cpp.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <optional>
#include <string>

#include "autograd/ops.h"
#include "memory/context.h"
#include "memory/memory.h"
#include "tensor/conv/ops.h"
#include "tensor/tensor.h"

namespace tally::python {

namespace py = pybind11;

// A dtype from tally.dtype, its name ("float32", "bfloat16", "bool", "long", ...), a numpy
// dtype or a numpy scalar type (np.float32). TypeError for anything else.
DType to_dtype(py::handle h);
// The numpy dtype of a Tally dtype (bfloat16 has none: TypeError).
py::object numpy_dtype(DType d);
// A device from tally.device or a string: "cpu", "cuda", "cuda:1", "meta", "meta:2". None
// gives memory::default_device() (cuda:0 when present, else cpu). ValueError otherwise.
Device to_device(py::handle h);
// A memory_format= argument: tally.channels_last or tally.contiguous_format (ValueError
// naming the value otherwise).
MemoryFormat to_memory_format(py::handle h);
Device parse_device(const std::string& s);
// "cpu", "cuda:0", "meta:1": the spelling the other direction reads.
std::string device_str(Device d);

// A Tensor from a Tally tensor, a numpy array, a Python scalar or a nested list (a copy into
// Tally's allocator; `dtype` overrides, else numpy's dtype, float32 for Python floats, int64
// for ints, bool for bools).
Tensor to_tensor(py::handle h, std::optional<DType> dtype = std::nullopt,
                 std::optional<Device> device = std::nullopt);
// Tally's view of a numpy array without a copy (its memory stays the array's, which is kept
// alive while any tensor uses it). TypeError for a dtype Tally has no equal of, ValueError
// for a layout it cannot view (negative or unaligned strides).
Tensor from_numpy(py::array array);
// A numpy array over a CPU tensor's memory (no copy; the array keeps the tensor alive).
// bfloat16 is copied to float32; other devices are copied to the CPU first.
py::array to_numpy(const Tensor& t);

// A size given as ints or one sequence: zeros(2, 3), zeros((2, 3)) and zeros([2, 3]).
Shape shape_from_args(const py::args& args);

// A kernel size, stride or padding: an int (both sides), a pair of ints, or None (Int2's
// default). ValueError for anything else.
Int2 int2(py::handle h);

// "None" for an undefined tensor.
py::object tensor_or_none(const Tensor& t);

// Sets the fields of config `c` (a bound class: GPTConfig, LlamaConfig, ...) named by `kw`
// through its Python attributes; an unknown name is a TypeError naming the class `cls`.
template <typename C>
void set_fields(C& c, const py::kwargs& kw, const char* cls) {
  py::object self = py::cast(&c, py::return_value_policy::reference);
  for (auto item : kw) {
    const std::string k = py::str(item.first);
    if (!py::hasattr(self, k.c_str()) || k.starts_with("_") || k == "preset")
      throw py::type_error(std::string(cls) + " has no field '" + k + "'");
    self.attr(k.c_str()) = item.second;
  }
}

// In-place writes are not recorded by autograd: refused (ValueError naming `what`) on a tensor
// that needs a gradient while grad mode is on (wrap them in tally.no_grad()), as PyTorch
// refuses a leaf's.
void check_in_place(const Tensor& x, const char* what);

// Python's `with` for a class whose T has enter() and exit(): __enter__ calls enter() and
// returns the object, __exit__ calls exit() and lets any exception through. Returns `cls`.
template <typename T, typename... Options>
py::class_<T, Options...>& def_enter_exit(py::class_<T, Options...>& cls) {
  cls.def("__enter__", [](py::object self) {
    self.cast<T&>().enter();
    return self;
  });
  cls.def("__exit__", [](T& t, py::args) {
    t.exit();
    return false;
  });
  return cls;
}

void bind_tensor(py::module_& m);
// Index, scan, sort and shape ops, x[mask], the arithmetic methods; after bind_tensor and
// bind_functional.
void bind_ops(py::module_& m, py::module_& functional);
void bind_functional(py::module_& m, py::module_& functional);
// tally.sin, cos, erf, lerp and their Tensor methods (python/elementwise.cpp); after bind_tensor.
void bind_elementwise(py::module_& m);
void bind_nn(py::module_& m, py::module_& nn);
// tally.nn's activations, losses, norms, Conv1d, ConvTranspose2d, pooling and resampling, their
// functional forms, tally.nn.init and Module.apply; after bind_nn and bind_functional.
void bind_layers(py::module_& m, py::module_& nn, py::module_& functional);
void bind_optim(py::module_& m, py::module_& optim, py::module_& amp);
void bind_memory(py::module_& m, py::module_& memory);
// tally.memory.plan: the planner for any model (optim/plan_training.h); after bind_memory.
void bind_plan(py::module_& memory);
void bind_profiler(py::module_& m, py::module_& profiler);
void bind_cuda(py::module_& cuda);
// tally._C._backends: the precision switches (tensor/precision.h).
void bind_backends(py::module_& m);
// tally._C._enable_python_call_sites: allocations name the calling Python line (the hook of
// memory/user_site.h).
void bind_call_sites(py::module_& m);

// RAII: a module called from Python runs under the phase "forward" unless a phase is open
// (backward, recompute, the user's own tally.memory.context(phase=...)).
class ForwardPhase {
 public:
  ForwardPhase();

 private:
  std::optional<memory::PhaseScope> scope_;
};
// tally.utils.data; after bind_nn, which makes tally.utils.
void bind_data(py::module_& m);
// tally.nn.MultiheadAttention, TransformerEncoderLayer, TransformerEncoder (python/attention.cpp);
// after bind_nn.
void bind_attention(py::module_& m, py::module_& nn);
// tally._C._ab: the A/B runner in process (python/ab.cpp).
void bind_ab(py::module_& m);

}  // namespace tally::python
