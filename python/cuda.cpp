// tally.cuda: CUDA graphs as torch.cuda has them (CUDAGraph, graph_pool_handle,
// is_current_stream_capturing; the `graph` context manager is python/tally/_cuda.py).
#include <pybind11/pybind11.h>

#include "common.h"
#include "memory/caching_allocator.h"
#include "tensor/cuda/graph.h"

namespace tally::python {

void bind_cuda(py::module_& cuda_mod) {
  py::class_<cuda::Graph>(cuda_mod, "CUDAGraph",
                          "torch.cuda.CUDAGraph: capture the work queued on a device's stream, "
                          "replay it with one launch (tensor/cuda/graph.h)")
      .def(py::init<>())
      .def(
          "capture_begin",
          [](cuda::Graph& g, py::object pool, int device) {
            g.capture_begin(device, pool.is_none() ? 0 : pool.cast<memory::MempoolId>());
          },
          py::arg("pool") = py::none(), py::arg("device") = 0,
          "Start capturing; allocations come from `pool` (a new private pool when None)")
      .def("capture_end", &cuda::Graph::capture_end, "End the capture and instantiate the graph")
      .def("replay", &cuda::Graph::replay, "Launch the captured work")
      .def("reset", &cuda::Graph::reset,
           "Drop the graph (waiting for its replays) and its use of the pool")
      .def("pool", &cuda::Graph::pool, "The private pool's handle (pass it to share the pool)")
      .def_property_readonly("captured", &cuda::Graph::captured)
      .def_property_readonly("device", &cuda::Graph::device);
  cuda_mod.def("graph_pool_handle", &memory::graph_pool_handle,
               "A new private memory pool's handle, to share between captures");
  cuda_mod.def("is_current_stream_capturing", &cuda::is_capturing, py::arg("device") = 0,
               "Whether a CUDAGraph is capturing Tally's stream on the device");
}

}  // namespace tally::python
