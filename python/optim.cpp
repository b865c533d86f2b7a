// tally.optim (SGD, Adam, AdamW, AdamW8bit, CpuOffload, clip_grad_norm_, state_dict and its load,
// the learning-rate schedulers of tally.optim.lr_scheduler, StepInBackward) and tally.amp (autocast
// as a context manager, GradScaler).
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "autograd/autocast.h"
#include "common.h"
#include "nn/module.h"
#include "optim/adam.h"
#include "optim/adamw8bit.h"
#include "optim/clip_grad.h"
#include "optim/cpu_offload.h"
#include "optim/grad_scaler.h"
#include "optim/lr_scheduler.h"
#include "optim/optimizer.h"
#include "optim/sgd.h"
#include "optim/step_in_backward.h"

namespace tally::python {

namespace {

using optim::Optimizer;

std::vector<Tensor> params_of(py::handle params) {
  std::vector<Tensor> out;
  for (py::handle p : params) {
    if (py::isinstance<py::dict>(p))
      throw py::type_error(
          "parameter groups (dicts) are not supported here: pass the parameters, then "
          "add_param_group(params, **options)");
    out.push_back(p.cast<Tensor>());
  }
  if (out.empty()) throw py::value_error("optimizer got an empty parameter list");
  return out;
}

optim::AdamOptions adam_options(double lr, std::pair<double, double> betas, double eps,
                                double weight_decay, bool amsgrad, bool maximize,
                                bool capturable = false) {
  return {.lr = lr,
          .beta1 = betas.first,
          .beta2 = betas.second,
          .eps = eps,
          .weight_decay = weight_decay,
          .amsgrad = amsgrad,
          .maximize = maximize,
          .capturable = capturable};
}

// torch.optim.Adam's or AdamW's constructor for Opt (a Base); their weight_decay defaults differ.
template <typename Opt, typename Base>
void bind_adam(py::module_& optim_mod, const char* name, double default_weight_decay) {
  py::class_<Opt, Base>(optim_mod, name)
      .def(py::init([](py::object params, double lr, std::pair<double, double> betas, double eps,
                       double weight_decay, bool amsgrad, bool maximize, bool capturable) {
             return std::make_unique<Opt>(
                 params_of(params),
                 adam_options(lr, betas, eps, weight_decay, amsgrad, maximize, capturable));
           }),
           py::arg("params"), py::arg("lr") = 1e-3, py::arg("betas") = std::make_pair(0.9, 0.999),
           py::arg("eps") = 1e-8, py::arg("weight_decay") = default_weight_decay,
           py::arg("amsgrad") = false, py::arg("maximize") = false, py::arg("capturable") = false);
}

// `with tally.autocast("cpu", dtype=tally.bfloat16):`
class Autocast {
 public:
  Autocast(Device device, std::optional<DType> dtype, bool enabled, bool cache_enabled)
      : device_(device), dtype_(dtype), enabled_(enabled), cache_enabled_(cache_enabled) {}
  void enter() {
    if (guard_) throw py::value_error("this autocast region is already open");
    if (dtype_)
      guard_ = std::make_unique<AutocastGuard>(device_.type, *dtype_, enabled_, cache_enabled_);
    else
      guard_ = std::make_unique<AutocastGuard>(device_.type, enabled_);
  }
  void exit() { guard_.reset(); }

 private:
  Device device_;
  std::optional<DType> dtype_;
  bool enabled_, cache_enabled_;
  std::unique_ptr<AutocastGuard> guard_;
};

// optim::StepInBackward whose hooks Python can remove before the object is collected.
class StepInBackwardScope {
 public:
  explicit StepInBackwardScope(Optimizer& opt)
      : sib_(std::make_unique<optim::StepInBackward>(opt)) {}
  int64_t updates() const { return sib_ ? sib_->updates() : updates_; }
  void remove() {
    if (!sib_) return;
    updates_ = sib_->updates();
    sib_.reset();
  }

 private:
  std::unique_ptr<optim::StepInBackward> sib_;
  int64_t updates_ = 0;
};

}  // namespace

void bind_optim(py::module_& m, py::module_& optim_mod, py::module_& amp) {
  py::class_<Optimizer>(optim_mod, "Optimizer")
      .def("step", [](Optimizer& o) { o.step(); })
      .def("zero_grad", &Optimizer::zero_grad, py::arg("set_to_none") = true)
      .def_property(
          "lr", [](const Optimizer& o) { return o.get_lr(0); },
          [](Optimizer& o, double lr) {
            for (size_t g = 0; g < o.param_groups().size(); ++g) o.set_lr(lr, g);
          })
      .def("get_lr", &Optimizer::get_lr, py::arg("group") = 0)
      .def("set_lr", &Optimizer::set_lr, py::arg("lr"), py::arg("group") = 0)
      .def_property_readonly("param_groups",
                             [](const Optimizer& o) {
                               py::list groups;
                               for (const auto& g : o.param_groups()) {
                                 py::dict d;
                                 d["params"] = g.params;
                                 for (const auto& [k, v] : g.options) d[py::str(k)] = v;
                                 groups.append(d);
                               }
                               return groups;
                             })
      .def(
          "add_param_group",
          [](Optimizer& o, py::object params, py::kwargs options) {
            optim::ParamGroup g;
            g.params = params_of(params);
            for (auto item : options) g.options[py::str(item.first)] = item.second.cast<double>();
            o.add_param_group(std::move(g));
          },
          py::arg("params"))
      .def_property_readonly("defaults", &Optimizer::defaults)
      .def(
          "state",
          [](const Optimizer& o, size_t i) {
            const auto& s = o.state(i);
            py::dict d;
            d["step"] = s.step;
            for (const auto& [k, t] : s.tensors) d[py::str(k)] = t;
            return d;
          },
          py::arg("param_index"), "The state of the i-th parameter (step and tensors)")
      .def("state_dict",
           [](const Optimizer& o) {
             const auto sd = o.state_dict();
             py::dict d;
             for (const auto& [k, t] : sd.tensors) d[py::str(k)] = t;
             for (const auto& [k, v] : sd.scalars) d[py::str(k)] = v;
             return d;
           })
      .def(
          "load_state_dict",
          [](Optimizer& o, const py::dict& d) {
            // state_dict()'s flat form: tensors ("state.<i>.<name>") and numbers (steps,
            // group options); a numpy array counts as a tensor.
            optim::OptimizerStateDict sd;
            for (auto item : d) {
              const std::string key = py::str(item.first);
              py::handle v = item.second;
              if (py::isinstance<Tensor>(v) || py::isinstance<py::array>(v))
                sd.tensors.emplace(key, to_tensor(v));
              else if (py::isinstance<py::float_>(v) || py::isinstance<py::int_>(v))
                sd.scalars.emplace(key, v.cast<double>());
              else
                throw py::type_error(o.name() + std::string(".load_state_dict: '") + key +
                                     "' is a " + std::string(py::str(py::type::of(v))) +
                                     ", not a tensor or a number");
            }
            o.load_state_dict(sd);
          },
          py::arg("state_dict"), "Restores what state_dict() returned (shapes must match)")
      .def("__repr__", [](const Optimizer& o) {
        std::string s = std::string(o.name()) + "(";
        bool first = true;
        for (const auto& [k, v] : o.defaults()) {
          s += (first ? "" : ", ") + k + "=" + std::string(py::str(py::float_(v)));
          first = false;
        }
        return s + ")";
      });

  // ---- tally.optim.lr_scheduler ----
  py::module_ sched = optim_mod.def_submodule("lr_scheduler", "torch.optim.lr_scheduler");
  py::class_<optim::LRScheduler>(sched, "LRScheduler")
      .def("step", &optim::LRScheduler::step, "Advances one epoch and sets the groups' lr")
      .def("get_last_lr", &optim::LRScheduler::get_last_lr)
      .def_property("last_epoch", &optim::LRScheduler::last_epoch,
                    &optim::LRScheduler::set_last_epoch)
      .def_property_readonly("base_lrs", &optim::LRScheduler::base_lrs);
  // Each scheduler keeps a reference to its optimizer: keep_alive<1, 2>.
  py::class_<optim::StepLR, optim::LRScheduler>(sched, "StepLR")
      .def(py::init<Optimizer&, int64_t, double>(), py::arg("optimizer"), py::arg("step_size"),
           py::arg("gamma") = 0.1, py::keep_alive<1, 2>());
  py::class_<optim::CosineAnnealingLR, optim::LRScheduler>(sched, "CosineAnnealingLR")
      .def(py::init<Optimizer&, int64_t, double>(), py::arg("optimizer"), py::arg("T_max"),
           py::arg("eta_min") = 0.0, py::keep_alive<1, 2>());
  py::class_<optim::LambdaLR, optim::LRScheduler>(sched, "LambdaLR")
      .def(py::init([](Optimizer& o, py::function f) {
             // The lambda is called with the GIL held: step() runs from Python.
             return std::make_unique<optim::LambdaLR>(o, [f](int64_t epoch) {
               py::object r = f(epoch);
               if (!py::isinstance<py::float_>(r) && !py::isinstance<py::int_>(r))
                 throw py::type_error("LambdaLR: lr_lambda(" + std::to_string(epoch) +
                                      ") returned a " + std::string(py::str(py::type::of(r))) +
                                      ", not a number");
               return r.cast<double>();
             });
           }),
           py::arg("optimizer"), py::arg("lr_lambda"), py::keep_alive<1, 2>());
  py::class_<optim::WarmupCosineLR, optim::LRScheduler>(sched, "WarmupCosineLR")
      .def(py::init<Optimizer&, int64_t, int64_t, double>(), py::arg("optimizer"),
           py::arg("warmup_steps"), py::arg("total_steps"), py::arg("min_lr") = 0.0,
           py::keep_alive<1, 2>(), "nanoGPT's linear warmup then cosine decay to min_lr");

  // ---- step-in-backward ----
  // `with tally.optim.StepInBackward(opt):` (or keep the object): while open, backward()
  // updates each parameter as its gradient is accumulated and frees that gradient.
  py::class_<StepInBackwardScope>(optim_mod, "StepInBackward",
                                  "PyTorch's optimizer-in-backward recipe: each parameter "
                                  "steps, and its gradient is freed, as backward reaches it")
      .def(py::init<Optimizer&>(), py::arg("optimizer"), py::keep_alive<1, 2>())
      .def_property_readonly("updates", &StepInBackwardScope::updates)
      .def("remove", &StepInBackwardScope::remove, "Removes the hooks (steps stop)")
      .def("__enter__", [](StepInBackwardScope& s) -> StepInBackwardScope& { return s; })
      .def("__exit__", [](StepInBackwardScope& s, py::args) { s.remove(); });

  py::class_<optim::SGD, Optimizer>(optim_mod, "SGD")
      .def(py::init([](py::object params, double lr, double momentum, double dampening,
                       double weight_decay, bool nesterov, bool maximize, bool capturable) {
             return std::make_unique<optim::SGD>(params_of(params),
                                                 optim::SGDOptions{.lr = lr,
                                                                   .momentum = momentum,
                                                                   .dampening = dampening,
                                                                   .weight_decay = weight_decay,
                                                                   .nesterov = nesterov,
                                                                   .maximize = maximize,
                                                                   .capturable = capturable});
           }),
           py::arg("params"), py::arg("lr") = 1e-3, py::arg("momentum") = 0.0,
           py::arg("dampening") = 0.0, py::arg("weight_decay") = 0.0, py::arg("nesterov") = false,
           py::arg("maximize") = false, py::arg("capturable") = false);
  bind_adam<optim::Adam, Optimizer>(optim_mod, "Adam", 0.0);
  bind_adam<optim::AdamW, optim::Adam>(optim_mod, "AdamW", 1e-2);
  py::class_<optim::AdamW8bit, Optimizer>(optim_mod, "AdamW8bit")
      .def(py::init([](py::object params, double lr, std::pair<double, double> betas, double eps,
                       double weight_decay, int64_t block_size, int64_t min_8bit_size) {
             optim::AdamW8bitOptions q;
             q.block_size = block_size;
             q.min_8bit_size = min_8bit_size;
             return std::make_unique<optim::AdamW8bit>(
                 params_of(params), adam_options(lr, betas, eps, weight_decay, false, false), q);
           }),
           py::arg("params"), py::arg("lr") = 1e-3, py::arg("betas") = std::make_pair(0.9, 0.999),
           py::arg("eps") = 1e-8, py::arg("weight_decay") = 1e-2, py::arg("block_size") = 256,
           py::arg("min_8bit_size") = 4096);

  // torchao's CPUOffloadOptimizer for AdamW: master weights and moments in pinned host memory.
  py::class_<optim::CpuOffload, Optimizer>(optim_mod, "CpuOffload")
      .def(py::init([](py::object params, double lr, std::pair<double, double> betas, double eps,
                       double weight_decay, bool amsgrad, bool maximize, bool adamw8bit,
                       int64_t block_size, int64_t min_8bit_size, bool overlap_backward,
                       int64_t bucket_bytes) {
             optim::CpuOffloadOptions o;
             o.adamw8bit = adamw8bit;
             o.quant.block_size = block_size;
             o.quant.min_8bit_size = min_8bit_size;
             o.overlap_backward = overlap_backward;
             o.bucket_bytes = bucket_bytes;
             return std::make_unique<optim::CpuOffload>(
                 params_of(params), adam_options(lr, betas, eps, weight_decay, amsgrad, maximize),
                 o);
           }),
           py::arg("params"), py::arg("lr") = 1e-3, py::arg("betas") = std::make_pair(0.9, 0.999),
           py::arg("eps") = 1e-8, py::arg("weight_decay") = 1e-2, py::arg("amsgrad") = false,
           py::arg("maximize") = false, py::arg("adamw8bit") = false, py::arg("block_size") = 256,
           py::arg("min_8bit_size") = 4096, py::arg("overlap_backward") = true,
           py::arg("bucket_bytes") = int64_t{32} << 20)
      .def("init_masters", &optim::CpuOffload::init_masters,
           "Makes the float32 master weights and moments now, from the parameters as they are")
      .def(
          "keep_16bit_weights",
          [](optim::CpuOffload& o, nn::Module& model, py::object dtype) {
            o.keep_16bit_weights(model, dtype.is_none() ? DType::bfloat16 : to_dtype(dtype));
          },
          py::arg("model"), py::arg("dtype") = py::none(),
          "init_masters(), then the model's float32 parameters become 16-bit (bfloat16 by "
          "default) in place: 16-bit weights and gradients on the device, float32 masters on the "
          "host")
      .def("overlap_with_forward", &optim::CpuOffload::overlap_with_forward, py::arg("model"),
           "From now on the updates not done when a step's last gradient reaches the host run as "
           "the next forward calls the modules (or blocks) holding their parameters, overlapped "
           "with the forward of the layers before; call finish_updates() before reading weights "
           "outside the model's forward")
      .def("clip_grad_norm_", &optim::CpuOffload::clip_grad_norm_, py::arg("max_norm"),
           py::arg("norm_type") = 2.0,
           "FSDP's clip_grad_norm_: the total norm of the gradients, its coefficient folded into "
           "the next step()'s host update (the device's gradients are not rewritten, so not sent "
           "again); the steps equal clip_grad_norm_ and step() bit for bit")
      .def("finish_updates", &optim::CpuOffload::finish_updates,
           "Runs every deferred update and copy back now")
      .def_property_readonly("deferred_updates", &optim::CpuOffload::deferred_updates)
      .def_property_readonly("updates_in_forward", &optim::CpuOffload::updates_in_forward);

  optim_mod.def(
      "clip_grad_norm_",
      [](py::object params, double max_norm, double norm_type) {
        return optim::clip_grad_norm_(py::isinstance<Tensor>(params)
                                          ? std::vector<Tensor>{params.cast<Tensor>()}
                                          : params.cast<std::vector<Tensor>>(),
                                      max_norm, norm_type);
      },
      py::arg("parameters"), py::arg("max_norm"), py::arg("norm_type") = 2.0);
  optim_mod.def(
      "clip_grad_value_",
      [](py::object params, double clip_value) {
        optim::clip_grad_value_(py::isinstance<Tensor>(params)
                                    ? std::vector<Tensor>{params.cast<Tensor>()}
                                    : params.cast<std::vector<Tensor>>(),
                                clip_value);
      },
      py::arg("parameters"), py::arg("clip_value"));

  // ---- mixed precision ----
  def_enter_exit(
      py::class_<Autocast>(amp, "autocast",
                           "with tally.autocast('cpu', dtype=tally.bfloat16): ... (torch.autocast)")
          .def(py::init(
                   [](py::object device_type, py::object dtype, bool enabled, bool cache_enabled) {
                     std::optional<DType> d;
                     if (!dtype.is_none()) d = to_dtype(dtype);
                     return std::make_unique<Autocast>(to_device(device_type), d, enabled,
                                                       cache_enabled);
                   }),
               py::arg("device_type") = "cpu", py::arg("dtype") = py::none(),
               py::arg("enabled") = true, py::arg("cache_enabled") = true));
  m.attr("autocast") = amp.attr("autocast");
  amp.def(
      "is_autocast_enabled", [](py::object d) { return is_autocast_enabled(to_device(d).type); },
      py::arg("device_type") = "cpu");
  amp.def("clear_autocast_cache", &clear_autocast_cache);
  amp.def("autocast_cache_size", &autocast_cache_size);

  py::class_<optim::GradScaler>(amp, "GradScaler", "torch.amp.GradScaler: dynamic loss scaling")
      .def(py::init([](double init_scale, double growth_factor, double backoff_factor,
                       int64_t growth_interval, bool enabled, bool capturable) {
             return std::make_unique<optim::GradScaler>(
                 optim::GradScalerOptions{.init_scale = init_scale,
                                          .growth_factor = growth_factor,
                                          .backoff_factor = backoff_factor,
                                          .growth_interval = growth_interval,
                                          .enabled = enabled,
                                          .capturable = capturable});
           }),
           py::arg("init_scale") = 65536.0, py::arg("growth_factor") = 2.0,
           py::arg("backoff_factor") = 0.5, py::arg("growth_interval") = 2000,
           py::arg("enabled") = true, py::arg("capturable") = false)
      .def("scale", [](optim::GradScaler& s, const Tensor& loss) { return s.scale(loss); })
      .def("unscale_", [](optim::GradScaler& s, Optimizer& o) { s.unscale_(o); })
      .def(
          "step", [](optim::GradScaler& s, Optimizer& o) { return s.step(o); },
          "Runs optimizer.step() unless a gradient is inf/NaN; returns whether it stepped")
      .def(
          "update",
          [](optim::GradScaler& s, std::optional<double> new_scale) {
            if (new_scale)
              s.update(*new_scale);
            else
              s.update();
          },
          py::arg("new_scale") = py::none())
      .def("get_scale", &optim::GradScaler::get_scale)
      .def("get_growth_tracker", &optim::GradScaler::get_growth_tracker)
      .def("is_enabled", &optim::GradScaler::is_enabled)
      .def("state_dict", &optim::GradScaler::state_dict)
      .def("load_state_dict", &optim::GradScaler::load_state_dict, py::arg("state_dict"));
}

}  // namespace tally::python
