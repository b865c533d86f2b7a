// tally._C._backends: the precision switches of tensor/precision.h, read and set from Python
// (tally.backends.cuda.matmul.allow_tf32, tally.backends.cudnn.allow_tf32 and .benchmark,
// torch.backends.cuda's enable_cudnn_sdp, torch.cuda.tunable's enable: python/tally/_torch.py
// puts PyTorch's names over these).
#include <pybind11/pybind11.h>

#include "common.h"
#include "tensor/precision.h"

namespace tally::python {

void bind_backends(py::module_& m) {
  py::module_ b = m.def_submodule("_backends", "tensor/precision.h's process-wide switches");
  b.def("allow_tf32", &allow_tf32, "float32 matmuls may use TF32 tensor cores (off by default)");
  b.def("set_allow_tf32", &set_allow_tf32, py::arg("allow"));
  b.def("cudnn_allow_tf32", &cudnn_allow_tf32,
        "float32 convolutions may use TF32 tensor cores (on by default, as in PyTorch)");
  b.def("set_cudnn_allow_tf32", &set_cudnn_allow_tf32, py::arg("allow"));
  b.def("cudnn_benchmark", &cudnn_benchmark,
        "convolutions time cuDNN's algorithms once per shape and keep the fastest");
  b.def("set_cudnn_benchmark", &set_cudnn_benchmark, py::arg("enabled"));
  b.def("cudnn_sdp_enabled", &cudnn_sdp_enabled,
        "float16/bfloat16 attention may run cuDNN's fused kernels");
  b.def("set_cudnn_sdp_enabled", &set_cudnn_sdp_enabled, py::arg("enabled"));
  b.def("tunable_enabled", &tunable_enabled, "products time cuBLASLt's candidates (TunableOp)");
  b.def("set_tunable_enabled", &set_tunable_enabled, py::arg("enabled"));
}

}  // namespace tally::python
