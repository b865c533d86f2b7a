// tally.nn's everyday layers beside the core ones of python/nn.cpp: activations (SiLU, Tanh,
// Sigmoid, Softmax, LogSoftmax, LeakyReLU), losses (MSELoss, L1Loss, SmoothL1Loss, HuberLoss,
// BCEWithLogitsLoss, NLLLoss, KLDivLoss), norms (GroupNorm, RMSNorm), Conv1d,
// ConvTranspose2d, AvgPool2d, Upsample; their tally.nn.functional functions; tally.nn.init;
// Module.apply. PyTorch's names, argument names and defaults.
#include <fmt/format.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <array>

#include "common.h"
#include "nn/activation.h"
#include "nn/conv.h"
#include "nn/functional.h"
#include "nn/init.h"
#include "nn/loss.h"
#include "nn/norm.h"
#include "nn/pooling.h"
#include "tensor/conv/transpose.h"

namespace tally::python {

namespace {

using nn::Module;
using ModulePtr = std::shared_ptr<Module>;
namespace F = nn::functional;

Tensor opt(const std::optional<Tensor>& t) {
  return t.value_or(Tensor());
}

// size / scale_factor of interpolate and Upsample: None, one number (for every spatial dim)
// or one per spatial dim.
std::optional<std::vector<int64_t>> sizes_of(py::handle h) {
  if (h.is_none()) return std::nullopt;
  if (py::isinstance<py::int_>(h)) return std::vector<int64_t>{h.cast<int64_t>()};
  return h.cast<std::vector<int64_t>>();
}
std::optional<std::vector<double>> scales_of(py::handle h) {
  if (h.is_none()) return std::nullopt;
  if (py::isinstance<py::int_>(h) || py::isinstance<py::float_>(h))
    return std::vector<double>{h.cast<double>()};
  return h.cast<std::vector<double>>();
}

int64_t int1(py::handle h, const char* what) {
  if (py::isinstance<py::int_>(h)) return h.cast<int64_t>();
  const auto v = h.cast<std::vector<int64_t>>();
  if (v.size() != 1) throw py::value_error(fmt::format("{} must be an int or a 1-tuple", what));
  return v[0];
}

Shape shape_of(py::handle h) {
  return py::isinstance<py::int_>(h) ? Shape{h.cast<int64_t>()} : h.cast<Shape>();
}

void apply_python(const py::object& self, const py::function& fn) {
  for (const ModulePtr& child : self.cast<ModulePtr>()->children())
    apply_python(py::cast(child), fn);
  fn(self);
}

// A loss class: its constructor comes from `init`; calling it runs forward(input, target)
// under the module's scope.
template <typename L, typename Init, typename... Args>
void bind_loss(py::module_& nn_mod, const char* name, Init&& init, Args&&... args) {
  py::class_<L, nn::PairLoss, std::shared_ptr<L>>(nn_mod, name, py::dynamic_attr())
      .def(py::init(std::forward<Init>(init)), std::forward<Args>(args)...);
}

// tally.nn.init.NAME(tensor, ...): `fill` initialises the tensor in place (no graph, the default
// generator) and the binding returns the tensor, as torch.nn.init's functions do.
template <typename... A, typename... Extra>
void def_init(py::module_& init, const char* name, void (*fill)(const Tensor&, A...),
              const Extra&... extra) {
  init.def(
      name,
      [fill](const Tensor& t, A... a) {
        fill(t, a...);
        return t;
      },
      py::arg("tensor"), extra...);
}

}  // namespace

void bind_layers(py::module_& m, py::module_& nn_mod, py::module_& Fm) {
  (void)m;
  using T = const Tensor&;

  // ---- activations ----
  py::class_<nn::SiLU, Module, std::shared_ptr<nn::SiLU>>(nn_mod, "SiLU", py::dynamic_attr())
      .def(py::init([](bool) { return std::make_shared<nn::SiLU>(); }), py::arg("inplace") = false);
  py::class_<nn::Tanh, Module, std::shared_ptr<nn::Tanh>>(nn_mod, "Tanh", py::dynamic_attr())
      .def(py::init([]() { return std::make_shared<nn::Tanh>(); }));
  py::class_<nn::Sigmoid, Module, std::shared_ptr<nn::Sigmoid>>(nn_mod, "Sigmoid",
                                                                py::dynamic_attr())
      .def(py::init([]() { return std::make_shared<nn::Sigmoid>(); }));
  py::class_<nn::Softmax, Module, std::shared_ptr<nn::Softmax>>(nn_mod, "Softmax",
                                                                py::dynamic_attr())
      .def(py::init([](std::optional<int64_t> dim) { return std::make_shared<nn::Softmax>(dim); }),
           py::arg("dim") = py::none())
      .def_readonly("dim", &nn::Softmax::dim);
  py::class_<nn::LogSoftmax, Module, std::shared_ptr<nn::LogSoftmax>>(nn_mod, "LogSoftmax",
                                                                      py::dynamic_attr())
      .def(py::init(
               [](std::optional<int64_t> dim) { return std::make_shared<nn::LogSoftmax>(dim); }),
           py::arg("dim") = py::none())
      .def_readonly("dim", &nn::LogSoftmax::dim);
  py::class_<nn::LeakyReLU, Module, std::shared_ptr<nn::LeakyReLU>>(nn_mod, "LeakyReLU",
                                                                    py::dynamic_attr())
      .def(py::init([](double slope, bool) { return std::make_shared<nn::LeakyReLU>(slope); }),
           py::arg("negative_slope") = 0.01, py::arg("inplace") = false)
      .def_readonly("negative_slope", &nn::LeakyReLU::negative_slope);
  Fm.def(
      "leaky_relu", [](T x, double slope, bool) { return F::leaky_relu(x, slope); },
      py::arg("input"), py::arg("negative_slope") = 0.01, py::arg("inplace") = false);

  // ---- losses ----
  py::class_<nn::PairLoss, Module, std::shared_ptr<nn::PairLoss>>(nn_mod, "_PairLoss",
                                                                  py::dynamic_attr())
      .def(
          "__call__", [](nn::PairLoss& l, T input, T target) { return l(input, target); },
          py::arg("input"), py::arg("target"))
      .def(
          "forward", [](nn::PairLoss& l, T input, T target) { return l.forward(input, target); },
          py::arg("input"), py::arg("target"))
      .def_readonly("reduction", &nn::PairLoss::reduction);
  bind_loss<nn::MSELoss>(
      nn_mod, "MSELoss", [](const std::string& r) { return std::make_shared<nn::MSELoss>(r); },
      py::arg("reduction") = "mean");
  bind_loss<nn::L1Loss>(
      nn_mod, "L1Loss", [](const std::string& r) { return std::make_shared<nn::L1Loss>(r); },
      py::arg("reduction") = "mean");
  bind_loss<nn::SmoothL1Loss>(
      nn_mod, "SmoothL1Loss",
      [](const std::string& r, double beta) { return std::make_shared<nn::SmoothL1Loss>(r, beta); },
      py::arg("reduction") = "mean", py::arg("beta") = 1.0);
  bind_loss<nn::HuberLoss>(
      nn_mod, "HuberLoss",
      [](const std::string& r, double delta) { return std::make_shared<nn::HuberLoss>(r, delta); },
      py::arg("reduction") = "mean", py::arg("delta") = 1.0);
  bind_loss<nn::BCEWithLogitsLoss>(
      nn_mod, "BCEWithLogitsLoss",
      [](std::optional<Tensor> w, const std::string& r, std::optional<Tensor> pw) {
        return std::make_shared<nn::BCEWithLogitsLoss>(opt(w), r, opt(pw));
      },
      py::arg("weight") = py::none(), py::arg("reduction") = "mean",
      py::arg("pos_weight") = py::none());
  bind_loss<nn::NLLLoss>(
      nn_mod, "NLLLoss",
      [](py::object weight, int64_t ignore, const std::string& r) {
        if (!weight.is_none())
          throw py::value_error("NLLLoss: class weights are not supported (weight=None only)");
        return std::make_shared<nn::NLLLoss>(ignore, r);
      },
      py::arg("weight") = py::none(), py::arg("ignore_index") = -100,
      py::arg("reduction") = "mean");
  bind_loss<nn::KLDivLoss>(
      nn_mod, "KLDivLoss",
      [](const std::string& r, bool log_target) {
        return std::make_shared<nn::KLDivLoss>(r, log_target);
      },
      py::arg("reduction") = "mean", py::arg("log_target") = false);

  Fm.def(
      "l1_loss", [](T i, T t, const std::string& r) { return F::l1_loss(i, t, r); },
      py::arg("input"), py::arg("target"), py::arg("reduction") = "mean");
  Fm.def(
      "smooth_l1_loss",
      [](T i, T t, const std::string& r, double beta) { return F::smooth_l1_loss(i, t, r, beta); },
      py::arg("input"), py::arg("target"), py::arg("reduction") = "mean", py::arg("beta") = 1.0);
  Fm.def(
      "huber_loss",
      [](T i, T t, const std::string& r, double delta) { return F::huber_loss(i, t, r, delta); },
      py::arg("input"), py::arg("target"), py::arg("reduction") = "mean", py::arg("delta") = 1.0);
  Fm.def(
      "binary_cross_entropy_with_logits",
      [](T i, T t, std::optional<Tensor> w, const std::string& r, std::optional<Tensor> pw) {
        return F::binary_cross_entropy_with_logits(i, t, opt(w), r, opt(pw));
      },
      py::arg("input"), py::arg("target"), py::arg("weight") = py::none(),
      py::arg("reduction") = "mean", py::arg("pos_weight") = py::none());
  Fm.def(
      "kl_div",
      [](T i, T t, const std::string& r, bool log_target) {
        return F::kl_div(i, t, r, log_target);
      },
      py::arg("input"), py::arg("target"), py::arg("reduction") = "mean",
      py::arg("log_target") = false);

  // ---- norms ----
  py::class_<nn::GroupNorm, Module, std::shared_ptr<nn::GroupNorm>>(nn_mod, "GroupNorm",
                                                                    py::dynamic_attr())
      .def(py::init([](int64_t groups, int64_t channels, double eps, bool affine) {
             return std::make_shared<nn::GroupNorm>(groups, channels, eps, affine);
           }),
           py::arg("num_groups"), py::arg("num_channels"), py::arg("eps") = 1e-5,
           py::arg("affine") = true)
      .def_readonly("num_groups", &nn::GroupNorm::num_groups)
      .def_readonly("num_channels", &nn::GroupNorm::num_channels);
  py::class_<nn::RMSNorm, Module, std::shared_ptr<nn::RMSNorm>>(nn_mod, "RMSNorm",
                                                                py::dynamic_attr())
      .def(py::init([](py::object shape, std::optional<double> eps, bool affine) {
             return std::make_shared<nn::RMSNorm>(shape_of(shape), eps, affine);
           }),
           py::arg("normalized_shape"), py::arg("eps") = py::none(),
           py::arg("elementwise_affine") = true);
  Fm.def(
      "group_norm",
      [](T x, int64_t groups, std::optional<Tensor> w, std::optional<Tensor> b, double eps) {
        return F::group_norm(x, groups, opt(w), opt(b), eps);
      },
      py::arg("input"), py::arg("num_groups"), py::arg("weight") = py::none(),
      py::arg("bias") = py::none(), py::arg("eps") = 1e-5);
  Fm.def(
      "rms_norm",
      [](T x, py::object shape, std::optional<Tensor> w, std::optional<double> eps) {
        return rms_norm(x, shape_of(shape), opt(w), eps);
      },
      py::arg("input"), py::arg("normalized_shape"), py::arg("weight") = py::none(),
      py::arg("eps") = py::none());
  Fm.def(
      "batch_norm",
      [](T x, std::optional<Tensor> mean, std::optional<Tensor> var, std::optional<Tensor> w,
         std::optional<Tensor> b, bool training, double momentum, double eps) {
        if (x.dim() == 2 || x.dim() == 3) {  // the 4-D kernels at unit width
          const Tensor x4 = x.dim() == 2 ? x.unsqueeze(2).unsqueeze(3) : x.unsqueeze(3);
          const Tensor y =
              batch_norm(x4, opt(mean), opt(var), opt(w), opt(b), training, momentum, eps);
          return x.dim() == 2 ? y.squeeze(3).squeeze(2) : y.squeeze(3);
        }
        return batch_norm(x, opt(mean), opt(var), opt(w), opt(b), training, momentum, eps);
      },
      py::arg("input"), py::arg("running_mean"), py::arg("running_var"),
      py::arg("weight") = py::none(), py::arg("bias") = py::none(), py::arg("training") = false,
      py::arg("momentum") = 0.1, py::arg("eps") = 1e-5);

  // ---- convolution, pooling, resampling ----
  py::class_<nn::Conv1d, Module, std::shared_ptr<nn::Conv1d>>(nn_mod, "Conv1d", py::dynamic_attr())
      .def(py::init([](int64_t in, int64_t out, py::object k, py::object stride, py::object padding,
                       py::object dilation, int64_t groups, bool bias) {
             return std::make_shared<nn::Conv1d>(in, out, int1(k, "kernel_size"),
                                                 int1(stride, "stride"), int1(padding, "padding"),
                                                 int1(dilation, "dilation"), groups, bias);
           }),
           py::arg("in_channels"), py::arg("out_channels"), py::arg("kernel_size"),
           py::arg("stride") = 1, py::arg("padding") = 0, py::arg("dilation") = 1,
           py::arg("groups") = 1, py::arg("bias") = true)
      .def_readonly("in_channels", &nn::Conv1d::in_channels)
      .def_readonly("out_channels", &nn::Conv1d::out_channels);
  py::class_<nn::ConvTranspose2d, Module, std::shared_ptr<nn::ConvTranspose2d>>(
      nn_mod, "ConvTranspose2d", py::dynamic_attr())
      .def(py::init([](int64_t in, int64_t out, py::object k, py::object stride, py::object padding,
                       py::object output_padding, int64_t groups, bool bias, py::object dilation) {
             return std::make_shared<nn::ConvTranspose2d>(in, out, int2(k), int2(stride),
                                                          int2(padding), int2(output_padding),
                                                          groups, bias, int2(dilation));
           }),
           py::arg("in_channels"), py::arg("out_channels"), py::arg("kernel_size"),
           py::arg("stride") = 1, py::arg("padding") = 0, py::arg("output_padding") = 0,
           py::arg("groups") = 1, py::arg("bias") = true, py::arg("dilation") = 1)
      .def_readonly("in_channels", &nn::ConvTranspose2d::in_channels)
      .def_readonly("out_channels", &nn::ConvTranspose2d::out_channels);
  py::class_<nn::AvgPool2d, Module, std::shared_ptr<nn::AvgPool2d>>(nn_mod, "AvgPool2d",
                                                                    py::dynamic_attr())
      .def(py::init([](py::object k, py::object stride, py::object padding, bool ceil_mode,
                       bool count_include_pad, std::optional<int64_t> divisor_override) {
             return std::make_shared<nn::AvgPool2d>(int2(k), int2(stride), int2(padding), ceil_mode,
                                                    count_include_pad, divisor_override);
           }),
           py::arg("kernel_size"), py::arg("stride") = py::none(), py::arg("padding") = 0,
           py::arg("ceil_mode") = false, py::arg("count_include_pad") = true,
           py::arg("divisor_override") = py::none());
  py::class_<nn::Upsample, Module, std::shared_ptr<nn::Upsample>>(nn_mod, "Upsample",
                                                                  py::dynamic_attr())
      .def(py::init([](py::object size, py::object scale, const std::string& mode,
                       std::optional<bool> align_corners) {
             return std::make_shared<nn::Upsample>(sizes_of(size), scales_of(scale), mode,
                                                   align_corners);
           }),
           py::arg("size") = py::none(), py::arg("scale_factor") = py::none(),
           py::arg("mode") = "nearest", py::arg("align_corners") = py::none());
  Fm.def(
      "conv1d",
      [](T x, T w, std::optional<Tensor> b, py::object stride, py::object padding,
         py::object dilation, int64_t groups) {
        return F::conv1d(x, w, opt(b), int1(stride, "stride"), int1(padding, "padding"),
                         int1(dilation, "dilation"), groups);
      },
      py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("stride") = 1,
      py::arg("padding") = 0, py::arg("dilation") = 1, py::arg("groups") = 1);
  Fm.def(
      "conv_transpose2d",
      [](T x, T w, std::optional<Tensor> b, py::object stride, py::object padding,
         py::object output_padding, int64_t groups, py::object dilation) {
        return conv_transpose2d(x, w, opt(b), int2(stride), int2(padding), int2(output_padding),
                                groups, int2(dilation));
      },
      py::arg("input"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("stride") = 1,
      py::arg("padding") = 0, py::arg("output_padding") = 0, py::arg("groups") = 1,
      py::arg("dilation") = 1);
  Fm.def(
      "interpolate",
      [](T x, py::object size, py::object scale, const std::string& mode,
         std::optional<bool> align_corners) {
        return F::interpolate(x, sizes_of(size), scales_of(scale), mode, align_corners);
      },
      py::arg("input"), py::arg("size") = py::none(), py::arg("scale_factor") = py::none(),
      py::arg("mode") = "nearest", py::arg("align_corners") = py::none());

  // ---- tally.nn.init: in place, no graph, the default generator; each returns its tensor ----
  py::module_ init = nn_mod.def_submodule("init", "torch.nn.init");
  init.def(
      "calculate_gain",
      [](const std::string& nl, std::optional<double> param) {
        return nn::init::calculate_gain(nl, param.value_or(0.01));
      },
      py::arg("nonlinearity"), py::arg("param") = py::none());
  def_init(
      init, "uniform_", +[](T t, double a, double b) { nn::init::uniform_(t, a, b); },
      py::arg("a") = 0.0, py::arg("b") = 1.0);
  def_init(
      init, "normal_", +[](T t, double mean, double std) { nn::init::normal_(t, mean, std); },
      py::arg("mean") = 0.0, py::arg("std") = 1.0);
  def_init(
      init, "constant_", +[](T t, double v) { nn::init::constant_(t, v); }, py::arg("val"));
  def_init(
      init, "zeros_", +[](T t) { nn::init::zeros_(t); });
  def_init(
      init, "ones_", +[](T t) { nn::init::ones_(t); });
  // The uniform and normal forms of Xavier's and Kaiming's initialisations take the same
  // arguments: one binding each.
  using Xavier = void (*)(T, double);
  const std::pair<const char*, Xavier> xavier[] = {
      {"xavier_uniform_", [](T t, double gain) { nn::init::xavier_uniform_(t, gain); }},
      {"xavier_normal_", [](T t, double gain) { nn::init::xavier_normal_(t, gain); }}};
  for (const auto& [name, fill] : xavier) def_init(init, name, fill, py::arg("gain") = 1.0);
  using Kaiming = void (*)(T, double, const std::string& mode, const std::string& nonlinearity);
  const Kaiming kaiming_uniform = [](T t, double a, const std::string& mode,
                                     const std::string& nl) {
    nn::init::kaiming_uniform_(t, a, mode, nl);
  };
  const Kaiming kaiming_normal = [](T t, double a, const std::string& mode, const std::string& nl) {
    nn::init::kaiming_normal_(t, a, mode, nl);
  };
  const std::pair<const char*, Kaiming> kaiming[] = {{"kaiming_uniform_", kaiming_uniform},
                                                     {"kaiming_normal_", kaiming_normal}};
  for (const auto& [name, fill] : kaiming)
    def_init(init, name, fill, py::arg("a") = 0.0, py::arg("mode") = "fan_in",
             py::arg("nonlinearity") = "leaky_relu");
  def_init(
      init, "trunc_normal_",
      +[](T t, double mean, double std, double a, double b) {
        nn::init::trunc_normal_(t, mean, std, a, b);
      },
      py::arg("mean") = 0.0, py::arg("std") = 1.0, py::arg("a") = -2.0, py::arg("b") = 2.0);

  // ---- Module.apply(fn): fn(module) on every submodule, children first, then self ----
  py::object module_cls = nn_mod.attr("Module");
  module_cls.attr("apply") = py::cpp_function(
      [](py::object self, py::function fn) {
        apply_python(self, fn);
        return self;
      },
      py::is_method(module_cls), py::name("apply"), py::arg("fn"),
      "fn on every submodule (children first) and then on this module, as torch.nn.Module.apply");
}

}  // namespace tally::python
