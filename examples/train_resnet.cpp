// train_resnet: trains a ResNet (torchvision's structure) on Fashion-MNIST, CIFAR-10 or
// synthetic images, with a progress bar (loss, accuracy, step time, peak memory), an
// evaluation at the end, and optionally a memory snapshot and memory summary.
//
//   train_resnet --arch tiny --dataset fashion-mnist --epochs 1 --summary
//   train_resnet --arch resnet18 --device cuda --epochs 2 --snapshot resnet18.pickle
//   train_resnet --arch resnet50 --dataset synthetic --image-size 224 --batch 64 --steps 20
//                --device cuda --checkpoint 4-segments --amp fp16
//   train_resnet --arch resnet50 --dataset synthetic --image-size 224 --amp fp16 --estimate h200
//                (the memory that run takes on an H200, predicted on any machine)
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <iostream>
#include <memory>

#include "examples/cli_common.h"
#include "examples/metrics_log.h"
#include "examples/train_common.h"
#include "nn/checkpoint.h"
#include "nn/data/cifar.h"
#include "nn/data/dataloader.h"
#include "nn/data/mnist.h"
#include "nn/data/synthetic.h"
#include "nn/models/resnet.h"
#include "optim/adam.h"
#include "optim/lr_scheduler.h"
#include "optim/sgd.h"

using namespace tally;
namespace ex = tally::examples;

namespace {

struct Args {
  std::string arch = "tiny";
  std::string dataset = "fashion-mnist";
  std::string data_root;
  int64_t batch = 128;
  int64_t epochs = 1;
  int64_t steps = 0;  // > 0: stop after this many steps
  double lr = 0.05;
  double momentum = 0.9;
  double weight_decay = 5e-4;
  std::string optimizer = "sgd";
  bool step_in_backward = false;
  std::string device = "cpu";
  int64_t image_size = 0;  // 0: the dataset's own
  std::string snapshot;
  std::string metrics;  // --metrics FILE.jsonl
  bool summary = false;
  uint64_t seed = 0;
  std::string checkpoint = "none";
  std::string amp = "off";
  std::string offload = "none";
  int64_t eval_batches = 0;  // 0: the whole test set
  int64_t log_every = 10;
  std::string estimate;       // a dry run's target: predict memory instead of training
  std::string memory_budget;  // --checkpoint auto: the planner's budget
  std::string memory_limit;   // caps what the device may reserve
  bool detect_leaks = false;
  bool cuda_graphs = false;
  bool channels_last = false;
};

// --optimizer over the model's parameters.
std::unique_ptr<optim::Optimizer> make_optimizer(const Args& a, nn::Module& model) {
  return ex::make_optimizer(
      a.optimizer, model.parameters(),
      optim::AdamOptions{.lr = a.lr, .weight_decay = a.weight_decay, .capturable = a.cuda_graphs},
      optim::SGDOptions{.lr = a.lr,
                        .momentum = a.momentum,
                        .weight_decay = a.weight_decay,
                        .capturable = a.cuda_graphs});
}

std::shared_ptr<nn::Module> make_model(const Args& a, int64_t classes, int64_t channels) {
  return nn::resnet_by_name(a.arch, {.num_classes = classes, .in_channels = channels});
}

// Nearest-neighbour upscaling by an integer factor (28 -> 224 for Fashion-MNIST at 224).
Tensor resize(const Tensor& x, int64_t size) {
  const int64_t h = x.size(2), w = x.size(3);
  if (size == 0 || size == h) return x;
  if (size % h != 0 || h != w)
    throw std::invalid_argument(fmt::format(
        "--image-size {}: the images are {}x{}; only integer multiples are supported", size, h, w));
  const int64_t k = size / h;
  const int64_t B = x.size(0), C = x.size(1);
  return x.reshape({B, C, h, 1, w, 1}).expand({B, C, h, k, w, k}).reshape({B, C, size, size});
}

// The images of a step as the model takes them: --image-size's, channels_last with
// --channels-last (PyTorch's x.to(memory_format=torch.channels_last)).
Tensor model_input(const Tensor& x, int64_t size, bool channels_last) {
  const Tensor r = resize(x, size);
  return channels_last ? r.contiguous(MemoryFormat::channels_last) : r;
}

// The shape of a dataset's first image, [C, H, W] (the example read to learn it is `input`).
Shape first_image_shape(const data::Dataset& ds) {
  memory::CategoryScope input(memory::Category::input);
  return ds.get(0).input.shape();
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"Train a ResNet with Tally and see where its memory goes."};
  app.add_option("--arch", a.arch, "tiny | resnet18 | resnet34 | resnet50")->capture_default_str();
  app.add_option("--dataset", a.dataset, "fashion-mnist | mnist | cifar10 | synthetic")
      ->capture_default_str();
  app.add_option("--data-root", a.data_root, "dataset folder (default: the dataset's usual place)");
  ex::add_checked_option(app, "--batch", a.batch, "batch size (at most the training set's size)",
                         ex::int_range(1));
  ex::add_checked_option(app, "--epochs", a.epochs, "epochs", ex::int_range(1));
  app.add_option("--steps", a.steps, "stop after this many steps (0: run the epochs)")
      ->check(ex::int_range(0));
  ex::add_checked_option(app, "--lr", a.lr, "learning rate (cosine schedule with warm-up)",
                         ex::positive_real());
  ex::add_checked_option(app, "--momentum", a.momentum, "SGD momentum",
                         ex::real_range({.lo = 0, .hi = 1}));
  ex::add_checked_option(app, "--weight-decay", a.weight_decay, "weight decay",
                         ex::non_negative_real());
  app.add_option("--optimizer", a.optimizer,
                 "sgd | adam | adamw | adamw8bit (block-wise 8-bit moments)")
      ->capture_default_str();
  app.add_flag("--step-in-backward", a.step_in_backward,
               "update each parameter as soon as its gradient is ready and free the gradient "
               "(not with --amp fp16)");
  app.add_option("--device", a.device, "cpu | cuda")->capture_default_str();
  app.add_flag("--channels-last", a.channels_last,
               "weights and images in channels_last (NHWC) memory, PyTorch's "
               "memory_format=torch.channels_last: cuDNN's tensor-core convolutions then read "
               "them without transposing");
  app.add_flag("--cuda-graphs", a.cuda_graphs,
               "capture the training step into a CUDA graph at step 2 and replay it (--device "
               "cuda; not with --offload, --step-in-backward, adamw8bit)");
  app.add_option("--image-size", a.image_size,
                 "resize images to this size (an integer multiple; 0: the dataset's own)")
      ->check(ex::int_range(0, 4096));
  app.add_option("--snapshot", a.snapshot, "write a memory_viz snapshot of the run to FILE");
  app.add_flag("--summary", a.summary, "print memory_summary() at the end");
  app.add_option("--metrics", a.metrics,
                 "write one JSON record per logged step (and the test accuracy) to FILE.jsonl");
  app.add_flag("--detect-leaks", a.detect_leaks,
               "report allocations that survive each step and grow, by source line "
               "(inspect::LeakDetector)");
  ex::add_checked_option(app, "--seed", a.seed, "seed of weights, data order and dropout",
                         ex::seed_value());
  ex::add_memory_options(app, a.checkpoint, a.amp, a.memory_budget, a.estimate, a.offload);
  app.add_option("--memory-limit", a.memory_limit,
                 "cap what the device may reserve (6GiB, 900MiB, ...): past it the run stops with "
                 "out-of-memory and reports what would fit");
  app.add_option("--eval-batches", a.eval_batches, "test batches to evaluate (0: all)")
      ->check(ex::int_range(0));
  ex::add_checked_option(app, "--log-every", a.log_every, "progress update interval in steps",
                         ex::int_range(1));

  return ex::run_cli("train_resnet", app, argc, argv, [&] {
    // ---- everything is checked before the first step ----
    // Before the device is parsed: what --cuda-graphs cannot do is the first thing said.
    ex::check_cuda_graphs(a.cuda_graphs, a.device, a.estimate, a.amp, a.offload, a.step_in_backward,
                          a.optimizer);
    const std::unique_ptr<memory::DryRun> dry =
        ex::make_dry_run(a.estimate, app.count("--device") > 0);
    const Device dev = dry ? dry->device() : ex::parse_device(a.device);
    ex::apply_memory_limit(a.memory_limit, dev);
    if (dry)
      a.steps = ex::kEstimateSteps;  // the dry run's steps (the synthetic set is sized by them)
    const ex::AutoPlan auto_plan =
        ex::parse_auto_plan(a.checkpoint, a.amp, a.memory_budget, a.offload);
    nn::OffloadSpec offload = auto_plan.offload;
    std::optional<DType> amp = auto_plan.amp_auto ? std::nullopt : ex::parse_amp(a.amp);
    nn::CheckpointSpec ckpt =
        auto_plan.checkpoint_auto ? nn::CheckpointSpec{} : nn::parse_checkpoint_spec(a.checkpoint);
    if (a.arch != "tiny" && a.arch != "resnet18" && a.arch != "resnet34" && a.arch != "resnet50")
      throw std::invalid_argument(
          fmt::format("--arch: expected tiny, resnet18, resnet34 or resnet50, got '{}'", a.arch));
    ex::check_optimizer(a.optimizer, {"sgd", "adam", "adamw", "adamw8bit"});
    ex::check_step_in_backward(a.step_in_backward, a.amp, 0);
    if (a.optimizer != "sgd" && app.count("--momentum") > 0)
      throw std::invalid_argument(
          fmt::format("--momentum applies to --optimizer sgd only, not {}", a.optimizer));
    if (a.dataset == "synthetic" && !a.data_root.empty())
      throw std::invalid_argument("--data-root does not apply to --dataset synthetic");
    if (!a.snapshot.empty()) ex::check_output_file(a.snapshot, "--snapshot");
    if (!a.metrics.empty()) ex::check_output_file(a.metrics, "--metrics");
    manual_seed(a.seed);
    // --snapshot: recorded from before the datasets and the model exist, so that every block
    // has its alloc in the trace (memory_viz shows a block from before the recording as
    // `unknown`).
    if (!a.snapshot.empty() && !dry) memory::record_memory_history(true, 1000000, dev);

    // ---- data ----
    std::unique_ptr<data::Dataset> train, test;
    int64_t classes = 10, channels = 1;
    if (a.dataset == "fashion-mnist" || a.dataset == "mnist") {
      const std::string root = a.data_root.empty() ? data::FashionMNIST::kDefaultRoot : a.data_root;
      ex::for_flag("--data-root", [&] {
        if (a.dataset == "mnist") {
          train = std::make_unique<data::MNIST>(root, true);
          test = std::make_unique<data::MNIST>(root, false);
        } else {
          train = std::make_unique<data::FashionMNIST>(root, true);
          test = std::make_unique<data::FashionMNIST>(root, false);
        }
      });
    } else if (a.dataset == "cifar10") {
      if (a.data_root.empty())
        throw std::invalid_argument(
            "--dataset cifar10 needs --data-root (the cifar-10-batches-bin folder)");
      ex::for_flag("--data-root", [&] {
        train = std::make_unique<data::CIFAR10>(a.data_root, true);
        test = std::make_unique<data::CIFAR10>(a.data_root, false);
      });
      channels = 3;
    } else if (a.dataset == "synthetic") {
      const int64_t s = a.image_size ? a.image_size : 32;
      const int64_t n = std::max<int64_t>(
          base::checked_mul<int64_t>(a.batch, std::max<int64_t>(a.steps, 8), "--batch x --steps"),
          1024);
      train = std::make_unique<data::SyntheticImages>(n, Shape{3, s, s}, classes, a.seed);
      test = std::make_unique<data::SyntheticImages>(std::max<int64_t>(a.batch * 4, 256),
                                                     Shape{3, s, s}, classes, a.seed + 1);
      channels = 3;
    } else {
      throw std::invalid_argument(fmt::format(
          "--dataset: expected fashion-mnist, mnist, cifar10 or synthetic, got '{}'", a.dataset));
    }
    // The training loader drops the last partial batch, so the training set must hold at
    // least one batch (else an epoch has no step); the test loader keeps a short last batch.
    const std::string source =
        a.data_root.empty() ? fmt::format("--dataset {}", a.dataset)
                            : fmt::format("--dataset {} --data-root {}", a.dataset, a.data_root);
    if (train->size() < 1 || test->size() < 1)
      throw std::invalid_argument(
          fmt::format("{}: the {} set is empty", source, train->size() < 1 ? "training" : "test"));
    if (a.batch > train->size())
      throw std::invalid_argument(
          fmt::format("--batch {} is larger than the training set ({}: {} examples): an epoch "
                      "would have no full batch",
                      a.batch, source, train->size()));
    const int64_t image_size = a.dataset == "synthetic" ? 0 : a.image_size;
    if (image_size != 0) {
      const Shape shape = first_image_shape(*train);  // [C, H, W]
      const int64_t h = shape.at(1), w = shape.at(2);
      if (image_size % h != 0 || h != w)
        throw std::invalid_argument(fmt::format(
            "--image-size {}: the images are {}x{}; only integer multiples are supported",
            image_size, h, w));
    }
    data::DataLoader loader(
        *train,
        {.batch_size = a.batch, .shuffle = true, .seed = a.seed, .drop_last = true, .device = dev});
    data::DataLoader test_loader(*test, {.batch_size = a.batch,
                                         .shuffle = false,
                                         .seed = a.seed,
                                         .drop_last = false,
                                         .device = dev});
    const int64_t per_epoch = loader.len();  // >= 1 (checked above)
    const int64_t total =
        a.steps > 0 ? a.steps
                    : base::checked_mul<int64_t>(per_epoch, a.epochs, "steps per epoch x --epochs");
    // The side of the images a step sees (dry runs make batches of it).
    const int64_t side = image_size ? image_size : first_image_shape(*train).at(1);

    // kEstimateSteps steps of a variation of this run (this run's optimizer, batches of its image
    // shape) and its evaluation on a dry run's device, the model built without host memory: what
    // the planner and the out-of-memory report predict.
    auto build = [&] {
      nn::BuildOnDevice on(Device::meta());
      return make_model(a, classes, channels);
    };
    auto dry_steps = [&](Device d, const ex::RunShape& shape) {
      const nn::PlanCandidate& c = shape.plan;
      auto m = build();
      m->to(d);
      if (a.channels_last) m->to(MemoryFormat::channels_last);
      nn::enable_checkpointing(*m, c.checkpoint);
      nn::offload_activations(*m, c.offload);
      auto o = make_optimizer(a, *m);
      ex::Precision p(c.amp, d);
      if (a.step_in_backward) p.step_in_backward(*o);
      Tensor x, y;
      {
        memory::CategoryScope input(memory::Category::input);
        x = ops::randn({shape.batch, channels, side, side}, DType::float32, d);
        if (a.channels_last) x = ops::contiguous(x, MemoryFormat::channels_last);
        y = ops::randint(0, classes, {shape.batch}, DType::int64, d);
      }
      for (int64_t s = 0; s < ex::kEstimateSteps; ++s) {
        o->zero_grad(true);
        Tensor loss;
        {
          memory::PhaseScope phase("forward");
          auto guard = p.autocast();
          loss = cross_entropy((*m)(x), y);
        }
        p.backward_and_step(loss, *o);
      }
      // Then the evaluation the program runs after training (a forward in eval mode without
      // gradients): its blocks can need segments that training left no room for.
      NoGradGuard ng;
      m->eval();
      auto guard = p.autocast();
      (void)argmax((*m)(x), 1);
    };
    if (auto_plan.checkpoint_auto) {
      // The planner dry-runs each candidate: kEstimateSteps steps on batches of this run's shape.
      const nn::PlanCandidate chosen = ex::plan_run(
          auto_plan, amp, dev, nn::checkpoint_block_count(*build()),
          [&](Device d, const nn::PlanCandidate& c) {
            dry_steps(d, {c, a.batch});
          },
          ex::kEstimateSteps);
      ckpt = chosen.checkpoint;
      amp = chosen.amp;
      offload = chosen.offload;
      a.checkpoint = ckpt.str();
    }

    // What the program holds on the device before the model (the datasets on the CPU).
    const size_t held = dry ? 0 : memory::memory_allocated(dev);
    try {  // running out of memory is reported (the catch below)
      // ---- model and optimizer ----
      auto model = make_model(a, classes, channels);
      model->to(dev);
      if (a.channels_last) model->to(MemoryFormat::channels_last);
      nn::enable_checkpointing(*model, ckpt);
      const std::shared_ptr<ActivationOffloader> offloader =
          nn::offload_activations(*model, offload);
      std::unique_ptr<optim::Optimizer> opt = make_optimizer(a, *model);
      // Warm-up: 5% of the steps, at least 1 and fewer than all (none for a 1-step run).
      const int64_t warmup = std::min<int64_t>(std::max<int64_t>(1, total / 20), total - 1);
      optim::WarmupCosineLR sched(*opt, warmup, total, a.lr * 0.01);
      ex::Precision prec(amp, dev, a.cuda_graphs);
      if (a.step_in_backward) prec.step_in_backward(*opt);
      ex::GraphedStep graphed(a.cuda_graphs, dev);

      fmt::print(
          "Tally train_resnet: {} ({:.2f} M parameters) on {} ({} train / {} test), device {}, "
          "batch {}, {} steps, {} {}, checkpoint {}, amp {}{}{}\n",
          a.arch, model->num_parameters() / 1e6, a.dataset, train->size(), test->size(), dev.str(),
          a.batch, total, a.optimizer + (a.step_in_backward ? " (step-in-backward)" : ""), a.lr,
          a.checkpoint, prec.name(),
          offload.enabled() ? ", offload " + offload.str() : std::string(),
          a.cuda_graphs ? ", CUDA graphs" : "");

      // ---- train ----
      model->train();
      ex::Progress bar(total, isatty(fileno(stdout)));
      ex::MetricsLog metrics(dry ? std::string() : a.metrics);
      ex::LeakCheck leak_check(a.detect_leaks && !dry, dev, isatty(fileno(stdout)));
      ex::Stopwatch clock;
      int64_t step = 0;
      double loss_sum = 0;
      int64_t correct = 0, seen = 0, window_steps = 0;
      Tensor loss_acc = zeros({}, TensorOptions{}.with_device(dev));
      Tensor correct_acc = zeros({}, TensorOptions{}.with_device(dev).with_dtype(DType::int64));
      while (step < total) {
        const int64_t step_at_epoch_start = step;
        for (const data::Example& batch : loader) {
          if (step >= total) break;
          const Tensor x = model_input(batch.input, image_size, a.channels_last);
          // zero_grad, forward, backward, optimizer step: replayed from step 2 with --cuda-graphs.
          const std::vector<Tensor> out =
              graphed({x, batch.target}, [&](const std::vector<Tensor>& in) {
                opt->zero_grad(true);
                Tensor logits, loss;
                {
                  memory::PhaseScope phase("forward");
                  auto guard = prec.autocast();
                  logits = (*model)(in[0]);
                  loss = cross_entropy(logits, in[1]);
                }
                prec.backward_and_step(loss, *opt);
                return std::vector<Tensor>{logits, loss};
              });
          const Tensor &logits = out[0], &loss = out[1];
          sched.step();
          {
            NoGradGuard ng;
            loss_acc = add(loss_acc, loss.detach().to(DType::float32));
            correct_acc = add(correct_acc,
                              sum(eq(argmax(logits.detach(), 1), batch.target)).to(DType::int64));
          }
          seen += x.size(0);
          ++step;
          ++window_steps;
          leak_check.step();
          if (dry) continue;  // no values to read
          if (step % a.log_every == 0 || step == total) {
            loss_sum = loss_acc.item() / static_cast<double>(window_steps);  // one sync per update
            correct = correct_acc.item<int64_t>();
            memory::synchronize(dev);
            const double ms = clock.ms() / static_cast<double>(window_steps);
            clock.reset();
            metrics.write({{"step", step},
                           {"epoch", loader.epoch()},
                           {"loss", loss_sum},
                           {"accuracy", static_cast<double>(correct) / static_cast<double>(seen)},
                           {"ms_per_step", ms},
                           {"lr", opt->get_lr()},
                           {"peak_allocated", memory::max_memory_allocated(dev)},
                           {"peak_reserved", memory::max_memory_reserved(dev)}});
            bar.update(
                step,
                fmt::format("loss {:.4f} acc {:.1f}% | {:.1f} ms/step | lr {:.4f} | peak {}",
                            loss_sum,
                            100.0 * static_cast<double>(correct) / static_cast<double>(seen), ms,
                            opt->get_lr(),
                            ex::fmt_bytes(static_cast<double>(memory::max_memory_allocated(dev)))));
            loss_acc = zeros({}, TensorOptions{}.with_device(dev));
            correct_acc = zeros({}, TensorOptions{}.with_device(dev).with_dtype(DType::int64));
            seen = 0;
            window_steps = 0;
          }
        }
        if (step == step_at_epoch_start)  // never spin on an empty epoch
          throw std::logic_error(
              fmt::format("the training loader yielded no batch in epoch {}", loader.epoch() - 1));
      }
      if (dry) return ex::finish_dry_run(*dry, "", a.snapshot, a.summary);
      bar.done();

      // ---- evaluate ----
      model->eval();
      int64_t right = 0, count = 0, nb = 0;
      {
        NoGradGuard ng;
        for (const data::Example& batch : test_loader) {
          if (a.eval_batches > 0 && nb >= a.eval_batches) break;
          auto guard = prec.autocast();
          const Tensor logits = (*model)(model_input(batch.input, image_size, a.channels_last));
          right += sum(eq(argmax(logits, 1), batch.target)).item<int64_t>();
          count += batch.input.size(0);
          ++nb;
        }
      }
      fmt::print(
          "test accuracy {:.2f}% ({} / {}), peak allocated {}, peak reserved {}\n",
          100.0 * static_cast<double>(right) / static_cast<double>(std::max<int64_t>(count, 1)),
          right, count, ex::fmt_bytes(static_cast<double>(memory::max_memory_allocated(dev))),
          ex::fmt_bytes(static_cast<double>(memory::max_memory_reserved(dev))));
      metrics.write({{"step", total},
                     {"test_accuracy", static_cast<double>(right) /
                                           static_cast<double>(std::max<int64_t>(count, 1))}});
      ex::print_offload(offloader, total);
      leak_check.report();
      ex::write_memory_outputs(dev, a.summary, a.snapshot);
      return 0;
    } catch (const memory::OutOfMemoryError& e) {
      // A real run: the error and what would fit. A dry run: its report, marked as not fitting.
      if (!dry)
        return ex::report_out_of_memory("train_resnet", e, dev, {{ckpt, amp, offload}, a.batch},
                                        held, dry_steps);
      return ex::finish_dry_run(*dry, e.what(), a.snapshot, a.summary);
    }
  });
}
