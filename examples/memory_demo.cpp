// memory_demo: one simulated training step's allocation pattern through Tally's caching
// allocator, every byte tagged: parameters, the input batch, the forward "staircase" of
// activations, backward freeing them while gradients appear, Adam's two states. Prints
// memory_summary() and writes a snapshot PyTorch's memory_viz opens.
//
//   memory_demo [--device cpu|cuda] [--steps N] [--snapshot FILE]
#include <fmt/format.h>

#include <cstring>
#include <string>
#include <vector>

#include "memory/memory.h"

using namespace tally::memory;

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
  int steps = 2;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        fmt::print(stderr, "memory_demo: {} needs a value\n", a);
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--device")
      device_arg = value();
    else if (a == "--snapshot")
      snapshot = value();
    else if (a == "--steps")
      steps = std::stoi(value());
    else {
      fmt::print(stderr, "usage: memory_demo [--device cpu|cuda] [--steps N] [--snapshot FILE]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  if (device_arg != "cpu" && device_arg != "cuda") {
    fmt::print(stderr, "memory_demo: --device must be cpu or cuda, got '{}'\n", device_arg);
    return 2;
  }
  if (device_arg == "cuda" && !cuda_available()) {
    fmt::print(stderr, "memory_demo: no CUDA device; use --device cpu\n");
    return 2;
  }
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
}
