// minimal: the first Tally program to read. It trains a small MLP for a few steps on
// synthetic data, tags its input batch as `input`, writes a memory snapshot (open it at
// https://pytorch.org/memory_viz) and prints where the memory went, by category.
//
//   minimal                                   (CPU, writes minimal.pickle)
//   minimal --device cuda --snapshot run.pickle
#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <string>

#include "autograd/ops.h"   // tensors, autograd, every op
#include "memory/memory.h"  // PyTorch's names: memory_stats, dump_snapshot, ...
#include "nn/container.h"   // Sequential
#include "nn/layers.h"      // Linear, ReLU
#include "optim/adam.h"     // AdamW

using namespace tally;

int main(int argc, char** argv) {
  // ---- flags: --device cpu|cuda, --snapshot FILE ----
  std::string device = "cpu", snapshot = "minimal.pickle";
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if ((flag == "--device" || flag == "--snapshot") && i + 1 < argc) {
      (flag == "--device" ? device : snapshot) = argv[++i];
    } else {
      std::fprintf(flag == "--help" ? stdout : stderr,
                   "usage: minimal [--device cpu|cuda] "
                   "[--snapshot FILE]\n");
      return flag == "--help" ? 0 : 2;
    }
  }
  try {
    if (device != "cpu" && device != "cuda")
      throw std::invalid_argument("--device: expected cpu or cuda, got '" + device + "'");
    if (device == "cuda" && !memory::cuda_available())
      throw std::invalid_argument("--device cuda: no GPU (or a build without CUDA)");
    const Device dev = device == "cuda" ? Device::cuda(0) : Device::cpu();

    // Record every allocation from here on: the snapshot shows each one with its stack.
    memory::record_memory_history(true, 100000, dev);
    manual_seed(0);

    // ---- the model and its optimizer (their memory: `parameter`, `optimizer_state`) ----
    auto model = std::make_shared<nn::Sequential>(std::make_shared<nn::Linear>(64, 256),
                                                  std::make_shared<nn::ReLU>(),
                                                  std::make_shared<nn::Linear>(256, 10));
    model->to(dev);
    optim::AdamW opt(model->parameters(), {.lr = 1e-2});

    // ---- the data: a batch whose labels a hidden linear map decides ----
    // Tensors made inside a CategoryScope carry its category: here `input`, not `unknown`.
    Tensor x, y;
    {
      memory::CategoryScope tag(memory::Category::input);
      x = randn({512, 64}, TensorOptions{}.with_device(dev));
      const Tensor teacher = randn({64, 10}, TensorOptions{}.with_device(dev));
      y = argmax(matmul(x, teacher), 1);
    }

    // ---- training: the forward's outputs are `activation`, backward's `gradient` ----
    for (int step = 1; step <= 30; ++step) {
      opt.zero_grad();
      const Tensor loss = cross_entropy((*model)(x), y);
      loss.backward();
      opt.step();
      if (step == 1 || step % 10 == 0) fmt::print("step {:2}  loss {:.4f}\n", step, loss.item());
    }

    // ---- the snapshot, for https://pytorch.org/memory_viz ----
    memory::dump_snapshot(snapshot, dev);
    fmt::print("snapshot written to {}\n", snapshot);

    // ---- where the memory went: memory_stats() has each category's bytes ----
    std::map<std::string, int64_t> stats = memory::memory_stats(dev);
    fmt::print("\n{:<16} {:>12} {:>12} {:>12}\n", "category", "now", "peak", "at peak");
    for (const memory::Category c : memory::kAllCategories) {
      const std::string key = "category." + std::string(memory::category_name(c));
      if (stats[key + ".peak"] == 0) continue;  // never used
      fmt::print("{:<16} {:>8.1f} KiB {:>8.1f} KiB {:>8.1f} KiB\n", memory::category_name(c),
                 stats[key + ".current"] / 1024.0, stats[key + ".peak"] / 1024.0,
                 stats[key + ".at_peak"] / 1024.0);
    }
    fmt::print("peak allocated {:.1f} KiB, peak reserved {:.1f} KiB\n",
               memory::max_memory_allocated(dev) / 1024.0,
               memory::max_memory_reserved(dev) / 1024.0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "minimal: %s\n", e.what());
    return 2;
  }
  return 0;
}
