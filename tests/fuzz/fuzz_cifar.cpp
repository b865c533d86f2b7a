// The CIFAR-10 reader (nn/data/cifar.cpp): the first byte picks the split. Test: the rest of
// the input is test_batch.bin. Train: the next ten bytes are five big-endian 16-bit lengths,
// and the rest is cut into data_batch_1..5.bin at those lengths (a file may come out short or
// empty, and bit 1 of the first byte leaves data_batch_5.bin out). Every example the dataset
// reports must be readable, its label in [0, 10) and its pixels the file's bytes.
#include "fuzz_common.h"
#include "nn/data/cifar.h"

using namespace tally;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path& dir = fuzz::scratch_dir();
  if (size < 1) return 0;
  const bool train = data[0] & 1;
  const bool drop_last = data[0] & 2;  // train: leave data_batch_5.bin out
  const uint8_t* p = data + 1;
  size_t left = size - 1;
  auto take = [&](size_t n) {
    n = std::min(n, left);
    std::string out(reinterpret_cast<const char*>(p), n);
    p += n;
    left -= n;
    return out;
  };
  const auto root = dir / (train ? "train" : "test");
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);
  std::vector<std::string> files;  // the bytes of each file, in the reader's order
  if (train) {
    if (left < 10) return 0;
    size_t lengths[5];
    for (size_t& l : lengths) {
      const std::string be = take(2);
      l = (size_t{static_cast<uint8_t>(be[0])} << 8) | static_cast<uint8_t>(be[1]);
    }
    for (int i = 0; i < 5; ++i) {
      if (drop_last && i == 4) break;
      files.push_back(take(lengths[i]));
      fuzz::write_file(root / ("data_batch_" + std::to_string(i + 1) + ".bin"), files.back());
    }
  } else {
    files.push_back(take(left));
    fuzz::write_file(root / "test_batch.bin", files.back());
  }
  fuzz::accepts([&] {
    const data::CIFAR10 c(root.string(), train);
    std::string all;
    for (const std::string& f : files) all += f;
    FUZZ_CHECK(static_cast<size_t>(c.size()) * data::CIFAR10::kRecordBytes == all.size());
    for (int64_t i = 0; i < c.size(); ++i) {
      const size_t at = static_cast<size_t>(i) * data::CIFAR10::kRecordBytes;
      FUZZ_CHECK(c.labels().data<int64_t>()[i] == static_cast<uint8_t>(all[at]));
      FUZZ_CHECK(
          std::memcmp(c.raw_image(i), all.data() + at + 1, data::CIFAR10::kRecordBytes - 1) == 0);
      const data::Example ex = c.get(i);
      FUZZ_CHECK(ex.target.item<int64_t>() >= 0 &&
                 ex.target.item<int64_t>() < data::CIFAR10::kClasses);
    }
    if (c.size() > 0) {
      const data::Example b = c.get_batch({c.size() - 1, 0});
      FUZZ_CHECK(b.input.size(0) == 2 && b.input.size(1) == 3);
    }
    // An index past the end is a clear error.
    bool threw = false;
    try {
      c.get(c.size());
    } catch (const std::out_of_range&) {
      threw = true;
    }
    FUZZ_CHECK(threw);
  });
  return 0;
}
