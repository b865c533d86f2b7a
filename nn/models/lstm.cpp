// The LSTM language model (nn/models/lstm.h) and its registry entry.
#include "nn/models/lstm.h"

#include <fmt/format.h>

#include "autograd/ops.h"
#include "nn/init.h"

namespace tally::nn {

LSTMLMConfig LSTMLMConfig::preset(const std::string& name) {
  LSTMLMConfig c;
  if (name == "tiny") {
    c.vocab_size = 256;
    c.emb_size = 64;
    c.hidden_size = 64;
    c.num_layers = 2;
    c.seq_len = 32;
  } else if (name != "medium") {
    throw std::invalid_argument(
        fmt::format("LSTMLMConfig: unknown preset '{}' (tiny | medium)", name));
  }
  return c;
}

LSTMLM::LSTMLM(const LSTMLMConfig& cfg) : Module("LSTMLM"), config(cfg) {
  encoder = register_module("encoder", std::make_shared<Embedding>(cfg.vocab_size, cfg.emb_size));
  drop = register_module("drop", std::make_shared<Dropout>(cfg.dropout));
  rnn = register_module("rnn", std::make_shared<LSTM>(cfg.emb_size, cfg.hidden_size, cfg.num_layers,
                                                      true, true, cfg.dropout));
  decoder = register_module("decoder", std::make_shared<Linear>(cfg.hidden_size, cfg.vocab_size));
  if (!SkipInitGuard::active()) init_weights();
}

void LSTMLM::init_weights() {
  init::uniform_(encoder->weight, -0.1, 0.1);
  init::zeros_(decoder->bias);
  init::uniform_(decoder->weight, -0.1, 0.1);
}

Tensor LSTMLM::forward(const Tensor& tokens) {
  if (tokens.dim() != 2)
    throw std::invalid_argument(
        fmt::format("LSTMLM: expected token ids [batch, seq], got {}", tokens.shape_string()));
  const Tensor emb = (*drop)((*encoder)(tokens));
  const Tensor out = (*drop)((*rnn)(emb).first);
  return (*decoder)(out);
}

ModelEntry lstm_entry() {
  ModelEntry e;
  e.name = "lstm";
  set_presets(e, "PyTorch's word_language_model LSTM", {"tiny", "medium"});
  e.input = ModelEntry::Input::tokens;
  e.context = [](const std::string& p) { return LSTMLMConfig::preset(p).seq_len; };
  e.build = [](const ModelOptions& o) -> std::shared_ptr<Module> {
    return std::make_shared<LSTMLM>(LSTMLMConfig::preset(o.preset));
  };
  e.synthetic_batch = [](const ModelOptions& o, int64_t batch, int64_t step, uint64_t seed) {
    return synthetic_token_batch(LSTMLMConfig::preset(o.preset).vocab_size, o, batch, step, seed);
  };
  e.loss = [](Module& m, const data::Example& b) {
    const Tensor logits = m(b.input);
    return cross_entropy(logits.reshape({-1, logits.size(-1)}), b.target.reshape({-1}));
  };
  return e;
}

}  // namespace tally::nn
