// tally::ab::run: the A/B memory runner as a library call. It trains every combination of the
// memory levers (checkpointing x precision x optimizer x offload x step-in-backward x gradient
// accumulation x allocator settings) on the same model, seed and data, in this process, each
// configuration next to its dry-run prediction (memory/estimate.h), then times them again in
// interleaved rounds (A B C A B C ...) for step times with their spread, and writes what
// ab_memory writes: results.json, report.html, a memory_viz snapshot and a timeline (JSON and
// HTML page) per configuration, and the snapshot diff of each against the first.
//
//   ab::Options o;
//   o.model = "gpt";                         // a registry model (nn/models/registry.h), or
//   o.factory = [](Device) { return std::make_shared<MyNet>(); };   // or o.module = net;
//   o.loss = [](nn::Module& m, const data::Example& b) { return cross_entropy(m(b.input),
//   b.target); }; o.data = batches;                        // or o.batches = [](int64_t step) { ...
//   } o.checkpoint = {"none", "blocks"};  o.precision = {"off", "bf16"};  o.grad_accum = {1, 2};
//   ab::Results r = ab::run(o);              // r.configs: the figures; r.report: report.html
//
// Flags and outputs in full: docs/notes.md §14 (ab_memory is the command line over this).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ab/report.h"
#include "nn/data/dataset.h"
#include "nn/models/registry.h"
#include "nn/module.h"
#include "nn/plan.h"

namespace tally::ab {

// Builds the model (its layers on the device of the enclosing nn::BuildOnDevice, which run()
// opens around the call; the device is passed too).
using ModelFactory = std::function<std::shared_ptr<nn::Module>(Device)>;
// The training loss of one (micro-)batch, already on the model's device: forward and loss.
using LossFn = std::function<Tensor(nn::Module&, const data::Example&)>;
// An evaluation after the last step (eval mode, no gradients, under autocast; phase "eval").
using EvalFn = std::function<void(nn::Module&, const data::Example&)>;
// Batch number `step` (on the CPU).
using BatchFn = std::function<data::Example(int64_t step)>;

// One configuration: a value on every lever's axis.
struct Config {
  std::string checkpoint = "none";  // nn::parse_checkpoint_spec's spellings, or "auto"
  std::string precision = "off";    // off | fp16 | bf16 (auto: with checkpoint auto)
  // sgd | adam | adamw | adamw8bit | adamw:cpu | adamw8bit:cpu (state in pinned host memory;
  // under bf16 the device then keeps bfloat16 weights, CpuOffload::keep_16bit_weights)
  std::string optimizer = "adamw";
  std::string offload = "none";  // nn::parse_offload_spec's spellings
  bool step_in_backward = false;
  int64_t grad_accum = 1;  // micro-batches per optimizer step
  std::string alloc_conf;  // TALLY_ALLOC_CONF's syntax; "": the environment's
};

// Runs the steps of a configuration with a planner's candidate on a dry run's device.
using DrySteps = std::function<void(Device, const nn::PlanCandidate&)>;
// Resolves a checkpoint "auto" row: the planner's choice for `row` on `device` (a dry run's
// meta device replaying the run's target), `blocks` the model's checkpoint blocks. The
// candidate's optimizer, step-in-backward and micro-batches, where it sets them, replace the
// row's.
using Planner = std::function<nn::PlanCandidate(const Config& row, Device device, int blocks,
                                                const DrySteps& dry_steps)>;

struct Options {
  // ---- the model: a registry name, a factory, or a module (exactly one) ----
  std::string model;               // nn::model_entry(model)
  nn::ModelOptions model_options;  // its preset, image size, sequence length, ...
  ModelFactory factory;            // called once per configuration (and per timing round)
  // A module the caller built: every configuration starts from its state at the call, which
  // it has again (on its device) when run() returns.
  std::shared_ptr<nn::Module> module;

  // ---- the step ----
  LossFn loss;  // default: the registry entry's; else cross_entropy(model(input), target)
  EvalFn eval;  // optional

  // ---- the data: one batch per step ----
  std::vector<data::Example> data;  // batch s is data[s % data.size()]
  BatchFn batches;                  // or a generator; neither: the entry's synthetic batches
  int64_t steps = 0;                // 0: data.size() when given, else 3
  int64_t batch = 8;                // the synthetic batches' size
  uint64_t seed = 0;

  // ---- the levers: every combination runs, in this order ----
  std::vector<std::string> checkpoint = {"none"};
  std::vector<std::string> precision = {"off"};
  std::vector<std::string> offload = {"none"};
  std::vector<std::string> optimizer;  // empty: sgd (momentum 0.9) for images, else adamw
  std::vector<bool> step_in_backward = {false};
  std::vector<int64_t> grad_accum = {1};
  // Allocator settings ("default": the environment's); empty: the environment's, unnamed.
  std::vector<std::string> alloc_conf;
  // Checkpoint "auto" rows: the library planner (optim/plan_training.h) chooses, within
  // memory_budget bytes of peak reserved, the checkpointing policy, the precision (with
  // precision "auto"), and the optimizer (AdamW or AdamW8bit), step-in-backward and
  // micro-batches where the row leaves them at their defaults (optimizer not listed,
  // step_in_backward {false}, grad_accum {1}); the row's offload stays. `planner` replaces it.
  size_t memory_budget = 0;
  Planner planner;
  double lr = 0.01;

  // ---- where and what ----
  Device device = Device::cpu();
  // A dry run's target (cpu | h100 | h200 | cuda): predict every configuration, run none.
  std::string estimate;
  // The host memory the dry runs check a GPU target's host peak against (0: this machine's).
  size_t host_memory = 0;
  // Timing rounds after the recorded runs: each round runs every configuration once, in
  // order, so that a machine's load falls on all of them alike (0: none, the recorded run's
  // steps are timed).
  int rounds = 3;
  std::string out = "ab_report";  // the output folder, replaced whole when the run succeeds
  std::string title;              // the report's; default: the model and the run
  bool verbose = true;            // the table, headlines and file list on stdout
};

struct Results {
  std::vector<ConfigResult> configs;
  std::string out;                     // the output folder
  std::string report;                  // report.html's path
  std::string table;                   // format_table(configs)
  std::vector<std::string> headlines;  // of configs 1.. against the first
  std::vector<std::string> diffs;      // the diff pages
};

// The configurations `o` describes, in the order run() runs them (validated: bad values
// throw std::invalid_argument naming the lever and the value before anything runs).
std::vector<Config> configurations(const Options& o);

// Runs every configuration and writes the outputs (see the top of this file).
Results run(const Options& o);

}  // namespace tally::ab
