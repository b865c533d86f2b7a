// train_ddp: data-parallel training of ResNet or GPT on synthetic data, one process per
// GPU, started by tools/tally_launch (torchrun's environment variables). Each rank takes
// its shard of the synthetic dataset (DistributedSampler), runs forward and backward, and
// DistributedDataParallel averages the gradients in buckets over NCCL while backward runs.
// Prints per-rank step time, throughput over all ranks, and peak memory with the
// `communication` category (the all-reduce buckets).
//
//   tools/tally_launch --nproc-per-node 8 build/examples/train_ddp --model resnet50 --batch 64
//   tools/tally_launch --nproc-per-node 8 build/examples/train_ddp --model gpt2 --batch 8 --amp
//   bf16 build/examples/train_ddp --model tiny --device cpu --steps 5          (world size 1)
//
// --snapshot FILE writes one memory_viz snapshot per rank (FILE with ".rank<R>" before the
// extension when WORLD_SIZE > 1). The last line of rank 0 is machine-readable ("RESULT ...").
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <iostream>
#include <memory>

#include "base/rank_path.h"
#include "distributed/ddp.h"
#include "examples/cli_common.h"
#include "examples/trainer.h"
#include "nn/data/distributed_sampler.h"
#include "nn/data/synthetic.h"
#include "nn/models/gpt.h"
#include "nn/models/resnet.h"
#include "optim/adam.h"
#include "optim/sgd.h"
#include "tensor/pinned.h"

using namespace tally;
namespace ex = tally::examples;

namespace {

struct Args {
  std::string model = "resnet50";
  int64_t batch = 0;  // per rank; 0: 64 for ResNet, 8 for GPT
  int64_t image_size = 224;
  int64_t seq = 0;  // GPT: 0 = the preset's block size (1024 for gpt2)
  int64_t steps = 20;
  int64_t warmup = 3;
  double lr = 0;  // 0: 0.05 (SGD) / 3e-4 (AdamW)
  std::string device = "cuda";
  std::string amp = "off";
  double bucket_cap_mb = 25;
  double first_bucket_cap_mb = 1;
  std::string snapshot;
  bool summary = false;
  bool detect_leaks = false;
  uint64_t seed = 0;
};

bool is_gpt(const std::string& m) {
  return m == "gpt2" || m == "gpt-small" || m == "gpt-tiny";
}

void add_flags(CLI::App& app, Args& a) {
  app.add_option("--model", a.model, "resnet50 | resnet18 | tiny | gpt2 | gpt-small | gpt-tiny")
      ->capture_default_str();
  app.add_option("--batch", a.batch, "batch size per rank (0: 64 for ResNet, 8 for GPT)")
      ->check(ex::int_range(0, 1 << 20));
  ex::add_checked_option(app, "--image-size", a.image_size, "ResNet: synthetic image size",
                         ex::int_range(1, 4096));
  app.add_option("--seq", a.seq, "GPT: sequence length (0: the preset's block size)")
      ->check(ex::int_range(0));
  ex::add_checked_option(app, "--steps", a.steps, "timed training steps",
                         ex::int_range(1, 1 << 24));
  ex::add_checked_option(app, "--warmup", a.warmup, "untimed steps first",
                         ex::int_range(0, 1 << 24));
  app.add_option("--lr", a.lr, "learning rate (0: 0.05 SGD for ResNet, 3e-4 AdamW for GPT)")
      ->check(ex::non_negative_real());
  app.add_option("--device", a.device, "cuda (cuda:LOCAL_RANK) | cpu (world size 1 only)")
      ->capture_default_str();
  app.add_option("--amp", a.amp, "off | fp16 | bf16")->capture_default_str();
  ex::add_checked_option(app, "--bucket-cap-mb", a.bucket_cap_mb, "DDP bucket cap in MiB",
                         ex::real_range({.lo = 0, .hi = 1 << 20, .lo_open = true}));
  ex::add_checked_option(app, "--first-bucket-cap-mb", a.first_bucket_cap_mb,
                         "cap of the first bucket in MiB (0: same)",
                         ex::real_range({.lo = 0, .hi = 1 << 20}));
  app.add_option("--snapshot", a.snapshot,
                 "write a memory_viz snapshot per rank to FILE (.rank<R> added)");
  app.add_flag("--summary", a.summary, "print memory_summary() per rank at the end");
  app.add_flag("--detect-leaks", a.detect_leaks,
               "report allocations that survive each step and grow, by source line, per rank "
               "(inspect::LeakDetector)");
  ex::add_checked_option(app, "--seed", a.seed, "seed (the same on every rank)", ex::seed_value());
}

// --device: the CPU (world size 1) or this rank's GPU, cuda:LOCAL_RANK.
Device pick_device(const Args& a, const distributed::DistEnv& env) {
  if (a.device == "cpu") {
    if (env.world_size > 1)
      throw std::invalid_argument(
          "--device cpu: only world size 1 (multi-process runs need one GPU per rank)");
    return Device::cpu();
  } else if (a.device == "cuda") {
    if (!memory::cuda_available())
      throw std::invalid_argument(
          "--device cuda: this build has no CUDA backend or no GPU is present");
    if (env.local_rank >= memory::cuda_device_count())
      throw std::invalid_argument(fmt::format("LOCAL_RANK {} but only {} GPU(s) are visible",
                                              env.local_rank, memory::cuda_device_count()));
    return Device::cuda(env.local_rank);
  } else {
    throw std::invalid_argument(fmt::format("--device: expected cuda or cpu, got '{}'", a.device));
  }
}

// The model (GPT or ResNet) and the synthetic dataset of the run: B x world x steps examples.
struct Run {
  std::shared_ptr<nn::Module> model;
  std::shared_ptr<nn::GPT> gpt;  // the same model, when it is a GPT
  std::shared_ptr<data::Dataset> dataset;
  int64_t image_size = 0;
};
Run make_run(const Args& a, bool gpt, const nn::GPTConfig& cfg, int64_t T, int64_t n_examples) {
  Run r;
  if (gpt) {
    r.gpt = std::make_shared<nn::GPT>(cfg);
    r.model = r.gpt;
    r.dataset =
        std::make_shared<data::SyntheticTokens>(n_examples, cfg.vocab_size, Shape{T}, a.seed);
  } else {
    nn::ResNetOptions o;
    o.num_classes = 1000;
    const int64_t s = a.model == "tiny" ? std::min<int64_t>(a.image_size, 32) : a.image_size;
    r.image_size = s;
    if (a.model == "tiny") o.num_classes = 10;
    if (a.model == "resnet50")
      r.model = nn::resnet50(o);
    else if (a.model == "resnet18")
      r.model = nn::resnet18(o);
    else
      r.model = nn::resnet_tiny(o);
    r.dataset =
        std::make_shared<data::SyntheticImages>(n_examples, Shape{3, s, s}, o.num_classes, a.seed);
  }
  return r;
}

// GPT: AdamW (betas 0.9, 0.95, weight decay 0.1); ResNet: SGD (momentum 0.9, weight decay 5e-4).
std::unique_ptr<optim::Optimizer> make_optimizer(bool gpt, std::vector<Tensor> params, double lr) {
  if (gpt)
    return std::make_unique<optim::AdamW>(
        std::move(params),
        optim::AdamOptions{.lr = lr, .beta1 = 0.9, .beta2 = 0.95, .weight_decay = 0.1});
  return std::make_unique<optim::SGD>(
      std::move(params), optim::SGDOptions{.lr = lr, .momentum = 0.9, .weight_decay = 5e-4});
}

// The rank's `n` batches of `B` (its shard of the sampler, in order), assembled once into
// pinned host memory and cycled: making synthetic 224x224 images on the CPU costs more than a
// GPU step, and the point here is the step and its all-reduces, not the data.
std::vector<data::Example> rank_batches(const data::Dataset& dataset,
                                        const std::vector<int64_t>& shard, int64_t B, int64_t n,
                                        bool pinned) {
  std::vector<data::Example> batches;
  for (int64_t b = 0; b < n; ++b) {
    std::vector<int64_t> idx(static_cast<size_t>(B));
    for (int64_t i = 0; i < B; ++i)
      idx[static_cast<size_t>(i)] =
          shard[static_cast<size_t>((b * B + i) % static_cast<int64_t>(shard.size()))];
    batches.push_back(dataset.get_batch(idx, pinned));
  }
  return batches;
}

// What a run was: the model kind, the batch per rank, GPT's tokens per example, the steps.
struct RunInfo {
  bool gpt = false;
  int64_t B = 0, T = 0, steps_total = 0;
  std::string amp;
};

// The end: each rank's step time, throughput and peaks, rank 0's totals and RESULT line, the
// leak report, memory_summary() and the per-rank snapshot.
void report(const Args& a, const distributed::DistEnv& env, distributed::ProcessGroup& pg,
            distributed::DistributedDataParallel& ddp, Device dev, const RunInfo& shape, double ms,
            double last_loss, const ex::LeakCheck& leak_check) {
  // Every rank's step time; throughput over all ranks uses the slowest.
  const std::vector<double> all_ms =
      pg.all_gather(ops::from_vector({ms}, {}, DType::float64, dev)).tolist();
  const double slowest = *std::max_element(all_ms.begin(), all_ms.end());
  const double per_step_items =
      static_cast<double>(shape.B * (shape.gpt ? shape.T : 1) * env.world_size);
  const double throughput = per_step_items / (slowest / 1000.0);
  const auto stats = memory::get_allocator(dev).stats();
  const int64_t comm_peak = stats.cat_bytes(memory::Category::communication).peak;
  fmt::print(
      "rank {}: {:.2f} ms/step, {:.0f} {}/s on this rank, loss {:.4f}, peak allocated {}, peak "
      "reserved {}, "
      "communication {} (peak), gradient {} (peak)\n",
      env.rank, ms, per_step_items / env.world_size / (ms / 1000.0),
      shape.gpt ? "tokens" : "images", last_loss,
      ex::fmt_bytes(static_cast<double>(memory::max_memory_allocated(dev))),
      ex::fmt_bytes(static_cast<double>(memory::max_memory_reserved(dev))),
      ex::fmt_bytes(static_cast<double>(comm_peak)),
      ex::fmt_bytes(static_cast<double>(stats.cat_bytes(memory::Category::gradient).peak)));
  std::fflush(stdout);
  pg.barrier();
  if (env.rank == 0) {
    fmt::print("all {} ranks: {:.0f} {}/s (slowest rank {:.2f} ms/step), {} all-reduces per step\n",
               env.world_size, throughput, shape.gpt ? "tokens" : "images", slowest,
               ddp.num_allreduces() / std::max<int64_t>(shape.steps_total, 1));
    fmt::print(
        "RESULT model={} world={} batch={} seq={} amp={} step_ms={:.3f} throughput={:.1f} "
        "unit={} "
        "peak_alloc_mib={:.1f} peak_reserved_mib={:.1f} comm_mib={:.1f}\n",
        a.model, env.world_size, shape.B, shape.T, shape.amp, slowest, throughput,
        shape.gpt ? "tokens/s" : "images/s",
        static_cast<double>(memory::max_memory_allocated(dev)) / 1048576.0,
        static_cast<double>(memory::max_memory_reserved(dev)) / 1048576.0,
        static_cast<double>(comm_peak) / 1048576.0);
  }
  if (leak_check.enabled()) {
    fmt::print("rank {}: ", env.rank);
    std::fflush(stdout);
    leak_check.report();
  }
  if (a.summary) std::cout << memory::memory_summary(dev) << std::flush;
  if (!a.snapshot.empty()) {
    memory::dump_snapshot(a.snapshot, dev);
    fmt::print("rank {}: snapshot written to {} (open it at https://pytorch.org/memory_viz)\n",
               env.rank, base::per_rank_path(a.snapshot));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Data-parallel training with Tally over NCCL (start it with tools/tally_launch)."};
  add_flags(app, a);

  std::string program = "train_ddp";  // "train_ddp (rank R)" once the environment is read
  return ex::run_cli(program, app, argc, argv, [&] {
    // ---- everything is checked before the process group starts ----
    const distributed::DistEnv env = distributed::DistEnv::from_env();
    const int rank = env.rank;
    program = fmt::format("train_ddp (rank {})", rank);
    const Device dev = pick_device(a, env);
    const auto amp = ex::parse_amp(a.amp);
    const bool gpt = is_gpt(a.model);
    if (!gpt && a.model != "resnet50" && a.model != "resnet18" && a.model != "tiny")
      throw std::invalid_argument(fmt::format(
          "--model: expected resnet50, resnet18, tiny, gpt2, gpt-small or gpt-tiny, got '{}'",
          a.model));
    if (gpt && app.count("--image-size") > 0)
      throw std::invalid_argument(
          fmt::format("--image-size applies to the ResNet models, not {}", a.model));
    if (!gpt && a.seq > 0)
      throw std::invalid_argument(fmt::format("--seq applies to the GPT models, not {}", a.model));
    const int64_t B = a.batch > 0 ? a.batch : (gpt ? 8 : 64);
    const double lr = a.lr > 0 ? a.lr : (gpt ? 3e-4 : 0.05);
    nn::GPTConfig cfg;
    int64_t T = 0;
    if (gpt) {
      cfg = nn::GPTConfig::preset(a.model == "gpt2"        ? "gpt2"
                                  : a.model == "gpt-small" ? "small"
                                                           : "tiny");
      T = a.seq > 0 ? a.seq : cfg.block_size;
      if (T > cfg.block_size)
        throw std::invalid_argument(
            fmt::format("--seq {} exceeds the block size {}", T, cfg.block_size));
    }
    const int64_t steps_total = a.warmup + a.steps;
    // Every rank's shard must hold its batches: B x world x steps examples in all.
    const int64_t n_examples =
        std::max<int64_t>(base::checked_mul<int64_t>(
                              base::checked_mul<int64_t>(B, env.world_size, "--batch x WORLD_SIZE"),
                              steps_total, "--batch x WORLD_SIZE x (--warmup + --steps)"),
                          256);
    if (!a.snapshot.empty()) ex::check_output_file(base::per_rank_path(a.snapshot), "--snapshot");
    manual_seed(a.seed);
    // First, before any other CUDA work: it makes cuda:LOCAL_RANK this process's device, so
    // no rank creates a context on another rank's GPU.
    auto pg = distributed::init_process_group(dev, env);
    if (!a.snapshot.empty()) memory::record_memory_history(true, 1000000, dev);

    // ---- model, data, optimizer ----
    Run run = make_run(a, gpt, cfg, T, n_examples);
    std::shared_ptr<nn::Module>& model = run.model;
    const std::shared_ptr<data::Dataset>& dataset = run.dataset;
    const int64_t image_size = run.image_size;
    model->to(dev);
    distributed::DistributedDataParallel ddp(
        model, pg,
        {.bucket_cap_mb = a.bucket_cap_mb, .first_bucket_cap_mb = a.first_bucket_cap_mb});
    const std::unique_ptr<optim::Optimizer> opt = make_optimizer(gpt, model->parameters(), lr);
    ex::Precision prec(amp, dev);
    data::DistributedSampler sampler(dataset->size(), env.world_size, env.rank,
                                     {.shuffle = true, .seed = a.seed});
    sampler.set_epoch(0);
    const std::vector<int64_t> shard = sampler.indices();

    if (rank == 0)
      fmt::print(
          "Tally train_ddp: {} ({:.2f} M parameters), world size {} ({}), batch {} per rank{}, "
          "{}+{} steps, "
          "amp {}, {} buckets (cap {} MiB, first {} MiB), {} of buckets\n",
          a.model, model->num_parameters() / 1e6, env.world_size, pg->backend(), B,
          gpt ? fmt::format(" x {} tokens", T) : fmt::format(" x 3x{}x{}", image_size, image_size),
          a.warmup, a.steps, prec.name(), ddp.num_buckets(), a.bucket_cap_mb, a.first_bucket_cap_mb,
          ex::fmt_bytes(static_cast<double>(ddp.bucket_bytes())));
    std::fflush(stdout);

    // ---- train ----
    model->train();
    const bool pinned = dev.type == DeviceType::cuda;
    const int64_t n_batches = std::min<int64_t>(steps_total, 4);
    const std::vector<data::Example> batches = rank_batches(*dataset, shard, B, n_batches, pinned);
    ex::Stopwatch clock;
    ex::LeakCheck leak_check(a.detect_leaks, dev);
    double last_loss = 0;
    for (int64_t step = 0; step < steps_total; ++step) {
      if (step == a.warmup) {
        memory::synchronize(dev);
        pg->barrier();
        memory::reset_peak_memory_stats(dev);
        clock.reset();
      }
      const data::Example& host = batches[static_cast<size_t>(step % n_batches)];
      Tensor x, y;
      {
        memory::CategoryScope input(memory::Category::input);
        x = ops::to_device_async(host.input, dev);
        y = ops::to_device_async(host.target, dev);
      }
      const Tensor loss = ex::train_step(*opt, prec, {x, y}, [&](const std::vector<Tensor>& in) {
        return std::vector<Tensor>{
            gpt ? ddp.forward([&] { return (*run.gpt)(in[0], in[1]).second; })
                : cross_entropy(ddp(in[0]), in[1])};
      })[0];
      leak_check.step();
      if (step == steps_total - 1) last_loss = loss.item();
    }
    memory::synchronize(dev);
    const double ms = clock.ms() / static_cast<double>(a.steps);
    report(a, env, *pg, ddp, dev, {gpt, B, T, steps_total, prec.name()}, ms, last_loss, leak_check);
    return 0;
  });
}
