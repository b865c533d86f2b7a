// The meta device's cost model: the rates a dry run predicts time from, next to the meta
// kernels that charge it. A kernel costs max(FLOPs / rate, bytes / bandwidth) plus the
// host's launch overhead (memory/meta.h keeps the clocks it is charged to). Rates come from
// a table per recorded GPU (rates_for), or from a calibration (nn::calibrated_rates: the CPU's,
// measured) set on a meta device with set_rates.
#pragma once

#include "memory/meta.h"
#include "tensor/tensor.h"

namespace tally::meta {

// Rates in FLOP/s for products in 16-bit floats (tensor cores), float32 products (matmul: no
// TF32 by default; cuDNN convolutions: TF32), float64; bytes/s for memory traffic. 0: not
// calibrated (predicted time stays 0).
struct Rates {
  double flops_16bit = 0, flops_32bit = 0, flops_tf32 = 0, flops_64bit = 0;
  double bandwidth = 0;
  double launch_seconds = 0;  // the host's time per kernel launch
  // bytes/s of a copy between pinned host memory and the device, each way (activation
  // offload's copies); 0 on the CPU, where offloading copies within host memory.
  double host_bandwidth = 0;
  // bytes/s the host's cores move through host memory in an update they run over every core
  // (optim/cpu_offload.h's AdamW on the host: master weights, gradients and moments read and
  // written); 0: a dry run charges the host no time for it.
  double host_update_bandwidth = 0;
  // The same for AdamW8bit's update on the host (its block-wise quantising is bound by the cores,
  // not by memory); 0: host_update_bandwidth.
  double host_update_8bit_bandwidth = 0;
  // Seconds per element of the fused optimizer updates where more than their bytes (a
  // calibrated CPU's: AdamW8bit's code-book search and scaling, optim/plan_training.cpp); 0:
  // their bytes only.
  double adam_element_seconds = 0, adamw8bit_element_seconds = 0;
  // How many times its bytes a kernel over 16-bit tensors costs at `bandwidth` (a calibrated
  // CPU's: its kernels widen every bfloat16 or float16 element to float32 and back, and take a
  // float32 element's time or more, nn::calibrated_rates); 1: its bytes.
  double byte_scale_bf16 = 1, byte_scale_fp16 = 1;
};

// The recorded rates of `target` (its workspace_tables names the GPU: "h200"); all 0 for
// the CPU and for a GPU without a record.
Rates rates_for(const memory::MetaTarget& target);
// The rates meta device `device` predicts with: those set_rates gave it, else its target's.
Rates rates_of(Device device);
// Gives meta device `device` these rates (a calibrated target) for the rest of its life.
void set_rates(Device device, const Rates& rates);

// The predicted time of one kernel on the target: max(flops / the rate of its dtype's
// products, bytes (scaled for 16-bit dtypes) / bandwidth, min_seconds) + the launch overhead.
// `tf32`: a float32 product on TF32 tensor cores (cuDNN's convolutions). Nothing when the target
// has no rates.
void cost(Device device, DType d, double flops, double bytes, bool tf32 = false,
          double min_seconds = 0);
inline void cost(const Tensor& like, double flops, double bytes, bool tf32 = false) {
  cost(like.device(), like.dtype(), flops, bytes, tf32);
}

}  // namespace tally::meta
