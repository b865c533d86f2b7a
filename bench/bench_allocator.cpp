// The allocation fast path: a cache-hit allocate + deallocate pair on the CPU provider,
// with history off and on. Targets: < 200 ns per pair off, < 500 ns on (also over a window
// that starts with an empty history, as a profiler's does).
#include <benchmark/benchmark.h>

#include "memory/caching_allocator.h"
#include "memory/cpu_provider.h"

using namespace tally::memory;

static void run_pairs(benchmark::State& state, bool history) {
  CachingAllocator alloc(std::make_unique<CpuProvider>(), AllocatorConfig{});
  alloc.record_memory_history(history, 100000);
  const auto size = static_cast<size_t>(state.range(0));
  // Warm the cache so every iteration is a hit, with a few live neighbours in the pool.
  std::vector<void*> live;
  for (int i = 0; i < 64; ++i) live.push_back(alloc.allocate(size));
  for (size_t i = 0; i < live.size(); i += 2) alloc.deallocate(live[i]);
  CategoryScope cat(Category::activation);
  ModuleScope mod("layer1.0.conv1");
  OpScope op("conv2d");
  for (auto _ : state) {
    void* p = alloc.allocate(size);
    benchmark::DoNotOptimize(p);
    alloc.deallocate(p);
  }
  state.SetItemsProcessed(state.iterations());
  for (size_t i = 1; i < live.size(); i += 2) alloc.deallocate(live[i]);
}

static void BM_AllocFreePair_HistoryOff(benchmark::State& s) {
  run_pairs(s, false);
}
static void BM_AllocFreePair_HistoryOn(benchmark::State& s) {
  run_pairs(s, true);
}
BENCHMARK(BM_AllocFreePair_HistoryOff)->Arg(4096)->Arg(4 << 20);
BENCHMARK(BM_AllocFreePair_HistoryOn)->Arg(4096)->Arg(4 << 20);

// A profiling window: history turned on (as the profiler does with profile_memory), 10,000
// pairs (about four ResNet-50 steps of allocator events), history off. Unlike the steady
// state above, the ring starts empty each time, so what filling it costs is counted.
static void BM_AllocFreePair_HistoryWindow(benchmark::State& state) {
  CachingAllocator alloc(std::make_unique<CpuProvider>(), AllocatorConfig{});
  constexpr int kPairs = 10000;
  void* warm = alloc.allocate(4096);
  alloc.deallocate(warm);
  for (auto _ : state) {
    alloc.record_memory_history(true, 100000);
    for (int i = 0; i < kPairs; ++i) {
      void* p = alloc.allocate(4096);
      benchmark::DoNotOptimize(p);
      alloc.deallocate(p);
    }
    alloc.record_memory_history(false);
  }
  state.SetItemsProcessed(state.iterations() * kPairs);
}
BENCHMARK(BM_AllocFreePair_HistoryWindow);

BENCHMARK_MAIN();
