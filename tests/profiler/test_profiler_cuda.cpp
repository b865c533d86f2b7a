// The profiler on the GPU (label gpu: skipped without a device): CUDA matmuls and a tiny
// CUDA training step profiled with CUPTI; kernels appear in the data and the Chrome trace,
// each attributed (external correlation id) to the op that launched it, with launch ->
// kernel flows; key_averages has CUDA time and CUDA memory columns; the CUDA op's
// kernel time is the row's Self CUDA; the memory timeline picks the GPU; launches are recorded
// and the runtime's queries (cudaGetLastError, cudaGetDevice) are not. A window detaches
// CUPTI when it ends: the next window (and a repeating schedule's next cycle) attaches it
// again and records its kernels.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>

#include "autograd/ops.h"
#include "profiler/profiler.h"
#include "testing/cuda_testing.h"

namespace tally {
namespace {

namespace fs = std::filesystem;

TEST(ProfilerCuda, KernelsAreRecordedAndAttributed) {
  REQUIRE_GPU();
  const Device gpu = testing::kGpu;
  manual_seed(0);
  Tensor a = randn({512, 512}).to(gpu), b = randn({512, 512}).to(gpu);
  Tensor warm = matmul(a, b);  // cuBLAS handles and workspaces before the window
  (void)warm.to(Device::cpu());

  profiler::ProfilerOptions o;
  o.profile_memory = true;
  o.record_shapes = true;
  profiler::Profiler prof(o);
  prof.start();
  Tensor c;
  for (int i = 0; i < 4; ++i) {
    profiler::record_function r("matmuls");
    c = matmul(relu(a), b);
  }
  prof.stop();
  const profiler::ProfileData& d = prof.data();

  std::map<uint64_t, const profiler::CpuSpan*> ops;
  for (const auto& s : d.spans)
    if (s.kind == profiler::SpanKind::op) ops[s.id] = &s;
  int kernels = 0, attributed_to_matmul = 0;
  for (const auto& g : d.gpu) {
    if (g.kind != profiler::GpuKind::kernel) continue;
    ++kernels;
    EXPECT_GT(g.end_ns, g.start_ns) << g.name;
    auto it = ops.find(g.external_id);
    if (it != ops.end() && it->second->name == "matmul") {
      ++attributed_to_matmul;
      // A kernel runs after its launch began (50 µs slack for the CUPTI clock conversion).
      EXPECT_GE(g.start_ns + 50000, it->second->start_ns) << g.name;
    }
  }
  EXPECT_GE(kernels, 8);  // 4 matmuls + 4 relus at least
  EXPECT_GE(attributed_to_matmul, 4);

  // Launches are recorded as runtime calls; the queries that follow each launch
  // (cudaGetLastError) are left out of the record (profiler/cupti_tracer.cpp).
  int launches = 0, queries = 0;
  for (const auto& g : d.gpu) {
    if (g.kind != profiler::GpuKind::runtime) continue;
    launches += g.name.find("Launch") != std::string::npos;
    queries += g.name.find("GetLastError") != std::string::npos ||
               g.name.find("GetDevice") != std::string::npos;
  }
  EXPECT_GE(launches, 4);  // the relus at least
  EXPECT_EQ(queries, 0);

  const profiler::EventList rows = prof.key_averages();
  EXPECT_GT(rows.at("matmul").self_cuda_time_total, 0);
  EXPECT_GT(rows.at("matmuls").cuda_time_total, rows.at("matmul").self_cuda_time_total - 1e-9);
  EXPECT_GT(rows.at("matmul").self_cuda_memory_usage, 0);  // outputs
  const std::string table = rows.table("cuda_time_total", 10);
  for (const char* h : {"Self CUDA", "Self CUDA %", "CUDA total", "CUDA time avg", "CUDA Mem",
                        "Self CUDA Mem", "Self CUDA time total: "})
    EXPECT_NE(table.find(h), std::string::npos) << h << "\n" << table;

  const fs::path dir =
      fs::temp_directory_path() / fmt::format("tally_profiler_cuda_{}", ::getpid());
  fs::create_directories(dir);
  const fs::path trace = dir / "matmul.trace.json";
  prof.export_chrome_trace(trace.string());
  const std::string cmd = fmt::format("{} {}/tests/profiler/check_trace.py {} --gpu", TALLY_PYTHON,
                                      TALLY_SOURCE_DIR, trace.string());
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  prof.export_memory_timeline((dir / "timeline.html").string());  // cuda:0 chosen
  prof.export_memory_timeline((dir / "timeline.json").string(), gpu);
}

// Each stop() detaches CUPTI (profiler/cupti_tracer.cpp); three windows in a row, the last
// one through a schedule with a warm-up, each record their own kernels and only theirs.
TEST(ProfilerCuda, EachWindowAttachesCuptiAgain) {
  REQUIRE_GPU();
  const Device gpu = testing::kGpu;
  manual_seed(0);
  Tensor a = randn({256, 256}).to(gpu);
  Tensor warm = matmul(a, a);
  (void)warm.to(Device::cpu());
  auto relu_kernels = [](const profiler::ProfileData& d) {
    int n = 0;
    for (const auto& g : d.gpu) n += g.kind == profiler::GpuKind::kernel;
    return n;
  };
  for (int window = 0; window < 2; ++window) {
    profiler::Profiler prof;
    prof.start();
    for (int i = 0; i < 3 + window; ++i) a = relu(a);
    prof.stop();
    EXPECT_EQ(relu_kernels(prof.data()), 3 + window) << "window " << window;
  }
  // wait 1, warmup 1, active 2, two cycles: four windows opened and closed.
  profiler::ProfilerOptions o;
  o.schedule = profiler::schedule(/*wait=*/1, /*warmup=*/1, /*active=*/2, /*repeat=*/2);
  int ready = 0;
  o.on_trace_ready = [&](profiler::Profiler& p) {
    ++ready;
    EXPECT_EQ(relu_kernels(p.data()), 2 * 5) << "cycle " << ready;  // 2 active steps
  };
  {
    profiler::Profiler prof(o);
    profiler::ProfilerGuard guard(prof);
    for (int step = 0; step < 8; ++step) {
      for (int i = 0; i < 5; ++i) a = relu(a);
      prof.step();
    }
  }
  EXPECT_EQ(ready, 2);
}

}  // namespace
}  // namespace tally
