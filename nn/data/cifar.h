// CIFAR-10, binary version (cifar-10-batches-bin: data_batch_1..5.bin, test_batch.bin; each
// record is 1 label byte + 3072 image bytes, 1024 per channel R, G, B, row-major 32x32).
// Images are float32 [3, 32, 32] normalised per channel, (x / 255 - mean[c]) / std[c];
// labels int64 scalars in [0, 10).
#pragma once

#include <array>
#include <string>

#include "nn/data/dataset.h"

namespace tally::data {

class CIFAR10 : public Dataset {
 public:
  static constexpr int64_t kClasses = 10;
  static constexpr int64_t kRecordBytes = 1 + 3 * 32 * 32;
  static constexpr std::array<double, 3> kMean = {0.4914, 0.4822, 0.4465};
  static constexpr std::array<double, 3> kStd = {0.2470, 0.2435, 0.2616};

  // Reads the five training batches (train) or test_batch.bin from `root`. A missing
  // directory or file, a size that is not a whole number of records, or a label out of
  // range throws, naming the path (and the byte offset).
  explicit CIFAR10(const std::string& root, bool train = true, std::array<double, 3> mean = kMean,
                   std::array<double, 3> std = kStd);

  int64_t size() const override { return n_; }
  Example get(int64_t index) const override;
  Example get_batch(const std::vector<int64_t>& indices, bool pinned = false) const override;

  // int64 labels [N].
  const Tensor& labels() const { return labels_; }
  // The raw pixels of example i: 3072 bytes, channel-major.
  const uint8_t* raw_image(int64_t i) const;

 private:
  void fill(const std::vector<int64_t>& indices, float* input, int64_t* target) const;

  int64_t n_ = 0;
  Storage images_;  // N x 3072 bytes
  Tensor labels_;
  std::array<double, 3> mean_, std_;
};

}  // namespace tally::data
