// Attention layers (torch.nn): MultiheadAttention, TransformerEncoderLayer, TransformerEncoder,
// with PyTorch's constructor arguments, parameter names (in_proj_weight, in_proj_bias,
// out_proj.weight; self_attn, linear1, linear2, norm1, norm2, dropout1, dropout2; layers.0 ...)
// and initialisation, composed from the differentiable ops (linear, scaled_dot_product_attention,
// softmax, layer_norm), so they run on every backend.
//
// Masks follow PyTorch's modules (not scaled_dot_product_attention): a bool attn_mask or
// key_padding_mask is True where a position may NOT be attended; a floating one is added to
// the scores. Both are merged into one floating mask, as F.multi_head_attention_forward does.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "nn/container.h"
#include "nn/layers.h"
#include "nn/norm.h"

namespace tally::nn {

// torch.nn.MultiheadAttention. With kdim == vdim == embed_dim the q, k, v projections are one
// parameter in_proj_weight [3E, E] (xavier_uniform_), else q_proj_weight [E, E],
// k_proj_weight [E, kdim], v_proj_weight [E, vdim] (each xavier_uniform_); in_proj_bias [3E]
// and out_proj.bias are zeros; out_proj.weight keeps Linear's default initialisation.
// add_bias_kv and add_zero_attn are refused (std::invalid_argument).
class MultiheadAttention : public Module {
 public:
  MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout = 0.0, bool bias = true,
                     bool add_bias_kv = false, bool add_zero_attn = false,
                     std::optional<int64_t> kdim = std::nullopt,
                     std::optional<int64_t> vdim = std::nullopt, bool batch_first = false,
                     Generator* gen = nullptr);

  // query [L, N, E] ([N, L, E] with batch_first; [L, E] unbatched), key [S, N, kdim], value
  // [S, N, vdim]; key_padding_mask [N, S] ([S] unbatched); attn_mask [L, S] or [N * heads, L, S].
  // Returns (output like query, weights): weights [N, L, S] averaged over the heads
  // (average_attn_weights) or [N, heads, L, S], undefined unless need_weights. is_causal is
  // PyTorch's hint that attn_mask is the causal mask (an attn_mask is required with it);
  // without key_padding_mask and need_weights, the causal kernel runs instead of the mask.
  std::pair<Tensor, Tensor> forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                    const Tensor& key_padding_mask = {}, bool need_weights = true,
                                    const Tensor& attn_mask = {}, bool average_attn_weights = true,
                                    bool is_causal = false);
  // The same under this module's scope (module path, the caller's line).
  std::pair<Tensor, Tensor> operator()(
      const Tensor& query, const Tensor& key, const Tensor& value,
      const Tensor& key_padding_mask = {}, bool need_weights = true, const Tensor& attn_mask = {},
      bool average_attn_weights = true, bool is_causal = false,
      const std::source_location& site = std::source_location::current()) {
    return call(
        [&] {
          return forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                         average_attn_weights, is_causal);
        },
        site);
  }
  using Module::operator();
  // Self-attention of x without weights: forward(x, x, x, {}, false).first.
  Tensor forward(const Tensor& x) override;
  void reset_parameters(Generator* gen = nullptr);
  std::string extra_repr() const override;

  int64_t embed_dim, kdim, vdim, num_heads, head_dim;
  double dropout;
  bool batch_first;
  Tensor in_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight, in_proj_bias;
  std::shared_ptr<Linear> out_proj;
};

// A bool mask (True = masked) as the floating mask PyTorch's modules use (-inf where True,
// 0 elsewhere) in `dtype`; a floating mask as it is (converted to dtype); undefined stays so.
// `what` names the argument in the error for other dtypes.
Tensor canonical_mask(const Tensor& mask, DType dtype, const char* what);

// The [sz, sz] float mask PyTorch's nn.Transformer.generate_square_subsequent_mask makes:
// -inf above the diagonal, 0 elsewhere (the causal mask is_causal describes).
Tensor generate_square_subsequent_mask(int64_t sz, DType dtype = DType::float32,
                                       Device device = Device::cpu());

// PyTorch's _detect_is_causal_mask: is_causal when given; else, with a mask, whether it equals
// generate_square_subsequent_mask(size) (a bool mask: True above the diagonal). It reads the
// mask's values (a host copy for a device mask); on the meta device, where there are none,
// a mask is not detected as causal.
bool detect_is_causal_mask(const Tensor& mask, std::optional<bool> is_causal, int64_t size);

// torch.nn.TransformerEncoderLayer: self-attention and a feed-forward block (linear1 ->
// activation -> dropout -> linear2), each with a residual connection and a LayerNorm,
// after them (post-norm) or before them (norm_first). activation "relu" | "gelu".
class TransformerEncoderLayer : public Module {
 public:
  TransformerEncoderLayer(int64_t d_model, int64_t nhead, int64_t dim_feedforward = 2048,
                          double dropout = 0.1, std::string activation = "relu",
                          double layer_norm_eps = 1e-5, bool batch_first = false,
                          bool norm_first = false, bool bias = true, Generator* gen = nullptr);
  // src [S, N, E] ([N, S, E] with batch_first); the masks as MultiheadAttention's.
  Tensor forward(const Tensor& src, const Tensor& src_mask, const Tensor& src_key_padding_mask = {},
                 bool is_causal = false);
  // Under this module's scope, and under nn::checkpoint with the masks while set_checkpoint
  // is on (as the single-tensor call).
  Tensor operator()(const Tensor& src, const Tensor& src_mask,
                    const Tensor& src_key_padding_mask = {}, bool is_causal = false,
                    const std::source_location& site = std::source_location::current()) {
    return call(
        [&] {
          return checkpointed_call(
              [this, is_causal](const TensorList& in) {
                return forward(in[0], in[1], in[2], is_causal);
              },
              {src, src_mask, src_key_padding_mask});
        },
        site);
  }
  using Module::operator();
  Tensor forward(const Tensor& src) override { return forward(src, {}, {}, false); }
  bool is_checkpoint_block() const override { return true; }
  // A deep copy (copy.deepcopy): the same configuration, parameters copied on their device
  // and dtype, the same training mode.
  std::shared_ptr<TransformerEncoderLayer> clone() const;
  std::string extra_repr() const override;

  int64_t d_model, nhead, dim_feedforward;
  double dropout_p, layer_norm_eps;
  std::string activation;
  bool batch_first, norm_first, bias;
  std::shared_ptr<MultiheadAttention> self_attn;
  std::shared_ptr<Linear> linear1, linear2;
  std::shared_ptr<Dropout> dropout, dropout1, dropout2;
  std::shared_ptr<LayerNorm> norm1, norm2;
};

// torch.nn.TransformerEncoder: num_layers deep copies of encoder_layer (layers.0, layers.1,
// ...; the layer passed in is not registered), then `norm` when given.
class TransformerEncoder : public Module {
 public:
  TransformerEncoder(const TransformerEncoderLayer& encoder_layer, int64_t num_layers,
                     std::shared_ptr<Module> norm = nullptr);
  // is_causal unset: detect_is_causal_mask(mask) decides, as in PyTorch.
  Tensor forward(const Tensor& src, const Tensor& mask, const Tensor& src_key_padding_mask = {},
                 std::optional<bool> is_causal = std::nullopt);
  Tensor operator()(const Tensor& src, const Tensor& mask, const Tensor& src_key_padding_mask = {},
                    std::optional<bool> is_causal = std::nullopt,
                    const std::source_location& site = std::source_location::current()) {
    return call([&] { return forward(src, mask, src_key_padding_mask, is_causal); }, site);
  }
  using Module::operator();
  Tensor forward(const Tensor& src) override { return forward(src, {}, {}, std::nullopt); }
  TransformerEncoderLayer& layer(size_t i) const;

  int64_t num_layers;
  std::shared_ptr<ModuleList> layers;
  std::shared_ptr<Module> norm;
};

}  // namespace tally::nn
