// A BERT-style encoder for masked language modelling, built on nn::TransformerEncoder: token,
// position and token-type embeddings summed and normalised (embeddings.*), num_hidden_layers
// post-norm GELU TransformerEncoderLayers (encoder.layers.N.*, PyTorch's names), and an MLM
// head (mlm_head.dense -> GELU -> mlm_head.layer_norm -> mlm_head.decoder) whose decoder weight
// IS the word embedding (tied, as BERT's; listed once, under embeddings.word_embeddings.weight)
// with a bias of its own. Initialisation: BERT's N(0, 0.02) for the embeddings and the head's
// dense layer, zero head biases; the encoder layers keep PyTorch's TransformerEncoderLayer
// initialisation. bench/models/bert.py is the same model in PyTorch.
#pragma once

#include <memory>
#include <string>

#include "nn/layers.h"
#include "nn/models/registry.h"
#include "nn/norm.h"
#include "nn/transformer.h"

namespace tally::nn {

struct BertConfig {
  int64_t vocab_size = 30522;
  int64_t hidden_size = 768;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t intermediate_size = 3072;
  int64_t max_position_embeddings = 512;
  int64_t type_vocab_size = 2;
  double layer_norm_eps = 1e-12;
  // BERT trains with 0.1; the presets use 0 so that a step is deterministic (the equivalence
  // check and the memory predictions replay it), as GPT's presets do.
  double dropout = 0.0;
  int64_t mask_token_id = 103;  // [MASK] in BERT's vocabulary

  // "tiny" (vocab 256, hidden 64, 2 layers, 2 heads, intermediate 128, 32 positions),
  // "bert-base" (BERT-base's shapes, 110M parameters), "bert-large".
  static BertConfig preset(const std::string& name);
};

class BertEmbeddings : public Module {
 public:
  explicit BertEmbeddings(const BertConfig& cfg);
  // input_ids [B, T] -> [B, T, hidden]; token_type_ids undefined: all zeros.
  Tensor forward(const Tensor& input_ids, const Tensor& token_type_ids);
  Tensor forward(const Tensor& input_ids) override { return forward(input_ids, {}); }
  std::shared_ptr<Embedding> word_embeddings, position_embeddings, token_type_embeddings;
  std::shared_ptr<nn::LayerNorm> LayerNorm;  // HuggingFace's name
  std::shared_ptr<Dropout> dropout;
};

class BertMLMHead : public Module {
 public:
  explicit BertMLMHead(const BertConfig& cfg);
  Tensor forward(const Tensor& x) override;  // [B, T, hidden] -> logits [B, T, vocab]
  std::shared_ptr<Linear> dense, decoder;
  std::shared_ptr<nn::LayerNorm> layer_norm;
};

class Bert : public Module {
 public:
  explicit Bert(const BertConfig& cfg);
  // input_ids [B, T] -> MLM logits [B, T, vocab]. attention_mask [B, T]: 1 (or true) for real
  // tokens, 0 for padding (HuggingFace's convention), undefined: no padding.
  Tensor forward(const Tensor& input_ids, const Tensor& token_type_ids,
                 const Tensor& attention_mask);
  Tensor forward(const Tensor& input_ids) override { return forward(input_ids, {}, {}); }
  BertConfig config;
  std::shared_ptr<BertEmbeddings> embeddings;
  std::shared_ptr<TransformerEncoder> encoder;
  std::shared_ptr<BertMLMHead> mlm_head;
};

// The registry's "bert": presets tiny | bert-base | bert-large. Its synthetic batch is masked
// language modelling: about one token in seven (position t of row b at step s where
// (b + 3t + s) % 7 == 0; with fewer than 7 tokens also t == 0) is replaced by [MASK] in the input,
// and the target is the original token there and -100 (ignored) elsewhere; the loss is
// cross-entropy over the masked tokens.
ModelEntry bert_entry();

}  // namespace tally::nn
