// MNIST-format image datasets: the IDX files (images idx3-ubyte, labels idx1-ubyte), gzip'd
// or not, read with zlib. FashionMNIST is the same class with Fashion-MNIST's root and
// normalisation. Images are float32 [1, rows, cols], ((x / 255) - mean) / std; labels
// int64 scalars in [0, 10).
#pragma once

#include <string>

#include "nn/data/dataset.h"

namespace tally::data {

// An array of unsigned bytes: its shape and the CPU storage (Tally has no uint8 dtype).
struct ByteArray {
  Shape shape;
  Storage storage;
  const uint8_t* data() const { return static_cast<const uint8_t*>(storage.data()); }
  int64_t numel() const { return shape_numel(shape); }
  int64_t size(int64_t d) const { return shape[static_cast<size_t>(d)]; }
};

// The contents of one IDX file of unsigned bytes (type code 0x08): the dimensions its
// header gives and the bytes in a CPU storage allocated under the current context. `path` ending in
// .gz must be gzip'd. Errors name the file: cannot open, not gzip, gzip error text, bad magic
// number (value and byte offset), truncated at byte offset N expecting M bytes.
ByteArray read_idx(const std::string& path);

class MNIST : public Dataset {
 public:
  static constexpr int64_t kClasses = 10;

  // MNIST's and Fashion-MNIST's images are 28x28.
  static constexpr int64_t kRows = 28, kCols = 28;

  // Reads {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] from `root`. The images file's
  // header must give `rows` x `cols` images (-1: any size of at least 1x1), else an error names
  // the file, the header's size and the expected one: a 14x56 file read as 28x28 scrambles
  // every image.
  explicit MNIST(const std::string& root, bool train = true, double mean = 0.1307,
                 double std = 0.3081, int64_t rows = kRows, int64_t cols = kCols);

  int64_t size() const override { return images_.size(0); }
  int64_t rows() const { return images_.size(1); }
  int64_t cols() const { return images_.size(2); }
  Example get(int64_t index) const override;
  Example get_batch(const std::vector<int64_t>& indices, bool pinned = false) const override;

  // The raw data: bytes [N, rows, cols] and int64 labels [N].
  const ByteArray& images() const { return images_; }
  const Tensor& labels() const { return labels_; }
  double mean() const { return mean_; }
  double std() const { return std_; }

 private:
  void fill(const std::vector<int64_t>& indices, float* input, int64_t* target) const;

  ByteArray images_;
  Tensor labels_;
  double mean_;
  double std_;
};

class FashionMNIST : public MNIST {
 public:
  static constexpr const char* kDefaultRoot = "/usr/share/datasets/fashion-mnist";

  explicit FashionMNIST(const std::string& root = kDefaultRoot, bool train = true,
                        double mean = 0.2860, double std = 0.3530, int64_t rows = kRows,
                        int64_t cols = kCols)
      : MNIST(root, train, mean, std, rows, cols) {}
};

}  // namespace tally::data
