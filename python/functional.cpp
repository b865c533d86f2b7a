// The functional ops: tally.matmul, tally.relu, ... and tally.nn.functional (F.cross_entropy,
// F.conv2d, ...), each the differentiable op of autograd/ops.h.
#include <pybind11/stl.h>

#include "common.h"
#include "tensor/conv/ops.h"

namespace tally::python {

namespace {

Shape dims_of(const py::object& dim) {
  if (dim.is_none()) return {};
  if (py::isinstance<py::int_>(dim)) return {dim.cast<int64_t>()};
  return dim.cast<Shape>();
}

}  // namespace

void bind_functional(py::module_& m, py::module_& F) {
  using T = const Tensor&;
  // elementwise and linear algebra (tally.*)
  m.def("matmul", [](T a, T b) { return matmul(a, b); });
  m.def("mm", [](T a, T b) { return mm(a, b); });
  m.def("bmm", [](T a, T b) { return bmm(a, b); });
  m.def(
      "add", [](T a, T b, double alpha) { return add(a, b, alpha); }, py::arg("input"),
      py::arg("other"), py::arg("alpha") = 1.0);
  m.def(
      "sub", [](T a, T b, double alpha) { return sub(a, b, alpha); }, py::arg("input"),
      py::arg("other"), py::arg("alpha") = 1.0);
  m.def("mul", [](T a, T b) { return mul(a, b); });
  m.def("div", [](T a, T b) { return div(a, b); });
  m.def("pow", [](T a, double e) { return pow(a, e); });
  m.def("pow", [](T a, T e) { return pow(a, e); });
  m.def("neg", [](T a) { return neg(a); });
  m.def("exp", [](T a) { return exp(a); });
  m.def("log", [](T a) { return log(a); });
  m.def("sqrt", [](T a) { return sqrt(a); });
  m.def("rsqrt", [](T a) { return rsqrt(a); });
  m.def("abs", [](T a) { return abs(a); });
  m.def("square", [](T a) { return square(a); });
  m.def("maximum", [](T a, T b) { return maximum(a, b); });
  m.def("minimum", [](T a, T b) { return minimum(a, b); });
  m.def(
      "clamp",
      [](T a, std::optional<double> lo, std::optional<double> hi) { return clamp(a, lo, hi); },
      py::arg("input"), py::arg("min") = py::none(), py::arg("max") = py::none());
  m.def("where", [](T c, T a, T b) { return where(c, a, b); });
  m.def("eq", [](T a, T b) { return eq(a, b); });
  m.def("ne", [](T a, T b) { return ne(a, b); });
  m.def("lt", [](T a, T b) { return lt(a, b); });
  m.def("gt", [](T a, T b) { return gt(a, b); });
  m.def("le", [](T a, T b) { return le(a, b); });
  m.def("ge", [](T a, T b) { return ge(a, b); });
  m.def(
      "sum",
      [](T x, py::object dim, bool keepdim, py::object dtype) {
        return sum(x, dims_of(dim), keepdim,
                   dtype.is_none() ? std::nullopt : std::optional<DType>(to_dtype(dtype)));
      },
      py::arg("input"), py::arg("dim") = py::none(), py::arg("keepdim") = false, py::kw_only(),
      py::arg("dtype") = py::none());
  m.def(
      "mean", [](T x, py::object dim, bool keepdim) { return mean(x, dims_of(dim), keepdim); },
      py::arg("input"), py::arg("dim") = py::none(), py::arg("keepdim") = false);
  m.def(
      "amax", [](T x, py::object dim, bool keepdim) { return amax(x, dims_of(dim), keepdim); },
      py::arg("input"), py::arg("dim") = py::none(), py::arg("keepdim") = false);
  m.def(
      "amin", [](T x, py::object dim, bool keepdim) { return amin(x, dims_of(dim), keepdim); },
      py::arg("input"), py::arg("dim") = py::none(), py::arg("keepdim") = false);
  m.def(
      "logsumexp",
      [](T x, py::object dim, bool keepdim) { return logsumexp(x, dims_of(dim), keepdim); },
      py::arg("input"), py::arg("dim"), py::arg("keepdim") = false);
  m.def(
      "argmax", [](T x, int64_t dim, bool keepdim) { return max(x, dim, keepdim).indices; },
      py::arg("input"), py::arg("dim"), py::arg("keepdim") = false);
  m.def(
      "cat", [](const TensorList& ts, int64_t dim) { return cat(ts, dim); }, py::arg("tensors"),
      py::arg("dim") = 0);
  m.def(
      "stack", [](const TensorList& ts, int64_t dim) { return stack(ts, dim); }, py::arg("tensors"),
      py::arg("dim") = 0);
  m.def(
      "split",
      [](T t, py::object size, int64_t dim) {
        return py::isinstance<py::int_>(size) ? split(t, size.cast<int64_t>(), dim)
                                              : split(t, size.cast<std::vector<int64_t>>(), dim);
      },
      py::arg("tensor"), py::arg("split_size_or_sections"), py::arg("dim") = 0);
  m.def(
      "chunk", [](T t, int64_t chunks, int64_t dim) { return chunk(t, chunks, dim); },
      py::arg("input"), py::arg("chunks"), py::arg("dim") = 0);

  // activations: tally.relu and F.relu alike
  for (py::module_* mod : {&m, &F}) {
    mod->def("relu", [](T x) { return relu(x); });
    mod->def("sigmoid", [](T x) { return sigmoid(x); });
    mod->def("tanh", [](T x) { return tanh(x); });
    mod->def("silu", [](T x) { return silu(x); });
    mod->def(
        "gelu", [](T x, const std::string& approximate) { return gelu(x, approximate); },
        py::arg("input"), py::arg("approximate") = "none");
    mod->def(
        "softmax", [](T x, int64_t dim) { return softmax(x, dim); }, py::arg("input"),
        py::arg("dim"));
    mod->def(
        "log_softmax", [](T x, int64_t dim) { return log_softmax(x, dim); }, py::arg("input"),
        py::arg("dim"));
  }

  F.def(
      "cross_entropy",
      [](T input, T target, int64_t ignore_index, const std::string& reduction,
         double label_smoothing) {
        return cross_entropy(input, target, ignore_index, label_smoothing, reduction);
      },
      py::arg("input"), py::arg("target"), py::kw_only(), py::arg("ignore_index") = -100,
      py::arg("reduction") = "mean", py::arg("label_smoothing") = 0.0);
  F.def(
      "nll_loss",
      [](T input, T target, int64_t ignore_index, const std::string& reduction) {
        return nll_loss(input, target, ignore_index, reduction);
      },
      py::arg("input"), py::arg("target"), py::kw_only(), py::arg("ignore_index") = -100,
      py::arg("reduction") = "mean");
  F.def(
      "mse_loss",
      [](T input, T target, const std::string& reduction) {
        Tensor d = square(sub(input, target));
        if (reduction == "mean") return mean(d);
        if (reduction == "sum") return sum(d);
        if (reduction == "none") return d;
        throw py::value_error("mse_loss: reduction must be mean, sum or none, got '" + reduction +
                              "'");
      },
      py::arg("input"), py::arg("target"), py::arg("reduction") = "mean");
  F.def(
      "linear",
      [](T x, T w, std::optional<Tensor> b) { return linear(x, w, b.value_or(Tensor())); },
      py::arg("input"), py::arg("weight"), py::arg("bias") = py::none());
  F.def(
      "linear_gelu_linear",
      [](T x, T w1, std::optional<Tensor> b1, T w2, std::optional<Tensor> b2) {
        return linear_gelu_linear(x, w1, b1.value_or(Tensor()), w2, b2.value_or(Tensor()));
      },
      py::arg("input"), py::arg("fc_weight"), py::arg("fc_bias"), py::arg("proj_weight"),
      py::arg("proj_bias"),
      "linear(gelu(linear(input, fc_weight, fc_bias), approximate='tanh'), proj_weight, "
      "proj_bias) as one autograd node (GELU in cuBLASLt's epilogues on CUDA)");
  F.def(
      "conv2d",
      [](T x, T w, std::optional<Tensor> b, py::object stride, py::object padding,
         py::object dilation, int64_t groups) {
        return conv2d(x, w, b.value_or(Tensor()), int2(stride), int2(padding), int2(dilation),
                      groups);
      },
      py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("stride") = 1,
      py::arg("padding") = 0, py::arg("dilation") = 1, py::arg("groups") = 1);
  F.def(
      "max_pool2d",
      [](T x, py::object k, py::object stride, py::object padding, py::object dilation,
         bool ceil_mode) {
        return max_pool2d(x, int2(k), int2(stride), int2(padding), int2(dilation), ceil_mode);
      },
      py::arg("input"), py::arg("kernel_size"), py::arg("stride") = py::none(),
      py::arg("padding") = 0, py::arg("dilation") = 1, py::arg("ceil_mode") = false);
  F.def(
      "avg_pool2d",
      [](T x, py::object k, py::object stride, py::object padding, bool ceil_mode,
         bool count_include_pad, std::optional<int64_t> divisor_override) {
        return avg_pool2d(x, int2(k), int2(stride), int2(padding), ceil_mode, count_include_pad,
                          divisor_override);
      },
      py::arg("input"), py::arg("kernel_size"), py::arg("stride") = py::none(),
      py::arg("padding") = 0, py::arg("ceil_mode") = false, py::arg("count_include_pad") = true,
      py::arg("divisor_override") = py::none());
  F.def(
      "adaptive_avg_pool2d",
      [](T x, py::object size) { return adaptive_avg_pool2d(x, int2(size)); }, py::arg("input"),
      py::arg("output_size"));
  F.def(
      "layer_norm",
      [](T x, py::object shape, std::optional<Tensor> w, std::optional<Tensor> b, double eps) {
        return layer_norm(x, dims_of(shape), w.value_or(Tensor()), b.value_or(Tensor()), eps);
      },
      py::arg("input"), py::arg("normalized_shape"), py::arg("weight") = py::none(),
      py::arg("bias") = py::none(), py::arg("eps") = 1e-5);
  F.def(
      "add_layer_norm",
      [](T x, T residual, py::object shape, std::optional<Tensor> w, std::optional<Tensor> b,
         double eps) {
        return add_layer_norm(x, residual, dims_of(shape), w.value_or(Tensor()),
                              b.value_or(Tensor()), eps);
      },
      py::arg("input"), py::arg("residual"), py::arg("normalized_shape"),
      py::arg("weight") = py::none(), py::arg("bias") = py::none(), py::arg("eps") = 1e-5,
      "(input + residual, layer_norm(input + residual)) as one node (Tally's own: a "
      "transformer block's residual add fused into the normalization after it)");
  F.def(
      "dropout", [](T x, double p, bool training) { return dropout(x, p, training); },
      py::arg("input"), py::arg("p") = 0.5, py::arg("training") = true);
  F.def(
      "embedding",
      [](T indices, T weight, std::optional<int64_t> padding_idx) {
        int64_t pad = -1;
        if (padding_idx)
          pad =
              *padding_idx < 0 && weight.dim() == 2 ? *padding_idx + weight.size(0) : *padding_idx;
        return embedding(weight, indices, pad);
      },
      py::arg("input"), py::arg("weight"), py::arg("padding_idx") = py::none());
  F.def(
      "scaled_dot_product_attention",
      [](T q, T k, T v, std::optional<Tensor> mask, double dropout_p, bool is_causal,
         std::optional<double> scale, bool enable_gqa) {
        return scaled_dot_product_attention(q, k, v, mask.value_or(Tensor()), dropout_p, is_causal,
                                            scale, enable_gqa);
      },
      py::arg("query"), py::arg("key"), py::arg("value"), py::arg("attn_mask") = py::none(),
      py::arg("dropout_p") = 0.0, py::arg("is_causal") = false, py::arg("scale") = py::none(),
      py::arg("enable_gqa") = false);
}

}  // namespace tally::python
