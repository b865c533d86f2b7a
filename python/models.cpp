// The registry's reference models as Python classes, beside tally.nn.GPT and the ResNets:
// tally.nn.LlamaForCausalLM, VisionTransformer, Bert, UNet and LSTMLM, each built from its
// config class (LlamaConfig, ...: the C++ fields, a preset by name, fields overridden by
// keywords) or a preset's name, and called as the PyTorch reference is
// (bench/models/NAME.py).
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <utility>

#include "common.h"
#include "nn/models/bert.h"
#include "nn/models/llama.h"
#include "nn/models/lstm.h"
#include "nn/models/unet.h"
#include "nn/models/vit.h"

namespace tally::python {

namespace {

// A config class: keyword construction, preset(name, **overrides), the fields (added by the
// caller) and a repr listing them.
template <typename C>
py::class_<C> config_class(py::module_& nn, const char* name, const char* presets) {
  py::class_<C> c(nn, name);
  c.def(py::init([name](py::kwargs kw) {
     C cfg;
     set_fields(cfg, kw, name);
     return cfg;
   }))
      .def_static(
          "preset",
          [name](const std::string& preset, py::kwargs kw) {
            C cfg = C::preset(preset);
            set_fields(cfg, kw, name);
            return cfg;
          },
          py::arg("name"), presets);
  return c;
}

// The config from a preset's name or a config object.
template <typename C>
C config_of(const py::object& config) {
  return py::isinstance<py::str>(config) ? C::preset(config.cast<std::string>()) : config.cast<C>();
}

// __repr__ from the fields listed: "Name(a=1, b=2)".
template <typename C>
void add_repr(py::class_<C>& c, const char* name, std::vector<std::string> fields) {
  c.def("__repr__", [name, fields](const C& cfg) {
    py::object self = py::cast(&cfg, py::return_value_policy::reference);
    std::string s = std::string(name) + "(";
    for (size_t i = 0; i < fields.size(); ++i)
      s += (i ? ", " : "") + fields[i] + "=" +
           py::repr(self.attr(fields[i].c_str())).cast<std::string>();
    return s + ")";
  });
}

}  // namespace

void bind_models(py::module_& nn_mod) {
  using nn::Module;

  // ---- LLaMA ----
  auto llama = config_class<nn::LlamaConfig>(
      nn_mod, "LlamaConfig",
      "tiny, small, 1b, 3b, 7b or 13b (HF LlamaConfig's names), fields overridden by keywords");
  llama.def_readwrite("vocab_size", &nn::LlamaConfig::vocab_size)
      .def_readwrite("hidden_size", &nn::LlamaConfig::hidden_size)
      .def_readwrite("intermediate_size", &nn::LlamaConfig::intermediate_size)
      .def_readwrite("num_hidden_layers", &nn::LlamaConfig::num_hidden_layers)
      .def_readwrite("num_attention_heads", &nn::LlamaConfig::num_attention_heads)
      .def_readwrite("num_key_value_heads", &nn::LlamaConfig::num_key_value_heads)
      .def_readwrite("max_position_embeddings", &nn::LlamaConfig::max_position_embeddings)
      .def_readwrite("rms_norm_eps", &nn::LlamaConfig::rms_norm_eps)
      .def_readwrite("rope_theta", &nn::LlamaConfig::rope_theta)
      .def_readwrite("initializer_range", &nn::LlamaConfig::initializer_range)
      .def_readwrite("tie_word_embeddings", &nn::LlamaConfig::tie_word_embeddings)
      .def_readwrite("fused_classifier", &nn::LlamaConfig::fused_classifier)
      .def_readwrite("fused_classifier_chunk_bytes", &nn::LlamaConfig::fused_classifier_chunk_bytes)
      .def_property_readonly("head_dim", &nn::LlamaConfig::head_dim);
  add_repr(llama, "LlamaConfig",
           {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings"});
  py::class_<nn::LlamaForCausalLM, Module, std::shared_ptr<nn::LlamaForCausalLM>>(
      nn_mod, "LlamaForCausalLM", py::dynamic_attr(),
      "HF's LlamaForCausalLM: model.embed_tokens, model.layers.N.{self_attn, mlp, ...}, lm_head")
      .def(py::init([](py::object config) {
             return std::make_shared<nn::LlamaForCausalLM>(config_of<nn::LlamaConfig>(config));
           }),
           py::arg("config"))
      .def(
          "__call__",
          [](nn::LlamaForCausalLM& m, const Tensor& idx, std::optional<Tensor> targets) {
            const ForwardPhase phase;
            auto [logits, loss] = m(idx, targets.value_or(Tensor()));
            return py::make_tuple(tensor_or_none(logits), tensor_or_none(loss));
          },
          py::arg("idx"), py::arg("targets") = py::none(),
          "(logits, loss) of token ids [B, T]: loss is None without targets; logits None with "
          "config.fused_classifier and targets")
      .def_readonly("config", &nn::LlamaForCausalLM::config);

  // ---- ViT ----
  auto vit = config_class<nn::ViTConfig>(
      nn_mod, "ViTConfig", "tiny, vit_b_16, vit_b_32 or vit_l_16, fields overridden by keywords");
  vit.def_readwrite("image_size", &nn::ViTConfig::image_size)
      .def_readwrite("patch_size", &nn::ViTConfig::patch_size)
      .def_readwrite("num_layers", &nn::ViTConfig::num_layers)
      .def_readwrite("num_heads", &nn::ViTConfig::num_heads)
      .def_readwrite("hidden_dim", &nn::ViTConfig::hidden_dim)
      .def_readwrite("mlp_dim", &nn::ViTConfig::mlp_dim)
      .def_readwrite("dropout", &nn::ViTConfig::dropout)
      .def_readwrite("attention_dropout", &nn::ViTConfig::attention_dropout)
      .def_readwrite("num_classes", &nn::ViTConfig::num_classes)
      .def_readwrite("in_channels", &nn::ViTConfig::in_channels);
  add_repr(vit, "ViTConfig",
           {"image_size", "patch_size", "num_layers", "num_heads", "hidden_dim", "mlp_dim",
            "num_classes"});
  py::class_<nn::VisionTransformer, Module, std::shared_ptr<nn::VisionTransformer>>(
      nn_mod, "VisionTransformer", py::dynamic_attr(),
      "torchvision's VisionTransformer (vit_b_16's names): images [N, C, H, W] -> logits")
      .def(py::init([](py::object config) {
             return std::make_shared<nn::VisionTransformer>(config_of<nn::ViTConfig>(config));
           }),
           py::arg("config"));

  // ---- BERT ----
  auto bert = config_class<nn::BertConfig>(
      nn_mod, "BertConfig", "tiny, bert-base or bert-large, fields overridden by keywords");
  bert.def_readwrite("vocab_size", &nn::BertConfig::vocab_size)
      .def_readwrite("hidden_size", &nn::BertConfig::hidden_size)
      .def_readwrite("num_hidden_layers", &nn::BertConfig::num_hidden_layers)
      .def_readwrite("num_attention_heads", &nn::BertConfig::num_attention_heads)
      .def_readwrite("intermediate_size", &nn::BertConfig::intermediate_size)
      .def_readwrite("max_position_embeddings", &nn::BertConfig::max_position_embeddings)
      .def_readwrite("type_vocab_size", &nn::BertConfig::type_vocab_size)
      .def_readwrite("layer_norm_eps", &nn::BertConfig::layer_norm_eps)
      .def_readwrite("dropout", &nn::BertConfig::dropout)
      .def_readwrite("mask_token_id", &nn::BertConfig::mask_token_id);
  add_repr(bert, "BertConfig",
           {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size", "max_position_embeddings"});
  py::class_<nn::Bert, Module, std::shared_ptr<nn::Bert>> bert_model(
      nn_mod, "Bert", py::dynamic_attr(),
      "A BERT-style encoder with its masked-language-model head: embeddings, encoder "
      "(TransformerEncoder), mlm_head");
  bert_model.def(py::init([](py::object config) {
                   return std::make_shared<nn::Bert>(config_of<nn::BertConfig>(config));
                 }),
                 py::arg("config"));
  for (const char* name : {"__call__", "forward"})
    bert_model.def(
        name,
        [](nn::Bert& m, const Tensor& input_ids, std::optional<Tensor> token_type_ids,
           std::optional<Tensor> attention_mask) {
          const ForwardPhase phase;
          return m.call([&] {
            return m.forward(input_ids, token_type_ids.value_or(Tensor()),
                             attention_mask.value_or(Tensor()));
          });
        },
        py::arg("input_ids"), py::arg("token_type_ids") = py::none(),
        py::arg("attention_mask") = py::none(),
        "MLM logits [B, T, vocab] of input_ids [B, T]; attention_mask [B, T]: 1 for real "
        "tokens, 0 for padding (HuggingFace's convention)");
  bert_model.def_readonly("config", &nn::Bert::config);

  // ---- U-Net ----
  auto unet = config_class<nn::UNetConfig>(nn_mod, "UNetConfig",
                                           "tiny or ddpm-cifar, fields overridden by keywords");
  unet.def_readwrite("in_channels", &nn::UNetConfig::in_channels)
      .def_readwrite("out_channels", &nn::UNetConfig::out_channels)
      .def_readwrite("resolution", &nn::UNetConfig::resolution)
      .def_readwrite("ch", &nn::UNetConfig::ch)
      .def_readwrite("ch_mult", &nn::UNetConfig::ch_mult)
      .def_readwrite("num_res_blocks", &nn::UNetConfig::num_res_blocks)
      .def_readwrite("attn_resolutions", &nn::UNetConfig::attn_resolutions)
      .def_readwrite("num_groups", &nn::UNetConfig::num_groups)
      .def_readwrite("dropout", &nn::UNetConfig::dropout);
  add_repr(unet, "UNetConfig",
           {"in_channels", "out_channels", "resolution", "ch", "ch_mult", "num_res_blocks",
            "attn_resolutions", "num_groups"});
  py::class_<nn::UNet, Module, std::shared_ptr<nn::UNet>> unet_model(
      nn_mod, "UNet", py::dynamic_attr(),
      "DDPM's diffusion U-Net: x [B, C, H, W] and timesteps t [B] -> the predicted noise");
  unet_model.def(py::init([](py::object config) {
                   return std::make_shared<nn::UNet>(config_of<nn::UNetConfig>(config));
                 }),
                 py::arg("config"));
  for (const char* name : {"__call__", "forward"})
    unet_model.def(
        name,
        [](nn::UNet& m, const Tensor& x, const Tensor& t) {
          const ForwardPhase phase;
          return m(x, t);
        },
        py::arg("x"), py::arg("t"));

  // ---- LSTM language model ----
  auto lstm = config_class<nn::LSTMLMConfig>(nn_mod, "LSTMLMConfig",
                                             "tiny or medium, fields overridden by keywords");
  lstm.def_readwrite("vocab_size", &nn::LSTMLMConfig::vocab_size)
      .def_readwrite("emb_size", &nn::LSTMLMConfig::emb_size)
      .def_readwrite("hidden_size", &nn::LSTMLMConfig::hidden_size)
      .def_readwrite("num_layers", &nn::LSTMLMConfig::num_layers)
      .def_readwrite("seq_len", &nn::LSTMLMConfig::seq_len)
      .def_readwrite("dropout", &nn::LSTMLMConfig::dropout);
  add_repr(lstm, "LSTMLMConfig",
           {"vocab_size", "emb_size", "hidden_size", "num_layers", "seq_len", "dropout"});
  py::class_<nn::LSTMLM, Module, std::shared_ptr<nn::LSTMLM>>(
      nn_mod, "LSTMLM", py::dynamic_attr(),
      "PyTorch's word_language_model RNNModel (LSTM): tokens [B, T] -> logits [B, T, vocab]")
      .def(py::init([](py::object config) {
             return std::make_shared<nn::LSTMLM>(config_of<nn::LSTMLMConfig>(config));
           }),
           py::arg("config"));
}

}  // namespace tally::python
