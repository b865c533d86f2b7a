// The snapshot diff (inspect/memdiff.h): two Tally snapshots made here with known allocations
// (exact bytes at each peak, allocation counts and deltas per category, module, op and phase, a
// re-tag, a parameter live before the trace), two runs of a small nn model, PyTorch's own
// snapshots (tests/memory/fixtures: peaks and frames checked against an independent replay in
// Python), and the errors: a foreign or truncated pickle, a snapshot without history, two
// snapshots of different devices.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <sstream>

#include "autograd/ops.h"
#include "inspect/memdiff.h"
#include "memory/caching_allocator.h"
#include "memory/fake_provider.h"
#include "memory/memory.h"
#include "memory/pickle.h"
#include "nn/container.h"
#include "nn/layers.h"
#include "tensor/ops.h"
#include "testing/files.h"

namespace tally::memory {
using namespace tally::inspect;
namespace {

namespace fs = std::filesystem;

using namespace tally::testing;

fs::path temp_file(const std::string& stem) {
  return tally::testing::temp_file(stem, ".pickle");
}

// A "training step" on a fake device with known sizes. B doubles layer1's activation and adds a
// temporary in layer2 that is re-tagged as a saved activation.
//   A: +4096 layer1, +300 -300 temporary, +2048 layer2, +1000 gradient = peak 1000 + 7144
//   B: +8192 layer1, +300 -300, +2048 layer2, +600 gelu (re-tagged), +1000 = peak 1000 + 11840
fs::path tally_run(bool b, const fs::path& path, int device = 0) {
  CachingAllocator alloc(std::make_unique<testing::FakeProvider>(size_t{1} << 30, device),
                         AllocatorConfig{});
  void* param;
  {
    AllocContextScope s(Category::parameter, "fc", "", "init");
    param = alloc.allocate(1000);  // before the history: live from its start
  }
  alloc.record_memory_history(true);
  void *x1, *x2, *g = nullptr, *grad;
  {
    AllocContextScope s(Category::activation, "layer1", "linear", "forward");
    x1 = alloc.allocate(b ? 8192 : 4096);
  }
  {
    AllocContextScope s(Category::temporary, "layer1", "add", "forward");
    alloc.deallocate(alloc.allocate(300));
  }
  {
    AllocContextScope s(Category::activation, "layer2", "linear", "forward");
    x2 = alloc.allocate(2048);
  }
  if (b) {
    AllocContextScope s(Category::temporary, "layer2", "gelu", "forward");
    g = alloc.allocate(600);
    alloc.retag(g, Category::activation);
  }
  {
    AllocContextScope s(Category::gradient, "fc", "linear_backward", "backward");
    grad = alloc.allocate(1000);
  }
  alloc.deallocate(x2);
  alloc.deallocate(x1);
  if (g) alloc.deallocate(g);
  alloc.dump_snapshot(path.string());
  alloc.deallocate(grad);
  alloc.deallocate(param);
  return path;
}

const DiffRow& row(const SnapshotDiff& d, std::string_view dim, std::string_view name) {
  const DiffSection* s = d.section(dim);
  EXPECT_NE(s, nullptr) << dim;
  static const DiffRow none{"<missing>"};
  if (!s) return none;
  for (const DiffRow& r : s->rows)
    if (r.name == name) return r;
  ADD_FAILURE() << "no row '" << name << "' by " << dim;
  return none;
}

// Each section's rows add up to both peaks: every live byte at a peak has one key.
void expect_sections_add_up(const SnapshotDiff& d) {
  for (const DiffSection& s : d.sections) {
    int64_t a = 0, b = 0, na = 0, nb = 0;
    for (const DiffRow& r : s.rows) {
      a += r.a_bytes;
      b += r.b_bytes;
      na += r.a_allocations;
      nb += r.b_allocations;
    }
    EXPECT_EQ(a, d.a.peak_allocated) << s.dimension;
    EXPECT_EQ(b, d.b.peak_allocated) << s.dimension;
    EXPECT_EQ(na, d.a.allocations) << s.dimension;
    EXPECT_EQ(nb, d.b.allocations) << s.dimension;
  }
}

TEST(MemDiff, TallySnapshotsKnownDeltas) {
  const SnapshotSummary a = read_snapshot_summary(tally_run(false, temp_file("a")).string());
  const SnapshotSummary b = read_snapshot_summary(tally_run(true, temp_file("b")).string());
  EXPECT_TRUE(a.tally);
  EXPECT_EQ(a.device, 0);
  EXPECT_EQ(a.start_allocated, 1000);
  EXPECT_EQ(a.peak_allocated, 8144);
  EXPECT_EQ(b.peak_allocated, 12840);
  EXPECT_EQ(a.allocations, 4);
  EXPECT_EQ(b.allocations, 5);  // the re-tag is not an allocation
  EXPECT_EQ(a.peak_reached_by, "gradient fc linear_backward backward");
  EXPECT_GE(a.peak_reserved, 2 << 20);  // one small segment
  // The timeline: the start, then one sample per alloc and free; the re-tag adds none and
  // does not dip.
  EXPECT_EQ(a.allocated.front(), 1000);
  EXPECT_EQ(a.allocated.size(), 1u + 4 + 3);  // gradient and parameter are freed after the dump
  EXPECT_EQ(b.allocated.size(), 1u + 5 + 4);
  EXPECT_EQ(*std::max_element(b.allocated.begin(), b.allocated.end()), 12840);
  for (size_t i = 1; i < b.allocated.size(); ++i) EXPECT_GE(b.t[i], b.t[i - 1]);

  const SnapshotDiff d = diff_snapshots(a, b);
  std::vector<std::string> dims;
  for (const DiffSection& s : d.sections) dims.push_back(s.dimension);
  EXPECT_EQ(dims, (std::vector<std::string>{"category", "phase", "module", "op", "key"}));
  expect_sections_add_up(d);

  EXPECT_EQ(d.section("category")->rows.front().name, "activation");  // the largest change
  const DiffRow& act = row(d, "category", "activation");
  EXPECT_EQ(act.a_bytes, 4096 + 2048);
  EXPECT_EQ(act.b_bytes, 8192 + 2048 + 600);
  EXPECT_EQ(act.bytes_delta(), 4696);
  EXPECT_EQ(act.a_allocations, 2);
  EXPECT_EQ(act.b_allocations, 2);  // the gelu block was allocated as a temporary
  const DiffRow& tmp = row(d, "category", "temporary");
  EXPECT_EQ(tmp.a_bytes, 0);
  EXPECT_EQ(tmp.b_bytes, 0);
  EXPECT_EQ(tmp.allocations_delta(), 1);
  const DiffRow& param = row(d, "category", "parameter");
  EXPECT_EQ(param.a_bytes, 1000);
  EXPECT_EQ(param.bytes_delta(), 0);
  EXPECT_EQ(param.a_allocations, 0);  // allocated before the trace
  EXPECT_EQ(row(d, "category", "gradient").b_bytes, 1000);

  // Modules by path.
  EXPECT_EQ(row(d, "module", "layer1").a_bytes, 4096);
  EXPECT_EQ(row(d, "module", "layer1").b_bytes, 8192);
  EXPECT_EQ(row(d, "module", "layer1").a_allocations, 2);
  EXPECT_EQ(row(d, "module", "layer2").bytes_delta(), 600);
  EXPECT_EQ(row(d, "module", "layer2").allocations_delta(), 1);
  EXPECT_EQ(row(d, "module", "fc").a_bytes, 2000);  // the parameter and its gradient
  EXPECT_EQ(row(d, "module", "fc").bytes_delta(), 0);
  EXPECT_EQ(d.section("module")->rows.front().name, "layer1");
  // Ops and phases.
  EXPECT_EQ(row(d, "op", "linear").b_bytes, 8192 + 2048);
  EXPECT_EQ(row(d, "op", "gelu").b_bytes, 600);
  EXPECT_EQ(row(d, "op", "gelu").a_allocations, 0);
  EXPECT_EQ(row(d, "phase", "forward").bytes_delta(), 4696);
  EXPECT_EQ(row(d, "phase", "init").a_bytes, 1000);
  EXPECT_EQ(row(d, "phase", "backward").b_bytes, 1000);
  EXPECT_EQ(row(d, "key", "activation layer2 gelu forward").b_bytes, 600);
  EXPECT_EQ(row(d, "key", "temporary layer2 gelu forward").b_allocations, 1);

  // The outputs.
  const std::string text = format_snapshot_diff(d);
  EXPECT_TRUE(contains(text, "peak allocated")) << text;
  EXPECT_TRUE(contains(text, "+4.59 KiB")) << text;
  EXPECT_TRUE(contains(text, "by module")) << text;
  const std::string json = snapshot_diff_json(d);
  EXPECT_TRUE(contains(json, "\"peak_allocated\": 8144")) << json;
  EXPECT_TRUE(contains(json, "\"name\": \"layer1\", \"a_bytes\": 4096, \"b_bytes\": 8192")) << json;
  const fs::path html = temp_file("diff") += ".html";
  write_snapshot_diff_html(html.string(), d);
  const std::string page = read_file(html);
  EXPECT_TRUE(contains(page, "<svg id=\"chart\"")) << page.substr(0, 200);
  EXPECT_TRUE(contains(page, "data-rendered"));
  EXPECT_FALSE(contains(page, "http")) << "the page must not reference the network";
  // A name cannot close the page's script: the data is escaped.
  SnapshotDiff odd = d;
  odd.a.path = "a</script><script>alert(1)</script>.pickle";
  write_snapshot_diff_html(html.string(), odd);
  const std::string odd_page = read_file(html);
  EXPECT_FALSE(contains(odd_page, "alert(1)</script>"));
  EXPECT_TRUE(contains(odd_page, "a\\u003c/script\\u003e"));
}

TEST(MemDiff, SameRunHasNoDeltas) {
  const SnapshotSummary a = read_snapshot_summary(tally_run(true, temp_file("a")).string());
  const SnapshotDiff d = diff_snapshots(a, a);
  for (const DiffSection& s : d.sections)
    for (const DiffRow& r : s.rows) {
      EXPECT_EQ(r.bytes_delta(), 0) << s.dimension << " " << r.name;
      EXPECT_EQ(r.allocations_delta(), 0) << s.dimension << " " << r.name;
    }
}

TEST(MemDiff, DifferentDevicesAreAnError) {
  const fs::path p0 = tally_run(false, temp_file("dev0"));
  const fs::path p1 = tally_run(false, temp_file("dev1"), /*device=*/1);
  const SnapshotSummary a = read_snapshot_summary(p0.string());
  const SnapshotSummary b = read_snapshot_summary(p1.string());
  EXPECT_EQ(b.device, 1);
  try {
    diff_snapshots(a, b);
    FAIL();
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(contains(msg, p0.string()) && contains(msg, p1.string())) << msg;
    EXPECT_TRUE(contains(msg, "different devices")) << msg;
  }
  // Unless they stand for one device (dry runs, each on a meta device of its own).
  const SnapshotDiff d = diff_snapshots(a, b, {.any_device = true});
  EXPECT_EQ(d.b.device, 1);
  EXPECT_EQ(d.section("category")->rows.size(), 4u);  // parameter, activation, gradient, temporary
  // Asking for device 0 of the second: it has no history there.
  try {
    read_snapshot_summary(p1.string(), 0);
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), p1.string() + ": no allocation history on device 0 (history "
                                                 "on devices 1)"))
        << e.what();
  }
}

// ---- a real model: a small MLP at batch 4 and 8

fs::path mlp_snapshot(int64_t batch, const fs::path& path) {
  const Device cpu = Device::cpu();
  manual_seed(0);
  nn::Sequential model{std::make_shared<nn::Linear>(32, 64), std::make_shared<nn::ReLU>(),
                       std::make_shared<nn::Linear>(64, 10)};
  const Tensor x = ops::randn({batch, 32});
  std::vector<double> labels(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) labels[static_cast<size_t>(i)] = static_cast<double>(i % 10);
  const Tensor target = ops::from_vector(labels, {batch}, DType::int64);
  record_memory_history(true, 100000, cpu);
  Tensor loss;
  {
    PhaseScope phase("forward");
    loss = cross_entropy(model(x), target);
  }
  {
    PhaseScope phase("backward");
    loss.backward();
  }
  dump_snapshot(path.string(), cpu);
  record_memory_history(false, 0, cpu);
  return path;
}

TEST(MemDiff, ModelAtTwoBatchSizes) {
  const SnapshotSummary a = read_snapshot_summary(mlp_snapshot(4, temp_file("mlp4")).string());
  const SnapshotSummary b = read_snapshot_summary(mlp_snapshot(8, temp_file("mlp8")).string());
  const SnapshotDiff d = diff_snapshots(a, b);
  expect_sections_add_up(d);
  // The parameters (live before the trace) are the same: 4 bytes x (32x64 + 64 + 64x10 + 10).
  EXPECT_EQ(row(d, "category", "parameter").a_bytes, 4 * (32 * 64 + 64 + 64 * 10 + 10));
  EXPECT_EQ(row(d, "category", "parameter").bytes_delta(), 0);
  // The input, live before the trace (4 bytes x batch x 32), is where the batch shows at the
  // start; the peak grows with the batch.
  EXPECT_EQ(row(d, "op", "randn").a_bytes, 4 * 4 * 32);
  EXPECT_EQ(row(d, "op", "randn").b_bytes, 4 * 8 * 32);
  EXPECT_EQ(d.b.start_allocated - d.a.start_allocated, 4 * 4 * 32 + 8 * 4);  // x, int64 target
  EXPECT_GT(d.b.peak_allocated, d.a.peak_allocated);
  // The same ops at both sizes, each layer's forward matched by its module path.
  EXPECT_EQ(d.b.allocations, d.a.allocations);
  for (const char* m : {"0", "1", "2"}) {
    EXPECT_GT(row(d, "module", m).a_allocations, 0) << m;
    EXPECT_EQ(row(d, "module", m).allocations_delta(), 0) << m;
  }
  EXPECT_GT(row(d, "phase", "forward").a_allocations, 0);
  EXPECT_GT(row(d, "phase", "backward").a_allocations, 0);
}

// ---- PyTorch's snapshots

struct Reference {
  const char* file;
  int64_t peak, allocations;
  const char* top_frame;
  int64_t top_bytes;
};

// From an independent replay in Python (alloc / free_completed, blocks live before the trace
// from frees without alloc and the segments' active blocks; key: the first frame under no
// torch/ folder).
constexpr Reference kTorch[] = {
    {"torch211-snapshot-expandable.pickle", 473960588, 96, "exp.py:45:<module>", 314572800},
    {"torch211-snapshot-oom-segfree.pickle", 293614408, 95, "exp.py:15:work", 234881024},
    {"torch211-snapshot-pending-free.pickle", 293614408, 94, "exp.py:15:work", 234881024},
};

TEST(MemDiff, PyTorchSnapshotsGroupByFrame) {
  for (const Reference& ref : kTorch) {
    SCOPED_TRACE(ref.file);
    const SnapshotSummary s = read_snapshot_summary(fixture(ref.file));
    EXPECT_FALSE(s.tally);
    EXPECT_EQ(s.peak_allocated, ref.peak);
    EXPECT_EQ(s.allocations, ref.allocations);
    EXPECT_EQ(s.start_allocated, 0);
    const SnapshotDiff self = diff_snapshots(s, s);
    ASSERT_EQ(self.sections.size(), 1u);
    EXPECT_EQ(self.sections[0].dimension, "frame");
    for (const DiffRow& r : self.sections[0].rows) {
      EXPECT_EQ(r.bytes_delta(), 0);
      EXPECT_EQ(r.allocations_delta(), 0);
    }
    EXPECT_EQ(row(self, "frame", ref.top_frame).a_bytes, ref.top_bytes);
    expect_sections_add_up(self);
  }
  const SnapshotDiff d = diff_snapshots(read_snapshot_summary(fixture(kTorch[2].file)),
                                        read_snapshot_summary(fixture(kTorch[0].file)));
  expect_sections_add_up(d);
  EXPECT_EQ(d.b.peak_allocated - d.a.peak_allocated, 473960588 - 293614408);
  EXPECT_EQ(d.section("frame")->rows.front().name, "exp.py:45:<module>");
  EXPECT_EQ(row(d, "frame", "exp.py:45:<module>").bytes_delta(), 314572800);
  EXPECT_EQ(row(d, "frame", "exp.py:15:work").bytes_delta(), 100663296 - 234881024);
  EXPECT_EQ(row(d, "frame", "exp.py:7:work").bytes_delta(), 0);
}

// ---- errors

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

fs::path write_pickle(const fs::path& p, const std::function<void(PickleWriter&)>& body) {
  std::ofstream out(p, std::ios::binary);
  PickleWriter w(out);
  body(w);
  w.finish();
  return p;
}

// {'segments': [], 'device_traces': [[<entries>]]}: one device's trace, no segments.
fs::path write_trace(const fs::path& p, const std::function<void(PickleWriter&)>& entries) {
  return write_pickle(p, [&](PickleWriter& w) {
    w.begin_dict();
    w.key("segments");
    w.begin_list();
    w.end_list();
    w.key("device_traces");
    w.begin_list();
    w.begin_list();
    entries(w);
    w.end_list();
    w.end_list();
    w.end_dict();
  });
}

TEST(MemDiff, ForeignAndBrokenFilesAreNamed) {
  const fs::path an_int = write_pickle(temp_file("int"), [](PickleWriter& w) { w.integer(5); });
  EXPECT_EQ(error_of([&] { read_snapshot_summary(an_int.string()); }),
            an_int.string() +
                ": not a memory snapshot: the pickle holds an int, expected a dict with "
                "'segments' and 'device_traces'");
  const fs::path no_segments = write_pickle(temp_file("nosegs"), [](PickleWriter& w) {
    w.begin_dict();
    w.key("device_traces");
    w.begin_list();
    w.end_list();
    w.key("blocks");
    w.integer(1);
    w.end_dict();
  });
  EXPECT_EQ(error_of([&] { read_snapshot_summary(no_segments.string()); }),
            no_segments.string() +
                ": not a memory snapshot: the dict has no 'segments' (its keys: "
                "'device_traces', 'blocks')");
  // A snapshot taken without history.
  const fs::path empty = write_trace(temp_file("empty"), [](PickleWriter&) {});
  EXPECT_TRUE(contains(error_of([&] { read_snapshot_summary(empty.string()); }),
                       empty.string() + ": no allocation history"));
  // An entry without its address, and one with a negative size.
  auto entry_file = [&](const char* name, bool with_addr, int64_t size) {
    return write_trace(temp_file(name), [&](PickleWriter& w) {
      w.begin_dict();
      w.key("action");
      w.string("alloc");
      if (with_addr) {
        w.key("addr");
        w.integer(4096);
      }
      w.key("size");
      w.integer(size);
      w.end_dict();
    });
  };
  const fs::path no_addr = entry_file("noaddr", false, 5);
  EXPECT_EQ(error_of([&] { read_snapshot_summary(no_addr.string()); }),
            no_addr.string() + ": device_traces[0][0] ('alloc'): no 'addr'");
  const fs::path negative = entry_file("negative", true, -5);
  EXPECT_EQ(error_of([&] { read_snapshot_summary(negative.string()); }),
            negative.string() + ": device_traces[0][0] ('alloc'): 'size' is negative (-5)");
  // Truncated: the unpickler's error, naming the file and the byte.
  const fs::path whole = tally_run(false, temp_file("whole"));
  const std::string bytes = read_file(whole);
  const fs::path cut = temp_file("cut");
  std::ofstream(cut, std::ios::binary).write(bytes.data(), 300);
  const std::string msg = error_of([&] { read_snapshot_summary(cut.string()); });
  EXPECT_TRUE(msg.starts_with(cut.string() + ": ")) << msg;
  EXPECT_TRUE(contains(msg, "truncated")) << msg;
  // A folder, and a file that does not exist.
  EXPECT_TRUE(contains(error_of([&] { read_snapshot_summary(fs::temp_directory_path().string()); }),
                       "is a folder"));
  EXPECT_TRUE(contains(error_of([&] { read_snapshot_summary("/nonexistent/x.pickle"); }),
                       "/nonexistent/x.pickle: cannot open"));
}

}  // namespace
}  // namespace tally::memory
