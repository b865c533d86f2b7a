// AdamW8bit: AdamW with block-wise 8-bit quantized moments, as bitsandbytes' AdamW8bit
// (Dettmers et al., "8-bit Optimizers via Block-wise Quantization"). The update is AdamW's
// (optim/update_math.h, decoupled weight decay, bias corrections from the host-side step
// count), computed in float32 on the dequantized moments; the moments are then stored again as
// one byte per element plus one float32 scale per block of `block_size` elements.
//
// State per parameter with at least `min_8bit_size` elements (float32 parameters only):
//   exp_avg, exp_avg_sq                 uint8 [numel]: codes into the signed / unsigned
//                                       dynamic maps (multi_tensor.h: create_dynamic_map)
//   exp_avg_absmax, exp_avg_sq_absmax   float32 [ceil(numel / block_size)]: each block's scale
// and the step count: 2 bytes per element and 8 per block instead of AdamW's 8 per element.
// Smaller parameters keep AdamW's float32 exp_avg / exp_avg_sq (bitsandbytes' min_8bit_size).
#pragma once

#include "optim/adam.h"

namespace tally::optim {

// The quantization, set once per optimizer (it decides the state's layout, so it is not a
// param-group option).
struct AdamW8bitOptions {
  int64_t block_size = 256;      // elements per scale: a power of two from 64 to 4096
  int64_t min_8bit_size = 4096;  // smaller parameters keep float32 moments
};

class AdamW8bit : public Optimizer {
 public:
  // `options` as AdamW's (lr, beta1, beta2, eps, weight_decay, maximize; amsgrad is not
  // supported and throws).
  AdamW8bit(std::vector<Tensor> params, AdamOptions options = AdamW::default_options(),
            AdamW8bitOptions quant = {});
  AdamW8bit(std::vector<ParamGroup> groups, AdamOptions defaults, AdamW8bitOptions quant = {});
  const char* name() const override { return "AdamW8bit"; }

  const AdamW8bitOptions& quant_options() const { return quant_; }
  // Whether parameter `param` gets 8-bit state (numel >= min_8bit_size).
  bool is_8bit(const Tensor& param) const { return param.numel() >= quant_.min_8bit_size; }

 protected:
  void update_group(const ParamGroup& group, const std::vector<size_t>& indices) override;
  void check_options(const GroupOptions& o) const override;
  std::optional<StateSpec> state_spec(size_t index, const std::string& name) const override;
  void check_loaded_state(size_t index, const ParamState& s) const override;

 private:
  void check_params() const;
  AdamW8bitOptions quant_;
};

// bitsandbytes' quantize_blockwise / dequantize_blockwise on the CPU, with the arithmetic
// AdamW8bit's kernels use (update_math.h: quantize8, dequantize8): x (float32, contiguous)
// becomes codes (uint8 [numel]) into the signed or unsigned dynamic map and one absmax per
// block (float32 [ceil(numel / block_size)]); dequantize_blockwise gives back float32
// [numel]. For tests and inspection of the optimizer's state.
struct QuantizedBlocks {
  Tensor codes, absmax;
};
QuantizedBlocks quantize_blockwise(const Tensor& x, bool is_signed, int64_t block_size = 256);
Tensor dequantize_blockwise(const QuantizedBlocks& q, bool is_signed, int64_t block_size = 256);

}  // namespace tally::optim
