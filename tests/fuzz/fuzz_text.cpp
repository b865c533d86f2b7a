// The text corpus (nn/data/text.cpp): the input is val_fraction (a little-endian double),
// a sequence length and a batch size (little-endian int64 each), a seed byte, then the corpus
// file. Every token must be one of the file's bytes; random batches, the window
// datasets and the sequential batches either work or refuse clearly; decode(encode(s)) == s.
#include <optional>

#include "fuzz_common.h"
#include "nn/data/text.h"

using namespace tally;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // 4 MiB: batches that fit are small enough to fill quickly; larger ones meet the cap.
  const std::filesystem::path& dir = fuzz::scratch_dir(size_t{4} << 20);
  if (size < 25) return 0;
  double val_fraction;
  int64_t seq_len, batch;
  std::memcpy(&val_fraction, data, 8);
  std::memcpy(&seq_len, data + 8, 8);
  std::memcpy(&batch, data + 16, 8);
  const uint64_t seed = data[24];
  const std::string text(reinterpret_cast<const char*>(data + 25), size - 25);
  const auto path = dir / "corpus.txt";
  fuzz::write_file(path, text);

  std::optional<data::TextCorpus> loaded;
  if (!fuzz::accepts([&] { loaded.emplace(path.string(), val_fraction); })) return 0;
  const data::TextCorpus& corpus = *loaded;
  FUZZ_CHECK(corpus.num_tokens() == static_cast<int64_t>(text.size()));
  FUZZ_CHECK(corpus.num_tokens(data::Split::train) + corpus.num_tokens(data::Split::val) ==
             corpus.num_tokens());
  for (const data::Split split : {data::Split::train, data::Split::val}) {
    const Tensor t = corpus.tokens(split);
    const int64_t offset = split == data::Split::train ? 0 : corpus.num_tokens(data::Split::train);
    for (int64_t i = 0; i < t.numel(); ++i)
      FUZZ_CHECK(t.data<int64_t>()[i] ==
                 static_cast<uint8_t>(text[static_cast<size_t>(offset + i)]));

    fuzz::accepts([&] {
      Generator gen(seed);
      const data::Example ex = corpus.get_batch(batch, seq_len, gen, split);
      FUZZ_CHECK(ex.input.size(0) == batch && ex.input.size(1) == seq_len);
    });
    fuzz::accepts([&] {
      const data::TextWindows w = corpus.windows(split, seq_len);
      for (int64_t i = 0; i < std::min<int64_t>(w.size(), 16); ++i) {
        const data::Example ex = w.get(i);
        FUZZ_CHECK(ex.input.numel() == seq_len && ex.target.numel() == seq_len);
      }
    });
    fuzz::accepts([&] {
      const data::SequentialBatches s = corpus.sequential(split, batch, seq_len);
      int64_t k = 0;
      for (const data::Example& ex : s) {
        FUZZ_CHECK(ex.input.size(0) >= 1 && ex.input.size(0) <= batch);
        if (++k == 4) break;
      }
    });
  }
  FUZZ_CHECK(data::TextCorpus::decode(data::TextCorpus::encode(text)) == text);
  return 0;
}
