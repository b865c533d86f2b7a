// The checkpoint spec (nn::parse_checkpoint_spec, --checkpoint of the training programs): the
// input is the spec. One that parses must print back to a spec that parses to the same thing,
// and applying it to a small GPT (3 blocks) must not change the step: the loss and every
// gradient equal those of the model without checkpointing, bit for bit.
#include <optional>

#include "fuzz_common.h"
#include "nn/checkpoint.h"
#include "nn/models/gpt.h"
#include "tensor/ops.h"

using namespace tally;

namespace {

struct Step {
  std::vector<double> values;  // the loss, then every gradient, flattened
};

nn::GPT& model() {
  static nn::GPT* gpt = [] {
    nn::GPTConfig cfg;
    cfg.vocab_size = 32;
    cfg.block_size = 8;
    cfg.n_layer = 3;
    cfg.n_head = 2;
    cfg.n_embd = 16;
    Generator gen(7);
    return new nn::GPT(cfg, &gen);
  }();
  return *gpt;
}

Step step(nn::GPT& gpt) {
  static const Tensor idx =
      ops::from_vector({1, 5, 9, 2, 30, 7, 7, 0, 3, 4, 31, 8, 16, 2, 9, 1}, {2, 8}, DType::int64);
  static const Tensor targets =
      ops::from_vector({5, 9, 2, 30, 7, 7, 0, 3, 4, 31, 8, 16, 2, 9, 1, 6}, {2, 8}, DType::int64);
  gpt.zero_grad();
  const auto [logits, loss] = gpt(idx, targets);
  loss.backward();
  Step s;
  s.values.push_back(loss.item());
  for (const auto& [name, p] : gpt.named_parameters()) {
    FUZZ_CHECK(p.grad().defined());
    for (double v : ops::to_vector(p.grad())) s.values.push_back(v);
  }
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::scratch_dir();  // the memory cap
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::optional<nn::CheckpointSpec> spec;
  if (!fuzz::accepts([&] { spec = nn::parse_checkpoint_spec(text); })) return 0;
  const nn::CheckpointSpec again = nn::parse_checkpoint_spec(spec->str());
  FUZZ_CHECK(again.kind == spec->kind && again.segments == spec->segments);
  if (spec->kind == nn::CheckpointSpec::Kind::segments) FUZZ_CHECK(spec->segments >= 1);

  static const Step reference = [] {
    nn::enable_checkpointing(model(), nn::parse_checkpoint_spec("none"));
    return step(model());
  }();
  if (!fuzz::accepts([&] { nn::enable_checkpointing(model(), *spec); })) return 0;
  const Step s = step(model());
  FUZZ_CHECK(s.values.size() == reference.values.size());
  for (size_t i = 0; i < s.values.size(); ++i)
    FUZZ_CHECK(std::memcmp(&s.values[i], &reference.values[i], sizeof(double)) == 0);
  return 0;
}
