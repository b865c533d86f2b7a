// memory_demo: one simulated training step's allocation pattern through Tally's caching
// allocator, every byte tagged: parameters, the input batch, the forward "staircase" of
// activations, backward freeing them while gradients appear, Adam's two states. Prints
// memory_summary() and writes a snapshot PyTorch's memory_viz opens.
//
//   memory_demo [--device cpu|cuda] [--steps N] [--snapshot FILE]
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "examples/cli_common.h"
#include "memory/memory.h"

using namespace tally::memory;
namespace ex = tally::examples;

namespace {

struct Layer {
  std::string name;
  size_t weight_bytes;
  size_t activation_bytes;  // output kept for backward
};

// A small ResNet-like stack at batch 32, 64x64 images (float32 sizes).
std::vector<Layer> make_model() {
  std::vector<Layer> layers;
  const size_t batch = 32;
  size_t hw = 64 * 64;
  size_t channels = 64;
  layers.push_back({"conv1", 3 * 64 * 7 * 7 * 4, batch * channels * hw * 4});
  for (int stage = 1; stage <= 4; ++stage) {
    for (int block = 0; block < 2; ++block) {
      const std::string base = fmt::format("layer{}.{}", stage, block);
      layers.push_back({base + ".conv1", channels * channels * 9 * 4, batch * channels * hw * 4});
      layers.push_back({base + ".bn1", channels * 2 * 4, batch * channels * hw * 4});
      layers.push_back({base + ".conv2", channels * channels * 9 * 4, batch * channels * hw * 4});
    }
    channels *= 2;
    hw /= 4;
  }
  layers.push_back({"fc", 512 * 10 * 4 + 10 * 4, batch * 10 * 4});
  return layers;
}

}  // namespace

int main(int argc, char** argv) {
  std::string device_arg = cuda_available() ? "cuda" : "cpu";
  std::string snapshot = "memory_demo.pickle";
  int64_t steps = 2;
  CLI::App app{"One simulated training step's allocations through Tally's caching allocator."};
  app.add_option("--device", device_arg, "cpu | cuda")->capture_default_str();
  ex::add_checked_option(app, "--steps", steps, "training steps", ex::int_range(1, 10000));
  app.add_option("--snapshot", snapshot, "write the memory_viz snapshot to FILE")
      ->capture_default_str();

  return ex::run_cli("memory_demo", app, argc, argv, [&] {
    if (device_arg != "cpu" && device_arg != "cuda")
      throw std::invalid_argument(
          fmt::format("--device: expected cpu or cuda, got '{}'", device_arg));
    if (device_arg == "cuda" && !cuda_available())
      throw std::invalid_argument("--device cuda: no CUDA device; use --device cpu");
    ex::check_output_file(snapshot, "--snapshot");
    const Device dev = device_arg == "cuda" ? Device::cuda(0) : Device::cpu();
    CachingAllocator& alloc = get_allocator(dev);
    alloc.record_memory_history(true, 200000);

    const std::vector<Layer> model = make_model();
    std::vector<void*> weights, grads, exp_avg, exp_avg_sq;
    for (const Layer& l : model) {
      AllocContextScope ctx(Category::parameter, l.name, "empty", "init");
      weights.push_back(alloc.allocate(l.weight_bytes));
    }
    grads.assign(model.size(), nullptr);

    for (int step = 0; step < steps; ++step) {
      void* batch;
      {
        AllocContextScope ctx(Category::input, "", "to", "data");
        batch = alloc.allocate(32 * 3 * 64 * 64 * 4);
      }
      // Forward: each layer's output is kept for backward; a temporary comes and goes.
      std::vector<void*> acts;
      {
        PhaseScope phase("forward");
        for (const Layer& l : model) {
          ModuleScope m(l.name);
          OpScope op(l.name.find("bn") != std::string::npos ? "batch_norm" : "conv2d");
          {
            CategoryScope c(Category::workspace);
            void* ws = alloc.allocate(8 * kMiB);  // a library workspace for the op
            alloc.deallocate(ws);
          }
          CategoryScope c(Category::activation);
          acts.push_back(alloc.allocate(l.activation_bytes));
        }
      }
      // Backward: activations are released in reverse while gradients appear.
      {
        PhaseScope phase("backward");
        for (size_t i = model.size(); i-- > 0;) {
          ModuleScope m(model[i].name);
          OpScope op("backward");
          void* grad_in;
          {
            CategoryScope c(Category::temporary);
            grad_in = alloc.allocate(model[i].activation_bytes);
          }
          if (!grads[i]) {
            CategoryScope c(Category::gradient);
            grads[i] = alloc.allocate(model[i].weight_bytes);
          }
          alloc.deallocate(acts[i]);
          alloc.deallocate(grad_in);
        }
      }
      // Adam: two states per parameter, created on the first step.
      {
        PhaseScope phase("optimizer");
        OpScope op("adam");
        for (size_t i = 0; i < model.size(); ++i) {
          ModuleScope m(model[i].name);
          if (exp_avg.size() <= i) {
            CategoryScope c(Category::optimizer_state);
            exp_avg.push_back(alloc.allocate(model[i].weight_bytes));
            exp_avg_sq.push_back(alloc.allocate(model[i].weight_bytes));
          }
          CategoryScope c(Category::temporary);
          alloc.deallocate(alloc.allocate(model[i].weight_bytes));
        }
      }
      alloc.deallocate(batch);
    }

    fmt::print("{}\n", alloc.memory_summary());
    alloc.dump_snapshot(snapshot);
    fmt::print("Snapshot written to {} (open it at pytorch.org/memory_viz)\n", snapshot);
    for (auto* v : {&weights, &grads, &exp_avg, &exp_avg_sq})
      for (void* p : *v) alloc.deallocate(p);
    return 0;
  });
}
