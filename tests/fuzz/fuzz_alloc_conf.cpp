// TALLY_ALLOC_CONF (memory/alloc_config.cpp): the input up to the first NUL byte is the
// setting. A setting that parses must be one the allocator can work under: a caching
// allocator over a fake 1 TiB device (addresses only, never touched) with that config serves
// requests the rest of the input gives (any size_t, small ones mostly), each block at least
// as large as asked, frees them all and ends with nothing allocated and, after empty_cache,
// nothing reserved.
#include <algorithm>
#include <bit>
#include <vector>

#include "fuzz_common.h"
#include "memory/alloc_config.h"
#include "memory/caching_allocator.h"
#include "memory/fake_provider.h"

using namespace tally;
using namespace tally::memory;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* text = reinterpret_cast<const char*>(data);
  const size_t end = std::find(text, text + size, '\0') - text;
  const std::string_view conf(text, end);
  AllocatorConfig cfg;
  if (!fuzz::accepts([&] { cfg = AllocatorConfig::parse(conf); })) return 0;
  FUZZ_CHECK(cfg.settings == conf);
  for (size_t d : cfg.roundup_power2_divisions) FUZZ_CHECK(d == 0 || std::has_single_bit(d));
  FUZZ_CHECK(cfg.garbage_collection_threshold >= 0 && cfg.garbage_collection_threshold < 1);
  // An out-of-memory error dumps a snapshot to oom_snapshot: into the scratch folder, never
  // where the input says.
  if (!cfg.oom_snapshot_path.empty())
    cfg.oom_snapshot_path = (fuzz::scratch_dir() / "oom.pickle").string();

  FuzzedDataProvider in(data + std::min(size, end + 1), size - std::min(size, end + 1));
  CachingAllocator alloc(std::make_unique<testing::FakeProvider>(size_t{1} << 40), cfg);
  if (in.ConsumeBool()) alloc.record_memory_history(true, 64);
  if (in.ConsumeBool()) alloc.set_memory_fraction(0.001 + 0.999 * in.ConsumeProbability<double>());
  std::vector<void*> live;
  for (int i = 0; i < 64 && in.remaining_bytes() > 0; ++i) {
    const int op = in.ConsumeIntegralInRange<int>(0, 9);
    if (op < 6 || live.empty()) {
      const size_t bytes = op == 0   ? in.ConsumeIntegral<size_t>()
                           : op == 1 ? in.ConsumeIntegralInRange<size_t>(0, size_t{64} << 20)
                                     : in.ConsumeIntegralInRange<size_t>(0, size_t{4} << 20);
      fuzz::accepts([&] {
        void* p = alloc.allocate(bytes);
        if (bytes == 0) {
          FUZZ_CHECK(p == nullptr);
          return;
        }
        FUZZ_CHECK(p != nullptr);
        FUZZ_CHECK(alloc.block_size(p) >= bytes);
        live.push_back(p);
      });
    } else if (op < 9) {
      const size_t k = in.ConsumeIntegralInRange<size_t>(0, live.size() - 1);
      alloc.deallocate(live[k]);
      live[k] = live.back();
      live.pop_back();
    } else {
      alloc.empty_cache();
    }
  }
  for (void* p : live) alloc.deallocate(p);
  FUZZ_CHECK(alloc.memory_allocated() == 0);
  alloc.empty_cache();
  FUZZ_CHECK(alloc.memory_reserved() == 0);
  return 0;
}
