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
#include "examples/trainer.h"
#include "nn/checkpoint.h"
#include "nn/data/cifar.h"
#include "nn/data/dataloader.h"
#include "nn/data/mnist.h"
#include "nn/data/synthetic.h"
#include "nn/models/resnet.h"
#include "optim/adam.h"
#include "optim/sgd.h"

using namespace tally;
namespace ex = tally::examples;

namespace {

struct Args {
  ex::TrainFlags t;  // defaults set by add_flags
  std::string arch = "tiny";
  std::string dataset = "fashion-mnist";
  std::string data_root;
  int64_t batch = 128;
  int64_t epochs = 1;
  int64_t steps = 0;  // > 0: stop after this many steps
  double momentum = 0.9;
  int64_t image_size = 0;    // 0: the dataset's own
  int64_t eval_batches = 0;  // 0: the whole test set
  bool channels_last = false;
};

void add_flags(CLI::App& app, Args& a) {
  ex::TrainFlags& t = a.t;
  t.optimizer = "sgd";
  t.lr = 0.05;
  t.weight_decay = 5e-4;
  app.add_option("--arch", a.arch, "tiny | resnet18 | resnet34 | resnet50")->capture_default_str();
  app.add_option("--dataset", a.dataset, "fashion-mnist | mnist | cifar10 | synthetic")
      ->capture_default_str();
  app.add_option("--data-root", a.data_root, "dataset folder (default: the dataset's usual place)");
  ex::add_checked_option(app, "--batch", a.batch, "batch size (at most the training set's size)",
                         ex::int_range(1));
  ex::add_checked_option(app, "--epochs", a.epochs, "epochs", ex::int_range(1));
  app.add_option("--steps", a.steps, "stop after this many steps (0: run the epochs)")
      ->check(ex::int_range(0));
  ex::add_checked_option(app, "--lr", t.lr, "learning rate (cosine schedule with warm-up)",
                         ex::positive_real());
  ex::add_checked_option(app, "--momentum", a.momentum, "SGD momentum",
                         ex::real_range({.lo = 0, .hi = 1}));
  ex::add_checked_option(app, "--weight-decay", t.weight_decay, "weight decay",
                         ex::non_negative_real());
  app.add_option(
         "--optimizer", t.optimizer,
         "sgd | adam | adamw | adamw8bit (block-wise 8-bit moments) | adamw:cpu, adamw8bit:cpu "
         "(master weights and moments in pinned host memory, updated on the CPU)")
      ->capture_default_str();
  app.add_flag("--step-in-backward", t.step_in_backward,
               "update each parameter as soon as its gradient is ready and free the gradient "
               "(not with --amp fp16)");
  app.add_option("--device", t.device, "cpu | cuda")->capture_default_str();
  app.add_flag("--channels-last", a.channels_last,
               "weights and images in channels_last (NHWC) memory, PyTorch's "
               "memory_format=torch.channels_last: cuDNN's tensor-core convolutions then read "
               "them without transposing");
  app.add_flag("--cuda-graphs", t.cuda_graphs,
               "capture the training step into a CUDA graph at step 2 and replay it (--device "
               "cuda; not with --offload, --step-in-backward, adamw8bit)");
  app.add_option("--image-size", a.image_size,
                 "resize images to this size (an integer multiple; 0: the dataset's own)")
      ->check(ex::int_range(0, 4096));
  ex::add_output_flags(
      app, t, "write one JSON record per logged step (and the test accuracy) to FILE.jsonl",
      "seed of weights, data order and dropout");
  app.add_option("--eval-batches", a.eval_batches, "test batches to evaluate (0: all)")
      ->check(ex::int_range(0));
  ex::add_checked_option(app, "--log-every", t.log_every, "progress update interval in steps",
                         ex::int_range(1));
}

// The --optimizer choices.
const std::vector<std::string> kOptimizers = {"sgd",       "adam",      "adamw",
                                              "adamw8bit", "adamw:cpu", "adamw8bit:cpu"};

// --optimizer over the model's parameters.
std::unique_ptr<optim::Optimizer> make_optimizer(const Args& a, nn::Module& model) {
  const ex::TrainFlags& t = a.t;
  return ex::make_optimizer(
      t.optimizer, model.parameters(),
      optim::AdamOptions{.lr = t.lr, .weight_decay = t.weight_decay, .capturable = t.cuda_graphs},
      optim::SGDOptions{.lr = t.lr,
                        .momentum = a.momentum,
                        .weight_decay = t.weight_decay,
                        .capturable = t.cuda_graphs});
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

// The datasets and their loaders, every flag about them checked.
struct Data {
  std::unique_ptr<data::Dataset> train, test;
  int64_t classes = 10, channels = 1;
  int64_t image_size = 0;  // --image-size (0: the dataset's own)
  int64_t side = 0;        // the side of the images a step sees (dry runs make batches of it)
  std::optional<data::DataLoader> loader, test_loader;

  Data(const Args& a, Device dev) {
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
      train = std::make_unique<data::SyntheticImages>(n, Shape{3, s, s}, classes, a.t.seed);
      test = std::make_unique<data::SyntheticImages>(std::max<int64_t>(a.batch * 4, 256),
                                                     Shape{3, s, s}, classes, a.t.seed + 1);
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
    image_size = a.dataset == "synthetic" ? 0 : a.image_size;
    if (image_size != 0) {
      const Shape shape = first_image_shape(*train);  // [C, H, W]
      const int64_t h = shape.at(1), w = shape.at(2);
      if (image_size % h != 0 || h != w)
        throw std::invalid_argument(fmt::format(
            "--image-size {}: the images are {}x{}; only integer multiples are supported",
            image_size, h, w));
    }
    loader.emplace(*train, data::DataLoaderOptions{.batch_size = a.batch,
                                                   .shuffle = true,
                                                   .seed = a.t.seed,
                                                   .drop_last = true,
                                                   .device = dev});
    test_loader.emplace(*test, data::DataLoaderOptions{.batch_size = a.batch,
                                                       .shuffle = false,
                                                       .seed = a.t.seed,
                                                       .drop_last = false,
                                                       .device = dev});
    side = image_size ? image_size : first_image_shape(*train).at(1);
  }
};

// The step's forward: the loss, and the logits (for the accuracy).
ex::Trainer::Forward forward_of(nn::Module& m) {
  return [&m](const std::vector<Tensor>& in) {
    const Tensor logits = m(in[0]);
    return std::vector<Tensor>{cross_entropy(logits, in[1]), logits};
  };
}

// Right answers and examples over the test set (its first `max_batches`; 0: all).
std::pair<int64_t, int64_t> evaluate(nn::Module& model, data::DataLoader& loader,
                                     ex::Precision& prec, const Args& a, int64_t image_size) {
  model.eval();
  NoGradGuard ng;
  int64_t right = 0, count = 0, nb = 0;
  for (const data::Example& batch : loader) {
    if (a.eval_batches > 0 && nb >= a.eval_batches) break;
    auto guard = prec.autocast();
    const Tensor logits = model(model_input(batch.input, image_size, a.channels_last));
    right += sum(eq(argmax(logits, 1), batch.target)).item<int64_t>();
    count += batch.input.size(0);
    ++nb;
  }
  return {right, count};
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  ex::TrainFlags& t = a.t;
  CLI::App app{"Train a ResNet with Tally and see where its memory goes."};
  add_flags(app, a);
  return ex::run_trainer("train_resnet", app, t, argc, argv, kOptimizers, [&](ex::Trainer& tr) {
    if (tr.dry())
      a.steps = ex::kEstimateSteps;  // the dry run's (the synthetic set is sized by them)
    if (a.arch != "tiny" && a.arch != "resnet18" && a.arch != "resnet34" && a.arch != "resnet50")
      throw std::invalid_argument(
          fmt::format("--arch: expected tiny, resnet18, resnet34 or resnet50, got '{}'", a.arch));
    if (t.optimizer != "sgd" && app.count("--momentum") > 0)
      throw std::invalid_argument(
          fmt::format("--momentum applies to --optimizer sgd only, not {}", t.optimizer));
    if (a.dataset == "synthetic" && !a.data_root.empty())
      throw std::invalid_argument("--data-root does not apply to --dataset synthetic");
    tr.start();
    const Device dev = tr.device();
    Data d(a, dev);
    const int64_t total = a.steps > 0 ? a.steps
                                      : base::checked_mul<int64_t>(d.loader->len(), a.epochs,
                                                                   "steps per epoch x --epochs");

    // kEstimateSteps steps of a variation of this run (this run's optimizer, batches of its
    // image shape) and its evaluation on a dry run's device, the model built without host
    // memory: what the planner and the out-of-memory report predict.
    auto build = [&](Device on_device) {
      nn::BuildOnDevice on(on_device);
      return make_model(a, d.classes, d.channels);
    };
    const ex::Trainer::DrySteps dry_steps = [&](Device dd, const ex::RunShape& shape) {
      auto m = build(dd);  // on the device: a GPU target's host (meta:0) holds pinned memory only
      if (a.channels_last) m->to(MemoryFormat::channels_last);
      tr.dry_train(
          dd, shape.plan, *m, [&](nn::Module& mm) { return make_optimizer(a, mm); },
          [&] {
            Tensor x = ops::randn({shape.batch, d.channels, d.side, d.side}, DType::float32, dd);
            if (a.channels_last) x = ops::contiguous(x, MemoryFormat::channels_last);
            return std::vector<Tensor>{x,
                                       ops::randint(0, d.classes, {shape.batch}, DType::int64, dd)};
          },
          [&](const std::vector<Tensor>& in) {
            return std::vector<Tensor>{cross_entropy((*m)(in[0]), in[1])};
          },
          [&](const std::vector<Tensor>& in) { (void)argmax((*m)(in[0]), 1); });
    };
    if (tr.planning()) {  // the model's blocks, on a meta device of its own (not a GPU's host)
      memory::DryRun scratch({.capacity = size_t{1} << 50, .max_history = 0});
      tr.plan(*build(scratch.device()), dry_steps, a.batch);
    }

    return tr.run({{tr.checkpoint, tr.amp, tr.offload}, a.batch}, dry_steps, [&] {
      auto model = make_model(a, d.classes, d.channels);
      model->to(dev);
      if (a.channels_last) model->to(MemoryFormat::channels_last);
      // Warm-up: 5% of the steps; down to lr / 100.
      const ex::Trainer::Training run = tr.prepare(
          *model, [&](nn::Module& mm) { return make_optimizer(a, mm); }, total, 20, 0.01);
      optim::Optimizer* opt = run.opt.get();
      fmt::print(
          "Tally train_resnet: {} ({:.2f} M parameters) on {} ({} train / {} test), device {}, "
          "batch {}, {} steps, {} {}, {}\n",
          a.arch, model->num_parameters() / 1e6, a.dataset, d.train->size(), d.test->size(),
          dev.str(), a.batch, total,
          t.optimizer + (t.step_in_backward ? " (step-in-backward)" : ""), t.lr, tr.describe());

      model->train();
      int64_t step = 0, seen = 0;
      const auto zero = [&] {
        return zeros({}, TensorOptions{}.with_device(dev).with_dtype(DType::int64));
      };
      Tensor correct = zero();
      while (step < total) {
        const int64_t step_at_epoch_start = step;
        for (const data::Example& batch : *d.loader) {
          if (step >= total) break;
          const Tensor x = model_input(batch.input, d.image_size, a.channels_last);
          const std::vector<Tensor> out = tr.step({x, batch.target}, forward_of(*model));
          run.sched->step();
          {
            NoGradGuard ng;
            correct =
                add(correct, sum(eq(argmax(out[1].detach(), 1), batch.target)).to(DType::int64));
          }
          seen += x.size(0);
          if (!tr.end_step(++step, out[0])) continue;
          const ex::Trainer::Window w = tr.read_window();
          const double acc =
              static_cast<double>(correct.item<int64_t>()) / static_cast<double>(seen);
          tr.log(step, w, {{"epoch", d.loader->epoch()}, {"accuracy", acc}},
                 fmt::format("loss {:.4f} acc {:.1f}% | {:.1f} ms/step | lr {:.4f}", w.loss,
                             100.0 * acc, w.ms, opt->get_lr()));
          correct = zero();
          seen = 0;
        }
        if (step == step_at_epoch_start)  // never spin on an empty epoch
          throw std::logic_error(fmt::format("the training loader yielded no batch in epoch {}",
                                             d.loader->epoch() - 1));
      }
      // A dry run's report, its evaluation dry-run too (one test batch's forward).
      const auto dry_eval = [&] {
        NoGradGuard ng;
        model->eval();
        for (const data::Example& batch : *d.test_loader) {
          auto guard = tr.precision().autocast();
          (void)(*model)(model_input(batch.input, d.image_size, a.channels_last));
          break;
        }
      };
      if (const std::optional<int> rc = tr.end_training(dry_eval)) return *rc;

      const auto [right, count] = evaluate(*model, *d.test_loader, tr.precision(), a, d.image_size);
      const double accuracy =
          static_cast<double>(right) / static_cast<double>(std::max<int64_t>(count, 1));
      fmt::print("test accuracy {:.2f}% ({} / {}), {}\n", 100.0 * accuracy, right, count,
                 tr.peaks());
      tr.write_metrics({{"step", total}, {"test_accuracy", accuracy}});
      return tr.finish(run.offloader, total);
    });
  });
}
