// An LSTM language model, PyTorch's word_language_model example (RNNModel with rnn_type
// "LSTM"): encoder (Embedding) -> drop -> rnn (LSTM, num_layers, dropout between layers)
// -> drop -> decoder (Linear to the vocabulary), with its module and parameter names, so
// state dicts load either way. Input [B, T] token ids (batch-first, the registry's layout:
// the LSTM runs with batch_first, the same computation as the example's [T, B]); logits
// [B, T, vocab].
#pragma once

#include <memory>
#include <string>

#include "nn/layers.h"
#include "nn/models/registry.h"
#include "nn/rnn.h"

namespace tally::nn {

struct LSTMLMConfig {
  int64_t vocab_size = 10000;  // ntoken
  int64_t emb_size = 650;      // ninp
  int64_t hidden_size = 650;   // nhid
  int64_t num_layers = 2;      // nlayers
  int64_t seq_len = 35;        // bptt: the registry's default context
  // The example's dropout (embeddings, between LSTM layers, outputs). The presets keep 0 so
  // that one training step is deterministic (the PyTorch comparison); Zaremba's medium
  // model trains with 0.5.
  double dropout = 0.0;
  // "tiny" (vocab 256, 64/64, 2 layers, seq 32) | "medium" (Zaremba et al.'s medium PTB
  // model: vocab 10000, 650/650, 2 layers, seq 35).
  static LSTMLMConfig preset(const std::string& name);
};

class LSTMLM : public Module {
 public:
  explicit LSTMLM(const LSTMLMConfig& cfg);
  // Logits [B, T, vocab] of token ids [B, T].
  Tensor forward(const Tensor& tokens) override;
  // The example's init_weights: encoder and decoder weights U(-0.1, 0.1), decoder bias 0.
  void init_weights();

  LSTMLMConfig config;
  std::shared_ptr<Embedding> encoder;
  std::shared_ptr<Dropout> drop;
  std::shared_ptr<LSTM> rnn;
  std::shared_ptr<Linear> decoder;
};

// The registry's "lstm" entry (nn/models/registry.h).
ModelEntry lstm_entry();

}  // namespace tally::nn
