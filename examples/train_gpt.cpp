// train_gpt: trains a GPT (GPT-2's structure, tied embeddings) on a byte-level text corpus
// (default: Debian's fortunes) or synthetic tokens, with a progress bar (loss, tokens/s,
// step time, peak memory), a validation loss at the end, an optional text sample, and
// optionally a memory snapshot and memory summary.
//
//   train_gpt --preset tiny --steps 200 --sample 200
//   train_gpt --preset gpt2 --data synthetic --batch 16 --seq 1024 --steps 20 --device cuda --amp
//   bf16
//   train_gpt --preset gpt2 --data synthetic --batch 16 --amp bf16 --estimate h200   (no GPU)
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "examples/cli_common.h"
#include "examples/metrics_log.h"
#include "examples/train_common.h"
#include "nn/checkpoint.h"
#include "nn/data/synthetic.h"
#include "nn/data/text.h"
#include "nn/models/gpt.h"
#include "optim/adam.h"
#include "optim/clip_grad.h"
#include "optim/lr_scheduler.h"
#include "tensor/pinned.h"

using namespace tally;
namespace ex = tally::examples;

namespace {

struct Args {
  std::string preset = "tiny";
  std::string data = data::TextCorpus::kDefaultPath;
  int64_t seq = 0;  // 0: the preset's block size
  int64_t batch = 16;
  int64_t steps = 200;
  double lr = 1e-3;
  double weight_decay = 0.1;
  double clip = 1.0;
  std::string device = "cpu";
  std::string snapshot;
  std::string metrics;  // --metrics FILE.jsonl
  bool summary = false;
  uint64_t seed = 0;
  std::string checkpoint = "none";
  std::string amp = "off";
  std::string offload = "none";
  std::string optimizer = "adamw";
  bool step_in_backward = false;
  bool fused_classifier = false;
  int64_t sample = 0;
  int64_t eval_batches = 8;
  int64_t log_every = 10;
  int64_t vocab = 0;          // synthetic data: the vocabulary (0: the preset's)
  std::string estimate;       // a dry run's target: predict memory instead of training
  std::string memory_budget;  // --checkpoint auto: the planner's budget
  std::string memory_limit;   // caps what the device may reserve
  bool detect_leaks = false;
  bool cuda_graphs = false;
};

// Sampling at temperature 0.8 of `n` bytes after `prompt`, from the logits of the 256 byte
// tokens (a preset's vocabulary can be larger; the text has no other tokens).
std::string sample_text(nn::GPT& model, const std::string& prompt, int64_t n, Device dev,
                        Generator& gen) {
  NoGradGuard ng;
  model.eval();
  std::string text = prompt;
  const int64_t T = model.config.block_size;
  for (int64_t i = 0; i < n; ++i) {
    const std::string ctx =
        text.size() > static_cast<size_t>(T) ? text.substr(text.size() - T) : text;
    const Tensor idx =
        data::TextCorpus::encode(ctx).reshape({1, static_cast<int64_t>(ctx.size())}).to(dev);
    const Tensor logits = model(idx)
                              .first.select(1, static_cast<int64_t>(ctx.size()) - 1)
                              .narrow(1, 0, data::TextCorpus::kVocabSize);  // [1, 256]
    const Tensor probs = softmax(div(logits.to(DType::float32), 0.8), -1).to(Device::cpu());
    const std::vector<double> p = probs.tolist();
    const double u = rand({1}, {}, &gen).item();
    double c = 0;
    size_t tok = p.size() - 1;
    for (size_t k = 0; k < p.size(); ++k) {
      c += p[k];
      if (u < c) {
        tok = k;
        break;
      }
    }
    text.push_back(static_cast<char>(tok));
  }
  model.train();
  return text;
}

// Text fit for a terminal: a byte sequence that is not UTF-8, or a control character other
// than a line break or tab (an untrained model's bytes often are), becomes U+FFFD.
std::string printable(const std::string& text) {
  const std::string utf8 =
      nlohmann::json::parse(nlohmann::json(text).dump(-1, ' ', /*ensure_ascii=*/false,
                                                      nlohmann::json::error_handler_t::replace))
          .get<std::string>();
  std::string out;
  out.reserve(utf8.size());
  for (const char c : utf8) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\n' && c != '\t') || u == 0x7f)
      out += "\xEF\xBF\xBD";
    else
      out += c;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Train a GPT with Tally and see where its memory goes."};
  app.add_option("--preset", a.preset, "tiny | small | gpt2 | gpt2-medium")->capture_default_str();
  app.add_option("--data", a.data, "a text file (byte-level tokens) or 'synthetic'")
      ->capture_default_str();
  app.add_option("--seq", a.seq, "sequence length (0: the preset's block size)")
      ->check(ex::int_range(0));
  ex::add_checked_option(app, "--batch", a.batch, "batch size", ex::int_range(1));
  ex::add_checked_option(app, "--steps", a.steps, "training steps", ex::int_range(1));
  ex::add_checked_option(app, "--lr", a.lr, "peak learning rate (linear warm-up, cosine decay)",
                         ex::positive_real());
  ex::add_checked_option(app, "--weight-decay", a.weight_decay, "AdamW weight decay",
                         ex::non_negative_real());
  ex::add_checked_option(app, "--clip", a.clip, "gradient clipping norm (0: off)",
                         ex::non_negative_real());
  app.add_option("--device", a.device, "cpu | cuda")->capture_default_str();
  app.add_option("--snapshot", a.snapshot, "write a memory_viz snapshot of the run to FILE");
  app.add_flag("--summary", a.summary, "print memory_summary() at the end");
  app.add_option("--metrics", a.metrics,
                 "write one JSON record per logged step (and the validation) to FILE.jsonl");
  app.add_flag("--detect-leaks", a.detect_leaks,
               "report allocations that survive each step and grow, by source line "
               "(inspect::LeakDetector)");
  ex::add_checked_option(app, "--seed", a.seed, "seed", ex::seed_value());
  ex::add_memory_options(app, a.checkpoint, a.amp, a.memory_budget, a.estimate, a.offload);
  app.add_option("--memory-limit", a.memory_limit,
                 "cap what the device may reserve (6GiB, 900MiB, ...): past it the run stops with "
                 "out-of-memory and reports what would fit");
  app.add_option("--optimizer", a.optimizer,
                 "adamw | adamw8bit (block-wise 8-bit moments) | sgd (momentum 0.9)")
      ->capture_default_str();
  app.add_flag("--fused-classifier", a.fused_classifier,
               "lm_head and cross-entropy fused and chunked over rows: the [B*T, vocab] logits "
               "never exist whole (with --checkpoint auto the planner also picks its chunk "
               "size from --memory-budget)");
  app.add_flag("--step-in-backward", a.step_in_backward,
               "update each parameter as soon as its gradient is ready and free the gradient "
               "(needs --clip 0, the default with it; not with --amp fp16)");
  app.add_flag("--cuda-graphs", a.cuda_graphs,
               "capture the training step into a CUDA graph at step 2 and replay it (--device "
               "cuda; not with --offload, --step-in-backward, adamw8bit)");
  app.add_option("--sample", a.sample, "print a sample of this many bytes at the end (text data)")
      ->check(ex::int_range(0, 1 << 20));
  ex::add_checked_option(app, "--eval-batches", a.eval_batches, "validation batches",
                         ex::int_range(1));
  ex::add_checked_option(app, "--log-every", a.log_every, "progress update interval in steps",
                         ex::int_range(1));
  app.add_option("--vocab", a.vocab, "vocabulary of synthetic data (0: the preset's)")
      ->check(ex::int_range(0, 1 << 24));

  return ex::run_cli("train_gpt", app, argc, argv, [&] {
    // ---- everything is checked before the first step ----
    // Before the device is parsed: what --cuda-graphs cannot do is the first thing said.
    ex::check_cuda_graphs(a.cuda_graphs, a.device, a.estimate, a.amp, a.offload, a.step_in_backward,
                          a.optimizer);
    const std::unique_ptr<memory::DryRun> dry =
        ex::make_dry_run(a.estimate, app.count("--device") > 0);
    const Device dev = dry ? dry->device() : ex::parse_device(a.device);
    ex::apply_memory_limit(a.memory_limit, dev);
    const bool pin = memory::behaves_as(dev) == DeviceType::cuda;  // pinned host batches
    const ex::AutoPlan auto_plan =
        ex::parse_auto_plan(a.checkpoint, a.amp, a.memory_budget, a.offload);
    nn::OffloadSpec offload = auto_plan.offload;
    ex::check_optimizer(a.optimizer, {"adamw", "adamw8bit", "sgd"});
    if (a.step_in_backward && app.count("--clip") == 0) a.clip = 0;  // clipping needs every grad
    ex::check_step_in_backward(a.step_in_backward, a.amp, a.clip);
    const optim::AdamOptions adam_options{.lr = a.lr,
                                          .beta1 = 0.9,
                                          .beta2 = 0.95,
                                          .eps = 1e-8,
                                          .weight_decay = a.weight_decay,
                                          .capturable = a.cuda_graphs};
    const optim::SGDOptions sgd_options{
        .lr = a.lr, .momentum = 0.9, .weight_decay = a.weight_decay, .capturable = a.cuda_graphs};
    std::optional<DType> amp = auto_plan.amp_auto ? std::nullopt : ex::parse_amp(a.amp);
    nn::CheckpointSpec ckpt =
        auto_plan.checkpoint_auto ? nn::CheckpointSpec{} : nn::parse_checkpoint_spec(a.checkpoint);
    if (!a.snapshot.empty()) ex::check_output_file(a.snapshot, "--snapshot");
    if (!a.metrics.empty()) ex::check_output_file(a.metrics, "--metrics");
    manual_seed(a.seed);
    // --snapshot: recorded from before the text and the model exist, so that every block has
    // its alloc in the trace (memory_viz shows a block from before the recording as `unknown`).
    if (!a.snapshot.empty() && !dry) memory::record_memory_history(true, 1000000, dev);

    nn::GPTConfig cfg = ex::for_flag("--preset", [&] { return nn::GPTConfig::preset(a.preset); });
    const bool synthetic = a.data == "synthetic";
    if (!synthetic && a.vocab > 0)
      throw std::invalid_argument("--vocab applies to --data synthetic only (text is 256 bytes)");
    if (synthetic && a.sample > 0)
      throw std::invalid_argument("--sample needs a text corpus, not --data synthetic");
    const int64_t T = a.seq > 0 ? a.seq : cfg.block_size;
    if (T > cfg.block_size)
      throw std::invalid_argument(
          fmt::format("--seq {} exceeds the preset's block size {}", T, cfg.block_size));
    std::unique_ptr<data::TextCorpus> corpus;
    if (!synthetic) {
      corpus = ex::for_flag("--data", [&] { return std::make_unique<data::TextCorpus>(a.data); });
      if (cfg.vocab_size < data::TextCorpus::kVocabSize)
        throw std::invalid_argument(
            fmt::format("--preset {}: vocabulary {} is smaller than the byte vocabulary 256",
                        a.preset, cfg.vocab_size));
      // A window of T tokens and its target (one token later) must fit in each split.
      for (const data::Split split : {data::Split::train, data::Split::val}) {
        const int64_t n = corpus->num_tokens(split);
        if (n <= T)
          throw std::invalid_argument(fmt::format(
              "--data {}: the {} split has {} tokens, too short for --seq {} (needs more than {}; "
              "use a shorter --seq or a longer text)",
              a.data, split == data::Split::train ? "training" : "validation", n, T, T));
      }
    } else if (a.vocab > 0) {
      cfg.vocab_size = a.vocab;
    }
    cfg.fused_classifier = a.fused_classifier;

    // kEstimateSteps steps of a variation of this run and its validation on a dry run's device, the
    // model built without host memory: what the planner and the out-of-memory report predict.
    auto build = [&](int64_t chunk_bytes = 0) {
      nn::BuildOnDevice on(Device::meta());
      nn::GPTConfig c = cfg;
      if (chunk_bytes > 0) c.fused_classifier_chunk_bytes = chunk_bytes;
      return std::make_shared<nn::GPT>(c);
    };
    auto dry_steps = [&](Device d, const ex::RunShape& shape) {
      const nn::PlanCandidate& c = shape.plan;
      auto m = build(c.classifier_chunk_bytes);
      m->to(d);
      nn::enable_checkpointing(*m, c.checkpoint);
      nn::offload_activations(*m, c.offload);
      auto o = ex::make_optimizer(a.optimizer, m->parameters(), adam_options, sgd_options);
      ex::Precision p(c.amp, d);
      if (a.step_in_backward) p.step_in_backward(*o);
      Tensor x, y;
      {
        memory::CategoryScope input(memory::Category::input);
        x = ops::randint(0, cfg.vocab_size, {shape.batch, T}, DType::int64, d);
        y = ops::randint(0, cfg.vocab_size, {shape.batch, T}, DType::int64, d);
      }
      for (int64_t s = 0; s < ex::kEstimateSteps; ++s) {
        o->zero_grad(true);
        Tensor loss;
        {
          memory::PhaseScope phase("forward");
          auto guard = p.autocast();
          loss = (*m)(x, y).second;
        }
        p.backward_and_step(loss, *o);
      }
      // Then the validation the program runs after training (a forward in eval mode without
      // gradients): its blocks can need segments that training left no room for (GPT-2 B16,
      // 2 segments: 5,310 MiB reserved by training, about 100 MiB more after validation).
      NoGradGuard ng;
      m->eval();
      auto guard = p.autocast();
      (void)(*m)(x, y).second;
    };
    if (auto_plan.checkpoint_auto) {
      // The planner dry-runs each candidate: kEstimateSteps steps on batches of this run's shape.
      // With --fused-classifier the chunk is searched too: the default 256 MiB, then smaller
      // ones for a plan that a smaller chunk would bring under the budget.
      std::vector<int64_t> chunks;
      if (cfg.fused_classifier)
        for (const int64_t mib : {256, 64, 16, 4})
          if ((mib << 20) <= cfg.fused_classifier_chunk_bytes) chunks.push_back(mib << 20);
      const nn::PlanCandidate chosen = ex::plan_run(
          auto_plan, amp, dev, nn::checkpoint_block_count(*build()),
          [&](Device d, const nn::PlanCandidate& c) {
            dry_steps(d, {c, a.batch});
          },
          ex::kEstimateSteps, chunks);
      ckpt = chosen.checkpoint;
      amp = chosen.amp;
      offload = chosen.offload;
      if (chosen.classifier_chunk_bytes > 0)
        cfg.fused_classifier_chunk_bytes = chosen.classifier_chunk_bytes;
      a.checkpoint = ckpt.str();
    }

    // What the program holds on the device before the model (the text on the CPU).
    const size_t held = dry ? 0 : memory::memory_allocated(dev);
    try {  // running out of memory is reported (the catch below)
      auto model = std::make_shared<nn::GPT>(cfg);
      model->to(dev);
      nn::enable_checkpointing(*model, ckpt);
      const std::shared_ptr<ActivationOffloader> offloader =
          nn::offload_activations(*model, offload);
      const std::unique_ptr<optim::Optimizer> opt_ptr =
          ex::make_optimizer(a.optimizer, model->parameters(), adam_options, sgd_options);
      optim::Optimizer& opt = *opt_ptr;
      // Warm-up: 10% of the steps, at least 1 and fewer than all (none for a 1-step run).
      const int64_t warmup = std::min<int64_t>(std::max<int64_t>(1, a.steps / 10), a.steps - 1);
      optim::WarmupCosineLR sched(opt, warmup, a.steps, a.lr * 0.1);
      ex::Precision prec(amp, dev, a.cuda_graphs);
      if (a.step_in_backward) prec.step_in_backward(opt);
      ex::GraphedStep graphed(a.cuda_graphs, dev);
      Generator gen(a.seed + 17);
      data::SyntheticTokens synth(1 << 20, cfg.vocab_size, {T}, a.seed);

      // The host batch and its copy on the device are both `input` (an untagged host batch
      // would be `unknown` in the snapshot).
      auto next_batch = [&](data::Split split) -> data::Example {
        data::Example b;
        if (synthetic) {
          std::vector<int64_t> idx(static_cast<size_t>(a.batch));
          for (auto& i : idx)
            i = static_cast<int64_t>(rand({1}, {}, &gen).item() * synth.size()) % synth.size();
          memory::CategoryScope input(memory::Category::input);
          b = synth.get_batch(idx, pin);
        } else {
          memory::CategoryScope input(memory::Category::input);
          b = corpus->get_batch(a.batch, T, gen, split, pin);
        }
        memory::CategoryScope input(memory::Category::input);
        return {ops::to_device_async(b.input, dev), ops::to_device_async(b.target, dev)};
      };

      fmt::print(
          "Tally train_gpt: preset {} ({:.2f} M parameters), data {}{}, device {}, batch {} x {} "
          "tokens, "
          "{} steps, {} lr {}, checkpoint {}, amp {}{}{}\n",
          a.preset, model->num_parameters() / 1e6, synthetic ? "synthetic" : a.data,
          synthetic ? "" : fmt::format(" ({} tokens)", corpus->num_tokens()), dev.str(), a.batch, T,
          a.steps, std::string(opt.name()) + (a.step_in_backward ? " (step-in-backward)" : ""),
          a.lr, a.checkpoint, prec.name(),
          offload.enabled() ? ", offload " + offload.str() : std::string(),
          a.cuda_graphs ? ", CUDA graphs" : "");

      model->train();
      ex::Progress bar(a.steps, isatty(fileno(stdout)));
      ex::MetricsLog metrics(dry ? std::string() : a.metrics);
      ex::LeakCheck leak_check(a.detect_leaks && !dry, dev, isatty(fileno(stdout)));
      ex::Stopwatch clock;
      Tensor loss_acc = zeros({}, TensorOptions{}.with_device(dev));
      int64_t window = 0;
      double first_loss = -1, last_loss = 0;
      const int64_t steps = dry ? std::min(a.steps, ex::kEstimateSteps) : a.steps;
      for (int64_t step = 1; step <= steps; ++step) {
        const data::Example batch = next_batch(data::Split::train);
        // zero_grad, forward, backward, clipping, optimizer step: replayed from step 2 with
        // --cuda-graphs.
        const Tensor loss =
            graphed({batch.input, batch.target}, [&](const std::vector<Tensor>& in) {
              opt.zero_grad(true);
              Tensor l;
              {
                memory::PhaseScope phase("forward");
                auto guard = prec.autocast();
                l = (*model)(in[0], in[1]).second;
              }
              {
                memory::PhaseScope phase("backward");
                prec.scaler().scale(l).backward();
              }
              if (!a.step_in_backward) {  // else every parameter stepped inside backward
                if (a.clip > 0) {
                  prec.scaler().unscale_(opt);
                  optim::clip_grad_norm_(model->parameters(), a.clip);
                }
                prec.scaler().step(opt);
                prec.scaler().update();
              }
              return std::vector<Tensor>{l};
            })[0];
        sched.step();
        {
          NoGradGuard ng;
          loss_acc = add(loss_acc, loss.detach().to(DType::float32));
        }
        ++window;
        leak_check.step();
        if (dry) continue;  // no values to read
        if (step % a.log_every == 0 || step == a.steps) {
          last_loss = loss_acc.item() / static_cast<double>(window);
          if (first_loss < 0) first_loss = last_loss;
          memory::synchronize(dev);
          const double ms = clock.ms() / static_cast<double>(window);
          clock.reset();
          metrics.write({{"step", step},
                         {"loss", last_loss},
                         {"ms_per_step", ms},
                         {"tokens_per_s", static_cast<double>(a.batch * T) / (ms / 1000.0)},
                         {"lr", opt.get_lr()},
                         {"peak_allocated", memory::max_memory_allocated(dev)},
                         {"peak_reserved", memory::max_memory_reserved(dev)}});
          bar.update(
              step,
              fmt::format("loss {:.4f} | {:.0f} tok/s | {:.1f} ms/step | lr {:.2e} | peak {}",
                          last_loss, static_cast<double>(a.batch * T) / (ms / 1000.0), ms,
                          opt.get_lr(),
                          ex::fmt_bytes(static_cast<double>(memory::max_memory_allocated(dev)))));
          loss_acc = zeros({}, TensorOptions{}.with_device(dev));
          window = 0;
        }
      }
      if (dry) return ex::finish_dry_run(*dry, "", a.snapshot, a.summary);
      bar.done();

      // ---- validation ----
      double val = 0;
      {
        NoGradGuard ng;
        model->eval();
        for (int64_t i = 0; i < a.eval_batches; ++i) {
          const data::Example b = next_batch(data::Split::val);
          auto guard = prec.autocast();
          val += (*model)(b.input, b.target).second.item();
        }
        model->train();
      }
      val /= static_cast<double>(a.eval_batches);  // >= 1
      metrics.write({{"step", a.steps}, {"val_loss", val}});
      fmt::print(
          "val loss {:.4f} (chance: ln {} = {:.4f}), train loss {:.4f} -> {:.4f}, peak allocated "
          "{}, "
          "peak reserved {}\n",
          val, cfg.vocab_size, std::log(static_cast<double>(cfg.vocab_size)), first_loss, last_loss,
          ex::fmt_bytes(static_cast<double>(memory::max_memory_allocated(dev))),
          ex::fmt_bytes(static_cast<double>(memory::max_memory_reserved(dev))));
      ex::print_offload(offloader, a.steps);
      leak_check.report();
      if (a.sample > 0 && !synthetic) {
        Generator sgen(a.seed + 99);
        fmt::print("--- sample ---\n{}\n--------------\n",
                   printable(sample_text(*model, "Q:", a.sample, dev, sgen)));
      }
      ex::write_memory_outputs(dev, a.summary, a.snapshot);
      return 0;
    } catch (const memory::OutOfMemoryError& e) {
      // A real run: the error and what would fit. A dry run: its report, marked as not fitting.
      if (!dry)
        return ex::report_out_of_memory(
            "train_gpt", e, dev,
            {{ckpt, amp, offload, cfg.fused_classifier ? cfg.fused_classifier_chunk_bytes : 0},
             a.batch},
            held, dry_steps);
      return ex::finish_dry_run(*dry, e.what(), a.snapshot, a.summary);
    }
  });
}
