// tally.nn.LSTM and tally.nn.GRU (nn/rnn.h): PyTorch's constructor, forward(input, hx=None)
// returning (output, (h_n, c_n)) / (output, h_n), and the attributes PyTorch exposes.
#include "nn/rnn.h"

#include <pybind11/stl.h>

#include "common.h"

namespace tally::python {

namespace {

// PyTorch's constructor, and forward(input, hx=None) as both __call__ and forward.
template <typename M, typename Forward>
py::class_<M, nn::RNNBase, std::shared_ptr<M>> bind_rnn_class(py::module_& nn_mod, const char* name,
                                                              Forward forward) {
  return py::class_<M, nn::RNNBase, std::shared_ptr<M>>(nn_mod, name, py::dynamic_attr())
      .def(py::init([](int64_t input_size, int64_t hidden_size, int64_t num_layers, bool bias,
                       bool batch_first, double dropout, bool bidirectional) {
             return std::make_shared<M>(input_size, hidden_size, num_layers, bias, batch_first,
                                        dropout, bidirectional);
           }),
           py::arg("input_size"), py::arg("hidden_size"), py::arg("num_layers") = 1,
           py::arg("bias") = true, py::arg("batch_first") = false, py::arg("dropout") = 0.0,
           py::arg("bidirectional") = false)
      .def("__call__", forward, py::arg("input"), py::arg("hx") = py::none())
      .def("forward", forward, py::arg("input"), py::arg("hx") = py::none());
}

}  // namespace

void bind_rnn(py::module_& nn_mod) {
  using nn::Module;
  py::class_<nn::RNNBase, Module, std::shared_ptr<nn::RNNBase>>(nn_mod, "RNNBase",
                                                                py::dynamic_attr())
      .def_readonly("input_size", &nn::RNNBase::input_size)
      .def_readonly("hidden_size", &nn::RNNBase::hidden_size)
      .def_readonly("num_layers", &nn::RNNBase::num_layers)
      .def_readonly("bias", &nn::RNNBase::bias)
      .def_readonly("batch_first", &nn::RNNBase::batch_first)
      .def_readonly("dropout", &nn::RNNBase::dropout)
      .def_readonly("bidirectional", &nn::RNNBase::bidirectional)
      .def_readonly("proj_size", &nn::RNNBase::proj_size)
      .def("reset_parameters", [](nn::RNNBase& m) { m.reset_parameters(); });

  auto lstm_forward = [](nn::LSTM& m, const Tensor& input, py::object hx) {
    const ForwardPhase phase;
    std::optional<std::pair<Tensor, Tensor>> state;
    if (!hx.is_none()) state = hx.cast<std::pair<Tensor, Tensor>>();
    return m(input, state);
  };
  bind_rnn_class<nn::LSTM>(nn_mod, "LSTM", lstm_forward)
      .def(py::init([](int64_t input_size, int64_t hidden_size, int64_t num_layers, bool bias,
                       bool batch_first, double dropout, bool bidirectional, int64_t proj_size) {
             return std::make_shared<nn::LSTM>(input_size, hidden_size, num_layers, bias,
                                               batch_first, dropout, bidirectional, proj_size);
           }),
           py::arg("input_size"), py::arg("hidden_size"), py::arg("num_layers") = 1,
           py::arg("bias") = true, py::arg("batch_first") = false, py::arg("dropout") = 0.0,
           py::arg("bidirectional") = false, py::arg("proj_size") = 0);
  bind_rnn_class<nn::GRU>(nn_mod, "GRU",
                          [](nn::GRU& m, const Tensor& input, std::optional<Tensor> hx) {
                            const ForwardPhase phase;
                            return m(input, hx.value_or(Tensor()));
                          });
}

}  // namespace tally::python
