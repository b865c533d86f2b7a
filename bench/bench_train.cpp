// bench_train: Tally's side of bench/train.py. The same workloads and configurations as
// PyTorch's reference runs (.ref/torch_baseline.py, see bench/train.py): ResNet-50 (batch 64,
// 224x224, SGD momentum 0.9) and GPT-2 124M (vocabulary 50304, B=16, T=1024, AdamW), fp32
// with TF32 off, with checkpointing and mixed precision. One JSON line per configuration
// with the baseline's keys: model, cfg, step_ms (median), step_ms_min, peak_alloc_mib,
// peak_reserved_mib (peaks over the timed steps, after warm-up, like the baseline).
// Configurations and options: docs/notes.md §18.
//
// --model NAME: a registry model (nn/models/registry.h) instead, bench/train.py's rows for
// LLaMA, ViT, the U-Net and the LSTM LM: its preset, batch and shape, autocast to --amp,
// AdamW (lr 1e-4, weight decay 0.01, as PyTorch's side), on --device (cpu: the plumbing with a
// tiny preset). Its row adds the step's FLOPs (16-bit and 32-bit products) and bytes as the
// meta device's cost model counts them on an H200 dry run, and the floor they give.
//   bench_train --model llama --preset 1b --batch 4 --seq 2048 --amp bf16
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "inspect/leak_detector.h"
#include "memory/estimate.h"
#include "memory/memory.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/models/gpt.h"
#include "nn/models/registry.h"
#include "nn/models/resnet.h"
#include "nn/offload.h"
#include "optim/adam.h"
#include "optim/adamw8bit.h"
#include "optim/grad_scaler.h"
#include "optim/sgd.h"
#include "optim/step_in_backward.h"
#include "profiler/profiler.h"
#include "tensor/cuda/graph.h"
#include "tensor/meta/cost.h"
#include "tensor/pinned.h"
#include "tensor/precision.h"

using namespace tally;

namespace {

struct Result {
  double median_ms, min_ms;
};

// Whether the configuration name holds a lever's token ("amp-bf16+offload" holds "offload").
bool has(const std::string& cfg, const char* token) {
  return cfg.find(token) != std::string::npos;
}

// The analysis tokens around a step: "hist" records memory history (what a snapshot needs)
// and "leaks" runs a LeakDetector boundary after each step.
std::function<void()> with_analysis(const std::string& cfg, Device dev,
                                    std::function<void()> step) {
  if (has(cfg, "hist")) memory::record_memory_history(true, 1000000, dev);
  if (!has(cfg, "leaks")) return step;
  auto leaks = std::make_shared<inspect::LeakDetector>(dev);
  return [step = std::move(step), leaks] {
    step();
    leaks->step();
  };
}

// The peaks are reset after the warm-up steps; a graphed step's (reset_peaks false) were reset
// before its capture, which allocates what the replays use (graphed()).
Result timed(const std::function<void()>& step, Device dev, int warm, int n,
             bool reset_peaks = true) {
  for (int i = 0; i < warm; ++i) step();
  memory::synchronize(dev);
  if (reset_peaks) memory::reset_peak_memory_stats(dev);
  std::vector<double> ts;
  for (int i = 0; i < n; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    memory::synchronize(dev);
    ts.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  return {ts[ts.size() / 2], ts.front()};
}

void report(const std::string& model, const std::string& cfg, Result r, Device dev,
            int64_t tokens = 0, std::string extra = "") {
  const double mib = 1024.0 * 1024.0;
  if (tokens) extra += fmt::format(", \"tok_per_s\": {:.0f}", tokens / (r.median_ms / 1000.0));
  // Bytes per category at the allocated peak (the levers' accounting).
  const auto& at = memory::get_allocator(dev).stats().category_at_peak;
  for (const char* c : {"activation", "gradient", "optimizer_state", "temporary"})
    extra += fmt::format(", \"{}_at_peak_mib\": {:.1f}", c,
                         at[static_cast<size_t>(*memory::parse_category(c))] / mib);
  // Host memory the offloaded activations took at most (pinned allocator).
  extra += fmt::format(", \"offloaded_host_peak_mib\": {:.1f}",
                       memory::get_pinned_allocator()
                               .stats()
                               .category_bytes[static_cast<size_t>(memory::Category::offloaded)]
                               .peak /
                           mib);
  memory::get_pinned_allocator().reset_peak_memory_stats();
  fmt::print(
      "{{\"model\": \"{}\", \"cfg\": \"{}\", \"step_ms\": {:.2f}, \"step_ms_min\": {:.2f}{}, "
      "\"peak_alloc_mib\": {:.1f}, \"peak_reserved_mib\": {:.1f}}}\n",
      model, cfg, r.median_ms, r.min_ms, extra, memory::max_memory_allocated(dev) / mib,
      memory::max_memory_reserved(dev) / mib);
  std::fflush(stdout);
}

std::optional<DType> amp_of(const std::string& cfg) {
  if (cfg.find("fp16") != std::string::npos) return DType::float16;
  if (cfg.find("bf16") != std::string::npos) return DType::bfloat16;
  return std::nullopt;
}

// "offloadlink": `--offload link` (nn/offload.h): one forward of `loss_fn` under the
// configuration's autocast measures what each block saves and the forward's time, and the
// blocks whose copies the host link carries within the forward are offloaded ("offload":
// every block's activations). The choice goes to stderr.
void offload_cfg(const std::string& cfg, nn::Module& model, Device dev,
                 const std::function<Tensor()>& loss_fn) {
  if (has(cfg, "offloadlink")) {
    const std::optional<DType> amp = amp_of(cfg);
    nn::LinkOffloadChoice choice;
    nn::offload_activations(
        model, nn::parse_offload_spec("link"), {},
        [&] {
          AutocastGuard ac(dev.type, amp.value_or(DType::bfloat16), amp.has_value());
          (void)loss_fn();
        },
        &choice);
    fmt::print(stderr, "{}: {}\n", cfg, choice.str());
  } else if (has(cfg, "offload")) {
    nn::offload_activations(model, nn::parse_offload_spec("activations"));
  }
}

// "graphs": the step runs eagerly once (its first calls search algorithms and make the
// optimizer's state), is captured into a CUDA graph at the second call, and every call from
// then on replays it (tensor/cuda/graph.h). What a replay cannot repeat is refused up front.
std::function<void()> graphed(const std::string& cfg, Device dev, std::function<void()> eager) {
  for (const char* token : {"sib", "offload", "varyseq", "hist", "leaks"})
    if (has(cfg, token))
      throw std::invalid_argument(fmt::format(
          "graphs with {}: a replayed step cannot change per step or run host work", token));
  auto graph = std::make_shared<cuda::Graph>();
  auto calls = std::make_shared<int>(0);
  return [=] {
    if ((*calls)++ == 0) return eager();
    if (!graph->captured()) {
      memory::synchronize(dev);
      memory::reset_peak_memory_stats(dev);  // the capture's allocations are the step's
      graph->capture(eager, dev.index);
    }
    graph->replay();
  };
}

// One training step of `cfg` (autocast to the dtype its name holds, with a GradScaler for
// fp16): zero_grad, the forward `loss_fn` under autocast, the scaled backward, the optimizer step.
// A cfg with "sib" steps in backward (optim/step_in_backward.h) instead; one with "graphs"
// replays a CUDA graph of the step (graphed()).
std::function<void()> train_step(const std::string& cfg, Device dev, optim::Optimizer& opt,
                                 std::function<Tensor()> loss_fn) {
  const auto amp = amp_of(cfg);
  auto scaler = std::make_shared<optim::GradScaler>(optim::GradScalerOptions{
      .enabled = amp && *amp == DType::float16, .capturable = has(cfg, "graphs")});
  if (has(cfg, "sib")) {
    auto sib = std::make_shared<optim::StepInBackward>(opt);
    return [=] {
      Tensor loss;
      {
        memory::PhaseScope phase("forward");
        AutocastGuard ac(dev.type, amp.value_or(DType::bfloat16), amp.has_value());
        loss = loss_fn();
      }
      memory::PhaseScope phase("backward");
      loss.backward();
      (void)sib;
    };
  }
  std::function<void()> step = [=, &opt] {
    opt.zero_grad(true);
    Tensor loss;
    {
      memory::PhaseScope phase("forward");
      AutocastGuard ac(dev.type, amp.value_or(DType::bfloat16), amp.has_value());
      loss = loss_fn();
    }
    {
      memory::PhaseScope phase("backward");
      scaler->scale(loss).backward();
    }
    scaler->step(opt);
    scaler->update();
  };
  return has(cfg, "graphs") ? graphed(cfg, dev, std::move(step)) : step;
}

void resnet_cfg(const std::string& cfg, Device dev, int steps) {
  manual_seed(0);
  set_tunable_enabled(has(cfg, "tuned"));
  auto model = nn::resnet50({.num_classes = 10});
  model->to(dev);
  if (has(cfg, "channels-last")) model->to(MemoryFormat::channels_last);
  model->train();
  if (cfg.find("ckpt4") != std::string::npos)
    nn::enable_checkpointing(*model, nn::parse_checkpoint_spec("4-segments"));
  optim::SGD opt(model->parameters(), {.lr = 1e-3, .momentum = 0.9});
  Tensor x = randn({64, 3, 224, 224}, TensorOptions{}.with_device(dev));
  // channels-last: the weights and images in NHWC memory (PyTorch's
  // model.to(memory_format=channels_last) and x.to(...)), so every activation is too.
  if (has(cfg, "channels-last")) x = x.contiguous(MemoryFormat::channels_last);
  const Tensor y = randint(0, 10, {64}, TensorOptions{}.with_device(dev).with_dtype(DType::int64));
  offload_cfg(cfg, *model, dev, [&] { return cross_entropy((*model)(x), y); });
  const auto step = with_analysis(
      cfg, dev, train_step(cfg, dev, opt, [&] { return cross_entropy((*model)(x), y); }));
  memory::empty_cache(dev);
  report("resnet50-bs64", cfg, timed(step, dev, 3, steps, !has(cfg, "graphs")), dev);
  memory::record_memory_history(false, 0, dev);
}

void gpt_cfg(const std::string& cfg, Device dev, int steps) {
  manual_seed(0);
  set_tunable_enabled(has(cfg, "tuned"));
  nn::GPTConfig c = nn::GPTConfig::preset("gpt2");
  c.vocab_size = has(cfg, "v50257") ? 50257 : 50304;  // the baseline's padded vocabulary
  c.fused_classifier = has(cfg, "fusedce");
  if (has(cfg, "chunk512")) c.fused_classifier_chunk_bytes = int64_t{512} << 20;
  c.fused_mlp = !has(cfg, "unfusedmlp");
  c.fused_add_norm = !has(cfg, "unfusedaddnorm");
  if (has(cfg, "nopad")) c.classifier_pad_multiple = 0;  // 50257's products unpadded
  auto model = std::make_shared<nn::GPT>(c);
  model->to(dev);
  model->train();
  if (cfg.find("ckpt") != std::string::npos)
    nn::enable_checkpointing(*model, nn::parse_checkpoint_spec("blocks"));
  std::unique_ptr<optim::Optimizer> opt_ptr;
  if (has(cfg, "adamw8bit"))
    opt_ptr =
        std::make_unique<optim::AdamW8bit>(model->parameters(), optim::AdamOptions{.lr = 3e-4});
  else
    opt_ptr = std::make_unique<optim::AdamW>(
        model->parameters(), optim::AdamOptions{.lr = 3e-4, .capturable = has(cfg, "graphs")});
  optim::Optimizer& opt = *opt_ptr;
  const int64_t B = 16, T = 1024;
  const Tensor idx =
      randint(0, 50257, {B, T}, TensorOptions{}.with_device(dev).with_dtype(DType::int64));
  const Tensor tgt =
      randint(0, 50257, {B, T}, TensorOptions{}.with_device(dev).with_dtype(DType::int64));
  // varyseq: step k takes the first T_k tokens, T_k = 128 + 64 ((7k + 3) mod 15): 15 lengths
  // from 128 to 1024 in a scrambled order (bench/levers.py's PyTorch rows use the same).
  offload_cfg(cfg, *model, dev, [&] { return (*model)(idx, tgt).second; });
  int64_t k = 0;
  const bool vary = has(cfg, "varyseq");
  const auto step = with_analysis(
      cfg, dev, train_step(cfg, dev, opt, [&] {
        if (!vary) return (*model)(idx, tgt).second;
        const int64_t t = 128 + 64 * ((7 * k++ + 3) % 15);
        return (*model)(idx.slice(1, 0, t).contiguous(), tgt.slice(1, 0, t).contiguous()).second;
      }));
  memory::empty_cache(dev);
  report("gpt2-124M-B16T1024", cfg, timed(step, dev, 2, steps, !has(cfg, "graphs")), dev, B * T);
  memory::record_memory_history(false, 0, dev);
}

// ---- registry models (--model) ----

struct ModelRun {
  std::string model, label;
  nn::ModelOptions opts;
  int64_t batch = 8;
  std::string amp = "off";  // off | fp16 | bf16
  int warmup = 3;
  int profile_rows = 0;  // --profile N: one more step profiled, its N costliest ops printed
};

std::string cfg_of(const ModelRun& m) {
  return m.amp == "off" ? "baseline-fp32" : "amp-" + m.amp;
}

// The FLOPs and bytes one training step's kernels cost, as the meta device's cost model counts
// them (tensor/meta/cost.h) on an H200 dry run. The rates make the compute clock count one
// quantity: 16-bit products' FLOPs, the other products' FLOPs, or the bytes moved (a kernel's
// time is max(FLOPs / rate, bytes / bandwidth), a rate of 0 leaving its FLOPs out). The second
// step is counted (the first also makes the optimizer's state).
struct StepCounts {
  double flops16 = 0, flops32 = 0, bytes = 0;
};

double count_step(const nn::ModelEntry& e, const ModelRun& m, const data::Example& shapes,
                  const meta::Rates& rates) {
  memory::DryRun dry({.target = "h200", .capacity = size_t{1} << 50, .max_history = 0});
  const Device d = dry.device();
  meta::set_rates(d, rates);
  manual_seed(0);
  std::shared_ptr<nn::Module> model;
  {
    nn::BuildOnDevice on(d);
    model = e.build(m.opts);
  }
  model->train();
  optim::AdamW opt(model->parameters(), {.lr = 1e-4, .weight_decay = 0.01});
  const Tensor x = ops::empty(shapes.input.sizes(), shapes.input.dtype(), d);
  const Tensor y = ops::empty(shapes.target.sizes(), shapes.target.dtype(), d);
  const auto step = train_step(cfg_of(m), d, opt, [&] { return e.loss(*model, {x, y}); });
  step();
  const double before = memory::meta_seconds(d);
  step();
  return memory::meta_seconds(d) - before;
}

StepCounts count_step(const nn::ModelEntry& e, const ModelRun& m, const data::Example& shapes) {
  constexpr double kUnit = 1, kNever = 1e300;  // a unit rate counts; a rate of kNever does not
  StepCounts c;
  c.flops16 = count_step(e, m, shapes, {.flops_16bit = kUnit, .bandwidth = kNever});
  c.flops32 = count_step(
      e, m, shapes,
      {.flops_32bit = kUnit, .flops_tf32 = kUnit, .flops_64bit = kUnit, .bandwidth = kNever});
  c.bytes = count_step(e, m, shapes, {.bandwidth = kUnit});
  return c;
}

// The floor of a step on the H200: its FLOPs at 790 TFLOP/s (bf16 tensor cores, measured) under
// 16-bit autocast, at 67 TFLOP/s (float32 without TF32, nominal) in float32, or its bytes at
// 4.3 TB/s (measured copy bandwidth), whichever is longer. All of an autocast step's FLOPs count
// at the 16-bit rate (the cost model files a product under its operands' dtype; the float32
// products left in an autocast step are few).
double floor_ms(const StepCounts& c, bool autocast) {
  const double flops = c.flops16 + c.flops32;
  return 1e3 * std::max(flops / (autocast ? 790e12 : 67e12), c.bytes / 4.3e12);
}

void model_cfg(const ModelRun& m, Device dev, int steps) {
  // bench/train.py's PyTorch rows run float32 exactly: no TF32 in matmuls or cuDNN (the LSTM's
  // cuDNN RNN included).
  set_cudnn_allow_tf32(false);
  const nn::ModelEntry& e = nn::model_entry(m.model);
  const data::Example batch = e.synthetic_batch(m.opts, m.batch, 0, 0);
  const StepCounts counts = count_step(e, m, batch);
  manual_seed(0);
  std::shared_ptr<nn::Module> model;
  {
    nn::BuildOnDevice on(dev);  // no host copy of a large model
    model = e.build(m.opts);
  }
  model->train();
  optim::AdamW opt(model->parameters(), {.lr = 1e-4, .weight_decay = 0.01});
  Tensor x, y;
  {
    memory::CategoryScope input(memory::Category::input);
    x = ops::to_device_async(batch.input, dev);
    y = ops::to_device_async(batch.target, dev);
  }
  const std::string cfg = cfg_of(m);
  const auto step = train_step(cfg, dev, opt, [&] { return e.loss(*model, {x, y}); });
  memory::empty_cache(dev);
  const bool tokens = e.input == nn::ModelEntry::Input::tokens;
  const std::string extra = fmt::format(
      ", \"params\": {}, \"gflop_16bit\": {:.2f}, \"gflop_32bit\": {:.2f}, \"gbytes\": {:.3f}, "
      "\"floor_ms\": {:.3f}, \"device\": \"{}\"",
      model->num_parameters(), counts.flops16 / 1e9, counts.flops32 / 1e9, counts.bytes / 1e9,
      floor_ms(counts, m.amp != "off"), dev.str());
  report(m.label, cfg, timed(step, dev, m.warmup, steps), dev, tokens ? m.batch * m.opts.seq : 0,
         extra);
  if (m.profile_rows > 0) {  // after the timed steps, so the timing never includes the profiler
    profiler::Profiler prof;
    {
      profiler::ProfilerGuard guard(prof);
      step();
      memory::synchronize(dev);
    }
    fmt::print("{}", prof.key_averages().table(dev.type == DeviceType::cuda ? "self_cuda_time_total"
                                                                            : "self_cpu_time_total",
                                               m.profile_rows));
  }
}

constexpr const char* kResnetBase[] = {"baseline-fp32", "ckpt4", "amp-fp16", "amp-bf16",
                                       "amp-fp16+ckpt4"};
constexpr const char* kGptBase[] = {"baseline-fp32", "ckpt-per-block", "amp-bf16", "amp-bf16+ckpt"};

bool is_base(const std::string& c, bool resnet, bool gpt) {
  auto in = [&](const auto& list) {
    return std::any_of(std::begin(list), std::end(list), [&](const char* b) { return c == b; });
  };
  return (resnet && in(kResnetBase)) || (gpt && in(kGptBase));
}

// A configuration is a base name of a chosen model ("ckpt-per-block") or a chosen model's
// prefix and '+'-joined tokens ("gpt:amp-bf16+fusedce"); anything else is an error, so that a
// misspelt configuration never measures nothing (or the wrong thing) in silence.
void check_config(const std::string& c, bool resnet, bool gpt) {
  static const char* const kTokens[] = {
      "baseline-fp32", "ckpt4",        "ckpt",           "ckpt-per-block",
      "amp-fp16",      "amp-bf16",     "offload",        "offloadlink",
      "sib",           "adamw8bit",    "fusedce",        "chunk512",
      "nopad",         "unfusedmlp",   "unfusedaddnorm", "v50257",
      "varyseq",       "hist",         "leaks",          "graphs",
      "tuned",         "channels-last"};
  const size_t colon = c.find(':');
  if (colon == std::string::npos) {
    if (is_base(c, resnet, gpt)) return;
    throw std::invalid_argument(fmt::format(
        "--configs: '{}' is not a configuration of the chosen models (ResNet: {}; GPT: {}; the "
        "levers take their model's prefix: resnet:TOKENS or gpt:TOKENS)",
        c, fmt::join(kResnetBase, ", "), fmt::join(kGptBase, ", ")));
  }
  const std::string model = c.substr(0, colon);
  if (model != "resnet" && model != "gpt")
    throw std::invalid_argument(
        fmt::format("--configs: '{}': the prefix is resnet: or gpt:, not {}:", c, model));
  if ((model == "resnet" && !resnet) || (model == "gpt" && !gpt))
    throw std::invalid_argument(
        fmt::format("--configs: '{}' needs --{} (or neither --resnet nor --gpt)", c, model));
  std::stringstream ss(c.substr(colon + 1));
  int n = 0;
  for (std::string t; std::getline(ss, t, '+'); ++n)
    if (std::none_of(std::begin(kTokens), std::end(kTokens), [&](const char* k) { return t == k; }))
      throw std::invalid_argument(fmt::format("--configs: '{}': unknown token '{}' (tokens: {})", c,
                                              t, fmt::join(kTokens, ", ")));
  if (n == 0) throw std::invalid_argument(fmt::format("--configs: '{}' names no tokens", c));
  if (model == "gpt" && has(c, "channels-last"))
    throw std::invalid_argument(
        fmt::format("--configs: '{}': channels-last is ResNet's (GPT has no 4-D activations)", c));
}

// An integer flag's value in [lo, hi]; std::invalid_argument naming the flag otherwise.
int64_t int_flag(const std::string& flag, const std::string& v, int64_t lo, int64_t hi) {
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < lo || n > hi)
    throw std::invalid_argument(
        fmt::format("{} takes an integer in [{}, {}], got '{}'", flag, lo, hi, v));
  return n;
}

constexpr const char* kUsage =
    "usage: bench_train [--resnet] [--gpt] [--configs a,b] [--steps N] [--cuda-graphs]\n"
    "       bench_train --model NAME [--preset P] [--batch B] [--seq T] [--image-size S]\n"
    "                   [--amp off|fp16|bf16] [--device cuda|cpu] [--steps N] [--warmup N]\n"
    "                   [--label L] [--profile ROWS]\n";

}  // namespace

int main(int argc, char** argv) {
  bool resnet = false, gpt = false, graphs = false;
  int steps = 10;
  std::vector<std::string> configs;
  ModelRun mr;
  std::string device = "cuda";
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      const bool has_value = i + 1 < argc;
      if (a == "--resnet")
        resnet = true;
      else if (a == "--gpt")
        gpt = true;
      else if (a == "--cuda-graphs")
        graphs = true;
      else if (a == "--steps" && has_value)
        steps = static_cast<int>(int_flag(a, argv[++i], 1, 100000));
      else if (a == "--configs" && has_value) {
        std::stringstream ss(argv[++i]);
        for (std::string c; std::getline(ss, c, ',');) configs.push_back(c);
      } else if (a == "--model" && has_value)
        mr.model = argv[++i];
      else if (a == "--preset" && has_value)
        mr.opts.preset = argv[++i];
      else if (a == "--batch" && has_value)
        mr.batch = int_flag(a, argv[++i], 1, 1 << 20);
      else if (a == "--seq" && has_value)
        mr.opts.seq = int_flag(a, argv[++i], 1, 1 << 24);
      else if (a == "--image-size" && has_value)
        mr.opts.image_size = int_flag(a, argv[++i], 1, 1 << 14);
      else if (a == "--warmup" && has_value)
        mr.warmup = static_cast<int>(int_flag(a, argv[++i], 0, 1000));
      else if (a == "--label" && has_value)
        mr.label = argv[++i];
      else if (a == "--profile" && has_value)
        mr.profile_rows = static_cast<int>(int_flag(a, argv[++i], 1, 1000));
      else if (a == "--amp" && has_value) {
        mr.amp = argv[++i];
        if (mr.amp != "off" && mr.amp != "fp16" && mr.amp != "bf16")
          throw std::invalid_argument(
              fmt::format("--amp takes off, fp16 or bf16, got '{}'", mr.amp));
      } else if (a == "--device" && has_value) {
        device = argv[++i];
        if (device != "cuda" && device != "cpu")
          throw std::invalid_argument(fmt::format("--device takes cuda or cpu, got '{}'", device));
      } else {
        fmt::print(stderr, "{}", kUsage);
        return 2;
      }
    }
    if (!mr.model.empty()) {
      if (resnet || gpt || graphs || !configs.empty())
        throw std::invalid_argument(
            "--model runs one registry model: not with --resnet, --gpt, --configs or "
            "--cuda-graphs");
      const nn::ModelEntry& e = [&]() -> const nn::ModelEntry& {
        try {
          return nn::model_entry(mr.model);
        } catch (const std::invalid_argument& err) {
          throw std::invalid_argument(fmt::format("--model: {}", err.what()));
        }
      }();
      const bool images = e.input == nn::ModelEntry::Input::images;
      if (images && mr.opts.seq > 0)
        throw std::invalid_argument(
            fmt::format("--seq applies to token models (--model {} takes images)", e.name));
      if (!images && mr.opts.image_size > 0)
        throw std::invalid_argument(
            fmt::format("--image-size applies to image models (--model {} takes tokens)", e.name));
      try {
        mr.opts = nn::resolve_options(e, mr.opts);
      } catch (const std::invalid_argument& err) {
        throw std::invalid_argument(fmt::format("--preset: {}", err.what()));
      }
      if (!images && e.context && mr.opts.seq > e.context(mr.opts.preset))
        throw std::invalid_argument(fmt::format("--seq {} exceeds --preset {}'s context {}",
                                                mr.opts.seq, mr.opts.preset,
                                                e.context(mr.opts.preset)));
      if (mr.label.empty())
        mr.label = fmt::format(
            "{}-{}-B{}{}", e.name, mr.opts.preset, mr.batch,
            images ? fmt::format("S{}", mr.opts.image_size) : fmt::format("T{}", mr.opts.seq));
    } else if (device != "cuda" || mr.amp != "off" || mr.batch != 8 || mr.warmup != 3 ||
               mr.profile_rows != 0 || !mr.label.empty() || !mr.opts.preset.empty() ||
               mr.opts.seq > 0 || mr.opts.image_size > 0) {
      throw std::invalid_argument(
          "--preset, --batch, --seq, --image-size, --amp, --device, --warmup, --label and "
          "--profile apply to --model");
    }
  } catch (const std::invalid_argument& e) {
    fmt::print(stderr, "bench_train: {}\n", e.what());
    return 2;
  }
  if (!mr.model.empty()) {
    if (device == "cuda" && !memory::cuda_available()) {
      fmt::print("bench_train: no GPU, nothing to measure (--device cpu runs on the CPU)\n");
      return 0;
    }
    try {
      model_cfg(mr, device == "cuda" ? Device::cuda(0) : Device::cpu(), steps);
    } catch (const std::exception& e) {
      fmt::print(stderr, "bench_train: error: {}\n", e.what());
      return 1;
    }
    return 0;
  }
  if (!resnet && !gpt) resnet = gpt = true;
  try {
    for (const std::string& c : configs) check_config(c, resnet, gpt);
  } catch (const std::invalid_argument& e) {
    fmt::print(stderr, "bench_train: {}\n", e.what());
    return 2;
  }
  if (!memory::cuda_available()) {
    fmt::print("bench_train: no GPU, nothing to measure\n");
    return 0;
  }
  const Device dev = Device::cuda(0);
  auto want = [&](const std::string& c) {
    return configs.empty() || std::find(configs.begin(), configs.end(), c) != configs.end();
  };
  try {
    // --cuda-graphs: every configuration as "<cfg>+graphs" (fp16's with a capturable
    // GradScaler).
    auto run = [&](const std::string& c, auto cfg_fn, int n) {
      cfg_fn(graphs ? c + "+graphs" : c, dev, n);
    };
    if (resnet)
      for (const char* c : kResnetBase)
        if (want(c)) run(c, resnet_cfg, steps);
    if (gpt)
      for (const char* c : kGptBase)
        if (want(c)) run(c, gpt_cfg, std::max(steps - 2, 3));
    // The levers (bench/levers.py), the analysis tools (bench/analysis.py) and any other
    // model-prefixed configuration: asked for by name only.
    for (const std::string& c : configs) {
      if (c.find(':') == std::string::npos) continue;
      const std::string named = graphs && !has(c, "graphs") ? c + "+graphs" : c;
      if (resnet && named.rfind("resnet:", 0) == 0) resnet_cfg(named.substr(7), dev, steps);
      if (gpt && named.rfind("gpt:", 0) == 0) gpt_cfg(named.substr(4), dev, std::max(steps - 2, 3));
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_train: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
