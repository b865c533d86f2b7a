#include "tensor/meta/cost.h"

#include <algorithm>
#include <deque>
#include <mutex>

namespace tally::meta {
namespace {
struct Registry {
  std::mutex mu;
  std::deque<Rates> rates;  // by meta index
  std::deque<bool> set;
};
Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: meta devices live to exit
  return *r;
}
}  // namespace

Rates rates_for(const memory::MetaTarget& target) {
  if (target.type == DeviceType::cuda && target.workspace_tables == "h200")
    // What Tally's kernels reach on the H200 (bench/RESULTS.md, ops_gpu.py): bf16 linear
    // 610 TFLOP/s, float32 linear 48, TF32 convolution 100, elementwise 3.9-4.2 TB/s; a
    // launch and its gap ~4 us; PCIe Gen5 x16 with pinned memory, each way (a pinned
    // device-to-host copy measures ~50 GB/s: a fair default where the link was not measured,
    // tensor/host_link.h). The host's AdamW (16 cores): ~38 GB/s in LLaMA-1B's offloaded step
    // (1,307 ms against ~300 on the device, 28 B a parameter), ~75 GB/s in 7B's
    // (bench/results/scale.md): 50 GB/s between them. Its AdamW8bit, 16 B a parameter: 24.5 GB/s
    // in 13B's (9,151 ms a step, 27eeb06, of which ~0.7 s on the device).
    return Rates{.flops_16bit = 600e12,
                 .flops_32bit = 48e12,
                 .flops_tf32 = 100e12,
                 .flops_64bit = 30e12,
                 .bandwidth = 3.9e12,
                 .launch_seconds = 4e-6,
                 .host_bandwidth = 50e9,
                 .host_update_bandwidth = 50e9,
                 .host_update_8bit_bandwidth = 25e9};
  return {};
}

Rates rates_of(Device device) {
  {
    Registry& r = registry();
    std::lock_guard lock(r.mu);
    const auto i = static_cast<size_t>(device.index);
    if (device.type == DeviceType::meta && device.index >= 0 && i < r.set.size() && r.set[i])
      return r.rates[i];
  }
  return rates_for(memory::meta_target_of(device));
}

void set_rates(Device device, const Rates& rates) {
  memory::meta_target_of(device);  // std::invalid_argument for anything but a meta device
  Registry& r = registry();
  std::lock_guard lock(r.mu);
  const auto i = static_cast<size_t>(device.index);
  if (r.set.size() <= i) {
    r.set.resize(i + 1, false);
    r.rates.resize(i + 1);
  }
  r.rates[i] = rates;
  r.set[i] = true;
}

void cost(Device device, DType d, double flops, double bytes, bool tf32, double min_seconds) {
  const Rates t = rates_of(device);
  if (t.bandwidth <= 0) return;
  const double rate = d == DType::float16 || d == DType::bfloat16 ? t.flops_16bit
                      : d == DType::float64                       ? t.flops_64bit
                      : tf32                                      ? t.flops_tf32
                                                                  : t.flops_32bit;
  const double scale = d == DType::bfloat16  ? t.byte_scale_bf16
                       : d == DType::float16 ? t.byte_scale_fp16
                                             : 1.0;
  const double s =
      std::max({rate > 0 ? flops / rate : 0.0, bytes * scale / t.bandwidth, min_seconds}) +
      t.launch_seconds;
  memory::add_meta_seconds(device, s, t.launch_seconds);
}

}  // namespace tally::meta
