// Datasets: IDX/MNIST parsing (gzip'd files written here, and the real Fashion-MNIST when
// installed), corrupt-file errors, CIFAR-10 binary, the byte-level text corpus and the
// synthetic datasets.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "data/data_testing.h"
#include "memory/memory.h"
#include "nn/data/cifar.h"
#include "nn/data/mnist.h"
#include "nn/data/synthetic.h"
#include "nn/data/text.h"
#include "tensor/ops.h"

using namespace tally;
using namespace tally::data;
using tally::testing::TempDir;
namespace dt = tally::testing;

namespace {

// Expects `fn` to throw an exception whose message contains every one of `parts`.
template <typename Fn>
void expect_error(Fn&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no exception";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    for (const std::string& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

// 3 images 2x4 with pixel (n, k) = 10 n + k (so 0..27) and labels 2, 0, 9.
void write_small_mnist(const TempDir& dir, const std::string& prefix = "train") {
  std::vector<uint8_t> px;
  for (int n = 0; n < 3; ++n)
    for (int k = 0; k < 8; ++k) px.push_back(static_cast<uint8_t>(10 * n + k));
  dt::write_gzip(dir.file(prefix + "-images-idx3-ubyte.gz"), dt::idx_bytes({3, 2, 4}, px));
  dt::write_gzip(dir.file(prefix + "-labels-idx1-ubyte.gz"), dt::idx_bytes({3}, {2, 0, 9}));
}

// 3 images rows x cols (header dimensions as given, pixels (n * k) % 256) and labels 2, 0, 9.
void write_mnist(const TempDir& dir, const std::string& prefix, uint32_t rows, uint32_t cols) {
  std::vector<uint8_t> px;
  for (uint32_t n = 0; n < 3; ++n)
    for (uint32_t k = 0; k < rows * cols; ++k) px.push_back(static_cast<uint8_t>((n * k) % 256));
  dt::write_gzip(dir.file(prefix + "-images-idx3-ubyte.gz"), dt::idx_bytes({3, rows, cols}, px));
  dt::write_gzip(dir.file(prefix + "-labels-idx1-ubyte.gz"), dt::idx_bytes({3}, {2, 0, 9}));
}

}  // namespace

// ---------------------------------------------------------------- IDX / MNIST

TEST(Idx, ReadsShapeAndBytes) {
  TempDir dir;
  write_small_mnist(dir);
  const ByteArray a = read_idx(dir.file("train-images-idx3-ubyte.gz"));
  EXPECT_EQ(a.shape, (Shape{3, 2, 4}));
  ASSERT_EQ(a.numel(), 24);
  EXPECT_EQ(a.data()[0], 0);
  EXPECT_EQ(a.data()[9], 11);
  EXPECT_EQ(a.data()[23], 27);
}

TEST(Idx, UncompressedFileToo) {
  TempDir dir;
  dt::write_bytes(dir.file("x-labels"), dt::idx_bytes({4}, {1, 2, 3, 4}));
  const ByteArray a = read_idx(dir.file("x-labels"));
  EXPECT_EQ(a.shape, (Shape{4}));
  EXPECT_EQ(a.data()[3], 4);
}

TEST(Mnist, ShapesValuesNormalisation) {
  TempDir dir;
  write_small_mnist(dir);
  MNIST ds(dir.str(), /*train=*/true, /*mean=*/0.5, /*std=*/0.25, /*rows=*/2, /*cols=*/4);
  ASSERT_EQ(ds.size(), 3);
  const Example ex = ds.get(1);
  EXPECT_EQ(ex.input.sizes(), (Shape{1, 2, 4}));
  EXPECT_EQ(ex.input.dtype(), DType::float32);
  EXPECT_EQ(ex.target.dtype(), DType::int64);
  EXPECT_EQ(ex.target.dim(), 0);
  EXPECT_EQ(ex.target.item<int64_t>(), 0);
  const std::vector<double> v = ops::to_vector(ex.input);
  for (int k = 0; k < 8; ++k) EXPECT_NEAR(v[k], ((10 + k) / 255.0 - 0.5) / 0.25, 1e-5) << k;

  const Example b = ds.get_batch({2, 0});
  EXPECT_EQ(b.input.sizes(), (Shape{2, 1, 2, 4}));
  EXPECT_EQ(ops::to_vector(b.target), (std::vector<double>{9, 2}));
  EXPECT_NEAR(ops::to_vector(b.input)[0], (20 / 255.0 - 0.5) / 0.25, 1e-5);
  EXPECT_THROW(ds.get(3), std::out_of_range);
}

TEST(Mnist, FashionDefaultsNormalise) {
  TempDir dir;
  write_mnist(dir, "t10k", 28, 28);
  FashionMNIST ds(dir.str(), /*train=*/false);
  EXPECT_DOUBLE_EQ(ds.mean(), 0.2860);
  EXPECT_DOUBLE_EQ(ds.std(), 0.3530);
  EXPECT_NEAR(ops::to_vector(ds.get(0).input)[0], (0.0 - 0.2860) / 0.3530, 1e-5);
}

TEST(Mnist, RealFashionMnist) {
  if (!std::filesystem::exists(std::string(FashionMNIST::kDefaultRoot) +
                               "/train-images-idx3-ubyte.gz"))
    GTEST_SKIP() << "Fashion-MNIST not installed (Debian package dataset-fashion-mnist)";
  for (bool train : {true, false}) {
    FashionMNIST ds(FashionMNIST::kDefaultRoot, train);
    const int64_t n = train ? 60000 : 10000;
    ASSERT_EQ(ds.size(), n);
    EXPECT_EQ(ds.rows(), 28);
    EXPECT_EQ(ds.cols(), 28);
    std::vector<int64_t> hist(10, 0);
    const int64_t* lab = ds.labels().data<int64_t>();
    for (int64_t i = 0; i < n; ++i) ++hist[static_cast<size_t>(lab[i])];
    for (int c = 0; c < 10; ++c) EXPECT_EQ(hist[static_cast<size_t>(c)], n / 10) << "class " << c;
    const Example ex = ds.get(0);
    EXPECT_EQ(ex.input.sizes(), (Shape{1, 28, 28}));
    const std::vector<double> v = ops::to_vector(ex.input);
    const double lo = *std::min_element(v.begin(), v.end()),
                 hi = *std::max_element(v.begin(), v.end());
    EXPECT_NEAR(lo, -0.2860 / 0.3530, 1e-5);  // background pixels are 0
    EXPECT_LE(hi, (1 - 0.2860) / 0.3530 + 1e-5);
    EXPECT_GT(hi, 1.0);
  }
}

TEST(MnistErrors, BadMagic) {
  TempDir dir;
  const std::string f = dir.file("bad-images.gz");
  dt::write_gzip(f, dt::idx_bytes({1, 1, 1}, {0}, 0x00000903u));
  expect_error([&] { read_idx(f); }, {f, "bad magic number 0x00000903", "byte offset 0"});
}

TEST(MnistErrors, TruncatedData) {
  TempDir dir;
  const std::string f = dir.file("short-images.gz");
  dt::write_gzip(f, dt::idx_bytes({3, 2, 4}, std::vector<uint8_t>(20, 7)));
  // Header 16 bytes, 24 data bytes expected, 20 present.
  expect_error([&] { read_idx(f); },
               {f, "truncated at byte offset 36", "expected 24 bytes", "got 20"});
}

TEST(MnistErrors, TruncatedHeader) {
  TempDir dir;
  const std::string f = dir.file("h.gz");
  dt::write_gzip(f, {0, 0, 8, 3, 0, 0});
  expect_error([&] { read_idx(f); }, {f, "truncated at byte offset 6", "header"});
}

TEST(MnistErrors, NotGzip) {
  TempDir dir;
  const std::string f = dir.file("plain.gz");
  dt::write_bytes(f, dt::idx_bytes({1}, {1}));
  expect_error([&] { read_idx(f); }, {f, "not a gzip file", "0x00 0x00"});
}

TEST(MnistErrors, CorruptGzipStream) {
  TempDir dir;
  const std::string f = dir.file("corrupt.gz");
  std::vector<uint8_t> px(4000);
  for (size_t i = 0; i < px.size(); ++i) px[i] = static_cast<uint8_t>((i * 7919) % 251);
  dt::write_gzip(f, dt::idx_bytes({1000, 2, 2}, px));
  std::vector<uint8_t> bytes = dt::read_bytes(f);
  ASSERT_GT(bytes.size(), 100u);
  for (size_t i = 20; i < 60; ++i) bytes[i] ^= 0x5a;  // wreck the deflate stream
  dt::write_bytes(f, bytes);
  expect_error([&] { read_idx(f); }, {f, "gzip error"});
}

TEST(MnistErrors, MissingFilesAndLabels) {
  TempDir dir;
  expect_error([&] { MNIST(dir.file("nope")); }, {dir.file("nope"), "does not exist"});
  expect_error([&] { MNIST m(dir.str()); }, {dir.str(), "train-images-idx3-ubyte"});
  dt::write_gzip(dir.file("train-images-idx3-ubyte.gz"), dt::idx_bytes({2, 1, 1}, {0, 0}));
  dt::write_gzip(dir.file("train-labels-idx1-ubyte.gz"), dt::idx_bytes({2}, {3, 10}));
  expect_error([&] { MNIST m(dir.str(), true, 0.1307, 0.3081, 1, 1); },
               {"train-labels-idx1-ubyte.gz", "label 10 of example 1", "byte offset 9",
                "out of range [0, 10)"});
  dt::write_gzip(dir.file("train-labels-idx1-ubyte.gz"), dt::idx_bytes({3}, {1, 2, 3}));
  expect_error([&] { MNIST m(dir.str(), true, 0.1307, 0.3081, 1, 1); },
               {"labels of shape [3]", "expected [2]"});
}

// Header dimensions that multiply past 2^63 - 1 (issue 22: past 2^64 they crashed the reader):
// an error naming the file and the byte offset of the dimension where the product overflows.
TEST(MnistErrors, HeaderDimensionsThatOverflow) {
  TempDir dir;
  const std::string f = dir.file("wrap-images");
  dt::write_bytes(f, dt::idx_bytes({0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu}, {1, 2, 3}));
  expect_error([&] { read_idx(f); }, {f, "[4294967295, 4294967295, 4294967295]",
                                      "multiply past 2^63 - 1 at dimension 1 (byte offset 8)"});
  // A 0 does not excuse the others (the tensor's strides would not fit).
  dt::write_bytes(f, dt::idx_bytes({0, 0xFFFFFFFFu, 0xFFFFFFFFu}, {}));
  expect_error([&] { read_idx(f); }, {f, "[0, 4294967295, 4294967295]",
                                      "multiply past 2^63 - 1 at dimension 2 (byte offset 12)"});
  // 2^16 x 2^16 x 2^16 x 2^16 = 2^64 exactly, gzip'd: overflows at the last dimension.
  const std::string g = dir.file("wrap-images.gz");
  dt::write_gzip(g, dt::idx_bytes({65536, 65536, 65536, 65536}, {1, 2, 3}));
  expect_error([&] { read_idx(g); }, {g, "dimension 3 (byte offset 16)"});
}

// Huge dimensions that do not wrap are checked against what the file holds, before anything
// is allocated (issue 22: they used to reach the allocator, "234 TiB out of memory").
TEST(MnistErrors, HugeHeaderDimensionsAreCheckedAgainstTheFile) {
  TempDir dir;
  const size_t before = memory::get_allocator(memory::Device::cpu()).memory_allocated();
  const int64_t allocs_before =
      memory::memory_stats(memory::Device::cpu()).at("allocation.all.allocated");
  const std::vector<uint8_t> idx = dt::idx_bytes({60000, 28, 28, 1000000}, {1, 2, 3});
  const std::string f = dir.file("huge-images");
  dt::write_bytes(f, idx);
  expect_error([&] { read_idx(f); },
               {f, "is truncated", "header (byte offsets 4 to 19)",
                "shape [60000, 28, 28, 1000000], 47040000000000 bytes of data from byte offset 20",
                "the file has 3 bytes after byte offset 20"});
  const std::string g = dir.file("huge-images.gz");
  dt::write_gzip(g, idx);
  const auto gz_bytes = std::filesystem::file_size(g);
  expect_error([&] { read_idx(g); },
               {g, "from byte offset 20", "a gzip file of " + std::to_string(gz_bytes) + " bytes",
                "holds at most " + std::to_string(gz_bytes * 1040) + " uncompressed bytes"});
  EXPECT_EQ(memory::get_allocator(memory::Device::cpu()).memory_allocated(), before);
  EXPECT_EQ(memory::memory_stats(memory::Device::cpu()).at("allocation.all.allocated"),
            allocs_before);
  // A plain file one byte short: the same check, naming the offsets.
  const std::string s = dir.file("short-labels");
  dt::write_bytes(s, dt::idx_bytes({5}, {1, 2, 3, 4}));
  expect_error([&] { read_idx(s); },
               {s, "is truncated", "5 bytes of data from byte offset 8", "has 4 bytes after"});
}

// ---------------------------------------------------------------- CIFAR-10

namespace {
// A record: label, then pixel (c, k) = (c * 50 + k + record) % 256.
std::vector<uint8_t> cifar_records(int count, int first_label, int salt) {
  std::vector<uint8_t> v;
  for (int r = 0; r < count; ++r) {
    v.push_back(static_cast<uint8_t>((first_label + r) % 10));
    for (int c = 0; c < 3; ++c)
      for (int k = 0; k < 1024; ++k)
        v.push_back(static_cast<uint8_t>((c * 50 + k + r + salt) % 256));
  }
  return v;
}
}  // namespace

TEST(Cifar10, TinyBinaryFiles) {
  TempDir dir;
  for (int i = 1; i <= 5; ++i)
    dt::write_bytes(dir.file("data_batch_" + std::to_string(i) + ".bin"), cifar_records(2, i, i));
  dt::write_bytes(dir.file("test_batch.bin"), cifar_records(3, 7, 0));
  CIFAR10 train(dir.str(), true);
  ASSERT_EQ(train.size(), 10);
  CIFAR10 test(dir.str(), false);
  ASSERT_EQ(test.size(), 3);
  // Example 3 = record 1 of data_batch_2 (label 3, salt 2).
  const Example ex = train.get(3);
  EXPECT_EQ(ex.input.sizes(), (Shape{3, 32, 32}));
  EXPECT_EQ(ex.target.item<int64_t>(), 3);
  const std::vector<double> v = ops::to_vector(ex.input);
  for (int c = 0; c < 3; ++c)
    for (int k : {0, 5, 1023}) {
      const double x = ((c * 50 + k + 1 + 2) % 256) / 255.0;
      EXPECT_NEAR(v[static_cast<size_t>(c * 1024 + k)], (x - CIFAR10::kMean[c]) / CIFAR10::kStd[c],
                  1e-5);
    }
  const Example b = test.get_batch({2, 0});
  EXPECT_EQ(b.input.sizes(), (Shape{2, 3, 32, 32}));
  EXPECT_EQ(ops::to_vector(b.target), (std::vector<double>{9, 7}));
}

TEST(Cifar10, Errors) {
  TempDir dir;
  expect_error([&] { CIFAR10 c(dir.file("cifar")); },
               {dir.file("cifar"), "does not exist", "binary version", "cifar-10-binary.tar.gz"});
  expect_error([&] { CIFAR10 c(dir.str()); }, {"data_batch_1.bin", "does not exist"});
  std::vector<uint8_t> rec = cifar_records(2, 0, 0);
  rec.resize(rec.size() + 100, 0);
  dt::write_bytes(dir.file("test_batch.bin"), rec);
  expect_error(
      [&] { CIFAR10 c(dir.str(), false); },
      {"test_batch.bin", "truncated at byte offset 6146", "expects 3073 bytes", "100 left"});
  rec = cifar_records(2, 0, 0);
  rec[3073] = 11;
  dt::write_bytes(dir.file("test_batch.bin"), rec);
  expect_error([&] { CIFAR10 c(dir.str(), false); },
               {"test_batch.bin", "label 11 of record 1", "byte offset 3073", "out of range"});
}

// A sparse file of `bytes` bytes in `dir` (no disk used); `why` says why not when the file
// system cannot make one.
struct SparseFile {
  std::string path, why;
  SparseFile(const TempDir& dir, const std::string& name, uint64_t bytes) : path(dir.file(name)) {
    dt::write_bytes(path, {});
    std::error_code ec;
    std::filesystem::resize_file(path, bytes, ec);
    if (ec) why = "no sparse file of " + std::to_string(bytes) + " bytes here: " + ec.message();
  }
};

// Sizes come from the file sizes: a sparse test_batch.bin of 2^30 records (3.3 TB, no disk
// used) gets an error naming the file and its bytes, not a bare out-of-memory.
TEST(Cifar10, OversizedFileNamesTheFile) {
  TempDir dir;
  const uint64_t bytes = uint64_t{3073} << 30;
  const SparseFile f(dir, "test_batch.bin", bytes);
  if (!f.why.empty()) GTEST_SKIP() << f.why;
  try {
    CIFAR10 c(dir.str(), false);
    ADD_FAILURE() << "a " << bytes << "-byte CIFAR file loaded";
  } catch (const memory::OutOfMemoryError& e) {
    const std::string m = e.what();
    for (const std::string& part :
         {std::string("CIFAR10: 1073741824 records of 3073 bytes in '") + f.path,
          "(byte offsets 0 to " + std::to_string(bytes) + ")"})
      EXPECT_NE(m.find(part), std::string::npos) << "'" << part << "' not in: " << m;
  }
}

// ---------------------------------------------------------------- text

namespace {
// Bytes i % 251: a window's first byte says where it starts (mod 251).
std::string write_ramp(const TempDir& dir, int n) {
  std::vector<uint8_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<uint8_t>(i % 251);
  const std::string f = dir.file("ramp.txt");
  dt::write_bytes(f, v);
  return f;
}
}  // namespace

TEST(TextCorpus, SplitsAndRandomWindows) {
  TempDir dir;
  TextCorpus corpus(write_ramp(dir, 1000), 0.1);
  EXPECT_EQ(corpus.vocab_size(), 256);
  EXPECT_EQ(corpus.num_tokens(Split::train), 900);
  EXPECT_EQ(corpus.num_tokens(Split::val), 100);
  EXPECT_EQ(ops::to_vector(corpus.tokens(Split::val))[0], 900 % 251);

  Generator g1(42), g2(42);
  const Example a = corpus.get_batch(6, 16, g1);
  const Example b = corpus.get_batch(6, 16, g2);
  EXPECT_EQ(a.input.sizes(), (Shape{6, 16}));
  EXPECT_EQ(a.input.dtype(), DType::int64);
  EXPECT_EQ(ops::to_vector(a.input), ops::to_vector(b.input));  // same seed, same windows
  const std::vector<double> x = ops::to_vector(a.input), y = ops::to_vector(a.target);
  for (int r = 0; r < 6; ++r)
    for (int t = 0; t < 16; ++t) {
      const double x0 = x[static_cast<size_t>(r * 16)];
      EXPECT_EQ(x[static_cast<size_t>(r * 16 + t)], std::fmod(x0 + t, 251.0));
      EXPECT_EQ(y[static_cast<size_t>(r * 16 + t)],
                std::fmod(x0 + t + 1, 251.0));  // y == x shifted
    }
  const Example c = corpus.get_batch(6, 16, g1);  // the generator moved on
  EXPECT_NE(ops::to_vector(c.input), x);

  const Example v = corpus.get_batch(4, 99, g1, Split::val);  // val windows stay inside val
  const std::vector<double> vx = ops::to_vector(v.input);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(vx[static_cast<size_t>(r * 99)], 900 % 251);
  EXPECT_THROW(corpus.get_batch(1, 100, g1, Split::val), std::invalid_argument);
}

TEST(TextCorpus, SequentialWindows) {
  TempDir dir;
  TextCorpus corpus(write_ramp(dir, 1000), 0.1);
  TextWindows w = corpus.windows(Split::train, 10);
  EXPECT_EQ(w.size(), 89);  // (900 - 1) / 10
  int64_t seen = 0;
  for (const Example& b : corpus.sequential(Split::train, 20, 10)) {
    const std::vector<double> x = ops::to_vector(b.input), y = ops::to_vector(b.target);
    for (size_t k = 0; k < x.size(); ++k) {
      EXPECT_EQ(x[k], (seen + static_cast<int64_t>(k)) % 251);
      EXPECT_EQ(y[k], (seen + static_cast<int64_t>(k) + 1) % 251);
    }
    seen += static_cast<int64_t>(x.size());
  }
  EXPECT_EQ(seen, 890);
  EXPECT_EQ(corpus.sequential(Split::train, 20, 10).size(), 5);
}

TEST(TextCorpus, EncodeDecodeAndErrors) {
  EXPECT_EQ(TextCorpus::decode(TextCorpus::encode("Tally!")), "Tally!");
  TempDir dir;
  expect_error([&] { TextCorpus c(dir.file("none.txt")); },
               {dir.file("none.txt"), "does not exist"});
}

TEST(TextCorpus, Fortunes) {
  if (!std::filesystem::exists(TextCorpus::kDefaultPath))
    GTEST_SKIP() << "fortunes not installed (Debian package fortunes-min)";
  TextCorpus corpus;
  EXPECT_GT(corpus.num_tokens(), 10000);
  Generator g(1);
  const Example b = corpus.get_batch(2, 64, g);
  const std::string s = TextCorpus::decode(b.input.select(0, 0));
  EXPECT_EQ(s.size(), 64u);
}

// The corpus size comes from the file: a sparse 2^42-byte file gets an error naming it.
TEST(TextCorpus, OversizedFileNamesTheFile) {
  TempDir dir;
  const SparseFile f(dir, "huge.txt", uint64_t{1} << 42);
  if (!f.why.empty()) GTEST_SKIP() << f.why;
  expect_error([&] { TextCorpus c(f.path); },
               {"TextCorpus: '" + f.path + "' (4398046511104 bytes from byte offset 0)"});
}

TEST(TextCorpus, BatchTimesSequenceThatOverflowsNamesTheCorpus) {
  TempDir dir;
  const std::string f = write_ramp(dir, 1000);
  TextCorpus corpus(f, 0.1);
  Generator g(1);
  const int64_t big = int64_t{1} << 62;
  expect_error([&] { (void)corpus.get_batch(big, 16, g); },
               {"TextCorpus::get_batch: '" + f + "'", "[4611686018427387904, 16]"});
  // SequentialBatches' count does not wrap for a batch near 2^63.
  const SequentialBatches seq =
      corpus.sequential(Split::train, std::numeric_limits<int64_t>::max(), 16);
  EXPECT_EQ(seq.size(), 1);
}

// ---------------------------------------------------------------- synthetic

TEST(Synthetic, ImagesDeterministic) {
  SyntheticImages a(50, {3, 4, 4}, 5, 7), b(50, {3, 4, 4}, 5, 7), c(50, {3, 4, 4}, 5, 8);
  EXPECT_EQ(a.size(), 50);
  const Example e = a.get(13);
  EXPECT_EQ(e.input.sizes(), (Shape{3, 4, 4}));
  EXPECT_EQ(ops::to_vector(e.input), ops::to_vector(b.get(13).input));
  EXPECT_NE(ops::to_vector(e.input), ops::to_vector(c.get(13).input));
  const Example batch = a.get_batch({13, 2});
  EXPECT_EQ(batch.input.sizes(), (Shape{2, 3, 4, 4}));
  EXPECT_EQ(ops::to_vector(batch.input.select(0, 0)), ops::to_vector(e.input));
  std::vector<int> hist(5, 0);
  for (int64_t i = 0; i < 50; ++i) {
    const int64_t y = a.label(i);
    ASSERT_GE(y, 0);
    ASSERT_LT(y, 5);
    ++hist[static_cast<size_t>(y)];
  }
  for (int h : hist) EXPECT_GT(h, 0);
  // Roughly N(pattern, 1): the mean of |x| over many elements is well above 0.
  double sum = 0;
  for (double v : ops::to_vector(a.get_batch({0, 1, 2, 3}).input)) sum += std::abs(v);
  EXPECT_GT(sum / (4 * 48), 0.8);
  // A batch large enough to be filled over several threads holds what each example gives
  // alone (one example is below the parallel grain: filled by this thread).
  SyntheticImages big(40, {3, 32, 32}, 10, 3);
  std::vector<int64_t> idx;
  for (int64_t i = 39; i >= 0; i -= 2) idx.push_back(i);
  const Example many = big.get_batch(idx);
  for (size_t j = 0; j < idx.size(); ++j) {
    const Example one = big.get(idx[j]);
    ASSERT_EQ(ops::to_vector(many.input.select(0, static_cast<int64_t>(j))),
              ops::to_vector(one.input))
        << "example " << idx[j];
    EXPECT_EQ(ops::to_vector(many.target)[j], ops::to_vector(one.target)[0]);
  }
}

TEST(Synthetic, TokensShifted) {
  SyntheticTokens ds(20, 11, {3, 8}, 3);
  const Example e = ds.get(4);
  EXPECT_EQ(e.input.sizes(), (Shape{3, 8}));
  const std::vector<double> x = ops::to_vector(e.input), y = ops::to_vector(e.target);
  for (int r = 0; r < 3; ++r)
    for (int t = 0; t + 1 < 8; ++t)
      EXPECT_EQ(y[static_cast<size_t>(r * 8 + t)], x[static_cast<size_t>(r * 8 + t + 1)]);
  for (double v : x) {
    EXPECT_GE(v, 0);
    EXPECT_LT(v, 11);
  }
  EXPECT_EQ(ops::to_vector(SyntheticTokens(20, 11, {3, 8}, 3).get(4).input), x);
  EXPECT_EQ(ops::to_vector(ds.get_batch({1, 4}).input.select(0, 1)), x);
}

// Issue 54: the images' size in the header must be the dataset's (a 14x56 file read as 28x28
// trained on scrambled images), and a 0x0 header is refused by the reader, naming the file
// (it used to reach conv2d as a shape error).
TEST(MnistErrors, ImageSizeMustBeTheDatasets) {
  TempDir dir;
  write_mnist(dir, "train", 14, 56);
  const std::string f = dir.file("train-images-idx3-ubyte.gz");
  expect_error([&] { FashionMNIST ds(dir.str()); },
               {"MNIST: '" + f + "'", "gives 14x56 images, expected 28x28"});
  expect_error([&] { MNIST ds(dir.str()); }, {f, "gives 14x56 images, expected 28x28"});
  // Another expected size, or any (-1), reads the file.
  EXPECT_EQ(MNIST(dir.str(), true, 0.1307, 0.3081, 14, 56).rows(), 14);
  EXPECT_EQ(MNIST(dir.str(), true, 0.1307, 0.3081, -1, -1).cols(), 56);
  write_mnist(dir, "train", 28, 28);
  EXPECT_EQ(FashionMNIST(dir.str()).size(), 3);
  write_mnist(dir, "train", 0, 0);
  for (int64_t any : {int64_t{-1}, int64_t{28}})
    expect_error([&] { MNIST ds(dir.str(), true, 0.1307, 0.3081, any, any); },
                 {"MNIST: '" + f + "'", "gives 0x0 images", "at least 1x1"});
  expect_error([&] { MNIST ds(dir.str(), true, 0.1307, 0.3081, 0, 28); },
               {"image size must be at least 1x1", "got 0x28"});
}
