// format_memory_summary(): PyTorch's torch.cuda.memory_summary() layout, byte for byte, plus
// Tally's category table; and the fragmentation diagnosis of a live allocator.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "memory/caching_allocator.h"
#include "memory/fake_provider.h"
#include "memory/summary.h"

namespace tally::memory {
namespace {

constexpr int64_t KiB = int64_t{1} << 10;
constexpr int64_t MiB = int64_t{1} << 20;
constexpr int64_t GiB = int64_t{1} << 30;

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

bool contains_line(const std::vector<std::string>& lines, const std::string& wanted) {
  for (const auto& l : lines) {
    if (l == wanted) return true;
  }
  return false;
}

void set(StatArray& arr, PoolIndex pool, int64_t current, int64_t peak, int64_t allocated,
         int64_t freed) {
  arr[pool] = Stat{current, peak, allocated, freed};
}

// Lines per summary: PyTorch's part is 6 header lines, 9 metrics x (rule + 3 rows), 2 oversize x
// (rule + row) and the closing rule; Tally's part is title, rule, header, rule, 10 categories,
// rule, 2 fragmentation lines and the closing rule.
constexpr size_t kPyTorchLines = 6 + 9 * 4 + 2 * 2 + 1;
constexpr size_t kPyTorchLinesAbbrev = 6 + 9 * 2 + 2 * 2 + 1;
constexpr size_t kCategoryLines = 4 + kNumCategories + 4;

// A DeviceStats with the numbers of docs/memory-formats.md §3 in the allocated_bytes row. The
// extra bytes below one unit check that values are floor-divided.
DeviceStats example_stats() {
  DeviceStats s;
  set(s.allocated_bytes, kAllPools, 244537 * KiB + 1023, 11650 * MiB + 12345, 2671 * GiB + 5,
      2671 * GiB + (GiB - 1));
  set(s.allocated_bytes, kLargePool, 200000 * KiB, 11000 * MiB, 2000 * GiB, 2000 * GiB);
  set(s.allocated_bytes, kSmallPool, 44537 * KiB + 1023, 650 * MiB, 671 * GiB + 5,
      671 * GiB + (GiB - 1));
  set(s.reserved_bytes, kAllPools, 2 * GiB, 3 * GiB, 40 * GiB, 38 * GiB);
  set(s.allocation, kAllPools, 3460, 749999, 15606123, 750000);
  set(s.allocation, kLargePool, 395, 563, 2812000, 500);
  set(s.allocation, kSmallPool, 3065, 4270, 12794123, 749500);
  s.num_ooms = 1;
  s.num_alloc_retries = 2;
  return s;
}

// Every one of `parts` is in `text` (a failure prints the whole text).
void expect_says(const std::string& text, std::initializer_list<std::string_view> parts) {
  for (std::string_view p : parts)
    EXPECT_NE(text.find(p), std::string::npos) << p << " in\n" << text;
}

TEST(MemorySummary, EveryLineIs77CharsAndBoxed) {
  DeviceStats s = example_stats();
  for (bool abbreviated : {false, true}) {
    const std::string text = format_memory_summary(s, 0, "cuda:0", abbreviated);
    ASSERT_FALSE(text.empty());
    EXPECT_EQ(text.back(), '\n');
    const auto lines = split_lines(text);
    EXPECT_EQ(lines.size(), (abbreviated ? kPyTorchLinesAbbrev : kPyTorchLines) + kCategoryLines);
    for (const auto& line : lines) {
      ASSERT_EQ(line.size(), 77u) << "[" << line << "]";
      EXPECT_EQ(line.front(), '|') << line;
      EXPECT_EQ(line.back(), '|') << line;
    }
  }
}

TEST(MemorySummary, HeaderLines) {
  const auto lines = split_lines(format_memory_summary(example_stats(), 0, "cuda:0"));
  const std::string eq = "|" + std::string(75, '=') + "|";
  const std::string dash = "|" + std::string(75, '-') + "|";
  EXPECT_EQ(lines[0], eq);
  EXPECT_EQ(lines[1],
            "|                 Tally memory summary, device ID 0 (cuda:0)                |");
  EXPECT_EQ(lines[2], dash);
  // Same OOM/retry counts as a published PyTorch summary (ROCm OOM report, PyTorch 2.x).
  EXPECT_EQ(lines[3],
            "|            CUDA OOMs: 1            |        cudaMalloc retries: 2         |");
  EXPECT_EQ(lines[4], eq);
  EXPECT_EQ(lines[5],
            "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |");
  EXPECT_EQ(lines[6], dash);
  EXPECT_EQ(lines[kPyTorchLines - 1], eq);
  EXPECT_EQ(lines.back(), eq);
}

TEST(MemorySummary, TitleWithLongerLabel) {
  const auto lines = split_lines(format_memory_summary(DeviceStats{}, 12, "cpu"));
  EXPECT_EQ(lines[1],
            "|                  Tally memory summary, device ID 12 (cpu)                 |");
  const auto long_lines =
      split_lines(format_memory_summary(DeviceStats{}, 3, std::string(200, 'x')));
  EXPECT_EQ(long_lines[1].size(), 77u);
  EXPECT_EQ(long_lines[1].substr(0, 34), "| Tally memory summary, device ID ");
  EXPECT_EQ(long_lines[1].substr(70), "xx... |");
}

TEST(MemorySummary, DocExampleRowAndPoolRowsReuseTheAllUnit) {
  const auto lines = split_lines(format_memory_summary(example_stats(), 0, "cuda:0"));
  EXPECT_EQ(lines[7],
            "| Allocated memory      | 244537 KiB |  11650 MiB |   2671 GiB |   2671 GiB |");
  EXPECT_EQ(lines[8],
            "|       from large pool | 200000 KiB |  11000 MiB |   2000 GiB |   2000 GiB |");
  EXPECT_EQ(lines[9],
            "|       from small pool |  44537 KiB |    650 MiB |    671 GiB |    671 GiB |");
  // All-zero metric: every cell stays in bytes.
  EXPECT_EQ(lines[11],
            "| Active memory         |      0 B   |      0 B   |      0 B   |      0 B   |");
  // Empty pool rows of an all-row shown in MiB read "0 MiB", not "0 B".
  EXPECT_EQ(lines[19],
            "| GPU reserved memory   |   2048 MiB |   3072 MiB |  40960 MiB |  38912 MiB |");
  EXPECT_EQ(lines[20],
            "|       from large pool |      0 MiB |      0 MiB |      0 MiB |      0 MiB |");
}

TEST(MemorySummary, ByteUnitBoundaries) {
  DeviceStats s;
  // The unit steps up once the value reaches 768 of the next unit (786432 of the current one).
  set(s.active_bytes, kAllPools, 786431, 786432, 786432 * KiB - 1, 786432 * KiB);
  set(s.active_bytes, kLargePool, 1023, 1023, 1023, 1023);
  // 5 PiB is only 5120 TiB, below 786432 TiB, so it stays in TiB.
  set(s.requested_bytes, kAllPools, 786432 * MiB - 1, 786432 * MiB, int64_t{5} << 50,
      786432 * (GiB << 10));
  const auto lines = split_lines(format_memory_summary(s, 0, "cuda:0"));
  EXPECT_EQ(lines[11],
            "| Active memory         | 786431 B   |    768 KiB | 786431 KiB |    768 MiB |");
  EXPECT_EQ(lines[12],
            "|       from large pool |   1023 B   |      0 KiB |      0 KiB |      0 MiB |");
  EXPECT_EQ(lines[15],
            "| Requested memory      | 786431 MiB |    768 GiB |   5120 TiB |    768 PiB |");
}

TEST(MemorySummary, CountFormattingWithKAndM) {
  DeviceStats s = example_stats();
  set(s.active, kAllPools, 999999, 750000000, 1234567890, 749999999);
  set(s.active, kLargePool, 999, 749999, 1234567890, 0);
  s.oversize_allocations = Stat{5, 750000, 1000000, 999999999};
  const auto lines = split_lines(format_memory_summary(s, 0, "cuda:0"));
  EXPECT_EQ(lines[27],
            "| Allocations           |    3460    |  749999    |   15606 K  |     750 K  |");
  EXPECT_EQ(lines[28],
            "|       from large pool |     395    |     563    |    2812 K  |       0 K  |");
  EXPECT_EQ(lines[29],
            "|       from small pool |    3065    |    4270    |   12794 K  |     749 K  |");
  EXPECT_EQ(lines[31],
            "| Active allocs         |     999 K  |     750 M  |    1234 M  |  749999 K  |");
  EXPECT_EQ(lines[32],
            "|       from large pool |       0 K  |       0 M  |    1234 M  |       0 K  |");
  // Oversize rows: no pool rows, each cell picks its own unit.
  EXPECT_EQ(lines[43],
            "| Oversize allocations  |       5    |     750 K  |    1000 K  |     999 M  |");
  EXPECT_EQ(lines[44], "|" + std::string(75, '-') + "|");
  EXPECT_EQ(lines[45],
            "| Oversize GPU segments |       0    |       0    |       0    |       0    |");
}

TEST(MemorySummary, AbbreviatedOmitsPoolRows) {
  const DeviceStats s = example_stats();
  const std::string full = format_memory_summary(s, 0, "cuda:0", false);
  const std::string abbrev = format_memory_summary(s, 0, "cuda:0", true);
  EXPECT_NE(full.find("from large pool"), std::string::npos);
  EXPECT_NE(full.find("from small pool"), std::string::npos);
  EXPECT_EQ(abbrev.find("from large pool"), std::string::npos);
  EXPECT_EQ(abbrev.find("from small pool"), std::string::npos);
  const auto lines = split_lines(abbrev);
  ASSERT_EQ(lines.size(), kPyTorchLinesAbbrev + kCategoryLines);
  EXPECT_EQ(lines[6], "|" + std::string(75, '-') + "|");
  EXPECT_EQ(lines[7],
            "| Allocated memory      | 244537 KiB |  11650 MiB |   2671 GiB |   2671 GiB |");
  EXPECT_EQ(lines[8], "|" + std::string(75, '-') + "|");
  EXPECT_EQ(lines[9],
            "| Active memory         |      0 B   |      0 B   |      0 B   |      0 B   |");
  // The category table is kept in the abbreviated form.
  EXPECT_TRUE(contains_line(
      lines, "|                             Memory by category                            |"));
}

TEST(MemorySummary, CategoryTable) {
  DeviceStats s;
  set(s.allocated_bytes, kAllPools, 600 * MiB, 1000 * MiB, 0, 0);
  s.cat_bytes(Category::parameter) = Stat{400 * MiB, 400 * MiB, 0, 0};
  s.cat_bytes(Category::activation) = Stat{100 * MiB, 413 * MiB, 0, 0};
  s.cat_bytes(Category::temporary) = Stat{123, 1000 * MiB, 0, 0};
  s.cat_bytes(Category::workspace) = Stat{244537 * KiB, 244537 * KiB, 0, 0};
  s.category_at_peak[static_cast<size_t>(Category::parameter)] = 400 * MiB;
  s.category_at_peak[static_cast<size_t>(Category::activation)] = 413 * MiB;
  s.category_at_peak[static_cast<size_t>(Category::temporary)] = 187 * MiB;
  const auto lines = split_lines(format_memory_summary(s, 0, "cuda:0"));
  const size_t t = kPyTorchLines;  // first line of Tally's table
  const std::string eq = "|" + std::string(75, '=') + "|";
  const std::string dash = "|" + std::string(75, '-') + "|";
  EXPECT_EQ(lines[t],
            "|                             Memory by category                            |");
  EXPECT_EQ(lines[t + 1], eq);
  EXPECT_EQ(lines[t + 2],
            "|        Category       | Cur Usage  | Peak Usage |  At peak   |  Share     |");
  EXPECT_EQ(lines[t + 3], dash);
  const std::vector<std::string> rows = {
      "| parameter             | 409600 KiB | 409600 KiB | 409600 KiB |   40.0%    |",
      "| gradient              |      0 B   |      0 B   |      0 B   |    0.0%    |",
      "| optimizer_state       |      0 B   |      0 B   |      0 B   |    0.0%    |",
      "| activation            | 102400 KiB | 422912 KiB | 422912 KiB |   41.3%    |",
      "| input                 |      0 B   |      0 B   |      0 B   |    0.0%    |",
      "| temporary             |    123 B   |   1000 MiB | 191488 KiB |   18.7%    |",
      "| workspace             | 244537 KiB | 244537 KiB |      0 B   |    0.0%    |",
      "| autocast_cache        |      0 B   |      0 B   |      0 B   |    0.0%    |",
      "| communication         |      0 B   |      0 B   |      0 B   |    0.0%    |",
      "| offloaded             |      0 B   |      0 B   |      0 B   |    0.0%    |",
      "| unknown               |      0 B   |      0 B   |      0 B   |    0.0%    |",
  };
  for (size_t i = 0; i < rows.size(); ++i) EXPECT_EQ(lines[t + 4 + i], rows[i]) << i;
  EXPECT_EQ(lines[t + 15], dash);
}

TEST(MemorySummary, CategoryShareWithoutAllocations) {
  const auto lines = split_lines(format_memory_summary(DeviceStats{}, 0, "cpu"));
  EXPECT_EQ(lines[kPyTorchLines + 4],
            "| parameter             |      0 B   |      0 B   |      0 B   |       -    |");
}

TEST(MemorySummary, FragmentationLines) {
  DeviceStats s;
  set(s.allocated_bytes, kAllPools, 1536 * MiB, 1000 * MiB, 0, 0);
  set(s.reserved_bytes, kAllPools, 2 * GiB, 3 * GiB, 0, 0);
  const auto lines = split_lines(format_memory_summary(s, 0, "cuda:0"));
  const size_t n = lines.size();
  // reserved - allocated = 512 MiB (shown as 524288 KiB: below 768 MiB);
  // peak reserved - peak allocated = 3072 - 1000 = 2072 MiB.
  EXPECT_EQ(lines[n - 3],
            "| Fragmentation (reserved - allocated): 524288 KiB                          |");
  EXPECT_EQ(lines[n - 2],
            "|   (peak reserved - peak allocated:      2072 MiB)                         |");
  EXPECT_EQ(lines[n - 1], "|" + std::string(75, '=') + "|");
}

// A torch.cuda.memory_summary() printed by PyTorch 2.x (published in SGLang/verl memory-debugging
// notes). Tally's rendering of the same statistics must match it line for line, the title line
// excepted (Tally names itself and the device label there).
constexpr const char* kPyTorchGolden =
    R"(|===========================================================================|
|                  PyTorch CUDA memory summary, device ID 0                 |
|---------------------------------------------------------------------------|
|            CUDA OOMs: 0            |        cudaMalloc retries: 0         |
|===========================================================================|
|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |
|---------------------------------------------------------------------------|
| Allocated memory      | 184648 KiB | 192833 KiB | 258378 KiB |  73729 KiB |
|       from large pool | 184576 KiB | 192768 KiB | 254208 KiB |  69632 KiB |
|       from small pool |     72 KiB |   1060 KiB |   4170 KiB |   4097 KiB |
|---------------------------------------------------------------------------|
| Active memory         | 184648 KiB | 192833 KiB | 258378 KiB |  73729 KiB |
|       from large pool | 184576 KiB | 192768 KiB | 254208 KiB |  69632 KiB |
|       from small pool |     72 KiB |   1060 KiB |   4170 KiB |   4097 KiB |
|---------------------------------------------------------------------------|
| Requested memory      | 184648 KiB | 192832 KiB | 258376 KiB |  73728 KiB |
|       from large pool | 184576 KiB | 192768 KiB | 254208 KiB |  69632 KiB |
|       from small pool |     72 KiB |   1060 KiB |   4168 KiB |   4096 KiB |
|---------------------------------------------------------------------------|
| GPU reserved memory   | 235520 KiB | 235520 KiB | 235520 KiB |      0 B   |
|       from large pool | 233472 KiB | 233472 KiB | 233472 KiB |      0 B   |
|       from small pool |   2048 KiB |   2048 KiB |   2048 KiB |      0 B   |
|---------------------------------------------------------------------------|
| Non-releasable memory |  30391 KiB |  38607 KiB | 132985 KiB | 102594 KiB |
|       from large pool |  28416 KiB |  36608 KiB | 126848 KiB |  98432 KiB |
|       from small pool |   1975 KiB |   2040 KiB |   6137 KiB |   4162 KiB |
|---------------------------------------------------------------------------|
| Allocations           |      21    |      23    |      42    |      21    |
|       from large pool |      12    |      14    |      26    |      14    |
|       from small pool |       9    |      10    |      16    |       7    |
|---------------------------------------------------------------------------|
| Active allocs         |      21    |      23    |      42    |      21    |
|       from large pool |      12    |      14    |      26    |      14    |
|       from small pool |       9    |      10    |      16    |       7    |
|---------------------------------------------------------------------------|
| GPU reserved segments |      10    |      10    |      10    |       0    |
|       from large pool |       9    |       9    |       9    |       0    |
|       from small pool |       1    |       1    |       1    |       0    |
|---------------------------------------------------------------------------|
| Non-releasable allocs |       6    |       6    |      13    |       7    |
|       from large pool |       4    |       5    |      11    |       7    |
|       from small pool |       2    |       2    |       2    |       0    |
|---------------------------------------------------------------------------|
| Oversize allocations  |       0    |       0    |       0    |       0    |
|---------------------------------------------------------------------------|
| Oversize GPU segments |       0    |       0    |       0    |       0    |
|===========================================================================|
)";

// The numbers of one metric of a published summary: the stat arrays that print them, their unit,
// and (current, peak, allocated, freed) for all, large and small pools.
struct MetricRows {
  std::vector<StatArray*> arrays;
  int64_t unit;
  std::array<std::array<int64_t, 4>, 3> pools;
};

void set_metrics(const std::vector<MetricRows>& metrics) {
  const PoolIndex pools[] = {kAllPools, kLargePool, kSmallPool};
  for (const MetricRows& m : metrics)
    for (StatArray* arr : m.arrays)
      for (size_t i = 0; i < 3; ++i) {
        const auto& [c, p, a, f] = m.pools[i];
        set(*arr, pools[i], c * m.unit, p * m.unit, a * m.unit, f * m.unit);
      }
}

TEST(MemorySummary, MatchesRealPyTorchOutput) {
  DeviceStats s;
  set_metrics({
      {{&s.allocated_bytes, &s.active_bytes},
       KiB,
       {{{184648, 192833, 258378, 73729},
         {184576, 192768, 254208, 69632},
         {72, 1060, 4170, 4097}}}},
      {{&s.requested_bytes},
       KiB,
       {{{184648, 192832, 258376, 73728},
         {184576, 192768, 254208, 69632},
         {72, 1060, 4168, 4096}}}},
      {{&s.reserved_bytes},
       KiB,
       {{{235520, 235520, 235520, 0}, {233472, 233472, 233472, 0}, {2048, 2048, 2048, 0}}}},
      {{&s.inactive_split_bytes},
       KiB,
       {{{30391, 38607, 132985, 102594}, {28416, 36608, 126848, 98432}, {1975, 2040, 6137, 4162}}}},
      {{&s.allocation, &s.active}, 1, {{{21, 23, 42, 21}, {12, 14, 26, 14}, {9, 10, 16, 7}}}},
      {{&s.segment}, 1, {{{10, 10, 10, 0}, {9, 9, 9, 0}, {1, 1, 1, 0}}}},
      {{&s.inactive_split}, 1, {{{6, 6, 13, 7}, {4, 5, 11, 7}, {2, 2, 2, 0}}}},
  });

  const auto golden = split_lines(kPyTorchGolden);
  const auto got = split_lines(format_memory_summary(s, 0, "cuda:0"));
  ASSERT_EQ(golden.size(), kPyTorchLines);
  ASSERT_EQ(got.size(), kPyTorchLines + kCategoryLines);
  for (size_t i = 0; i < golden.size(); ++i) {
    if (i == 1) continue;  // title
    EXPECT_EQ(got[i], golden[i]) << "line " << i;
  }
  EXPECT_EQ(got[1],
            "|                 Tally memory summary, device ID 0 (cuda:0)                |");
}

// Rows taken from another published PyTorch 2.x summary (Unsloth "standby" benchmark), exercising
// MiB/GiB next to KiB in one row and the K count suffix.
TEST(MemorySummary, MatchesRealPyTorchRowsWithGiBAndK) {
  DeviceStats s;
  set(s.inactive_split_bytes, kAllPools, 713142 * KiB, 4633 * MiB + 17, 103206 * GiB + 3,
      103205 * GiB + 999);
  set(s.inactive_split_bytes, kLargePool, 525312 * KiB, 4594 * MiB, 101923 * GiB, 101922 * GiB);
  set(s.inactive_split_bytes, kSmallPool, 187830 * KiB, 250 * MiB, 1283 * GiB, 1283 * GiB);
  set(s.allocation, kAllPools, 3460, 4809, 15606321, 15603001);
  set(s.allocation, kLargePool, 395, 563, 2812000, 2811999);
  set(s.allocation, kSmallPool, 3065, 4270, 12794321, 12791002);
  set(s.reserved_bytes, kAllPools, 37644 * MiB, 47504 * MiB, 705806 * MiB, 668162 * MiB);
  const auto lines = split_lines(format_memory_summary(s, 0, "cuda:0"));
  EXPECT_EQ(lines[19],
            "| GPU reserved memory   |  37644 MiB |  47504 MiB | 705806 MiB | 668162 MiB |");
  EXPECT_EQ(lines[23],
            "| Non-releasable memory | 713142 KiB |   4633 MiB | 103206 GiB | 103205 GiB |");
  EXPECT_EQ(lines[24],
            "|       from large pool | 525312 KiB |   4594 MiB | 101923 GiB | 101922 GiB |");
  EXPECT_EQ(lines[25],
            "|       from small pool | 187830 KiB |    250 MiB |   1283 GiB |   1283 GiB |");
  EXPECT_EQ(lines[27],
            "| Allocations           |    3460    |    4809    |   15606 K  |   15603 K  |");
  EXPECT_EQ(lines[28],
            "|       from large pool |     395    |     563    |    2812 K  |    2811 K  |");
  EXPECT_EQ(lines[29],
            "|       from small pool |    3065    |    4270    |   12794 K  |   12791 K  |");
}

// ---- the fragmentation diagnosis, from an allocator over a fake device ----

struct FragmentedDevice {
  explicit FragmentedDevice(size_t capacity, const std::string& conf = "") {
    auto p = std::make_unique<testing::FakeProvider>(capacity);
    alloc = std::make_unique<CachingAllocator>(std::move(p), AllocatorConfig::parse(conf));
  }
  void* allocate(size_t bytes, Category c) {
    CategoryScope scope(c);
    return alloc->allocate(bytes);
  }
  // The diagnosis lines of memory_summary(): everything after the fragmentation lines.
  std::vector<std::string> diagnosis() const {
    const auto lines = split_lines(alloc->memory_summary());
    std::vector<std::string> out;
    bool in = false;
    for (const auto& l : lines) {
      EXPECT_EQ(l.size(), 77u) << "[" << l << "]";
      if (l.find("Diagnosis:") != std::string::npos) in = true;
      if (in && l != "|" + std::string(75, '=') + "|") out.push_back(l);
    }
    return out;
  }
  std::unique_ptr<CachingAllocator> alloc;
};

std::string joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += l + "\n";
  return s;
}

// A 20 MiB segment cut into ten 2 MiB blocks: activations and parameters kept, the
// temporaries between them freed. 10 MiB are free, but in 2 MiB holes; a 4 MiB request has
// nowhere to go (the device has no room for a second segment).
TEST(MemorySummaryDiagnosis, NamesThePoolTheInterleavedCategoriesAndTheSetting) {
  FragmentedDevice d(22 * MiB);
  std::vector<void*> kept;
  std::vector<void*> temps;
  for (int i = 0; i < 10; ++i) {
    if (i % 2 == 1)
      temps.push_back(d.allocate(2 * MiB, Category::temporary));
    else
      kept.push_back(d.allocate(2 * MiB, i % 4 == 0 ? Category::activation : Category::parameter));
  }
  for (void* p : temps) d.alloc->deallocate(p);
  EXPECT_THROW((void)d.allocate(4 * MiB, Category::activation), OutOfMemoryError);

  const auto lines = d.diagnosis();
  const std::string text = joined(lines);
  ASSERT_GE(lines.size(), 5u) << text;
  EXPECT_EQ(lines[0],
            "| Diagnosis: largest free block 2.0 MiB < failed request 4.0 MiB            |");
  EXPECT_EQ(lines[1],
            "|   large pool, activation: 10.0 MiB free in the pool when it failed        |");
  expect_says(text, {"free in the large pool: 10.0 MiB in 1 segment, 0 B releasable",
                     "5 free blocks, 10.0 MiB free",
                     // Three activations (6 MiB) and two parameters (4 MiB) sit between the holes.
                     "interleaved with: activation 6.0 MiB, parameter 4.0 MiB",
                     "would help: TALLY_ALLOC_CONF=expandable_segments:True"});
  // A 4 MiB request is no case for max_split_size_mb (its floor is 20 MiB).
  EXPECT_EQ(text.find("max_split_size_mb"), std::string::npos) << text;
  EXPECT_EQ(text.find("small pool"), std::string::npos) << text;

  // The allocator's own view agrees.
  const FragmentationInfo f = d.alloc->fragmentation();
  EXPECT_EQ(f.last_oom.requested, 4 * MiB);
  EXPECT_EQ(f.last_oom.largest_free, 2 * MiB);
  EXPECT_EQ(f.free_bytes[kLargePool], 10 * MiB);
  EXPECT_EQ(f.free_segments[kLargePool], 1);
  ASSERT_EQ(f.segments.size(), 1u);
  EXPECT_EQ(f.segments[0].free_blocks, 5);
  EXPECT_EQ(f.interleaved[static_cast<size_t>(Category::temporary)], 0);
  for (void* p : kept) d.alloc->deallocate(p);
}

// A large request after a small one split the only large cached block: max_split_size_mb
// would have kept that block whole.
TEST(MemorySummaryDiagnosis, LargeRequestsSuggestMaxSplitSize) {
  FragmentedDevice d(100 * MiB);
  void* big = d.allocate(60 * MiB, Category::activation);
  d.alloc->deallocate(big);
  void* small = d.allocate(3 * MiB, Category::optimizer_state);  // split from the 60 MiB block
  EXPECT_THROW((void)d.allocate(60 * MiB, Category::activation), OutOfMemoryError);
  const std::string text = joined(d.diagnosis());
  expect_says(text, {"Diagnosis: largest free block 57.0 MiB < failed request 60.0 MiB",
                     "interleaved with: optimizer_state 3.0 MiB",
                     "would help: TALLY_ALLOC_CONF=expandable_segments:True",
                     "or TALLY_ALLOC_CONF=max_split_size_mb:60 (blocks >= 60 MiB stay whole)"});
  d.alloc->deallocate(small);
}

// Without an out-of-memory error the largest request is the yardstick; whole cached segments
// are released by empty_cache(), and with expandable segments on no setting is left to try.
TEST(MemorySummaryDiagnosis, WithoutFailureAndWithExpandableSegments) {
  {
    FragmentedDevice d(size_t{1} << 30);
    void* a = d.allocate(30 * MiB, Category::activation);
    void* b = d.allocate(1000, Category::parameter);
    d.alloc->deallocate(a);
    const std::string text = joined(d.diagnosis());
    expect_says(text, {"Diagnosis: largest free block 30.0 MiB >= largest request 30.0 MiB",
                       "would help: nothing needed; empty_cache() returns 30.0 MiB",
                       // The small segment holds free bytes next to the parameter.
                       "free in the small pool"});
    d.alloc->deallocate(b);
  }
  {
    // One 20 MiB page of ten 2 MiB blocks, every other one freed: the holes do not merge.
    FragmentedDevice d(22 * MiB, "expandable_segments:True");
    std::vector<void*> kept;
    std::vector<void*> temps;
    for (int i = 0; i < 10; ++i) {
      if (i % 2)
        temps.push_back(d.allocate(2 * MiB, Category::temporary));
      else
        kept.push_back(d.allocate(2 * MiB, Category::activation));
    }
    for (void* p : temps) d.alloc->deallocate(p);
    EXPECT_THROW((void)d.allocate(4 * MiB, Category::activation), OutOfMemoryError);
    const std::string text = joined(d.diagnosis());
    expect_says(text, {"Diagnosis: largest free block 2.0 MiB < failed request 4.0 MiB",
                       "interleaved with: activation",
                       "would help: no setting (expandable_segments is on)"});
    for (void* p : kept) d.alloc->deallocate(p);
  }
  {
    FragmentedDevice d(22 * MiB);
    EXPECT_EQ(joined(d.diagnosis()),
              "| Diagnosis: nothing allocated and nothing cached                           |\n");
  }
}

TEST(MemorySummary, HostLabelsAreDeviceNeutral) {
  for (const char* label : {"cpu", "cpu (pinned)", "meta:0 (cpu)"}) {
    const std::string s = format_memory_summary(example_stats(), 0, label);
    EXPECT_EQ(s.find("GPU"), std::string::npos) << label;
    EXPECT_EQ(s.find("CUDA"), std::string::npos) << label;
    EXPECT_EQ(s.find("cudaMalloc"), std::string::npos) << label;
    const auto lines = split_lines(s);
    EXPECT_EQ(lines[3],
              "|                 OOMs: 1            |         allocator retries: 2         |")
        << label;
    EXPECT_EQ(lines[19],
              "| Reserved memory       |   2048 MiB |   3072 MiB |  40960 MiB |  38912 MiB |");
  }
  // PyTorch's own labels stay on CUDA, and on a meta device replaying a GPU.
  for (const char* label : {"cuda:0", "meta:0 (h200)"}) {
    const std::string s = format_memory_summary(example_stats(), 0, label);
    EXPECT_NE(s.find("GPU reserved memory"), std::string::npos) << label;
    EXPECT_NE(s.find("CUDA OOMs: 1"), std::string::npos) << label;
  }
}

}  // namespace
}  // namespace tally::memory
