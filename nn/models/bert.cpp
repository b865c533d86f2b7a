// The BERT-style masked language model over nn::TransformerEncoder.
#include "nn/models/bert.h"

#include <fmt/format.h>

#include <stdexcept>

#include "nn/init.h"
#include "nn/models/preset.h"
#include "tensor/softmax/autograd.h"

namespace tally::nn {

BertConfig BertConfig::preset(const std::string& name) {
  return preset_of<BertConfig>("BertConfig::preset", name, "tiny, bert-base, bert-large",
                               {{"bert-base", [](BertConfig&) {}},
                                {"bert-large",
                                 [](BertConfig& c) {
                                   c.hidden_size = 1024, c.num_hidden_layers = 24,
                                   c.num_attention_heads = 16;
                                   c.intermediate_size = 4096;
                                 }},
                                {"tiny", [](BertConfig& c) {
                                   c.vocab_size = 256, c.hidden_size = 64, c.num_hidden_layers = 2,
                                   c.num_attention_heads = 2;
                                   c.intermediate_size = 128, c.max_position_embeddings = 32;
                                 }}});
}

BertEmbeddings::BertEmbeddings(const BertConfig& cfg) : Module("BertEmbeddings") {
  const int64_t h = cfg.hidden_size;
  word_embeddings =
      register_module("word_embeddings", std::make_shared<Embedding>(cfg.vocab_size, h));
  position_embeddings = register_module(
      "position_embeddings", std::make_shared<Embedding>(cfg.max_position_embeddings, h));
  token_type_embeddings =
      register_module("token_type_embeddings", std::make_shared<Embedding>(cfg.type_vocab_size, h));
  LayerNorm = register_module("LayerNorm", std::make_shared<nn::LayerNorm>(h, cfg.layer_norm_eps));
  dropout = register_module("dropout", std::make_shared<Dropout>(cfg.dropout));
  if (!SkipInitGuard::active())
    for (const auto& e : {word_embeddings, position_embeddings, token_type_embeddings})
      init::normal_(e->weight, 0.0, 0.02);
}

Tensor BertEmbeddings::forward(const Tensor& ids, const Tensor& token_type_ids) {
  const int64_t max_pos = position_embeddings->num_embeddings;
  if (ids.dim() != 2 || ids.size(1) > max_pos)
    throw std::invalid_argument(fmt::format(
        "BertEmbeddings: input_ids must be [B, T] with T <= max_position_embeddings ({}), got {}",
        max_pos, ids.shape_string()));
  const int64_t T = ids.size(1);
  const Tensor pos = ops::arange(0, static_cast<double>(T), 1, DType::int64, ids.device());
  const Tensor types = token_type_ids.defined()
                           ? token_type_ids
                           : ops::zeros(ids.sizes(), DType::int64, ids.device());
  Tensor x = add((*word_embeddings)(ids), (*token_type_embeddings)(types));
  x = add(x, (*position_embeddings)(pos));
  return (*dropout)((*LayerNorm)(x));
}

BertMLMHead::BertMLMHead(const BertConfig& cfg) : Module("BertMLMHead") {
  const int64_t h = cfg.hidden_size;
  dense = register_module("dense", std::make_shared<Linear>(h, h));
  layer_norm =
      register_module("layer_norm", std::make_shared<nn::LayerNorm>(h, cfg.layer_norm_eps));
  decoder = register_module("decoder", std::make_shared<Linear>(h, cfg.vocab_size));
  if (!SkipInitGuard::active()) {
    init::normal_(dense->weight, 0.0, 0.02);
    init::zeros_(dense->bias);
    init::zeros_(decoder->bias);
  }
}

Tensor BertMLMHead::forward(const Tensor& x) {
  return (*decoder)((*layer_norm)(gelu((*dense)(x))));
}

Bert::Bert(const BertConfig& cfg) : Module("Bert"), config(cfg) {
  embeddings = register_module("embeddings", std::make_shared<BertEmbeddings>(cfg));
  {
    const TransformerEncoderLayer layer(cfg.hidden_size, cfg.num_attention_heads,
                                        cfg.intermediate_size, cfg.dropout, "gelu",
                                        cfg.layer_norm_eps, /*batch_first=*/true);
    encoder = register_module("encoder",
                              std::make_shared<TransformerEncoder>(layer, cfg.num_hidden_layers));
  }
  mlm_head = register_module("mlm_head", std::make_shared<BertMLMHead>(cfg));
  // Weight tying: the decoder's weight is the word embedding (one Tensor).
  mlm_head->decoder->weight = embeddings->word_embeddings->weight;
  mlm_head->decoder->register_parameter("weight", mlm_head->decoder->weight);
}

Tensor Bert::forward(const Tensor& ids, const Tensor& token_type_ids,
                     const Tensor& attention_mask) {
  const Tensor x = embeddings->call([&] { return embeddings->forward(ids, token_type_ids); });
  Tensor padding;  // True where a key is padding (PyTorch's src_key_padding_mask)
  if (attention_mask.defined())
    padding = ops::binary_scalar(ops::BinaryOp::eq, attention_mask, 0.0);
  const Tensor h = padding.defined() ? (*encoder)(x, {}, padding) : (*encoder)(x);
  return (*mlm_head)(h);
}

ModelEntry bert_entry() {
  ModelEntry e;
  e.name = "bert";
  set_presets(e, "a BERT-style masked language model on TransformerEncoder",
              {"tiny", "bert-base", "bert-large"});
  e.input = ModelEntry::Input::tokens;
  e.context = [](const std::string& p) { return BertConfig::preset(p).max_position_embeddings; };
  e.build = [](const ModelOptions& o) -> std::shared_ptr<Module> {
    return std::make_shared<Bert>(BertConfig::preset(o.preset));
  };
  e.synthetic_batch = [](const ModelOptions& o, int64_t batch, int64_t step, uint64_t seed) {
    const BertConfig cfg = BertConfig::preset(o.preset);
    const data::Example tokens = synthetic_token_batch(cfg.vocab_size, o, batch, step, seed);
    std::vector<double> input = ops::to_vector(tokens.input), target(input.size(), -100.0);
    const int64_t T = o.seq;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < T; ++t)
        if ((b + 3 * t + step) % 7 == 0 || (T < 7 && t == 0)) {
          const auto i = static_cast<size_t>(b * T + t);
          target[i] = input[i];
          input[i] = static_cast<double>(cfg.mask_token_id % cfg.vocab_size);
        }
    return data::Example{ops::from_vector(input, {batch, T}, DType::int64),
                         ops::from_vector(target, {batch, T}, DType::int64)};
  };
  e.loss = [](Module& m, const data::Example& b) {
    const Tensor logits = m(b.input);
    return cross_entropy(logits.reshape({-1, logits.size(-1)}), b.target.reshape({-1}));
  };
  return e;
}

}  // namespace tally::nn
