// train_model: trains any model of the registry (nn/models/registry.h) by name on its synthetic
// batches, with the shared trainer (examples/trainer.h): the progress bar (loss, step time,
// peak memory), a validation loss on held-out synthetic batches at the end, and the memory
// flags of train_gpt (--checkpoint, --amp, --offload, --estimate, --memory-budget, ...).
//
//   train_model --model llama --steps 20
//   train_model --model llama --preset 7b --batch 1 --seq 4096 --amp bf16 --checkpoint blocks \
//       --estimate h200                                        (a dry run: no GPU, no host copy)
//   train_model --model resnet --preset resnet18 --batch 64 --device cuda --amp bf16
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <memory>

#include "examples/cli_common.h"
#include "examples/trainer.h"
#include "memory/estimate.h"
#include "nn/checkpoint.h"
#include "nn/layers.h"
#include "nn/models/registry.h"
#include "tensor/pinned.h"

using namespace tally;
namespace ex = tally::examples;

namespace {

struct Args {
  ex::TrainFlags t;  // defaults set by add_flags
  std::string model;
  nn::ModelOptions opts;  // --preset, --seq, --image-size, --num-classes, --fused-classifier
  int64_t batch = 8;
  int64_t steps = 20;
  int64_t eval_batches = 4;
};

void add_flags(CLI::App& app, Args& a) {
  ex::TrainFlags& t = a.t;
  app.add_option("--model", a.model, nn::model_names())->required();
  app.add_option("--preset", a.opts.preset,
                 "the model's preset (default: its first, the smallest)");
  app.add_option("--seq", a.opts.seq, "token models: sequence length (0: the preset's context)")
      ->check(ex::int_range(0));
  app.add_option("--image-size", a.opts.image_size, "image models: height = width (0: 32)")
      ->check(ex::int_range(0, 1 << 14));
  app.add_option("--num-classes", a.opts.num_classes, "image models: classes (0: 10)")
      ->check(ex::int_range(0, 1 << 24));
  app.add_flag("--fused-classifier", a.opts.fused_classifier,
               "token models: the classifier and cross-entropy fused and chunked over rows (the "
               "[B*T, vocab] logits never exist whole)");
  ex::add_token_model_flags(app, t, a.batch, a.steps, "weight decay");
  app.add_option("--optimizer", t.optimizer,
                 "adamw | adam | adamw8bit (block-wise 8-bit moments) | sgd (momentum 0.9) | "
                 "adamw:cpu | adamw8bit:cpu (state and master weights in pinned host memory)")
      ->capture_default_str();
  ex::add_token_step_flags(app, t,
                           "capture the training step into a CUDA graph at step 2 and replay it "
                           "(--device cuda; not with --offload, --step-in-backward, adamw8bit)");
  ex::add_checked_option(app, "--eval-batches", a.eval_batches, "validation batches",
                         ex::int_range(1));
  ex::add_checked_option(app, "--log-every", t.log_every, "progress update interval in steps",
                         ex::int_range(1));
}

// The --optimizer choices.
const std::vector<std::string> kOptimizers = {"adamw", "adam",      "adamw8bit",
                                              "sgd",   "adamw:cpu", "adamw8bit:cpu"};

// The entry and its options, every model flag checked against the kind of model.
const nn::ModelEntry& resolve(Args& a) {
  const nn::ModelEntry& e =
      ex::for_flag("--model", [&] { return std::cref(nn::model_entry(a.model)); });
  const bool images = e.input == nn::ModelEntry::Input::images;
  if (images && (a.opts.seq > 0 || a.opts.fused_classifier))
    throw std::invalid_argument(fmt::format(
        "--model {} takes images: --seq and --fused-classifier apply to token models", e.name));
  if (!images && (a.opts.image_size > 0 || a.opts.num_classes > 0))
    throw std::invalid_argument(fmt::format(
        "--model {} takes tokens: --image-size and --num-classes apply to image models", e.name));
  a.opts = nn::resolve_options(e, a.opts);
  if (!images && e.context) {
    const int64_t context = e.context(a.opts.preset);
    if (a.opts.seq > context)
      throw std::invalid_argument(
          fmt::format("--seq {} exceeds --model {} --preset {}'s context {}", a.opts.seq, e.name,
                      a.opts.preset, context));
  }
  return e;
}

// The entry's loss as the trainer's forward.
ex::Trainer::Forward forward_of(const nn::ModelEntry& e, nn::Module& m) {
  return [&e, &m](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{e.loss(m, {in[0], in[1]})};
  };
}

// The entry's loss over `in` without gradients, in `parts` equal micro-batches as training
// splits it (--grad-accum), so that evaluation needs no more memory than a training
// micro-batch: the mean of their losses.
Tensor eval_loss(const nn::ModelEntry& e, nn::Module& m, const std::vector<Tensor>& in,
                 int64_t parts) {
  NoGradGuard ng;
  const int64_t len = in[0].size(0) / parts;
  Tensor total;
  for (int64_t k = 0; k < parts; ++k) {
    const Tensor l =
        e.loss(m, {ops::narrow(in[0], 0, k * len, len), ops::narrow(in[1], 0, k * len, len)});
    total = total.defined() ? add(total, l) : l;
  }
  return parts > 1 ? mul(total, 1.0 / static_cast<double>(parts)) : total;
}

// Batch `step` of the synthetic set seeded `seed`, on `dev` (both copies tagged `input`).
std::vector<Tensor> batch_on(const nn::ModelEntry& e, const Args& a, int64_t step, uint64_t seed,
                             Device dev) {
  memory::CategoryScope input(memory::Category::input);
  const data::Example b = e.synthetic_batch(a.opts, a.batch, step, seed);
  return {ops::to_device_async(b.input, dev), ops::to_device_async(b.target, dev)};
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  ex::TrainFlags& t = a.t;
  CLI::App app{"Train any registry model (" + nn::model_names() +
               ") with Tally on synthetic batches and see where its memory goes."};
  add_flags(app, a);
  return ex::run_trainer("train_model", app, t, argc, argv, kOptimizers, [&](ex::Trainer& tr) {
    const nn::ModelEntry& entry = resolve(a);
    tr.start();
    const Device dev = tr.device();
    // The batch's shapes and dtypes (one small host batch), for the dry runs' inputs.
    const data::Example shape_of = entry.synthetic_batch(a.opts, 1, 0, t.seed);

    // kEstimateSteps steps of a variation of this run and its validation on a dry run's device,
    // the model built there (no host memory): what the planner and the out-of-memory report
    // predict.
    auto build_on = [&](Device d) {
      nn::BuildOnDevice on(d);
      return entry.build(a.opts);
    };
    const ex::Trainer::DrySteps dry_steps = [&](Device d, const ex::RunShape& shape) {
      auto m = build_on(d);  // as the real run builds it: on the device
      tr.dry_train(
          d, shape.plan, *m, [&](nn::Module& mm) { return ex::make_token_model_optimizer(t, mm); },
          [&] {
            memory::CategoryScope input(memory::Category::input);
            std::vector<Tensor> in;
            for (const Tensor& x : {shape_of.input, shape_of.target}) {
              Shape s = x.sizes();
              s[0] = shape.batch;
              in.push_back(ops::empty(s, x.dtype(), d));
            }
            return in;
          },
          forward_of(entry, *m),
          [&](const std::vector<Tensor>& in) { (void)eval_loss(entry, *m, in, tr.grad_accum()); });
    };
    // The model's blocks, and --checkpoint checked against them, before any real work: on a
    // meta device of its own whose capacity no model reaches (the default meta device replays
    // this host's memory, which a 7B model's parameters exceed).
    {
      memory::DryRun scratch({.capacity = size_t{1} << 50, .max_history = 0});
      const std::shared_ptr<nn::Module> m = build_on(scratch.device());
      nn::enable_checkpointing(*m, tr.checkpoint);
      tr.plan(*m, dry_steps, a.batch);
    }

    return tr.run({{tr.checkpoint, tr.amp, tr.offload}, a.batch}, dry_steps, [&] {
      // Built and initialised on the device itself: no host copy of a large model.
      std::shared_ptr<nn::Module> model = build_on(dev);
      // Warm-up: 10% of the steps; down to lr / 10.
      const ex::Trainer::Training run = tr.prepare(
          *model, [&](nn::Module& mm) { return ex::make_token_model_optimizer(t, mm); }, a.steps,
          10, 0.1);
      optim::Optimizer* opt = run.opt.get();
      const bool tokens = entry.input == nn::ModelEntry::Input::tokens;
      const std::string shape_text = tokens
                                         ? fmt::format("{} x {} tokens", a.batch, a.opts.seq)
                                         : fmt::format("{} x {}x{}x{}", a.batch, a.opts.in_channels,
                                                       a.opts.image_size, a.opts.image_size);
      fmt::print(
          "Tally train_model: {} {} ({:.2f} M parameters), synthetic data, device {}, batch "
          "{}, "
          "{} steps, {} lr {}, {}\n",
          entry.name, a.opts.preset, model->num_parameters() / 1e6, dev.str(), shape_text, a.steps,
          t.optimizer + (t.step_in_backward ? " (step-in-backward)" : ""), t.lr, tr.describe());

      model->train();
      double first_loss = -1, last_loss = 0;
      const int64_t steps = tr.dry() ? std::min(a.steps, ex::kEstimateSteps) : a.steps;
      for (int64_t step = 1; step <= steps; ++step) {
        const Tensor loss =
            tr.step(batch_on(entry, a, step - 1, t.seed, dev), forward_of(entry, *model))[0];
        run.sched->step();
        if (!tr.end_step(step, loss)) continue;
        const ex::Trainer::Window w = tr.read_window();
        last_loss = w.loss;
        if (first_loss < 0) first_loss = last_loss;
        const double per_s =
            static_cast<double>(a.batch * (tokens ? a.opts.seq : 1)) / (w.ms / 1000.0);
        tr.log(step, w, {{tokens ? "tokens_per_s" : "samples_per_s", per_s}},
               fmt::format("loss {:.4f} | {:.0f} {}/s | {:.1f} ms/step | lr {:.2e}", w.loss, per_s,
                           tokens ? "tok" : "samples", w.ms, opt->get_lr()));
      }
      if (const std::optional<int> rc = tr.end_training()) return *rc;  // a dry run's report

      // Held-out synthetic batches (another seed), in eval mode without gradients.
      double val = 0;
      {
        NoGradGuard ng;
        model->eval();
        for (int64_t i = 0; i < a.eval_batches; ++i) {
          const std::vector<Tensor> b = batch_on(entry, a, i, t.seed + 1000003, dev);
          auto guard = tr.precision().autocast();
          val += eval_loss(entry, *model, b, tr.grad_accum()).item();
        }
        model->train();
        val /= static_cast<double>(a.eval_batches);
      }
      tr.write_metrics({{"step", a.steps}, {"val_loss", val}});
      fmt::print("val loss {:.4f}, train loss {:.4f} -> {:.4f}, {}\n", val, first_loss, last_loss,
                 tr.peaks());
      return tr.finish(run.offloader, a.steps);
    });
  });
}
