#include "nn/data/cifar.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "base/checked.h"
#include "base/path_kind.h"
#include "memory/caching_allocator.h"
#include "memory/context.h"

namespace tally::data {
namespace {

constexpr int64_t kImageBytes = CIFAR10::kRecordBytes - 1;

[[noreturn]] void missing(const std::string& what) {
  throw std::runtime_error(fmt::format(
      "CIFAR10: {}. Tally reads the binary version of CIFAR-10: download "
      "cifar-10-binary.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html and extract it, "
      "then pass the cifar-10-batches-bin directory (data_batch_1.bin .. data_batch_5.bin, "
      "test_batch.bin) as root",
      what));
}

}  // namespace

CIFAR10::CIFAR10(const std::string& root, bool train, std::array<double, 3> mean,
                 std::array<double, 3> std)
    : mean_(mean), std_(std) {
  namespace fs = std::filesystem;
  for (double s : std)
    if (!(s > 0)) throw std::invalid_argument(fmt::format("CIFAR10: std must be > 0, got {}", s));
  if (fs::exists(root) && !fs::is_directory(root))
    missing(fmt::format("'{}' is not a directory ({})", root,
                        fs::is_regular_file(root) ? "a file" : "not a folder"));
  if (!fs::is_directory(root)) missing(fmt::format("directory '{}' does not exist", root));
  std::vector<std::string> files;
  if (train) {
    for (int i = 1; i <= 5; ++i)
      files.push_back((fs::path(root) / fmt::format("data_batch_{}.bin", i)).string());
  } else {
    files.push_back((fs::path(root) / "test_batch.bin").string());
  }
  std::vector<int64_t> counts;
  for (const std::string& f : files) {
    base::refuse_directory(f, "CIFAR10");
    if (!fs::is_regular_file(f)) missing(fmt::format("'{}' does not exist", f));
    const auto bytes = static_cast<int64_t>(fs::file_size(f));
    if (bytes == 0 || bytes % kRecordBytes != 0)
      throw std::runtime_error(fmt::format(
          "CIFAR10: '{}' is truncated at byte offset {}: record {} expects {} bytes, {} left "
          "(file size {} is not a whole number of {}-byte records)",
          f, bytes / kRecordBytes * kRecordBytes, bytes / kRecordBytes, kRecordBytes,
          bytes % kRecordBytes, bytes, kRecordBytes));
    counts.push_back(bytes / kRecordBytes);
    n_ = base::checked_add(n_, counts.back(), "CIFAR10: the number of records");
  }

  memory::CategoryScope scope(memory::Category::input);
  try {
    images_ = Storage::allocate(
        static_cast<size_t>(base::checked_mul(n_, kImageBytes, "CIFAR10: the image bytes")),
        Device::cpu());
    labels_ = empty_host({n_}, DType::int64, false);
  } catch (const memory::OutOfMemoryError& e) {
    std::string where;
    for (size_t k = 0; k < files.size(); ++k)
      where += fmt::format("{}'{}' (byte offsets 0 to {})", k ? ", " : "", files[k],
                           counts[k] * kRecordBytes);
    throw memory::OutOfMemoryError(
        fmt::format("CIFAR10: {} records of {} bytes in {}: {}", n_, kRecordBytes, where, e.what()),
        e.requested());
  }
  auto* img = static_cast<char*>(images_.data());
  int64_t* lab = labels_.data<int64_t>();
  int64_t i = 0;
  for (size_t k = 0; k < files.size(); ++k) {
    std::ifstream in(files[k], std::ios::binary);
    if (!in) throw std::runtime_error(fmt::format("CIFAR10: cannot open '{}'", files[k]));
    for (int64_t r = 0; r < counts[k]; ++r, ++i) {
      char label = 0;
      in.read(&label, 1);
      in.read(img + i * kImageBytes, kImageBytes);
      if (!in)
        throw std::runtime_error(
            fmt::format("CIFAR10: '{}' is truncated at byte offset {}: "
                        "expected a {}-byte record",
                        files[k], r * kRecordBytes, kRecordBytes));
      const auto v = static_cast<uint8_t>(label);
      if (v >= kClasses)
        throw std::runtime_error(fmt::format(
            "CIFAR10: '{}': label {} of record {} (byte offset {}) is out of range [0, {})",
            files[k], v, r, r * kRecordBytes, kClasses));
      lab[i] = v;
    }
  }
}

const uint8_t* CIFAR10::raw_image(int64_t i) const {
  check_index("CIFAR10", i, n_);
  return static_cast<const uint8_t*>(images_.data()) + i * kImageBytes;
}

void CIFAR10::fill(const std::vector<int64_t>& indices, float* input, int64_t* target) const {
  float scale[3], shift[3];
  for (int c = 0; c < 3; ++c) {
    scale[c] = static_cast<float>(1.0 / (255.0 * std_[static_cast<size_t>(c)]));
    shift[c] = static_cast<float>(-mean_[static_cast<size_t>(c)] / std_[static_cast<size_t>(c)]);
  }
  const int64_t* lab = labels_.data<int64_t>();
  for (size_t b = 0; b < indices.size(); ++b) {
    const uint8_t* src = raw_image(indices[b]);
    float* dst = input + static_cast<int64_t>(b) * kImageBytes;
    for (int c = 0; c < 3; ++c)
      for (int64_t k = 0; k < 1024; ++k)
        dst[c * 1024 + k] = static_cast<float>(src[c * 1024 + k]) * scale[c] + shift[c];
    target[b] = lab[indices[b]];
  }
}

Example CIFAR10::get(int64_t index) const {
  return fill_example(*this, &CIFAR10::fill, {index}, {3, 32, 32}, {}, false);
}

Example CIFAR10::get_batch(const std::vector<int64_t>& indices, bool pinned) const {
  const auto b = static_cast<int64_t>(indices.size());
  return fill_example(*this, &CIFAR10::fill, indices, {b, 3, 32, 32}, {b}, pinned);
}

}  // namespace tally::data
