// tally.nn's attention layers (nn/transformer.h): MultiheadAttention, TransformerEncoderLayer,
// TransformerEncoder and generate_square_subsequent_mask, with PyTorch's argument names and
// defaults; MultiheadAttention returns (output, weights or None) as torch's does.
#include <fmt/format.h>
#include <pybind11/stl.h>

#include "common.h"
#include "nn/transformer.h"

namespace tally::python {

namespace {

using nn::Module;

Tensor opt(const std::optional<Tensor>& t) {
  return t.value_or(Tensor());
}

// activation: "relu" | "gelu", tally.nn.functional.relu / gelu, or a tally.nn.ReLU / GELU()
// instance (what PyTorch users pass); ValueError for anything else.
std::string activation_name(py::handle a) {
  if (py::isinstance<py::str>(a)) return a.cast<std::string>();
  const py::module_ F = py::module_::import("tally._C").attr("nn").attr("functional");
  if (py::hasattr(F, "relu") && a.is(F.attr("relu"))) return "relu";
  if (py::hasattr(F, "gelu") && a.is(F.attr("gelu"))) return "gelu";
  if (py::isinstance<nn::ReLU>(a)) return "relu";
  if (py::isinstance<nn::GELU>(a) && a.cast<nn::GELU&>().approximate == "none") return "gelu";
  throw py::value_error(fmt::format(
      "TransformerEncoderLayer: activation should be 'relu', 'gelu', F.relu, F.gelu, nn.ReLU() "
      "or nn.GELU(), got {}",
      py::repr(a).cast<std::string>()));
}

}  // namespace

void bind_attention(py::module_& m, py::module_& nn_mod) {
  (void)m;
  using T = const Tensor&;
  using OT = std::optional<Tensor>;

  py::class_<nn::MultiheadAttention, Module, std::shared_ptr<nn::MultiheadAttention>> mha(
      nn_mod, "MultiheadAttention", py::dynamic_attr());
  const auto mha_call = [](nn::MultiheadAttention& a, T query, T key, T value, OT kpm,
                           bool need_weights, OT attn_mask, bool average, bool is_causal) {
    const ForwardPhase phase;
    auto [out, w] =
        a(query, key, value, opt(kpm), need_weights, opt(attn_mask), average, is_causal);
    return py::make_tuple(out, tensor_or_none(w));
  };
  mha.def(py::init([](int64_t embed_dim, int64_t num_heads, double dropout, bool bias,
                      bool add_bias_kv, bool add_zero_attn, std::optional<int64_t> kdim,
                      std::optional<int64_t> vdim, bool batch_first) {
            return std::make_shared<nn::MultiheadAttention>(embed_dim, num_heads, dropout, bias,
                                                            add_bias_kv, add_zero_attn, kdim, vdim,
                                                            batch_first);
          }),
          py::arg("embed_dim"), py::arg("num_heads"), py::arg("dropout") = 0.0,
          py::arg("bias") = true, py::arg("add_bias_kv") = false, py::arg("add_zero_attn") = false,
          py::arg("kdim") = py::none(), py::arg("vdim") = py::none(),
          py::arg("batch_first") = false)
      .def_readonly("embed_dim", &nn::MultiheadAttention::embed_dim)
      .def_readonly("kdim", &nn::MultiheadAttention::kdim)
      .def_readonly("vdim", &nn::MultiheadAttention::vdim)
      .def_readonly("num_heads", &nn::MultiheadAttention::num_heads)
      .def_readonly("head_dim", &nn::MultiheadAttention::head_dim)
      .def_readonly("dropout", &nn::MultiheadAttention::dropout)
      .def_readonly("batch_first", &nn::MultiheadAttention::batch_first)
      .def_property_readonly("_qkv_same_embed_dim", [](const nn::MultiheadAttention& a) {
        return a.in_proj_weight.defined();
      });
  for (const char* name : {"__call__", "forward"})
    mha.def(name, mha_call, py::arg("query"), py::arg("key"), py::arg("value"),
            py::arg("key_padding_mask") = py::none(), py::arg("need_weights") = true,
            py::arg("attn_mask") = py::none(), py::arg("average_attn_weights") = true,
            py::arg("is_causal") = false,
            "(attn_output, attn_output_weights): the weights are None unless need_weights");

  py::class_<nn::TransformerEncoderLayer, Module, std::shared_ptr<nn::TransformerEncoderLayer>>
      layer(nn_mod, "TransformerEncoderLayer", py::dynamic_attr());
  const auto layer_call = [](nn::TransformerEncoderLayer& l, T src, OT src_mask, OT kpm,
                             bool is_causal) {
    const ForwardPhase phase;
    return l(src, opt(src_mask), opt(kpm), is_causal);
  };
  layer
      .def(py::init([](int64_t d_model, int64_t nhead, int64_t dim_feedforward, double dropout,
                       py::object activation, double eps, bool batch_first, bool norm_first,
                       bool bias) {
             return std::make_shared<nn::TransformerEncoderLayer>(
                 d_model, nhead, dim_feedforward, dropout, activation_name(activation), eps,
                 batch_first, norm_first, bias);
           }),
           py::arg("d_model"), py::arg("nhead"), py::arg("dim_feedforward") = 2048,
           py::arg("dropout") = 0.1, py::arg("activation") = "relu",
           py::arg("layer_norm_eps") = 1e-5, py::arg("batch_first") = false,
           py::arg("norm_first") = false, py::arg("bias") = true)
      .def_readonly("norm_first", &nn::TransformerEncoderLayer::norm_first)
      .def_readonly("batch_first", &nn::TransformerEncoderLayer::batch_first);
  for (const char* name : {"__call__", "forward"})
    layer.def(name, layer_call, py::arg("src"), py::arg("src_mask") = py::none(),
              py::arg("src_key_padding_mask") = py::none(), py::arg("is_causal") = false);

  py::class_<nn::TransformerEncoder, Module, std::shared_ptr<nn::TransformerEncoder>> enc(
      nn_mod, "TransformerEncoder", py::dynamic_attr());
  const auto enc_call = [](nn::TransformerEncoder& e, T src, OT mask, OT kpm,
                           std::optional<bool> is_causal) {
    const ForwardPhase phase;
    return e(src, opt(mask), opt(kpm), is_causal);
  };
  enc.def(py::init([](const nn::TransformerEncoderLayer& encoder_layer, int64_t num_layers,
                      std::shared_ptr<Module> norm, bool, bool) {
            return std::make_shared<nn::TransformerEncoder>(encoder_layer, num_layers,
                                                            std::move(norm));
          }),
          py::arg("encoder_layer"), py::arg("num_layers"), py::arg("norm") = py::none(),
          py::arg("enable_nested_tensor") = true, py::arg("mask_check") = true,
          "num_layers deep copies of encoder_layer (layers.0, ...), then norm")
      .def_readonly("num_layers", &nn::TransformerEncoder::num_layers);
  for (const char* name : {"__call__", "forward"})
    enc.def(name, enc_call, py::arg("src"), py::arg("mask") = py::none(),
            py::arg("src_key_padding_mask") = py::none(), py::arg("is_causal") = py::none());

  nn_mod.def(
      "generate_square_subsequent_mask",
      [](int64_t sz, py::object device, py::object dtype) {
        return nn::generate_square_subsequent_mask(
            sz, dtype.is_none() ? DType::float32 : to_dtype(dtype),
            device.is_none() ? Device::cpu() : to_device(device));
      },
      py::arg("sz"), py::arg("device") = py::none(), py::arg("dtype") = py::none(),
      "nn.Transformer.generate_square_subsequent_mask: -inf above the diagonal, 0 elsewhere");
}

}  // namespace tally::python
