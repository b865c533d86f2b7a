// ab_memory: the A/B memory runner's command line, over the library call tally::ab::run
// (ab/ab.h): a reference model by name (nn/models/registry.h), its batches, and the levers'
// axes (--checkpoint, --amp, --offload, --optimizer, --step-in-backward, --grad-accum, each a
// comma list, and --alloc-conf, repeated); every combination runs with the same seed and
// data, next to its dry-run prediction, and is timed again in interleaved rounds. Writes
// results.json, report.html, a snapshot and a timeline per configuration, and the snapshot
// diffs against the first (--out).
// Flags and outputs in full: docs/notes.md §14.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <sstream>

#include "ab/ab.h"
#include "examples/cli_common.h"
#include "examples/train_common.h"
#include "memory/estimate.h"
#include "nn/data/mnist.h"
#include "nn/data/text.h"
#include "nn/models/registry.h"

using namespace tally;
namespace ex = tally::examples;

namespace {

struct Args {
  std::string model = "resnet";
  std::string arch;
  std::string preset;
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
  std::string optimizers;         // default: the library's (sgd for images, adamw otherwise)
  std::string step_in_backward = "off";
  std::string grad_accums = "1";
  std::vector<std::string> alloc_confs;  // --alloc-conf, repeated
  int rounds = 3;
  std::string out = "ab_report";
  double lr = 0.01;
  std::string estimate;           // a dry run's target: predict every configuration, run none
  std::string memory_budget;      // --checkpoint auto: the planner's budget
  std::string host_memory;        // the dry runs' host memory ("": this machine's)
  bool fused_classifier = false;  // token models: the classifier and cross-entropy fused
};

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');)
    if (!x.empty()) v.push_back(x);
  return v;
}

// What both input kinds check: --dataset is one of `datasets` (the model's kind's), and the
// other kind's size flag (--seq for an image model, --image-size for a token model) is unset.
void check_input_flags(const Args& a, bool images, const std::vector<std::string>& datasets) {
  if (std::find(datasets.begin(), datasets.end(), a.dataset) == datasets.end()) {
    std::string list = datasets.front();  // "a, b or c"
    for (size_t i = 1; i < datasets.size(); ++i)
      list += (i + 1 == datasets.size() ? " or " : ", ") + datasets[i];
    throw std::invalid_argument(
        fmt::format("--dataset: expected {} for --model {}, got '{}'", list, a.model, a.dataset));
  }
  if ((images ? a.seq : a.image_size) > 0)
    throw std::invalid_argument(fmt::format(
        "{} applies to {} models (--model {} takes {})", images ? "--seq" : "--image-size",
        images ? "token" : "image", a.model, images ? "images" : "tokens"));
}

// The batches of the real datasets (the synthetic ones are the registry entry's, made by
// ab::run): Fashion-MNIST images for image models, the text corpus for token models; batch s
// made when ab::run asks for it, in order (it keeps a copy outside the allocators, so no
// batch stays allocated on the device it measures).
ab::BatchFn dataset_batches(const Args& a, const nn::ModelOptions& mo) {
  auto gen = std::make_shared<Generator>(a.seed);
  if (a.dataset == "fashion-mnist") {
    auto ds = std::make_shared<data::FashionMNIST>(data::FashionMNIST::kDefaultRoot, true);
    if (ds->size() < 1)
      throw std::invalid_argument(
          fmt::format("--dataset fashion-mnist: the training set in {} is empty",
                      data::FashionMNIST::kDefaultRoot));
    return [ds, gen, batch = a.batch](int64_t) {
      std::vector<int64_t> idx(static_cast<size_t>(batch));
      for (auto& i : idx)
        i = static_cast<int64_t>(rand({1}, {}, gen.get()).item() * ds->size()) % ds->size();
      return ds->get_batch(idx);
    };
  }
  auto corpus = std::make_shared<data::TextCorpus>();
  return [corpus, gen, batch = a.batch, seq = mo.seq](int64_t) {
    return corpus->get_batch(batch, seq, *gen);
  };
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{
      "A/B memory runner: every combination of the memory levers, one table, one HTML report."};
  std::string models;
  for (const nn::ModelEntry& e : nn::model_registry())
    models += fmt::format("\n  {}: {}", e.name, e.description);
  app.add_option("--model", a.model, "a reference model by name:" + models)->capture_default_str();
  app.add_option("--arch", a.arch, "ResNet: its preset (the same as --preset)");
  app.add_option("--preset", a.preset, "the model's preset (default: its first)");
  app.add_option("--dataset", a.dataset,
                 "synthetic | fashion-mnist (image models) | text (token models)")
      ->capture_default_str();
  app.add_option("--device", a.device, "cpu | cuda")->capture_default_str();
  ex::add_checked_option(app, "--batch", a.batch, "batch size", ex::int_range(1, 1 << 20));
  app.add_option("--image-size", a.image_size, "image models: synthetic image size (default 32)")
      ->check(ex::int_range(0, 4096));
  app.add_option("--seq", a.seq, "token models: sequence length (default: the preset's context)")
      ->check(ex::int_range(0));
  ex::add_checked_option(app, "--steps", a.steps,
                         "steps per configuration (the last one is recorded)",
                         ex::int_range(2, 1 << 20));
  ex::add_checked_option(app, "--seed", a.seed, "seed", ex::seed_value());
  // The levers' axes: comma lists, their defaults shown.
  auto axis = [&app](const std::string& flag, std::string& list, const std::string& help) {
    return app.add_option(flag, list, "comma list of " + help)->capture_default_str();
  };
  axis("--checkpoint", a.checkpoints, "none | blocks | N-segments | selective");
  axis("--amp", a.amps, "off | fp16 | bf16 | auto (with --checkpoint auto)");
  axis("--offload", a.offloads,
       "none | activations | link | N-blocks (activation offload to pinned host memory)");
  app.add_option("--optimizer", a.optimizers,
                 "comma list of sgd | adam | adamw | adamw8bit | adamw:cpu | adamw8bit:cpu (the "
                 "last two keep master weights and moments in pinned host memory; the report "
                 "then shows the host's peak) (default: sgd with momentum 0.9 for image models, "
                 "adamw for the others)");
  axis("--grad-accum", a.grad_accums,
       "micro-batch counts: the batch split into N, N forwards and backwards (losses scaled by "
       "1/N), one optimizer step");
  app.add_option("--rounds", a.rounds,
                 "timing rounds after the recorded runs: each runs every configuration once, "
                 "interleaved (A B A B ...), for step times with their spread")
      ->check(ex::int_range(0, 1000))
      ->capture_default_str();
  app.add_option("--alloc-conf", a.alloc_confs,
                 "allocator settings to compare, TALLY_ALLOC_CONF's syntax (e.g. "
                 "expandable_segments:True or max_split_size_mb:64); repeat the flag, one "
                 "configuration each; 'default' is the environment's")
      ->take_all()
      ->allow_extra_args(false);
  axis("--step-in-backward", a.step_in_backward,
       "off | on (each parameter steps as soon as its gradient is ready)");
  app.add_option("--memory-budget", a.memory_budget,
                 "device memory a run may reserve, for the --checkpoint entry auto (the planner "
                 "picks the fastest plan that fits: 6GiB, 900MiB, ...)");
  app.add_flag(
      "--fused-classifier", a.fused_classifier,
      "token models: the classifier and cross-entropy fused and chunked over rows in every "
      "configuration (the [B*T, vocab] logits never exist whole)");
  ex::add_checked_option(app, "--lr", a.lr, "learning rate", ex::positive_real());
  app.add_option("--out", a.out, "output folder (snapshots, timelines, report.html)")
      ->capture_default_str();
  app.add_option(
      "--estimate", a.estimate,
      "predict every configuration on TARGET (cpu | h100 | h200 | cuda) with shapes-only dry "
      "runs and run none (no GPU needed); without it each run is shown next to its "
      "prediction");
  app.add_option("--host-memory", a.host_memory,
                 "the host memory the dry runs check a GPU target's host peak against (pinned "
                 "optimizer state, offloaded activations): 128GiB, 64GB or bytes (default: this "
                 "machine's)");

  return ex::run_cli("ab_memory", app, argc, argv, [&] {
    // ---- everything is checked before the first configuration runs ----
    const bool estimate_only = !a.estimate.empty();
    if (estimate_only && app.count("--device") > 0)
      throw std::invalid_argument(
          "--estimate: it predicts a run on its target device (cpu, h100, h200, cuda): leave out "
          "--device");
    const Device dev = estimate_only ? Device::cpu() : ex::parse_device(a.device);
    const std::string target =
        estimate_only ? a.estimate : (dev.type == DeviceType::cuda ? "cuda" : "cpu");
    ex::for_flag("--estimate", [&] { return memory::meta_target(target); });  // before any run
    const nn::ModelEntry& entry = nn::model_entry(a.model);
    const bool images = entry.input == nn::ModelEntry::Input::images;
    if (app.count("--arch") > 0) {
      if (a.model != "resnet") throw std::invalid_argument("--arch applies to --model resnet");
      if (app.count("--preset") > 0)
        throw std::invalid_argument("--arch and --preset name the same thing: give one");
      a.preset = a.arch;
    }
    nn::ModelOptions mo;
    mo.preset = a.preset;
    mo.fused_classifier = a.fused_classifier;
    if (images) {
      check_input_flags(a, images, {"synthetic", "fashion-mnist"});
      if (a.image_size > 0 && a.dataset != "synthetic")
        throw std::invalid_argument("--image-size applies to --dataset synthetic only");
      if (a.fused_classifier)
        throw std::invalid_argument(fmt::format(
            "--fused-classifier applies to token models only (--model {} takes images)", a.model));
      mo.image_size = a.image_size;
      if (a.dataset == "fashion-mnist") {
        mo.in_channels = 1;
        mo.image_size = 28;
      }
    } else {
      check_input_flags(a, images, {"synthetic", "text", "fortunes"});
      mo.seq = a.seq;
    }
    mo = ex::for_flag(app.count("--arch") > 0 ? "--arch" : "--preset",
                      [&] { return nn::resolve_options(entry, mo); });
    if (!images && entry.context && a.seq > entry.context(mo.preset))
      throw std::invalid_argument(
          fmt::format("--seq {} exceeds the preset's context {}", a.seq, entry.context(mo.preset)));
    if (a.dataset == "text" || a.dataset == "fortunes") {
      const data::TextCorpus corpus = ex::for_flag("--dataset", [] { return data::TextCorpus(); });
      if (corpus.num_tokens(data::Split::train) <= mo.seq)
        throw std::invalid_argument(fmt::format(
            "--dataset {}: the training split of {} has {} tokens, too short for --seq {}",
            a.dataset, corpus.path(), corpus.num_tokens(data::Split::train), mo.seq));
    }

    ab::Options o;
    o.model = a.model;
    o.model_options = mo;
    o.steps = a.steps;
    o.batch = a.batch;
    o.seed = a.seed;
    o.lr = a.lr;
    o.device = dev;
    o.estimate = a.estimate;
    if (!a.host_memory.empty()) {
      o.host_memory = memory::parse_bytes(a.host_memory, "--host-memory");
      if (o.host_memory == 0)
        throw std::invalid_argument("--host-memory: expected a size above 0 (128GiB, say)");
    }
    o.rounds = a.rounds;
    o.checkpoint = split_list(a.checkpoints);
    o.precision = split_list(a.amps);
    o.offload = split_list(a.offloads);
    o.optimizer = split_list(a.optimizers);
    o.alloc_conf = a.alloc_confs;
    if (o.checkpoint.empty()) throw std::invalid_argument("--checkpoint: empty list");
    if (o.precision.empty()) throw std::invalid_argument("--amp: empty list");
    if (o.offload.empty()) throw std::invalid_argument("--offload: empty list");
    if (!a.optimizers.empty() && o.optimizer.empty())
      throw std::invalid_argument("--optimizer: empty list");
    o.step_in_backward.clear();
    for (const std::string& s : split_list(a.step_in_backward)) {
      if (s != "on" && s != "off")
        throw std::invalid_argument(
            fmt::format("--step-in-backward: expected a comma list of off and on, got '{}'", s));
      o.step_in_backward.push_back(s == "on");
    }
    if (o.step_in_backward.empty()) throw std::invalid_argument("--step-in-backward: empty list");
    o.grad_accum.clear();
    for (const std::string& s : split_list(a.grad_accums)) {
      const int64_t n = ex::for_flag("--grad-accum", [&] {
        size_t used = 0;
        const long long v = std::stoll(s, &used);
        if (used != s.size() || v < 1 || v > a.batch)
          throw std::invalid_argument(fmt::format(
              "expected micro-batch counts from 1 to the batch ({}), got '{}'", a.batch, s));
        return static_cast<int64_t>(v);
      });
      o.grad_accum.push_back(n);
    }
    if (o.grad_accum.empty()) throw std::invalid_argument("--grad-accum: empty list");
    // "auto" entries: the planner (optim/plan_training.h) resolves them per configuration.
    const bool ck_auto =
        std::find(o.checkpoint.begin(), o.checkpoint.end(), "auto") != o.checkpoint.end();
    const bool amp_auto =
        std::find(o.precision.begin(), o.precision.end(), "auto") != o.precision.end();
    const ex::AutoPlan auto_plan =
        ex::parse_auto_plan(ck_auto ? "auto" : "", amp_auto ? "auto" : "", a.memory_budget);
    o.memory_budget = auto_plan.budget;  // the library planner resolves "auto" rows
    ab::configurations(o);               // every lever's value checked before any data is read
    ex::check_output_dir(a.out, "--out");
    o.out = a.out;
    if (a.dataset != "synthetic") o.batches = dataset_batches(a, mo);
    const std::string where =
        estimate_only ? fmt::format("predicted for {}, dry runs", target) : dev.str();
    o.title = images ? fmt::format("{} {} on {} (batch {}, {} steps, {})", a.model, mo.preset,
                                   a.dataset, a.batch, a.steps, where)
                     : fmt::format("{} {}{} (batch {} x {} tokens, {} steps, {})", a.model,
                                   mo.preset, a.fused_classifier ? ", fused classifier" : "",
                                   a.batch, mo.seq, a.steps, where);
    ab::run(o);
    return 0;
  });
}
