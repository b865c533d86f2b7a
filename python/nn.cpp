// tally.nn: Module (subclassable from Python: a Python `forward`, attributes that are modules
// or nn.Parameter register themselves), the layers (BatchNorm1d and BatchNorm2d among them),
// containers, ResNet and GPT, and checkpointing (tally.nn.enable_checkpointing,
// tally.utils.checkpoint).
#include <fmt/format.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include "autograd/offload.h"
#include "common.h"
#include "nn/checkpoint.h"
#include "nn/container.h"
#include "nn/layers.h"
#include "nn/loss.h"
#include "nn/models/gpt.h"
#include "nn/models/resnet.h"
#include "nn/norm.h"
#include "nn/offload.h"
#include "nn/serialize.h"
#include "tensor/host_link.h"

namespace tally::python {

namespace {

using nn::Module;
using ModulePtr = std::shared_ptr<Module>;

// A Module subclassed in Python: its `forward` and `train` reach C++ callers (Sequential,
// checkpointing) through these overrides.
class PyModule : public Module {
 public:
  using Module::Module;
  Tensor forward(const Tensor& x) override { PYBIND11_OVERRIDE(Tensor, Module, forward, x); }
  void train(bool on) override { PYBIND11_OVERRIDE(void, Module, train, on); }
  std::string extra_repr() const override { PYBIND11_OVERRIDE(std::string, Module, extra_repr, ); }
};

// Every module under `m` with its dotted name, as shared pointers (named_modules gives raw
// ones, which Python must not own).
void collect_modules(const std::string& prefix, const ModulePtr& m,
                     std::vector<std::pair<std::string, ModulePtr>>& out) {
  out.emplace_back(prefix, m);
  for (auto& [name, child] : m->named_children())
    collect_modules(prefix.empty() ? name : prefix + "." + name, child, out);
}

py::list named_tensors(const nn::NamedTensors& ts) {
  py::list out;
  for (const auto& [n, t] : ts) out.append(py::make_tuple(n, t));
  return out;
}

// dict(obj) for a mapping or a list or tuple of (key, value) pairs, else a TypeError naming
// `what`. dict() of any other iterable would walk it: a tensor row by row, and an expanded
// tensor has billions of rows.
py::dict mapping_arg(py::handle obj, const char* what, const char* expected) {
  if (py::isinstance<py::dict>(obj)) return py::reinterpret_borrow<py::dict>(obj);
  const py::object mapping = py::module_::import("collections.abc").attr("Mapping");
  if (py::isinstance(obj, mapping) || py::isinstance<py::list>(obj) ||
      py::isinstance<py::tuple>(obj))
    return py::dict(py::reinterpret_borrow<py::object>(obj));
  throw py::type_error(
      fmt::format("{}: expected {}, got {}", what, expected,
                  py::str(py::type::of(obj).attr("__name__")).cast<std::string>()));
}

bool is_parameter_object(py::handle value) {
  py::object nn_mod = py::module_::import("tally._C").attr("nn");
  if (!py::hasattr(nn_mod, "Parameter")) return false;
  return py::isinstance(value, nn_mod.attr("Parameter"));
}

// Calls a Python-defined forward under the module's scope (module path, call site); a Python
// exception from inside passes through unchanged.
py::object call_python_forward(Module& m, py::object self, const py::args& args,
                               const py::kwargs& kw) {
  std::optional<py::error_already_set> error;
  py::object result = m.call([&]() -> py::object {
    try {
      return self.attr("forward")(*args, **kw);
    } catch (py::error_already_set& e) {
      error.emplace(std::move(e));
      return py::none();
    }
  });
  if (error) throw std::move(*error);
  return result;
}

std::map<std::string, Tensor> state_from(py::dict d) {
  std::map<std::string, Tensor> out;
  for (auto item : d) out[py::str(item.first)] = to_tensor(item.second);
  return out;
}

nn::ResNetOptions resnet_options(int64_t num_classes, int64_t in_channels, bool zero_init) {
  nn::ResNetOptions o;
  o.num_classes = num_classes;
  o.in_channels = in_channels;
  o.zero_init_residual = zero_init;
  return o;
}

std::function<Tensor(const Tensor&)> stage_of(py::handle f) {
  if (py::isinstance<Module>(f)) {
    ModulePtr m = f.cast<ModulePtr>();
    return [m](const Tensor& x) { return (*m)(x); };
  }
  py::function fn = py::reinterpret_borrow<py::function>(f);
  return [fn](const Tensor& x) { return fn(x).cast<Tensor>(); };
}

// `with tally.device("meta:1"):` builds layers there (nn::BuildOnDevice, PyTorch's
// `with torch.device(d):`); nested regions stack.
std::vector<std::unique_ptr<nn::BuildOnDevice>>& build_stack() {
  static auto* stack = new std::vector<std::unique_ptr<nn::BuildOnDevice>>();
  return *stack;
}

// SaveOnCpu as a Python context manager; the offloader outlives the scope (its stats).
class SaveOnCpuScope {
 public:
  explicit SaveOnCpuScope(bool pin_memory) : pin_memory_(pin_memory) {}
  SaveOnCpuScope& enter() {
    if (scope_) throw py::value_error("this save_on_cpu scope is already open");
    if (!offloader_) {
      OffloadOptions o;
      o.pin_memory = pin_memory_;
      offloader_ = ActivationOffloader::create(o);
    }
    scope_ = std::make_unique<SaveOnCpu>(offloader_);
    return *this;
  }
  void exit() { scope_.reset(); }
  std::shared_ptr<ActivationOffloader> offloader() const { return offloader_; }

 private:
  bool pin_memory_;
  std::shared_ptr<ActivationOffloader> offloader_;
  std::unique_ptr<SaveOnCpu> scope_;
};

// A Python check_fn(name, module) -> bool as a module selector (every K-th match).
nn::ModuleSelector selector_of(py::object check_fn, int every) {
  if (!PyCallable_Check(check_fn.ptr()))
    throw py::type_error("expected a spec string or a callable check_fn(name, module) -> bool");
  nn::ModuleSelector sel;
  sel.every = every;
  sel.label = py::str(py::getattr(check_fn, "__name__", py::str("custom")));
  // Called only while the policy is applied (under the GIL), never during training.
  sel.predicate = [check_fn](const std::string& name, const Module& m) {
    return check_fn(name, py::cast(const_cast<Module&>(m), py::return_value_policy::reference))
        .cast<bool>();
  };
  return sel;
}

nn::CheckpointSpec checkpoint_spec_arg(py::object spec, int every, bool selective) {
  if (py::isinstance<py::str>(spec)) {
    nn::CheckpointSpec s = nn::parse_checkpoint_spec(spec.cast<std::string>());
    if (every != 1 || selective) {
      if (s.kind != nn::CheckpointSpec::Kind::modules)
        throw py::value_error(
            "every= and selective= apply to a module policy (type:, name: or a "
            "callable), not '" +
            spec.cast<std::string>() + "'");
      if (every != 1) s.modules.every = every;
      s.selective = s.selective || selective;
    }
    return s;
  }
  nn::CheckpointSpec s;
  s.kind = nn::CheckpointSpec::Kind::modules;
  s.modules = selector_of(spec, every);
  s.selective = selective;
  return s;
}

// torch.nn.BatchNorm1d or BatchNorm2d (BN).
template <typename BN>
void bind_batch_norm(py::module_& nn_mod, const char* name) {
  py::class_<BN, Module, std::shared_ptr<BN>>(nn_mod, name, py::dynamic_attr())
      .def(py::init(
               [](int64_t n, double eps, std::optional<double> momentum, bool affine, bool track) {
                 return std::make_shared<BN>(n, eps, momentum, affine, track);
               }),
           py::arg("num_features"), py::arg("eps") = 1e-5, py::arg("momentum") = 0.1,
           py::arg("affine") = true, py::arg("track_running_stats") = true)
      .def_readonly("num_features", &BN::num_features);
}

// Sequential's and ModuleList's list methods: append(m), len(), [i] (negative from the end;
// IndexError naming `name` out of range) and iteration over the children.
template <typename L, typename... Options>
void def_list_methods(py::class_<L, Options...>& cls, const char* name) {
  cls.def(
      "append", [](L& l, ModulePtr mod) { l.push_back(std::move(mod)); }, py::keep_alive<1, 2>());
  cls.def("__len__", &L::size);
  cls.def("__getitem__", [name](const L& l, int64_t i) {
    const auto n = static_cast<int64_t>(l.size());
    if (i < -n || i >= n) throw py::index_error(std::string(name) + " index out of range");
    return l[static_cast<size_t>(i < 0 ? i + n : i)];
  });
  cls.def("__iter__", [](const L& l) { return py::iter(py::cast(l.children())); });
}

}  // namespace

void bind_nn(py::module_& m, py::module_& nn_mod) {
  py::class_<Module, PyModule, ModulePtr> module(nn_mod, "Module", py::dynamic_attr(),
                                                 "torch.nn.Module: subclass it and define forward");
  module
      .def(py::init(
               [](const std::string& type_name) { return std::make_shared<PyModule>(type_name); }),
           py::arg("type_name") = "Module")
      .def("forward", &Module::forward, py::arg("input"))
      .def("__call__",
           [](py::object self, py::args args, py::kwargs kw) -> py::object {
             const ForwardPhase phase;
             Module& mod = self.cast<Module&>();
             py::object fwd = py::getattr(py::type::of(self), "forward", py::none());
             const bool python_forward = PyFunction_Check(fwd.ptr());
             const bool one_tensor =
                 args.size() == 1 && kw.empty() && py::isinstance<Tensor>(args[0]);
             if (python_forward && !(one_tensor && mod.is_checkpointed()))
               return call_python_forward(mod, self, args, kw);
             if (one_tensor) return py::cast(mod(args[0].cast<Tensor>()));
             throw py::type_error(mod.type_name() + " is called with one tensor");
           })
      .def("__setattr__",
           [](py::object self, py::str name, py::object value) {
             Module& mod = self.cast<Module&>();
             const std::string n = name;
             if (py::isinstance<Module>(value)) {
               mod.register_module(n, value.cast<ModulePtr>());
             } else if (is_parameter_object(value)) {
               Tensor t = value.cast<Tensor>();
               Tensor& stored = mod.register_parameter(n, t, t.requires_grad());
               if (!stored.is_same(t)) value = py::cast(stored);
             }
             if (PyObject_GenericSetAttr(self.ptr(), name.ptr(), value.ptr()) != 0)
               throw py::error_already_set();
           })
      .def("__getattr__",
           [](py::object self, const std::string& name) -> py::object {
             Module* mod = nullptr;
             try {
               mod = &self.cast<Module&>();
             } catch (...) {
               throw py::attribute_error(name);
             }
             for (auto& [n, c] : mod->named_children())
               if (n == name) return py::cast(c);
             for (auto& [n, p] : mod->named_parameters(false))
               if (n == name) return py::cast(p);
             for (auto& [n, b] : mod->named_buffers(false))
               if (n == name) return py::cast(b);
             throw py::attribute_error("'" + mod->type_name() + "' object has no attribute '" +
                                       name + "'");
           })
      .def(
          "register_parameter",
          [](Module& mod, const std::string& name, py::object t, bool requires_grad) {
            return mod.register_parameter(name, to_tensor(t), requires_grad);
          },
          py::arg("name"), py::arg("param"), py::arg("requires_grad") = true)
      .def(
          "register_buffer",
          [](Module& mod, const std::string& name, py::object t, bool persistent) {
            return mod.register_buffer(name, to_tensor(t), persistent);
          },
          py::arg("name"), py::arg("tensor"), py::arg("persistent") = true)
      .def(
          "register_module",
          [](py::object self, const std::string& name, py::object child) {
            self.cast<Module&>().register_module(name, child.cast<ModulePtr>());
            if (PyObject_GenericSetAttr(self.ptr(), py::str(name).ptr(), child.ptr()) != 0)
              throw py::error_already_set();
          },
          py::arg("name"), py::arg("module"))
      .def(
          "parameters", [](const Module& mod, bool recurse) { return mod.parameters(recurse); },
          py::arg("recurse") = true)
      .def(
          "named_parameters",
          [](const Module& mod, bool recurse) {
            return named_tensors(mod.named_parameters(recurse));
          },
          py::arg("recurse") = true)
      .def(
          "buffers", [](const Module& mod, bool recurse) { return mod.buffers(recurse); },
          py::arg("recurse") = true)
      .def(
          "named_buffers",
          [](const Module& mod, bool recurse) { return named_tensors(mod.named_buffers(recurse)); },
          py::arg("recurse") = true)
      .def("children", &Module::children)
      .def("named_children", &Module::named_children)
      .def("named_modules",
           [](ModulePtr self) {
             std::vector<std::pair<std::string, ModulePtr>> out;
             collect_modules("", self, out);
             return out;
           })
      .def("modules",
           [](ModulePtr self) {
             std::vector<std::pair<std::string, ModulePtr>> all;
             collect_modules("", self, all);
             std::vector<ModulePtr> out;
             for (auto& [n, mod] : all) out.push_back(mod);
             return out;
           })
      .def(
          "get_submodule",
          [](ModulePtr self, const std::string& target) -> ModulePtr {
            if (target.empty()) return self;
            std::vector<std::pair<std::string, ModulePtr>> all;
            collect_modules("", self, all);
            for (auto& [n, mod] : all)
              if (n == target) return mod;
            throw py::attribute_error(self->type_name() + " has no submodule '" + target + "'");
          },
          py::arg("target"))
      .def("num_parameters", &Module::num_parameters, py::arg("trainable_only") = false)
      .def_property_readonly("name", &Module::name)
      .def_property_readonly("type_name", &Module::type_name)
      .def_property_readonly("training", &Module::is_training)
      .def(
          "train",
          [](py::object self, bool mode) {
            self.cast<Module&>().train(mode);
            return self;
          },
          py::arg("mode") = true)
      .def("eval",
           [](py::object self) {
             self.cast<Module&>().train(false);
             return self;
           })
      .def("to",
           [](py::object self, py::args args, py::kwargs kw) {
             Module& mod = self.cast<Module&>();
             std::optional<Device> device;
             std::optional<DType> dtype;
             for (py::handle a : args) {
               if (py::isinstance<Device>(a))
                 device = a.cast<Device>();
               else if (py::isinstance<py::str>(a)) {
                 try {
                   device = parse_device(a.cast<std::string>());
                 } catch (py::value_error&) {
                   dtype = to_dtype(a);
                 }
               } else
                 dtype = to_dtype(a);
             }
             if (kw.contains("device")) device = to_device(kw["device"]);
             if (kw.contains("dtype")) dtype = to_dtype(kw["dtype"]);
             if (device && dtype)
               mod.to(*device, *dtype);
             else if (device)
               mod.to(*device);
             else if (dtype)
               mod.to(*dtype);
             // model.to(memory_format=tally.channels_last): 4-D parameters and buffers.
             if (kw.contains("memory_format")) mod.to(to_memory_format(kw["memory_format"]));
             return self;
           })
      .def("zero_grad", &Module::zero_grad, py::arg("set_to_none") = true)
      .def("state_dict",
           [](const Module& mod) {
             py::dict d;
             for (const auto& [n, t] : mod.state_dict()) d[py::str(n)] = t;
             return d;
           })
      .def(
          "load_state_dict",
          [](Module& mod, py::dict state, bool strict) {
            mod.load_state_dict(state_from(state), strict);
          },
          py::arg("state_dict"), py::arg("strict") = true)
      .def(
          "set_checkpoint",
          [](Module& mod, bool enabled, py::object policy) {
            if (policy.is_none()) {
              mod.set_checkpoint(enabled);
            } else if (py::isinstance<py::str>(policy) &&
                       policy.cast<std::string>() == "selective") {
              mod.set_checkpoint(enabled, nn::selective_policy());
            } else {
              mod.set_checkpoint(enabled, nn::save_ops(policy.cast<std::vector<std::string>>()));
            }
          },
          py::arg("enabled") = true, py::arg("policy") = py::none(),
          "Recompute this module's activations in backward (policy: None keeps nothing, "
          "'selective', or a list of op names whose outputs are kept)")
      .def_property_readonly("is_checkpointed", &Module::is_checkpointed)
      .def("extra_repr", &Module::extra_repr)
      .def("__repr__", &Module::repr);

  py::object device_cls = py::reinterpret_borrow<py::object>(py::type::of<Device>());
  device_cls.attr("__enter__") = py::cpp_function(
      [](py::object self) {
        build_stack().push_back(std::make_unique<nn::BuildOnDevice>(self.cast<Device>()));
        return self;
      },
      py::is_method(device_cls));
  device_cls.attr("__exit__") = py::cpp_function(
      [](py::object, py::args) {
        if (!build_stack().empty()) build_stack().pop_back();
        return false;
      },
      py::is_method(device_cls));

  // Parameters are tally.nn.Parameter (python/tally/__init__.py); Module.__setattr__ registers
  // them.

  py::class_<nn::Linear, Module, std::shared_ptr<nn::Linear>>(nn_mod, "Linear", py::dynamic_attr())
      .def(py::init([](int64_t in, int64_t out, bool bias) {
             return std::make_shared<nn::Linear>(in, out, bias);
           }),
           py::arg("in_features"), py::arg("out_features"), py::arg("bias") = true)
      .def_readonly("in_features", &nn::Linear::in_features)
      .def_readonly("out_features", &nn::Linear::out_features);
  py::class_<nn::Conv2d, Module, std::shared_ptr<nn::Conv2d>>(nn_mod, "Conv2d", py::dynamic_attr())
      .def(py::init([](int64_t in, int64_t out, py::object k, py::object stride, py::object padding,
                       py::object dilation, int64_t groups, bool bias) {
             nn::Conv2dOptions o;
             o.stride = int2(stride);
             o.padding = int2(padding);
             o.dilation = int2(dilation);
             o.groups = groups;
             o.bias = bias;
             return std::make_shared<nn::Conv2d>(in, out, int2(k), o);
           }),
           py::arg("in_channels"), py::arg("out_channels"), py::arg("kernel_size"),
           py::arg("stride") = 1, py::arg("padding") = 0, py::arg("dilation") = 1,
           py::arg("groups") = 1, py::arg("bias") = true)
      .def_readonly("in_channels", &nn::Conv2d::in_channels)
      .def_readonly("out_channels", &nn::Conv2d::out_channels);
  py::class_<nn::Embedding, Module, std::shared_ptr<nn::Embedding>>(nn_mod, "Embedding",
                                                                    py::dynamic_attr())
      .def(py::init([](int64_t n, int64_t d, std::optional<int64_t> padding_idx) {
             return std::make_shared<nn::Embedding>(n, d, padding_idx);
           }),
           py::arg("num_embeddings"), py::arg("embedding_dim"),
           py::arg("padding_idx") = py::none());
  py::class_<nn::Dropout, Module, std::shared_ptr<nn::Dropout>>(nn_mod, "Dropout",
                                                                py::dynamic_attr())
      .def(py::init([](double p) { return std::make_shared<nn::Dropout>(p); }), py::arg("p") = 0.5);
  py::class_<nn::ReLU, Module, std::shared_ptr<nn::ReLU>>(nn_mod, "ReLU", py::dynamic_attr())
      .def(py::init([]() { return std::make_shared<nn::ReLU>(); }));
  py::class_<nn::GELU, Module, std::shared_ptr<nn::GELU>>(nn_mod, "GELU", py::dynamic_attr())
      .def(py::init([](const std::string& a) { return std::make_shared<nn::GELU>(a); }),
           py::arg("approximate") = "none");
  py::class_<nn::MaxPool2d, Module, std::shared_ptr<nn::MaxPool2d>>(nn_mod, "MaxPool2d",
                                                                    py::dynamic_attr())
      .def(py::init([](py::object k, py::object stride, py::object padding, py::object dilation,
                       bool ceil_mode) {
             return std::make_shared<nn::MaxPool2d>(int2(k), int2(stride), int2(padding),
                                                    int2(dilation), ceil_mode);
           }),
           py::arg("kernel_size"), py::arg("stride") = py::none(), py::arg("padding") = 0,
           py::arg("dilation") = 1, py::arg("ceil_mode") = false);
  py::class_<nn::AdaptiveAvgPool2d, Module, std::shared_ptr<nn::AdaptiveAvgPool2d>>(
      nn_mod, "AdaptiveAvgPool2d", py::dynamic_attr())
      .def(py::init(
               [](py::object size) { return std::make_shared<nn::AdaptiveAvgPool2d>(int2(size)); }),
           py::arg("output_size"));
  py::class_<nn::Flatten, Module, std::shared_ptr<nn::Flatten>>(nn_mod, "Flatten",
                                                                py::dynamic_attr())
      .def(py::init([](int64_t s, int64_t e) { return std::make_shared<nn::Flatten>(s, e); }),
           py::arg("start_dim") = 1, py::arg("end_dim") = -1);
  py::class_<nn::Identity, Module, std::shared_ptr<nn::Identity>>(nn_mod, "Identity",
                                                                  py::dynamic_attr())
      .def(py::init([]() { return std::make_shared<nn::Identity>(); }));
  bind_batch_norm<nn::BatchNorm1d>(nn_mod, "BatchNorm1d");
  bind_batch_norm<nn::BatchNorm2d>(nn_mod, "BatchNorm2d");
  py::class_<nn::LayerNorm, Module, std::shared_ptr<nn::LayerNorm>>(nn_mod, "LayerNorm",
                                                                    py::dynamic_attr())
      .def(py::init([](py::object shape, double eps, bool affine, bool bias) {
             Shape s = py::isinstance<py::int_>(shape) ? Shape{shape.cast<int64_t>()}
                                                       : shape.cast<Shape>();
             return std::make_shared<nn::LayerNorm>(s, eps, affine, bias);
           }),
           py::arg("normalized_shape"), py::arg("eps") = 1e-5, py::arg("elementwise_affine") = true,
           py::arg("bias") = true)
      .def_readwrite("autocast_output", &nn::LayerNorm::autocast_output,
                     "Under autocast, write the output in the autocast dtype (the next Linear's "
                     "cast, fused); off by default");
  py::class_<nn::CrossEntropyLoss, Module, std::shared_ptr<nn::CrossEntropyLoss>>(
      nn_mod, "CrossEntropyLoss", py::dynamic_attr())
      .def(py::init([](int64_t ignore_index, const std::string& reduction, double smoothing) {
             return std::make_shared<nn::CrossEntropyLoss>(ignore_index, reduction, smoothing);
           }),
           py::arg("ignore_index") = -100, py::arg("reduction") = "mean",
           py::arg("label_smoothing") = 0.0)
      .def("__call__", [](nn::CrossEntropyLoss& l, const Tensor& input, const Tensor& target) {
        const ForwardPhase phase;
        return l(input, target);
      });

  def_list_methods(py::class_<nn::Sequential, Module, std::shared_ptr<nn::Sequential>>(
                       nn_mod, "Sequential", py::dynamic_attr())
                       .def(py::init([](py::args modules) {
                              auto s = std::make_shared<nn::Sequential>();
                              for (py::handle h : modules) s->push_back(h.cast<ModulePtr>());
                              return s;
                            }),
                            py::keep_alive<1, 2>()),
                   "Sequential");
  def_list_methods(py::class_<nn::ModuleList, Module, std::shared_ptr<nn::ModuleList>>(
                       nn_mod, "ModuleList", py::dynamic_attr())
                       .def(py::init([](py::object modules) {
                              auto l = std::make_shared<nn::ModuleList>();
                              if (!modules.is_none())
                                for (py::handle h : modules) l->push_back(h.cast<ModulePtr>());
                              return l;
                            }),
                            py::arg("modules") = py::none(), py::keep_alive<1, 2>()),
                   "ModuleList");
  py::class_<nn::ModuleDict, Module, std::shared_ptr<nn::ModuleDict>>(nn_mod, "ModuleDict",
                                                                      py::dynamic_attr())
      .def(py::init([](py::object modules) {
             auto d = std::make_shared<nn::ModuleDict>();
             if (!modules.is_none())
               for (auto item :
                    mapping_arg(modules, "ModuleDict", "a dict (or pairs) of name -> Module"))
                 d->insert(py::str(item.first), item.second.cast<ModulePtr>());
             return d;
           }),
           py::arg("modules") = py::none(), py::keep_alive<1, 2>())
      .def(
          "__setitem__",
          [](nn::ModuleDict& d, const std::string& k, ModulePtr mod) {
            d.insert(k, std::move(mod));
          },
          py::keep_alive<1, 3>())
      .def("__getitem__", [](const nn::ModuleDict& d, const std::string& k) { return d[k]; })
      .def("__contains__", &nn::ModuleDict::contains)
      .def("__len__", &nn::ModuleDict::size)
      .def("keys", &nn::ModuleDict::keys)
      .def("items", &nn::ModuleDict::items)
      .def("__iter__", [](const nn::ModuleDict& d) { return py::iter(py::cast(d.keys())); });

  // ---- models ----
  py::class_<nn::StagedModule, Module, std::shared_ptr<nn::StagedModule>>(nn_mod, "StagedModule",
                                                                          py::dynamic_attr())
      .def_readwrite("checkpoint_segments", &nn::StagedModule::checkpoint_segments);
  py::class_<nn::BasicBlock, Module, std::shared_ptr<nn::BasicBlock>>(nn_mod, "BasicBlock",
                                                                      py::dynamic_attr());
  py::class_<nn::Bottleneck, Module, std::shared_ptr<nn::Bottleneck>>(nn_mod, "Bottleneck",
                                                                      py::dynamic_attr());
  py::class_<nn::ResNet, nn::StagedModule, std::shared_ptr<nn::ResNet>>(nn_mod, "ResNet",
                                                                        py::dynamic_attr());
  py::class_<nn::ResNetTiny, nn::StagedModule, std::shared_ptr<nn::ResNetTiny>>(
      nn_mod, "ResNetTiny", py::dynamic_attr());
  auto resnet_factory = [&](const char* name, auto fn, int64_t classes, int64_t channels) {
    nn_mod.def(
        name,
        [fn](int64_t num_classes, int64_t in_channels, bool zero_init_residual) {
          return fn(resnet_options(num_classes, in_channels, zero_init_residual));
        },
        py::arg("num_classes") = classes, py::arg("in_channels") = channels,
        py::arg("zero_init_residual") = false);
  };
  resnet_factory(
      "resnet18", [](nn::ResNetOptions o) { return nn::resnet18(o); }, 1000, 3);
  resnet_factory(
      "resnet34", [](nn::ResNetOptions o) { return nn::resnet34(o); }, 1000, 3);
  resnet_factory(
      "resnet50", [](nn::ResNetOptions o) { return nn::resnet50(o); }, 1000, 3);
  resnet_factory(
      "resnet101", [](nn::ResNetOptions o) { return nn::resnet101(o); }, 1000, 3);
  resnet_factory(
      "resnet_tiny", [](nn::ResNetOptions o) { return nn::resnet_tiny(o); }, 10, 1);
  nn_mod.def(
      "resnet",
      [](const std::string& arch, int64_t num_classes, int64_t in_channels) {
        return nn::resnet_by_name(arch, resnet_options(num_classes, in_channels, false));
      },
      py::arg("arch"), py::arg("num_classes") = 1000, py::arg("in_channels") = 3,
      "The ResNet called `arch`: tiny, resnet18, resnet34, resnet50 or resnet101");

  py::class_<nn::GPTConfig>(nn_mod, "GPTConfig", "nanoGPT's GPTConfig")
      .def(py::init([](py::kwargs kw) {
        nn::GPTConfig c;
        set_fields(c, kw, "GPTConfig");
        return c;
      }))
      .def_static(
          "preset",
          [](const std::string& name, py::kwargs kw) {
            nn::GPTConfig c = nn::GPTConfig::preset(name);
            set_fields(c, kw, "GPTConfig");
            return c;
          },
          py::arg("name"),
          "gpt2, gpt2-medium, gpt2-large, gpt2-xl, tiny or small, fields overridden by keywords")
      .def_readwrite("vocab_size", &nn::GPTConfig::vocab_size)
      .def_readwrite("block_size", &nn::GPTConfig::block_size)
      .def_readwrite("n_layer", &nn::GPTConfig::n_layer)
      .def_readwrite("n_head", &nn::GPTConfig::n_head)
      .def_readwrite("n_embd", &nn::GPTConfig::n_embd)
      .def_readwrite("dropout", &nn::GPTConfig::dropout)
      .def_readwrite("bias", &nn::GPTConfig::bias)
      .def_readwrite("fused_classifier", &nn::GPTConfig::fused_classifier)
      .def_readwrite("fused_mlp", &nn::GPTConfig::fused_mlp)
      .def_readwrite("fused_add_norm", &nn::GPTConfig::fused_add_norm)
      .def_readwrite("fused_classifier_chunk_bytes", &nn::GPTConfig::fused_classifier_chunk_bytes)
      .def_readwrite("classifier_pad_multiple", &nn::GPTConfig::classifier_pad_multiple)
      .def("__repr__", [](const nn::GPTConfig& c) {
        return "GPTConfig(vocab_size=" + std::to_string(c.vocab_size) +
               ", block_size=" + std::to_string(c.block_size) +
               ", n_layer=" + std::to_string(c.n_layer) + ", n_head=" + std::to_string(c.n_head) +
               ", n_embd=" + std::to_string(c.n_embd) + ")";
      });
  py::class_<nn::CausalSelfAttention, Module, std::shared_ptr<nn::CausalSelfAttention>>(
      nn_mod, "CausalSelfAttention", py::dynamic_attr());
  py::class_<nn::MLP, Module, std::shared_ptr<nn::MLP>>(nn_mod, "MLP", py::dynamic_attr());
  py::class_<nn::Block, Module, std::shared_ptr<nn::Block>>(nn_mod, "Block", py::dynamic_attr());
  py::class_<nn::GPTTransformer, nn::StagedModule, std::shared_ptr<nn::GPTTransformer>>(
      nn_mod, "GPTTransformer", py::dynamic_attr());
  py::class_<nn::GPT, Module, std::shared_ptr<nn::GPT>>(nn_mod, "GPT", py::dynamic_attr())
      .def(py::init([](py::object config) {
             nn::GPTConfig c = py::isinstance<py::str>(config)
                                   ? nn::GPTConfig::preset(config.cast<std::string>())
                                   : config.cast<nn::GPTConfig>();
             return std::make_shared<nn::GPT>(c);
           }),
           py::arg("config"))
      .def(
          "__call__",
          [](nn::GPT& g, const Tensor& idx, std::optional<Tensor> targets) {
            const ForwardPhase phase;
            auto [logits, loss] = g(idx, targets.value_or(Tensor()));
            return py::make_tuple(tensor_or_none(logits), tensor_or_none(loss));
          },
          py::arg("idx"), py::arg("targets") = py::none(),
          "(logits, loss): loss is None without targets")
      .def_readonly("config", &nn::GPT::config)
      .def("get_num_params", &nn::GPT::get_num_params, py::arg("non_embedding") = true);

  // ---- checkpointing ----
  nn_mod.def(
      "enable_checkpointing",
      [](Module& model, py::object spec, int every, bool selective) {
        nn::enable_checkpointing(model, checkpoint_spec_arg(spec, every, selective));
      },
      py::arg("model"), py::arg("spec"), py::kw_only(), py::arg("every") = 1,
      py::arg("selective") = false,
      "Checkpoint a model: spec is none, blocks, N-blocks, N-segments, selective, type:TYPE or "
      "name:GLOB (optionally /K, +selective), or check_fn(name, module) -> bool (FSDP's "
      "apply_activation_checkpointing); every=K keeps every K-th module check_fn selects");
  nn_mod.def("checkpoint_block_count", &nn::checkpoint_block_count, py::arg("model"));

  nn_mod.def(
      "save_safetensors",
      [](const std::string& path, py::object tensors) {
        nn::NamedTensors ts;
        if (py::isinstance<Module>(tensors)) {
          ts = tensors.cast<Module&>().state_dict();
        } else {
          for (auto item :
               mapping_arg(tensors, "save_safetensors", "a Module or a dict of name -> Tensor"))
            ts.emplace_back(py::str(item.first), to_tensor(item.second));
        }
        nn::save_safetensors(path, ts);
      },
      py::arg("path"), py::arg("tensors"), "A module's state_dict or a dict of tensors");
  nn_mod.def(
      "load_safetensors",
      [](const std::string& path) {
        py::dict d;
        for (const auto& [n, t] : nn::load_safetensors(path)) d[py::str(n)] = t;
        return d;
      },
      py::arg("path"));

  // ---- activation offload ----
  // The link policy's choice as a dict (its "summary" is the line train_* prints).
  const auto choice_dict = [](const nn::LinkOffloadChoice& c) {
    py::dict d;
    d["modules"] = c.modules;
    d["bytes"] = c.bytes;
    d["candidate_bytes"] = c.candidate_bytes;
    d["candidates"] = c.candidates;
    d["link_bytes_per_second"] = c.link_bytes_per_second;
    d["forward_seconds"] = c.forward_seconds;
    d["margin"] = c.margin;
    d["forward_saved_bytes"] = c.forward_saved_bytes;
    d["prefetch_lead"] = c.prefetch_lead;
    d["summary"] = c.str();
    return d;
  };
  py::class_<ActivationOffloader, std::shared_ptr<ActivationOffloader>>(
      nn_mod, "ActivationOffloader",
      "Where offloaded activations go; stats() says what moved; link_choice (\"link\" only) "
      "what the link policy chose and why",
      py::dynamic_attr())
      .def("stats", [](const ActivationOffloader& o) {
        const OffloadStats s = o.stats();
        py::dict d;
        d["tensors_offloaded"] = s.tensors_offloaded;
        d["bytes_offloaded"] = s.bytes_offloaded;
        d["tensors_kept"] = s.tensors_kept;
        d["tensors_in_place"] = s.tensors_in_place;
        d["copy_waits"] = s.copy_waits;
        d["tensors_deduplicated"] = s.tensors_deduplicated;
        d["tensors_prefetched"] = s.tensors_prefetched;
        d["tensors_fetched"] = s.tensors_fetched;
        d["groups"] = s.groups;
        d["groups_held"] = s.groups_held;
        return d;
      });
  nn_mod.def(
      "offload_activations",
      [choice_dict](Module& model, py::object spec, bool pin_memory, size_t min_bytes,
                    bool prefetch, int every, py::object forward) {
        OffloadOptions o;
        o.pin_memory = pin_memory;
        o.min_bytes = min_bytes;
        o.prefetch = prefetch;
        nn::OffloadSpec s;
        if (py::isinstance<py::str>(spec)) {
          s = nn::parse_offload_spec(spec.cast<std::string>());
        } else {
          s.kind = nn::OffloadSpec::Kind::modules;
          s.modules = selector_of(spec, every);
        }
        std::function<void()> fwd;
        if (!forward.is_none()) fwd = [forward] { forward(); };
        nn::LinkOffloadChoice choice;
        auto off = nn::offload_activations(model, s, o, fwd, &choice);
        py::object r = py::cast(off);
        if (off && s.kind == nn::OffloadSpec::Kind::link)
          r.attr("link_choice") = choice_dict(choice);
        return r;
      },
      py::arg("model"), py::arg("spec"), py::kw_only(), py::arg("pin_memory") = true,
      py::arg("min_bytes") = 0, py::arg("prefetch") = true, py::arg("every") = 1,
      py::arg("forward") = py::none(),
      "--offload's plans (none, activations, N-blocks) on a ResNet or GPT, or a module policy on "
      "any model (type:TYPE, name:GLOB, optionally /K, or check_fn(name, module) -> bool): the "
      "modules' saved activations go to host memory, tagged `offloaded`; returns the offloader "
      "(None for none). \"link\" offloads what the host link carries within the forward: "
      "forward() (one forward of the step, no arguments) is run once to measure it; the "
      "offloader's link_choice says what was chosen (None when nothing fits: "
      "choose_link_offload says why)");
  nn_mod.def(
      "choose_link_offload",
      [choice_dict](Module& model, py::object forward, std::optional<double> link_bytes_per_second,
                    double margin) {
        if (link_bytes_per_second && !(*link_bytes_per_second > 0))
          throw py::value_error(
              fmt::format("choose_link_offload: link_bytes_per_second must be positive, got {}",
                          *link_bytes_per_second));
        return choice_dict(nn::link_offload_choice(
            model, [forward] { forward(); }, link_bytes_per_second.value_or(0), margin));
      },
      py::arg("model"), py::arg("forward"), py::kw_only(),
      py::arg("link_bytes_per_second") = py::none(), py::arg("margin") = nn::kLinkOffloadMargin,
      "What offload_activations(model, \"link\", forward=forward) would offload, and why, without "
      "applying it: forward() is run once (what each module saves, the forward's time); the "
      "link's speed is the measured one (tensor/host_link.h) unless given");
  // `with tally.autograd.graph.save_on_cpu():` tensors saved inside go to host memory.
  py::module_ graph = m.attr("autograd")
                          .cast<py::module_>()
                          .def_submodule("graph", "torch.autograd.graph: save_on_cpu");
  py::class_<SaveOnCpuScope>(graph, "save_on_cpu",
                             "A scope whose saved tensors are kept in (pinned) host memory")
      .def(py::init<bool>(), py::arg("pin_memory") = true)
      .def("__enter__", &SaveOnCpuScope::enter, py::return_value_policy::reference_internal)
      .def("__exit__", [](SaveOnCpuScope& s, py::args) { s.exit(); })
      .def_property_readonly("offloader", &SaveOnCpuScope::offloader);

  py::module_ utils = m.def_submodule("utils", "torch.utils");
  py::module_ ckpt = utils.def_submodule("checkpoint", "torch.utils.checkpoint");
  // torch.utils.checkpoint.set_checkpoint_early_stop: a context manager over whether the
  // segments checkpointed inside it stop their recompute once backward has all it needs
  // (nn/checkpoint.h; on by default). Python state, so the GIL guards it.
  struct EarlyStopSetting {
    bool enable = true, prev = true;
  };
  static bool early_stop = true;
  py::class_<EarlyStopSetting>(ckpt, "set_checkpoint_early_stop",
                               "with set_checkpoint_early_stop(False): the recomputes of the "
                               "segments checkpointed inside run the whole segment again")
      .def(py::init([](bool enable) {
             return EarlyStopSetting{enable, early_stop};
           }),
           py::arg("enable"))
      .def("__enter__",
           [](EarlyStopSetting& s) {
             s.prev = early_stop;
             early_stop = s.enable;
           })
      .def("__exit__", [](EarlyStopSetting& s, py::args) { early_stop = s.prev; });
  ckpt.def(
      "checkpoint",
      [](py::function fn, py::args inputs, bool preserve_rng_state) {
        TensorList in;
        for (py::handle h : inputs) in.push_back(h.cast<Tensor>());
        nn::CheckpointOptions o;
        o.preserve_rng_state = preserve_rng_state;
        o.early_stop = early_stop;
        return nn::checkpoint(
            [fn](const TensorList& xs) {
              py::tuple args(xs.size());
              for (size_t i = 0; i < xs.size(); ++i) args[i] = py::cast(xs[i]);
              return fn(*args).cast<Tensor>();
            },
            in, o);
      },
      py::arg("function"), py::kw_only(), py::arg("preserve_rng_state") = true,
      "Runs function(*inputs) keeping nothing for backward; backward recomputes it");
  ckpt.def(
      "checkpoint_sequential",
      [](py::object functions, int segments, const Tensor& input) {
        std::vector<std::function<Tensor(const Tensor&)>> stages;
        if (py::isinstance<nn::Sequential>(functions)) {
          for (auto& c : functions.cast<nn::Sequential&>().children())
            stages.push_back(stage_of(py::cast(c)));
        } else {
          for (py::handle f : functions) stages.push_back(stage_of(f));
        }
        nn::CheckpointOptions o;
        o.early_stop = early_stop;
        return nn::checkpoint_sequential(std::move(stages), segments, input, o);
      },
      py::arg("functions"), py::arg("segments"), py::arg("input"));
  ckpt.def("checkpoint_stats", []() {
    const nn::CheckpointStats s = nn::checkpoint_stats();
    py::dict d;
    d["segments"] = s.segments;
    d["recomputations"] = s.recomputations;
    d["tensors_dropped"] = s.tensors_dropped;
    d["tensors_kept"] = s.tensors_kept;
    d["tensors_recomputed"] = s.tensors_recomputed;
    d["early_stops"] = s.early_stops;
    d["products_replayed"] = s.products_replayed;
    return d;
  });
  ckpt.def("reset_checkpoint_stats", &nn::reset_checkpoint_stats);
}

}  // namespace tally::python
