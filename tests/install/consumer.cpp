// The README's "API in ten lines", built against an installed Tally (tests/install/).
#include <fmt/core.h>
#include <tally/autograd/ops.h>   // tensors, autograd, every op
#include <tally/memory/memory.h>  // the allocator's PyTorch-named functions
#include <tally/tensor/precision.h>
#include <tally/version.h>

#include <cstdio>
#include <exception>
#include <string>

using namespace tally;

int main(int argc, char** argv) {
  const std::string snapshot = argc > 1 ? argv[1] : "step.pickle";
  try {
    memory::record_memory_history(true, 100000, Device::cpu());
    Tensor w = mul(randn({784, 10}), 0.01).detach().requires_grad_();
    Tensor x;
    {
      memory::CategoryScope in(memory::Category::input);
      x = randn({64, 784});
    }
    Tensor loss = cross_entropy(matmul(x, w), randint(0, 10, {64}));
    loss.backward();
    fmt::print("{}", memory::memory_summary(Device::cpu()));
    memory::dump_snapshot(snapshot, Device::cpu());
    fmt::print("tally {} allow_tf32={} loss={:.4f} grad={}\n", TALLY_VERSION, allow_tf32(),
               loss.item(), w.grad().shape_string());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
  return 0;
}
