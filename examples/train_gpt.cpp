// train_gpt: trains a GPT (GPT-2's structure, tied embeddings) on a byte-level text corpus
// (default: Debian's fortunes) or synthetic tokens, with a progress bar (loss, tokens/s,
// step time, peak memory), a validation loss at the end, an optional text sample, and
// optionally a memory snapshot and memory summary.
//
//   train_gpt --preset tiny --steps 200 --sample 200
//   train_gpt --preset gpt2 --data synthetic --batch 16 --seq 1024 --steps 20 --device cuda --amp
//   bf16
//   train_gpt --preset gpt2 --data synthetic --batch 16 --amp bf16 --estimate h200   (no GPU)
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "examples/cli_common.h"
#include "examples/trainer.h"
#include "nn/checkpoint.h"
#include "nn/data/synthetic.h"
#include "nn/data/text.h"
#include "nn/models/gpt.h"
#include "optim/adam.h"
#include "tensor/pinned.h"

using namespace tally;
namespace ex = tally::examples;

namespace {

struct Args {
  ex::TrainFlags t;  // defaults set by add_flags
  std::string preset = "tiny";
  std::string data = data::TextCorpus::kDefaultPath;
  int64_t seq = 0;  // 0: the preset's block size
  int64_t batch = 16;
  int64_t steps = 200;
  bool fused_classifier = false;
  int64_t sample = 0;
  int64_t eval_batches = 8;
  int64_t vocab = 0;  // synthetic data: the vocabulary (0: the preset's)
};

void add_flags(CLI::App& app, Args& a) {
  ex::TrainFlags& t = a.t;
  app.add_option("--preset", a.preset, "tiny | small | gpt2 | gpt2-medium | gpt2-large | gpt2-xl")
      ->capture_default_str();
  app.add_option("--data", a.data, "a text file (byte-level tokens) or 'synthetic'")
      ->capture_default_str();
  app.add_option("--seq", a.seq, "sequence length (0: the preset's block size)")
      ->check(ex::int_range(0));
  ex::add_token_model_flags(app, t, a.batch, a.steps, "AdamW weight decay");
  app.add_option("--optimizer", t.optimizer,
                 "adamw | adamw8bit (block-wise 8-bit moments) | sgd (momentum 0.9) | adamw:cpu, "
                 "adamw8bit:cpu (master weights and moments in pinned host memory, updated on "
                 "the CPU)")
      ->capture_default_str();
  app.add_flag("--fused-classifier", a.fused_classifier,
               "lm_head and cross-entropy fused and chunked over rows: the [B*T, vocab] logits "
               "never exist whole (with --checkpoint auto the planner also picks its chunk "
               "size from --memory-budget)");
  ex::add_token_step_flags(app, t,
                           "capture the training step into a CUDA graph at step 2 and replay it "
                           "(--device cuda; not with --offload, --step-in-backward, adamw8bit, "
                           ":cpu optimizers)");
  app.add_option("--sample", a.sample, "print a sample of this many bytes at the end (text data)")
      ->check(ex::int_range(0, 1 << 20));
  ex::add_checked_option(app, "--eval-batches", a.eval_batches, "validation batches",
                         ex::int_range(1));
  ex::add_checked_option(app, "--log-every", t.log_every, "progress update interval in steps",
                         ex::int_range(1));
  app.add_option("--vocab", a.vocab, "vocabulary of synthetic data (0: the preset's)")
      ->check(ex::int_range(0, 1 << 24));
}

// The --optimizer choices.
const std::vector<std::string> kOptimizers = {"adamw", "adamw8bit", "sgd", "adamw:cpu",
                                              "adamw8bit:cpu"};

// The model's configuration, the sequence length and the text (none for synthetic tokens),
// every flag about them checked.
struct Text {
  nn::GPTConfig cfg;
  int64_t T = 0;
  bool synthetic = false;
  std::unique_ptr<data::TextCorpus> corpus;
};
Text load_text(const Args& a) {
  Text x;
  x.cfg = ex::for_flag("--preset", [&] { return nn::GPTConfig::preset(a.preset); });
  x.synthetic = a.data == "synthetic";
  if (!x.synthetic && a.vocab > 0)
    throw std::invalid_argument("--vocab applies to --data synthetic only (text is 256 bytes)");
  if (x.synthetic && a.sample > 0)
    throw std::invalid_argument("--sample needs a text corpus, not --data synthetic");
  x.T = a.seq > 0 ? a.seq : x.cfg.block_size;
  if (x.T > x.cfg.block_size)
    throw std::invalid_argument(
        fmt::format("--seq {} exceeds the preset's block size {}", x.T, x.cfg.block_size));
  if (!x.synthetic) {
    x.corpus = ex::for_flag("--data", [&] { return std::make_unique<data::TextCorpus>(a.data); });
    if (x.cfg.vocab_size < data::TextCorpus::kVocabSize)
      throw std::invalid_argument(
          fmt::format("--preset {}: vocabulary {} is smaller than the byte vocabulary 256",
                      a.preset, x.cfg.vocab_size));
    // A window of T tokens and its target (one token later) must fit in each split.
    for (const data::Split split : {data::Split::train, data::Split::val}) {
      const int64_t n = x.corpus->num_tokens(split);
      if (n <= x.T)
        throw std::invalid_argument(fmt::format(
            "--data {}: the {} split has {} tokens, too short for --seq {} (needs more than {}; "
            "use a shorter --seq or a longer text)",
            a.data, split == data::Split::train ? "training" : "validation", n, x.T, x.T));
    }
  } else if (a.vocab > 0) {
    x.cfg.vocab_size = a.vocab;
  }
  x.cfg.fused_classifier = a.fused_classifier;
  return x;
}

// The batches of the run: windows of the text, or synthetic tokens. The host batch and its
// copy on the device are both `input` (an untagged host batch would be `unknown` in the
// snapshot); pinned host batches for a CUDA device.
class Batches {
 public:
  Batches(const Args& a, const Text& text, Device dev)
      : a_(a),
        text_(text),
        dev_(dev),
        pin_(memory::behaves_as(dev) == DeviceType::cuda),
        gen_(a.t.seed + 17),
        synth_(1 << 20, text.cfg.vocab_size, {text.T}, a.t.seed) {}
  data::Example next(data::Split split) {
    data::Example b;
    if (text_.synthetic) {
      std::vector<int64_t> idx(static_cast<size_t>(a_.batch));
      for (auto& i : idx)
        i = static_cast<int64_t>(rand({1}, {}, &gen_).item() * synth_.size()) % synth_.size();
      memory::CategoryScope input(memory::Category::input);
      b = synth_.get_batch(idx, pin_);
    } else {
      memory::CategoryScope input(memory::Category::input);
      b = text_.corpus->get_batch(a_.batch, text_.T, gen_, split, pin_);
    }
    memory::CategoryScope input(memory::Category::input);
    return {ops::to_device_async(b.input, dev_), ops::to_device_async(b.target, dev_)};
  }

 private:
  const Args& a_;
  const Text& text_;
  Device dev_;
  bool pin_;
  Generator gen_;
  data::SyntheticTokens synth_;
};

// The step's forward: the loss of inputs and targets.
ex::Trainer::Forward forward_of(nn::GPT& m) {
  return
      [&m](const std::vector<Tensor>& in) { return std::vector<Tensor>{m(in[0], in[1]).second}; };
}

// The mean validation loss over `n` batches (eval mode, no gradients).
double validate(nn::GPT& model, Batches& batches, ex::Precision& prec, int64_t n) {
  NoGradGuard ng;
  model.eval();
  double val = 0;
  for (int64_t i = 0; i < n; ++i) {
    const data::Example b = batches.next(data::Split::val);
    auto guard = prec.autocast();
    val += model(b.input, b.target).second.item();
  }
  model.train();
  return val / static_cast<double>(n);  // n >= 1
}

// Sampling at temperature 0.8 of `n` bytes after `prompt`, from the logits of the 256 byte
// tokens (a preset's vocabulary can be larger; the text has no other tokens).
std::string sample_text(nn::GPT& model, const std::string& prompt, int64_t n, Device dev,
                        Generator& gen) {
  NoGradGuard ng;
  model.eval();
  std::string text = prompt;
  const int64_t T = model.config.block_size;
  for (int64_t i = 0; i < n; ++i) {
    const std::string ctx =
        text.size() > static_cast<size_t>(T) ? text.substr(text.size() - T) : text;
    const Tensor idx =
        data::TextCorpus::encode(ctx).reshape({1, static_cast<int64_t>(ctx.size())}).to(dev);
    const Tensor logits = model(idx)
                              .first.select(1, static_cast<int64_t>(ctx.size()) - 1)
                              .narrow(1, 0, data::TextCorpus::kVocabSize);  // [1, 256]
    const Tensor probs = softmax(div(logits.to(DType::float32), 0.8), -1).to(Device::cpu());
    const std::vector<double> p = probs.tolist();
    const double u = rand({1}, {}, &gen).item();
    double c = 0;
    size_t tok = p.size() - 1;
    for (size_t k = 0; k < p.size(); ++k) {
      c += p[k];
      if (u < c) {
        tok = k;
        break;
      }
    }
    text.push_back(static_cast<char>(tok));
  }
  model.train();
  return text;
}

// Text fit for a terminal: a byte sequence that is not UTF-8, or a control character other
// than a line break or tab (an untrained model's bytes often are), becomes U+FFFD.
std::string printable(const std::string& text) {
  const std::string utf8 =
      nlohmann::json::parse(nlohmann::json(text).dump(-1, ' ', /*ensure_ascii=*/false,
                                                      nlohmann::json::error_handler_t::replace))
          .get<std::string>();
  std::string out;
  out.reserve(utf8.size());
  for (const char c : utf8) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\n' && c != '\t') || u == 0x7f)
      out += "\xEF\xBF\xBD";
    else
      out += c;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  ex::TrainFlags& t = a.t;
  CLI::App app{"Train a GPT with Tally and see where its memory goes."};
  add_flags(app, a);
  return ex::run_trainer("train_gpt", app, t, argc, argv, kOptimizers, [&](ex::Trainer& tr) {
    tr.start();
    const Device dev = tr.device();
    Text text = load_text(a);
    nn::GPTConfig& cfg = text.cfg;
    const int64_t T = text.T;

    // kEstimateSteps steps of a variation of this run and its validation on a dry run's device,
    // the model built without host memory: what the planner and the out-of-memory report predict.
    auto build = [&](Device on_device, int64_t chunk_bytes = 0, bool fused = false) {
      nn::BuildOnDevice on(on_device);
      nn::GPTConfig c = cfg;
      c.fused_classifier = c.fused_classifier || fused;
      if (chunk_bytes > 0) c.fused_classifier_chunk_bytes = chunk_bytes;
      return std::make_shared<nn::GPT>(c);
    };
    const ex::Trainer::DrySteps dry_steps = [&](Device d, const ex::RunShape& shape) {
      // As the real run builds it: on the device (a GPU target's host, meta:0, stays the
      // pinned memory's alone).
      auto m = build(d, shape.plan.classifier_chunk_bytes, shape.plan.fused_classifier);
      tr.dry_train(
          d, shape.plan, *m, [&](nn::Module& mm) { return ex::make_token_model_optimizer(t, mm); },
          [&] {
            return std::vector<Tensor>{
                ops::randint(0, cfg.vocab_size, {shape.batch, T}, DType::int64, d),
                ops::randint(0, cfg.vocab_size, {shape.batch, T}, DType::int64, d)};
          },
          forward_of(*m), [&](const std::vector<Tensor>& in) { (void)(*m)(in[0], in[1]).second; });
    };
    // --checkpoint auto: without --fused-classifier the planner tries the fused classifier
    // too; with it the chunk is searched: the default 256 MiB, then smaller ones for a plan
    // that a smaller chunk would bring under the budget.
    std::vector<int64_t> chunks;
    if (cfg.fused_classifier)
      for (const int64_t mib : {256, 64, 16, 4})
        if ((mib << 20) <= cfg.fused_classifier_chunk_bytes) chunks.push_back(mib << 20);
    std::optional<nn::PlanCandidate> chosen;
    if (tr.planning()) {  // the model's blocks, on a meta device of its own (not a GPU's host)
      memory::DryRun scratch({.capacity = size_t{1} << 50, .max_history = 0});
      chosen = tr.plan(*build(scratch.device()), dry_steps, a.batch, chunks, !cfg.fused_classifier);
    }
    if (chosen && chosen->fused_classifier) cfg.fused_classifier = true;
    if (chosen && chosen->classifier_chunk_bytes > 0)
      cfg.fused_classifier_chunk_bytes = chosen->classifier_chunk_bytes;

    const ex::RunShape shape{{tr.checkpoint, tr.amp, tr.offload,
                              cfg.fused_classifier ? cfg.fused_classifier_chunk_bytes : 0},
                             a.batch};
    return tr.run(shape, dry_steps, [&] {
      // On a GPU the parameters are made and initialised there (nn::BuildOnDevice): no float32
      // copy of the model passes through host memory (GPT-2 XL's is 6 GB).
      auto model = [&] {
        std::optional<nn::BuildOnDevice> on;
        if (dev.type == DeviceType::cuda) on.emplace(dev);
        return std::make_shared<nn::GPT>(cfg);
      }();
      model->to(dev);
      // Warm-up: 10% of the steps; down to lr / 10.
      const ex::Trainer::Training run = tr.prepare(
          *model, [&](nn::Module& mm) { return ex::make_token_model_optimizer(t, mm); }, a.steps,
          10, 0.1);
      optim::Optimizer* opt = run.opt.get();
      Batches batches(a, text, dev);
      fmt::print(
          "Tally train_gpt: preset {} ({:.2f} M parameters), data {}{}, device {}, batch {} x "
          "{} "
          "tokens, {} steps, {} lr {}, {}\n",
          a.preset, model->num_parameters() / 1e6, text.synthetic ? "synthetic" : a.data,
          text.synthetic ? "" : fmt::format(" ({} tokens)", text.corpus->num_tokens()), dev.str(),
          a.batch, T, a.steps,
          std::string(opt->name()) + (t.step_in_backward ? " (step-in-backward)" : ""), t.lr,
          tr.describe());

      model->train();
      double first_loss = -1, last_loss = 0;
      const int64_t steps = tr.dry() ? std::min(a.steps, ex::kEstimateSteps) : a.steps;
      for (int64_t step = 1; step <= steps; ++step) {
        const data::Example batch = batches.next(data::Split::train);
        const Tensor loss = tr.step({batch.input, batch.target}, forward_of(*model))[0];
        run.sched->step();
        if (!tr.end_step(step, loss)) continue;
        const ex::Trainer::Window w = tr.read_window();
        last_loss = w.loss;
        if (first_loss < 0) first_loss = last_loss;
        const double tok_s = static_cast<double>(a.batch * T) / (w.ms / 1000.0);
        tr.log(step, w, {{"tokens_per_s", tok_s}},
               fmt::format("loss {:.4f} | {:.0f} tok/s | {:.1f} ms/step | lr {:.2e}", w.loss, tok_s,
                           w.ms, opt->get_lr()));
      }
      // A dry run's report, its validation dry-run too (one batch, as validate() runs them).
      const auto dry_eval = [&] {
        NoGradGuard ng;
        model->eval();
        const data::Example b = batches.next(data::Split::val);
        auto guard = tr.precision().autocast();
        (void)(*model)(b.input, b.target);
      };
      if (const std::optional<int> rc = tr.end_training(dry_eval)) return *rc;

      const double val = validate(*model, batches, tr.precision(), a.eval_batches);
      tr.write_metrics({{"step", a.steps}, {"val_loss", val}});
      fmt::print("val loss {:.4f} (chance: ln {} = {:.4f}), train loss {:.4f} -> {:.4f}, {}\n", val,
                 cfg.vocab_size, std::log(static_cast<double>(cfg.vocab_size)), first_loss,
                 last_loss, tr.peaks());
      return tr.finish(run.offloader, a.steps, [&] {
        if (a.sample == 0 || text.synthetic) return;
        Generator sgen(t.seed + 99);
        fmt::print("--- sample ---\n{}\n--------------\n",
                   printable(sample_text(*model, "Q:", a.sample, dev, sgen)));
      });
    });
  });
}
