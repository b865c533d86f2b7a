// profile_demo: torch.profiler's workflow on a small CNN built from raw ops. Trains a few
// steps on random data under a schedule (wait 1, warmup 1, active 2), then writes the
// Chrome trace (open in Perfetto or chrome://tracing), prints key_averages() tables (by op
// and by module) and writes the memory timeline (.json, .html) and the window's allocator
// snapshot (for pytorch.org/memory_viz).
//
//   profile_demo [--device cpu|cuda] [--steps N] [--batch N] [--out PREFIX]
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "examples/cli_common.h"
#include "examples/train_common.h"
#include "memory/memory.h"
#include "profiler/profiler.h"
#include "profiler/training_step.h"

using namespace tally;
namespace ex = tally::examples;

namespace {

struct Net {
  Device device;
  int64_t batch;
  Tensor c1w, c1b, c2w, c2b, fw, fb;
  Tensor x, y;

  Net(Device d, int64_t n) : device(d), batch(n) {
    manual_seed(0);
    auto param = [&](Shape s, double scale) {
      memory::CategoryScope cat(memory::Category::parameter);
      Tensor t = mul(randn(s), scale).to(device).detach();
      t.requires_grad_(true);
      return t;
    };
    c1w = param({16, 3, 3, 3}, 0.2);
    c1b = param({16}, 0.0);
    c2w = param({32, 16, 3, 3}, 0.1);
    c2b = param({32}, 0.0);
    fw = param({10, 32 * 8 * 8}, 0.02);
    fb = param({10}, 0.0);
    memory::CategoryScope cat(memory::Category::input);
    x = randn({batch, 3, 32, 32}).to(device);
    y = randint(0, 10, {batch}, TensorOptions{}.with_dtype(DType::int64)).to(device);
  }

  std::vector<Tensor*> params() { return {&c1w, &c1b, &c2w, &c2b, &fw, &fb}; }

  Tensor forward() {
    memory::PhaseScope phase("forward");
    Tensor h;
    {
      memory::ModuleScope m("conv1");
      h = max_pool2d(relu(conv2d(x, c1w, c1b, 1, 1)), 2);
    }
    {
      memory::ModuleScope m("conv2");
      h = max_pool2d(relu(conv2d(h, c2w, c2b, 1, 1)), 2);
    }
    memory::ModuleScope m("fc");
    return linear(h.flatten(1), fw, fb);
  }

  // Plain SGD (lr 0.01) in torch.profiler's recipe ranges.
  void step() {
    for (Tensor* p : params()) p->set_grad(Tensor());
    profiler::annotated_training_step([&] { return cross_entropy(forward(), y); },
                                      [&] {
                                        for (Tensor* p : params()) ops::add_(*p, p->grad(), -0.01);
                                      });
  }
};

}  // namespace

int main(int argc, char** argv) {
  std::string device_arg = memory::cuda_available() ? "cuda" : "cpu";
  std::string out = "profile_demo";
  int64_t steps = 6;
  int64_t batch = 16;
  CLI::App app{"torch.profiler's workflow on a small CNN: trace, key_averages, memory timeline."};
  app.add_option("--device", device_arg, "cpu | cuda")->capture_default_str();
  // The schedule waits 1 step, warms up 1 and records 2: fewer than 4 steps record nothing.
  ex::add_checked_option(app, "--steps", steps,
                         "training steps (the profiler waits 1, warms up 1, records 2)",
                         ex::int_range(4, 10000));
  ex::add_checked_option(app, "--batch", batch, "batch size", ex::int_range(1, 1 << 16));
  app.add_option("--out", out,
                 "output prefix: PREFIX.trace.json, .timeline.json, .timeline.html, .pickle")
      ->capture_default_str();

  return ex::run_cli("profile_demo", app, argc, argv, [&] {
    const Device device = ex::parse_device(device_arg);
    for (const char* ext : {".trace.json", ".timeline.json", ".timeline.html", ".pickle"})
      ex::check_output_file(out + ext, "--out");
    Net net(device, batch);
    profiler::ProfilerOptions opts;
    opts.profile_memory = true;
    opts.record_shapes = true;
    opts.with_stack = true;
    opts.schedule = profiler::schedule(/*wait=*/1, /*warmup=*/1, /*active=*/2, /*repeat=*/1);
    opts.on_trace_ready = [&](profiler::Profiler& p) {
      p.export_chrome_trace(out + ".trace.json");
      p.export_memory_timeline(out + ".timeline.json");
      p.export_memory_timeline(out + ".timeline.html");
      p.export_memory_snapshot(out + ".pickle");
      fmt::print("{}\n", p.key_averages().table("self_cpu_time_total", 15));
      fmt::print("{}\n", p.key_averages_by_module().table("cpu_time_total", 10));
      fmt::print(
          "wrote {0}.trace.json, {0}.timeline.json, {0}.timeline.html, {0}.pickle "
          "(steps {1})\n",
          out, fmt::join(p.data().steps, ", "));
    };
    profiler::Profiler prof(opts);
    prof.start();
    for (int s = 0; s < steps; ++s) {
      net.step();
      prof.step();
    }
    prof.stop();
    return 0;
  });
}
