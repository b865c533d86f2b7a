// ab_memory: the A/B memory runner. Runs a matrix of configurations (checkpointing x
// precision x the levers: --offload, --optimizer, --step-in-backward, each a comma list, and
// --alloc-conf, repeated, one allocator setting per configuration) on a
// ResNet or a GPT with the same seed and data, N steps each, and prints one
// table: peak allocated and reserved, bytes per category at the peak, median step time,
// final loss, and each column's change against the first configuration (the baseline).
// Writes, per configuration, a memory_viz snapshot of the whole run (recorded from before the
// batches and the model exist, so no block is `unknown` there) and a memory-timeline JSON
// (PyTorch's layout) of the last step, and one self-contained HTML report (report.html) with the
// stacked memory-by-category of one training step per configuration on the same scale, the
// forward staircase labelled by module, and the table. Every configuration after the first
// also gets its snapshot diff against the first (diff/<configuration>.html, .txt, .json:
// inspect/memdiff.h, the same as tally_memdiff).
//
// Each configuration is dry-run first (memory/estimate.h: the same steps on a meta device
// replaying the run's device) and shown next to its prediction. --estimate TARGET runs only
// the dry runs, for any target, on any machine. A --checkpoint entry `auto` (with
// --memory-budget; `auto` in --amp lets it choose the precision too) is the memory planner's
// choice (nn/plan.h).
//
//   ab_memory --model resnet --arch tiny --steps 4 --out ab_report
//   ab_memory --model gpt --preset gpt2 --batch 16 --seq 1024 --estimate h200 --out gpt2_h200
//   ab_memory --model gpt --preset gpt2 --batch 8 --seq 1024 --device cuda
//             --checkpoint none,blocks --amp off,bf16
//   ab_memory --model gpt --amp bf16 --checkpoint none --offload none,activations
//             --optimizer adamw,adamw8bit --step-in-backward off,on
//   ab_memory --model gpt --checkpoint none --amp bf16 --alloc-conf default
//             --alloc-conf expandable_segments:True
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "base/atomic_file.h"
#include "examples/ab_report.h"
#include "examples/cli_common.h"
#include "examples/train_common.h"
#include "inspect/memdiff.h"
#include "memory/timeline.h"
#include "nn/checkpoint.h"
#include "nn/data/mnist.h"
#include "nn/data/synthetic.h"
#include "nn/data/text.h"
#include "nn/models/gpt.h"
#include "nn/models/resnet.h"
#include "nn/offload.h"
#include "optim/adam.h"
#include "optim/sgd.h"
#include "profiler/memory_timeline.h"
#include "tensor/pinned.h"

using namespace tally;
namespace ex = tally::examples;

namespace {

struct Args {
  std::string model = "resnet";
  std::string arch = "tiny";
  std::string preset = "tiny";
  std::string dataset = "synthetic";
  std::string device = "cpu";
  int64_t batch = 32;
  int64_t image_size = 0;
  int64_t seq = 0;
  int64_t steps = 4;
  uint64_t seed = 0;
  std::string checkpoints = "none,blocks";
  std::string amps = "off,bf16";
  std::string offloads = "none";  // the levers' axes (each a comma list)
  std::string optimizers;         // default: adamw for gpt, sgd for resnet
  std::string step_in_backward = "off";
  std::vector<std::string> alloc_confs;  // --alloc-conf, repeated
  std::string out = "ab_report";
  double lr = 0.01;
  std::string estimate;           // a dry run's target: predict every configuration, run none
  std::string memory_budget;      // --checkpoint auto: the planner's budget
  bool fused_classifier = false;  // GPT: lm_head and cross-entropy fused, chunked over rows
};

// One combination of the levers' axes (--offload, --optimizer, --step-in-backward).
struct Lever {
  std::string offload = "none";
  std::string optimizer;
  bool step_in_backward = false;
  std::string alloc_conf;  // --alloc-conf: TALLY_ALLOC_CONF's syntax; "" the environment's
};

// The allocator settings of one configuration, on `alloc` while this lives, the previous
// ones after. The caller starts it with nothing cached (a fresh dry run, or after
// empty_cache), so the run's segments all follow the new settings.
class AllocConfScope {
 public:
  AllocConfScope(memory::CachingAllocator& alloc, const std::string& conf) : alloc_(alloc) {
    if (conf.empty()) return;
    saved_ = alloc.config();
    alloc.set_config(memory::AllocatorConfig::parse(conf));
  }
  ~AllocConfScope() {
    if (saved_) alloc_.set_config(*saved_);
  }
  AllocConfScope(const AllocConfScope&) = delete;
  AllocConfScope& operator=(const AllocConfScope&) = delete;

 private:
  memory::CachingAllocator& alloc_;
  std::optional<memory::AllocatorConfig> saved_;
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');)
    if (!x.empty()) v.push_back(x);
  return v;
}

// The batches every configuration sees: the same values, built once on the CPU, then kept in
// host buffers outside the allocators (detach_from_allocators) so that each run copies them
// into its device's allocator while its history records.
struct Batches {
  std::vector<data::Example> items;
  std::vector<std::vector<std::byte>> host;  // what items' tensors wrap
};

// The trace entries each run keeps: the whole run's, from before its batches and model exist.
constexpr size_t kHistoryEntries = 2000000;

// Moves the batches' values into host buffers the tensors wrap (ops::from_blob): a run's
// snapshot then shows its copy of them as `input` allocated in its trace (not as blocks from
// before the recording, `unknown` in memory_viz), and a CPU run's allocator holds one copy, as
// the dry run's that predicts it does.
void detach_from_allocators(Batches& b) {
  for (data::Example& e : b.items) {
    for (Tensor* t : {&e.input, &e.target}) {
      const Tensor c = ops::contiguous(*t);
      std::vector<std::byte>& buf = b.host.emplace_back(c.nbytes());
      std::memcpy(buf.data(), c.data_ptr(), c.nbytes());
      *t = ops::from_blob(buf.data(), c.sizes(), c.dtype());
    }
  }
}

Batches make_batches(const Args& a, int64_t& classes_or_vocab, int64_t& channels, int64_t& seq) {
  Batches b;
  if (a.model == "resnet") {
    classes_or_vocab = 10;
    if (a.dataset == "fashion-mnist") {
      data::FashionMNIST ds(data::FashionMNIST::kDefaultRoot, true);
      if (ds.size() < 1)
        throw std::invalid_argument(
            fmt::format("--dataset fashion-mnist: the training set in {} is empty",
                        data::FashionMNIST::kDefaultRoot));
      channels = 1;
      Generator gen(a.seed);
      for (int64_t s = 0; s < a.steps; ++s) {
        std::vector<int64_t> idx(static_cast<size_t>(a.batch));
        for (auto& i : idx)
          i = static_cast<int64_t>(rand({1}, {}, &gen).item() * ds.size()) % ds.size();
        b.items.push_back(ds.get_batch(idx));
      }
    } else if (a.dataset == "synthetic") {
      channels = 3;
      const int64_t s = a.image_size ? a.image_size : 32;
      data::SyntheticImages ds(a.batch * a.steps, {3, s, s}, classes_or_vocab, a.seed);
      for (int64_t k = 0; k < a.steps; ++k) {
        std::vector<int64_t> idx;
        for (int64_t i = 0; i < a.batch; ++i) idx.push_back(k * a.batch + i);
        b.items.push_back(ds.get_batch(idx));
      }
    } else {
      throw std::invalid_argument(
          fmt::format("--dataset: expected synthetic or fashion-mnist, got '{}'", a.dataset));
    }
  } else if (a.model == "gpt") {
    const nn::GPTConfig cfg = nn::GPTConfig::preset(a.preset);
    seq = a.seq > 0 ? a.seq : cfg.block_size;
    classes_or_vocab = cfg.vocab_size;
    Generator gen(a.seed);
    if (a.dataset == "text" || a.dataset == "fortunes") {
      data::TextCorpus corpus;
      for (int64_t k = 0; k < a.steps; ++k) b.items.push_back(corpus.get_batch(a.batch, seq, gen));
    } else {
      data::SyntheticTokens ds(a.batch * a.steps, cfg.vocab_size, {seq}, a.seed);
      for (int64_t k = 0; k < a.steps; ++k) {
        std::vector<int64_t> idx;
        for (int64_t i = 0; i < a.batch; ++i) idx.push_back(k * a.batch + i);
        b.items.push_back(ds.get_batch(idx));
      }
    }
  } else {
    throw std::invalid_argument(fmt::format("--model: expected resnet or gpt, got '{}'", a.model));
  }
  return b;
}

std::string safe_name(std::string s) {
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') c = '_';
  return s;
}

// The snapshot diff (inspect/memdiff.h) of every configuration against the first:
// <out>/diff/<configuration>.{txt,html,json} (ConfigResult::diff_path is the page). Returns
// the HTML pages' paths. The diffs name each snapshot as `out` will (StagedOutputDir::shown).
std::vector<std::string> write_diffs(const ex::StagedOutputDir& out,
                                     const std::vector<ex::ConfigResult>& results) {
  std::vector<std::string> pages;
  if (results.size() < 2) return pages;
  std::filesystem::create_directories(out.path() + "/diff");
  auto read = [&](const std::string& path) {
    inspect::SnapshotSummary s = inspect::read_snapshot_summary(path);
    s.path = out.shown(path);
    return s;
  };
  const inspect::SnapshotSummary base = read(results[0].snapshot_path);
  for (size_t i = 1; i < results.size(); ++i) {
    // Every run is of the same device; a dry run's (--estimate) is a meta device of its own.
    const inspect::SnapshotDiff d =
        inspect::diff_snapshots(base, read(results[i].snapshot_path), {.any_device = true});
    const std::string page = results[i].diff_path;
    const std::string stem = page.substr(0, page.size() - 5);  // less ".html"
    base::write_file_atomic(stem + ".txt", inspect::format_snapshot_diff(d), "ab_memory");
    inspect::write_snapshot_diff_json(stem + ".json", d);
    inspect::write_snapshot_diff_html(page, d);
    pages.push_back(page);
  }
  return pages;
}

// The recorded step as the profiler's timeline page draws it (profiler/memory_timeline.h):
// bytes per column, allocated, and reserved replayed from the segment entries of `history`
// (ending at `reserved_now`), and the step's phases.
profiler::MemoryTimeline timeline_page(const memory::MemoryTimeline& t,
                                       const std::vector<memory::TraceEntry>& history,
                                       const std::vector<ex::PhaseRun>& phases,
                                       memory::Device device, int64_t reserved_now) {
  profiler::MemoryTimeline p;
  p.device = device;
  const auto segment = [](const memory::TraceEntry& e) -> int64_t {
    switch (e.action) {
      case memory::TraceAction::segment_alloc:
      case memory::TraceAction::segment_map:
        return static_cast<int64_t>(e.size);
      case memory::TraceAction::segment_free:
      case memory::TraceAction::segment_unmap:
        return -static_cast<int64_t>(e.size);
      default:
        return 0;
    }
  };
  int64_t reserved = reserved_now;
  for (const memory::TraceEntry& e : history) reserved -= segment(e);
  std::vector<size_t> reserved_at;  // after each entry that changes a category
  reserved_at.push_back(static_cast<size_t>(std::max<int64_t>(0, reserved)));
  for (const memory::TraceEntry& e : history) {
    reserved += segment(e);
    if (e.action == memory::TraceAction::alloc || e.action == memory::TraceAction::free_completed ||
        e.action == memory::TraceAction::retag)
      reserved_at.push_back(static_cast<size_t>(std::max<int64_t>(0, reserved)));
  }
  for (size_t i = 0; i < t.size(); ++i) {
    p.times_us.push_back(t.times_us[i]);
    std::array<int64_t, profiler::kTimelineColumns> row{};
    for (memory::Category c : memory::kAllCategories)
      row[static_cast<size_t>(memory::timeline_column(c))] += t.bytes[i][static_cast<size_t>(c)];
    p.sizes.push_back(row);
    p.allocated.push_back(static_cast<size_t>(std::max<int64_t>(0, t.total(i))));
  }
  if (reserved_at.size() == t.size()) p.reserved = reserved_at;
  const int64_t t0 = t.size() ? t.times_us.front() : 0;
  for (const ex::PhaseRun& r : phases)
    p.phases.push_back({r.name, t0 + static_cast<int64_t>(std::llround(r.start_ms * 1000.0)),
                        t0 + static_cast<int64_t>(std::llround(r.end_ms * 1000.0))});
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"A/B memory runner: checkpointing x precision, one table, one HTML report."};
  app.add_option("--model", a.model, "resnet | gpt")->capture_default_str();
  app.add_option("--arch", a.arch, "ResNet: tiny | resnet18 | resnet34 | resnet50")
      ->capture_default_str();
  app.add_option("--preset", a.preset, "GPT: tiny | small | gpt2")->capture_default_str();
  app.add_option("--dataset", a.dataset, "synthetic | fashion-mnist (ResNet) | text (GPT)")
      ->capture_default_str();
  app.add_option("--device", a.device, "cpu | cuda")->capture_default_str();
  ex::add_checked_option(app, "--batch", a.batch, "batch size", ex::int_range(1, 1 << 20));
  app.add_option("--image-size", a.image_size, "synthetic image size (default 32)")
      ->check(ex::int_range(0, 4096));
  app.add_option("--seq", a.seq, "GPT sequence length (default: the preset's block size)")
      ->check(ex::int_range(0));
  ex::add_checked_option(app, "--steps", a.steps,
                         "steps per configuration (the last one is recorded)",
                         ex::int_range(2, 1 << 20));
  ex::add_checked_option(app, "--seed", a.seed, "seed", ex::seed_value());
  app.add_option("--checkpoint", a.checkpoints,
                 "comma list of none | blocks | N-segments | selective")
      ->capture_default_str();
  app.add_option("--amp", a.amps, "comma list of off | fp16 | bf16 | auto (with --checkpoint auto)")
      ->capture_default_str();
  app.add_option("--offload", a.offloads,
                 "comma list of none | activations | N-blocks (activation offload to pinned host "
                 "memory)")
      ->capture_default_str();
  app.add_option("--optimizer", a.optimizers,
                 "comma list of sgd | adam | adamw | adamw8bit (default: adamw for gpt, sgd with "
                 "momentum 0.9 for resnet)");
  app.add_option("--alloc-conf", a.alloc_confs,
                 "allocator settings to compare, TALLY_ALLOC_CONF's syntax (e.g. "
                 "expandable_segments:True or max_split_size_mb:64); repeat the flag, one "
                 "configuration each; 'default' is the environment's")
      ->take_all()
      ->allow_extra_args(false);
  app.add_option("--step-in-backward", a.step_in_backward,
                 "comma list of off | on (each parameter steps as soon as its gradient is ready)")
      ->capture_default_str();
  app.add_option("--memory-budget", a.memory_budget,
                 "device memory a run may reserve, for the --checkpoint entry auto (the planner "
                 "picks the fastest plan that fits: 6GiB, 900MiB, ...)");
  app.add_flag("--fused-classifier", a.fused_classifier,
               "GPT: lm_head and cross-entropy fused and chunked over rows in every configuration "
               "(the [B*T, vocab] logits never exist whole)");
  ex::add_checked_option(app, "--lr", a.lr, "learning rate", ex::positive_real());
  app.add_option("--out", a.out, "output folder (snapshots, timelines, report.html)")
      ->capture_default_str();
  app.add_option("--estimate", a.estimate,
                 "predict every configuration on TARGET (cpu | h200 | cuda) with shapes-only dry "
                 "runs and run none (no GPU needed); without it each run is shown next to its "
                 "prediction");

  return ex::run_cli("ab_memory", app, argc, argv, [&] {
    // ---- everything is checked before the first configuration runs ----
    // --estimate TARGET: only the dry runs (no device needed); otherwise each configuration
    // runs on --device, next to its prediction for that device.
    const bool estimate_only = !a.estimate.empty();
    if (estimate_only && app.count("--device") > 0)
      throw std::invalid_argument(
          "--estimate: it predicts a run on its target device (cpu, h200, cuda): leave out "
          "--device");
    const Device dev = estimate_only ? Device::cpu() : ex::parse_device(a.device);
    const std::string target =
        estimate_only ? a.estimate : (dev.type == DeviceType::cuda ? "cuda" : "cpu");
    ex::for_flag("--estimate", [&] { return memory::meta_target(target); });  // before any run
    if (a.model != "resnet" && a.model != "gpt")
      throw std::invalid_argument(
          fmt::format("--model: expected resnet or gpt, got '{}'", a.model));
    const std::vector<std::string> checkpoints = split_list(a.checkpoints);
    const std::vector<std::string> amps = split_list(a.amps);
    if (checkpoints.empty()) throw std::invalid_argument("--checkpoint: empty list");
    if (amps.empty()) throw std::invalid_argument("--amp: empty list");
    // "auto" entries: the planner (nn/plan.h) resolves them per configuration.
    const bool ck_auto =
        std::find(checkpoints.begin(), checkpoints.end(), "auto") != checkpoints.end();
    const bool amp_auto = std::find(amps.begin(), amps.end(), "auto") != amps.end();
    const ex::AutoPlan auto_plan =
        ex::parse_auto_plan(ck_auto ? "auto" : "", amp_auto ? "auto" : "", a.memory_budget);
    for (const std::string& ck : checkpoints)
      if (ck != "auto") nn::parse_checkpoint_spec(ck);
    for (const std::string& am : amps)
      if (am != "auto") ex::parse_amp(am);
    // The levers' axes: every combination runs with every checkpoint x amp configuration.
    const std::vector<std::string> offloads = split_list(a.offloads);
    const std::vector<std::string> optimizers =
        a.optimizers.empty() ? std::vector<std::string>{a.model == "gpt" ? "adamw" : "sgd"}
                             : split_list(a.optimizers);
    const std::vector<std::string> sibs = split_list(a.step_in_backward);
    if (offloads.empty()) throw std::invalid_argument("--offload: empty list");
    if (optimizers.empty()) throw std::invalid_argument("--optimizer: empty list");
    if (sibs.empty()) throw std::invalid_argument("--step-in-backward: empty list");
    for (const std::string& o : offloads) nn::parse_offload_spec(o);
    for (const std::string& o : optimizers)
      ex::check_optimizer(o, {"sgd", "adam", "adamw", "adamw8bit"});
    for (const std::string& s : sibs) {
      if (s != "on" && s != "off")
        throw std::invalid_argument(
            fmt::format("--step-in-backward: expected a comma list of off and on, got '{}'", s));
      if (s == "on")
        for (const std::string& am : amps) ex::check_step_in_backward(true, am, 0);
    }
    std::vector<Lever> levers;
    // --alloc-conf, repeated: one configuration per setting ("default": the environment's).
    std::vector<std::string> alloc_confs;
    for (const std::string& c : a.alloc_confs) {
      if (c == "default") {
        alloc_confs.push_back("");
        continue;
      }
      try {
        memory::AllocatorConfig::parse(c);
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(fmt::format("--alloc-conf '{}': {}", c, e.what()));
      }
      alloc_confs.push_back(c);
    }
    if (alloc_confs.empty()) alloc_confs.push_back("");
    for (const std::string& o : offloads)
      for (const std::string& opt : optimizers)
        for (const std::string& s : sibs)
          for (const std::string& c : alloc_confs) levers.push_back({o, opt, s == "on", c});
    if (a.model == "resnet") {
      if (a.arch != "tiny" && a.arch != "resnet18" && a.arch != "resnet34" && a.arch != "resnet50")
        throw std::invalid_argument(
            fmt::format("--arch: expected tiny, resnet18, resnet34 or resnet50, got '{}'", a.arch));
      if (a.dataset != "synthetic" && a.dataset != "fashion-mnist")
        throw std::invalid_argument(fmt::format(
            "--dataset: expected synthetic or fashion-mnist for --model resnet, got '{}'",
            a.dataset));
      if (a.seq > 0) throw std::invalid_argument("--seq applies to --model gpt only");
      if (app.count("--preset") > 0)
        throw std::invalid_argument("--preset applies to --model gpt only");
      if (a.image_size > 0 && a.dataset != "synthetic")
        throw std::invalid_argument("--image-size applies to --dataset synthetic only");
      if (a.fused_classifier)
        throw std::invalid_argument("--fused-classifier applies to --model gpt only");
    } else {
      const nn::GPTConfig cfg =
          ex::for_flag("--preset", [&] { return nn::GPTConfig::preset(a.preset); });
      if (a.dataset != "synthetic" && a.dataset != "text" && a.dataset != "fortunes")
        throw std::invalid_argument(
            fmt::format("--dataset: expected synthetic, text or fortunes for --model gpt, got '{}'",
                        a.dataset));
      if (a.seq > cfg.block_size)
        throw std::invalid_argument(
            fmt::format("--seq {} exceeds the preset's block size {}", a.seq, cfg.block_size));
      if (a.image_size > 0) throw std::invalid_argument("--image-size applies to --model resnet");
      if (app.count("--arch") > 0) throw std::invalid_argument("--arch applies to --model resnet");
      if (a.dataset != "synthetic") {
        const int64_t T = a.seq > 0 ? a.seq : cfg.block_size;
        const data::TextCorpus corpus =
            ex::for_flag("--dataset", [] { return data::TextCorpus(); });
        if (corpus.num_tokens(data::Split::train) <= T)
          throw std::invalid_argument(fmt::format(
              "--dataset {}: the training split of {} has {} tokens, too short for --seq {}",
              a.dataset, corpus.path(), corpus.num_tokens(data::Split::train), T));
      }
    }
    ex::check_output_dir(a.out, "--out");
    // Every file goes to a fresh folder beside --out, swapped into place once the report is
    // complete: a run that fails leaves the previous report whole (ex::StagedOutputDir).
    ex::StagedOutputDir staged(a.out, [](const std::string& n) {
      return n == "results.json" || n == "report.html" || n == "diff" || n.ends_with(".pickle") ||
             n.ends_with(".timeline.json") || n.ends_with(".timeline.html");
    });
    const std::string& out = staged.path();
    int64_t classes = 10, channels = 3, seq = 0;
    Batches batches;
    {
      memory::CategoryScope input(memory::Category::input);  // the batches live through every run
      batches = make_batches(a, classes, channels, seq);
    }
    detach_from_allocators(batches);

    // The model of every configuration, built on `build_on` (the CPU, as a real run does;
    // meta:0 for the planner's dry runs, which need no values).
    auto build_model = [&](Device build_on) -> std::shared_ptr<nn::Module> {
      nn::BuildOnDevice on(build_on);
      if (a.model == "gpt") {
        nn::GPTConfig cfg = nn::GPTConfig::preset(a.preset);
        cfg.fused_classifier = a.fused_classifier;
        return std::make_shared<nn::GPT>(cfg);
      }
      return nn::resnet_by_name(a.arch, {.num_classes = classes, .in_channels = channels});
    };
    // A CPU run's batches live in the device's own allocator from the start of the run (a
    // copy of the host buffers, made while its history records); a CUDA run copies each batch
    // when its step begins.
    auto resident_batches = [&](Device d) {
      std::vector<data::Example> resident;
      if (memory::behaves_as(d) != DeviceType::cpu) return batches.items;
      memory::CategoryScope input(memory::Category::input);
      for (const data::Example& b : batches.items)
        resident.push_back({ops::to(b.input, d, b.input.dtype(), /*copy=*/true),
                            ops::to(b.target, d, b.target.dtype(), /*copy=*/true)});
      return resident;
    };

    // One configuration's steps on `on`: the real device, or a dry run's meta device (no
    // values to read there: no loss). Returns when its last step began (now_us()).
    auto run_config = [&](Device on, const std::vector<data::Example>& items,
                          const nn::CheckpointSpec& spec, std::optional<DType> amp,
                          const Lever& lever, ex::ConfigResult& r,
                          Device build_on = Device::cpu()) -> int64_t {
      // The last step's phases, with their times (the report's bands).
      std::optional<ex::PhaseRecorder> phases;
      const bool dry = on.is_meta();
      manual_seed(a.seed);
      std::shared_ptr<nn::Module> model = build_model(build_on);
      std::shared_ptr<nn::GPT> gpt = std::dynamic_pointer_cast<nn::GPT>(model);
      model->to(on);
      model->train();
      nn::enable_checkpointing(*model, spec);
      nn::offload_activations(*model, nn::parse_offload_spec(lever.offload));
      std::unique_ptr<optim::Optimizer> opt =
          ex::make_optimizer(lever.optimizer, model->parameters(), optim::AdamOptions{.lr = a.lr},
                             optim::SGDOptions{.lr = a.lr, .momentum = 0.9});
      ex::Precision prec(amp, on);
      if (lever.step_in_backward) prec.step_in_backward(*opt);

      std::vector<double> times;
      double loss_value = std::nan("");
      int64_t last_step_us = 0;
      for (int64_t s = 0; s < a.steps; ++s) {
        memory::synchronize(on);
        if (s == a.steps - 1) {
          last_step_us = memory::now_us();
          phases.emplace();
        }
        ex::Stopwatch sw;
        data::Example batch;
        {
          memory::CategoryScope input(memory::Category::input);
          const auto& b = items[static_cast<size_t>(s)];
          batch = {ops::to_device_async(b.input, on), ops::to_device_async(b.target, on)};
        }
        opt->zero_grad(true);
        Tensor loss;
        {
          memory::PhaseScope phase("forward");
          auto guard = prec.autocast();
          loss = gpt ? (*gpt)(batch.input, batch.target).second
                     : cross_entropy((*model)(batch.input), batch.target);
        }
        const double scale = prec.scaler().get_scale();
        prec.backward_and_step(loss, *opt);
        if (!dry && prec.scaler().get_scale() < scale) ++r.skipped_steps;  // backed off: inf
        if (!dry) loss_value = loss.item();
        batch = {};
        loss = Tensor();
        memory::synchronize(on);
        times.push_back(sw.ms());
      }
      if (phases) r.phases = phases->runs(0);  // µs since the epoch / 1000 until rebased
      phases.reset();
      std::sort(times.begin(), times.end());
      r.median_ms = dry ? std::nan("") : times[times.size() / 2];
      r.final_loss = loss_value;
      return last_step_us;
    };

    // The prediction of one configuration: the same steps on a dry run of `target` (its
    // history records from the start, as a real run's does). `last_step_us`: when its last
    // step began.
    auto predict = [&](const std::string& target, const nn::CheckpointSpec& spec,
                       std::optional<DType> amp, const Lever& lever, ex::ConfigResult& r,
                       int64_t& last_step_us) {
      memory::DryRun dry({.target = target, .max_history = kHistoryEntries});
      AllocConfScope conf(memory::get_allocator(dry.device()), lever.alloc_conf);
      std::string oom;
      try {
        last_step_us =
            run_config(dry.device(), resident_batches(dry.device()), spec, amp, lever, r);
      } catch (const memory::OutOfMemoryError& e) {
        oom = e.what();
      }
      r.predicted = true;
      r.estimate = dry.finish(oom);
      if (!r.estimate.fits()) fmt::print("   predicted: does not fit on {}: {}\n", target, oom);
      return r.estimate.device;
    };

    std::vector<ex::ConfigResult> results;
    for (const std::string& ck : checkpoints) {
      for (const auto& [am, lever_of_row] : [&] {
             std::vector<std::pair<std::string, Lever>> v;
             for (const std::string& x : amps)
               for (const Lever& l : levers) v.emplace_back(x, l);
             return v;
           }()) {
        Lever lever = lever_of_row;
        if (am == "auto" && ck != "auto") continue;  // --amp auto belongs to the planned rows
        std::optional<DType> amp = am == "auto" ? std::nullopt : ex::parse_amp(am);
        nn::CheckpointSpec spec =
            ck == "auto" ? nn::CheckpointSpec{} : nn::parse_checkpoint_spec(ck);
        std::string ck_name = ck, am_name = am == "none" ? "off" : am;
        if (ck == "auto") {
          // The planner's choice for this row, planned for the prediction's target.
          ex::AutoPlan row = auto_plan;
          row.amp_auto = am == "auto";
          row.offload = nn::parse_offload_spec(lever.offload);
          memory::DryRun probe({.target = target});
          const nn::PlanCandidate c = ex::plan_run(
              row, amp, probe.device(), nn::checkpoint_block_count(*build_model(Device::meta())),
              [&](Device d, const nn::PlanCandidate& cand) {
                ex::ConfigResult scratch;
                Lever l = lever;
                l.offload = cand.offload.str();
                run_config(d, resident_batches(d), cand.checkpoint, cand.amp, l, scratch,
                           Device::meta());
              },
              a.steps);
          spec = c.checkpoint;
          amp = c.amp;
          lever.offload = c.offload.str();
          ck_name = fmt::format("auto({})", spec.str());
          am_name = !amp ? "off" : *amp == DType::float16 ? "fp16" : "bf16";
          if (am == "auto") am_name = fmt::format("auto({})", am_name);
        }
        ex::ConfigResult r;
        r.name = fmt::format("ckpt={} amp={}", ck_name, am_name);
        r.settings = {{"ckpt", ck_name},
                      {"amp", am_name},
                      {"offload", lever.offload},
                      {"opt", lever.optimizer},
                      {"sib", lever.step_in_backward ? "on" : "off"}};
        if (!a.alloc_confs.empty()) {
          const std::string conf = lever.alloc_conf.empty() ? "default" : lever.alloc_conf;
          r.settings.push_back({"alloc", conf});
          r.name += " alloc=" + conf;
        }
        if (offloads.size() > 1 || lever.offload != "none") r.name += " offload=" + lever.offload;
        if (optimizers.size() > 1 || !a.optimizers.empty()) r.name += " opt=" + lever.optimizer;
        if (sibs.size() > 1 || lever.step_in_backward)
          r.name += std::string(" sib=") + (lever.step_in_backward ? "on" : "off");
        fmt::print("== {}\n", r.name);
        std::fflush(stdout);

        // The prediction first (it needs no device), then the run it predicts. With
        // --estimate there is no run: the dry run's allocator stands in for the device.
        Device recorded = dev;
        int64_t last_step_us = 0;
        std::optional<AllocConfScope> run_conf;  // the real run's settings, to the snapshot
        recorded = predict(target, spec, amp, lever, r, last_step_us);
        if (r.estimate.predicted_seconds > 0)
          r.predicted_step_ms =
              r.estimate.predicted_seconds * 1000.0 / static_cast<double>(a.steps);
        r.device = estimate_only ? target : dev.str();
        if (estimate_only) {
          r.measured = false;
          r.peak_allocated = r.estimate.peak_allocated;
          r.peak_reserved = r.estimate.peak_reserved;
          r.at_peak = r.estimate.at_peak;
        } else {
          memory::record_memory_history(false, 0, recorded);
          recorded = dev;
          memory::empty_cache(dev);
          run_conf.emplace(memory::get_allocator(dev), lever.alloc_conf);
          memory::reset_peak_memory_stats(dev);
          // Recorded from before the batches' copies and the model: the snapshot has every
          // block's alloc (parameters, optimizer state, inputs), nothing `unknown`.
          memory::record_memory_history(true, kHistoryEntries, dev);
          last_step_us = run_config(dev, resident_batches(dev), spec, amp, lever, r);
          const memory::DeviceStats st = memory::get_allocator(dev).stats();
          r.peak_allocated = st.allocated_bytes[0].peak;
          r.peak_reserved = st.reserved_bytes[0].peak;
          r.at_peak = st.category_at_peak;
        }
        auto& alloc = memory::get_allocator(recorded);
        const memory::DeviceStats st = alloc.stats();
        memory::CategoryBytes now{};
        for (size_t c = 0; c < now.size(); ++c) now[c] = st.category_bytes[c].current;
        // The snapshot holds the whole run; the report's timeline is its last step.
        std::vector<memory::TraceEntry> history = alloc.history();
        std::erase_if(history,
                      [&](const memory::TraceEntry& e) { return e.time_us < last_step_us; });
        r.timeline = memory::timeline_from_history(history, &now);
        const int64_t t0 = r.timeline.size() ? r.timeline.times_us.front() : 0;
        for (ex::PhaseRun& p : r.phases) {  // in ms from the recorded step's first sample
          p.start_ms = std::max(0.0, p.start_ms - static_cast<double>(t0) / 1000.0);
          p.end_ms = std::max(p.start_ms, p.end_ms - static_cast<double>(t0) / 1000.0);
        }
        const std::string stem = out + "/" + safe_name(r.name);
        r.snapshot_path = stem + ".pickle";
        r.timeline_path = stem + ".timeline.json";
        r.timeline_html_path = stem + ".timeline.html";
        if (!results.empty()) r.diff_path = out + "/diff/" + safe_name(r.name) + ".html";
        memory::dump_snapshot(r.snapshot_path, recorded);
        memory::write_timeline_json(r.timeline, r.timeline_path);
        {
          const profiler::MemoryTimeline page =
              timeline_page(r.timeline, history, r.phases, recorded, st.reserved_bytes[0].current);
          base::write_file_atomic(
              r.timeline_html_path,
              [&](std::ostream& o) { profiler::write_memory_timeline_html(page, o); }, "ab_memory");
        }
        memory::record_memory_history(false, 0, recorded);
        memory::empty_cache(recorded);
        results.push_back(std::move(r));
      }
    }

    const std::string where =
        estimate_only ? fmt::format("predicted for {}, dry runs", target) : dev.str();
    const std::string title =
        a.model == "resnet" ? fmt::format("{} on {} (batch {}, {} steps, {})", a.arch, a.dataset,
                                          a.batch, a.steps, where)
                            : fmt::format("GPT {}{} (batch {} x {} tokens, {} steps, {})", a.preset,
                                          a.fused_classifier ? ", fused classifier" : "", a.batch,
                                          seq, a.steps, where);
    std::cout << ex::format_table(results) << std::flush;
    if (results.size() > 1) {
      fmt::print("what each option bought, against {}:\n", results.front().name);
      for (size_t i = 1; i < results.size(); ++i) fmt::print("  {}\n", ex::headline(results, i));
    }
    if (const std::string caveat = ex::cpu_autocast_caveat(results); !caveat.empty())
      fmt::print("{}\n", caveat);
    if (estimate_only) {
      // What the table cannot show: where the activations at each predicted peak come from.
      fmt::print("largest activations at the predicted peak, by module:\n");
      for (const auto& r : results) {
        std::string top;
        for (size_t k = 0; k < r.estimate.activations_at_peak.size() && k < 4; ++k)
          top += fmt::format(
              "{}{} {}", k ? ", " : "",
              r.estimate.activations_at_peak[k].module.empty()
                  ? std::string("(no module)")
                  : r.estimate.activations_at_peak[k].module,
              ex::fmt_bytes(static_cast<double>(r.estimate.activations_at_peak[k].bytes)));
        fmt::print("  {}: {}\n", r.name, top.empty() ? std::string("none") : top);
      }
    }
    {
      // results.json: the table's numbers for scripts (bytes; categories by Tally's names).
      using Json = nlohmann::ordered_json;
      // Times to the µs, losses to 6 decimals; a dry run has no step time and no loss: null.
      auto number = [](double v, int digits) {
        const double scale = std::pow(10.0, digits);
        return std::isfinite(v) ? Json(std::round(v * scale) / scale) : Json();
      };
      auto by_category = [](const memory::CategoryBytes& bytes) {
        Json o = Json::object();
        for (size_t c = 0; c < memory::kNumCategories; ++c)
          o[std::string(memory::category_name(memory::kAllCategories[c]))] = bytes[c];
        return o;
      };
      Json j = Json::array();
      for (const auto& r : results) {
        Json settings = Json::object();
        for (const auto& [axis, v] : r.settings) settings[axis] = v;
        Json o = {{"name", r.name},
                  {"settings", std::move(settings)},
                  {"peak_allocated", r.peak_allocated},
                  {"peak_reserved", r.peak_reserved},
                  {"median_ms", number(r.median_ms, 3)},
                  {"final_loss", number(r.final_loss, 6)},
                  {"skipped_steps", r.skipped_steps},
                  {"at_peak", by_category(r.at_peak)}};
        if (r.predicted) {
          o["estimate_target"] = r.estimate.target.name;
          o["estimated_peak_allocated"] = r.estimate.peak_allocated;
          o["estimated_peak_reserved"] = r.estimate.peak_reserved;
          o["estimated_at_peak"] = by_category(r.estimate.at_peak);
        }
        o["measured"] = r.measured;
        o["snapshot"] = staged.shown(r.snapshot_path);
        o["timeline"] = staged.shown(r.timeline_path);
        o["timeline_html"] = staged.shown(r.timeline_html_path);
        o["diff"] = staged.shown(r.diff_path);
        j.push_back(std::move(o));
      }
      // A path that is not UTF-8 gets U+FFFD for its odd bytes rather than failing the run.
      base::write_file_atomic(out + "/results.json",
                              j.dump(2, ' ', false, Json::error_handler_t::replace) + "\n",
                              "ab_memory");
    }
    // The diffs first: the report links them.
    std::vector<std::string> diffs = write_diffs(staged, results);
    ex::write_report(out + "/report.html", title, results);
    staged.commit();
    const std::string report = a.out + "/report.html";
    for (std::string& d : diffs) d = staged.shown(d);
    fmt::print(
        "report: {}\nper configuration: *.pickle (open at https://pytorch.org/memory_viz), "
        "*.timeline.json (PyTorch's memory-timeline layout), *.timeline.html (its chart)\n",
        report);
    if (!diffs.empty())
      fmt::print("snapshot diffs against {} (.html, .txt, .json; tally_memdiff A B):\n  {}\n",
                 results.front().name, fmt::join(diffs, "\n  "));
    return 0;
  });
}
