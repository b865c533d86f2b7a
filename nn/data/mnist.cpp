#include "nn/data/mnist.h"

#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <filesystem>
#include <stdexcept>

#include "base/checked.h"
#include "base/path_kind.h"
#include "memory/caching_allocator.h"
#include "memory/context.h"

namespace tally::data {
namespace {

// Bounds deflate's largest compression ratio, about 1032:1 (a 258-byte match in 2 bits), so
// that a gzip file of n bytes holds at most kMaxDeflateRatio * n uncompressed bytes.
constexpr uint64_t kMaxDeflateRatio = 1024 + 16;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Sequential reader over a gzip'd (or, without .gz, plain) file that knows its offset in
// the uncompressed stream, so errors can say where the data ran out.
class IdxReader {
 public:
  explicit IdxReader(std::string path) : path_(std::move(path)) {
    if (!std::filesystem::exists(path_))
      throw std::runtime_error(fmt::format("read_idx: '{}' does not exist", path_));
    base::refuse_directory(path_, "read_idx");
    if (ends_with(path_, ".gz")) {
      gzipped_ = true;
      unsigned char head[2] = {0, 0};
      std::FILE* f = std::fopen(path_.c_str(), "rb");
      if (!f) throw std::runtime_error(fmt::format("read_idx: cannot open '{}'", path_));
      const size_t n = std::fread(head, 1, 2, f);
      std::fclose(f);
      if (n < 2 || head[0] != 0x1f || head[1] != 0x8b)
        throw std::runtime_error(fmt::format(
            "read_idx: '{}' is not a gzip file (first bytes {}, expected 0x1f 0x8b)", path_,
            n == 0   ? std::string("none: empty file")
            : n == 1 ? fmt::format("0x{:02x}", head[0])
                     : fmt::format("0x{:02x} 0x{:02x}", head[0], head[1])));
    }
    gz_ = gzopen(path_.c_str(), "rb");
    if (!gz_) throw std::runtime_error(fmt::format("read_idx: cannot open '{}'", path_));
    gzbuffer(gz_, 1 << 17);
  }
  ~IdxReader() {
    if (gz_) gzclose(gz_);
  }
  IdxReader(const IdxReader&) = delete;
  IdxReader& operator=(const IdxReader&) = delete;

  const std::string& path() const { return path_; }
  uint64_t offset() const { return offset_; }
  bool gzipped() const { return gzipped_; }

  // Exactly `n` bytes into `dst`, or an error naming the offset (`what` says what was read).
  void read(void* dst, uint64_t n, const char* what) {
    char* p = static_cast<char*>(dst);
    uint64_t done = 0;
    while (done < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<uint64_t>(n - done, 1u << 30));
      const int got = gzread(gz_, p + done, chunk);
      if (got < 0) gz_fail(what);
      if (got == 0) {
        int err = Z_OK;
        gzerror(gz_, &err);
        if (err != Z_OK && err != Z_STREAM_END) gz_fail(what);
        throw std::runtime_error(fmt::format(
            "read_idx: '{}' is truncated at byte offset {} reading the {}: expected {} bytes "
            "from byte offset {}, got {}",
            path_, offset_ + done, what, n, offset_, done));
      }
      done += static_cast<uint64_t>(got);
    }
    offset_ += n;
  }

 private:
  [[noreturn]] void gz_fail(const char* what) {
    int err = Z_OK;
    const char* msg = gzerror(gz_, &err);
    throw std::runtime_error(fmt::format(
        "read_idx: gzip error in '{}' reading the {} near uncompressed byte offset {}: {}", path_,
        what, offset_, msg ? msg : "unknown error"));
  }

  std::string path_;
  gzFile gz_ = nullptr;
  uint64_t offset_ = 0;
  bool gzipped_ = false;
};

uint32_t big_endian(const unsigned char* b) {
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
}

// The first of `names` that exists in `root` (the .gz or the extracted file).
std::string find_file(const std::string& root, const std::string& stem) {
  namespace fs = std::filesystem;
  base::require_directory(root, "MNIST",
                          fmt::format(" (expected {}.gz in it; Debian/Ubuntu ship Fashion-MNIST "
                                      "as the package dataset-fashion-mnist)",
                                      stem));
  for (const std::string& name : {stem + ".gz", stem}) {
    const fs::path p = fs::path(root) / name;
    if (fs::exists(p)) return p.string();
  }
  throw std::runtime_error(fmt::format("MNIST: '{}' has neither {}.gz nor {}", root, stem, stem));
}

}  // namespace

ByteArray read_idx(const std::string& path) {
  IdxReader r(path);
  unsigned char magic[4];
  r.read(magic, 4, "magic number");
  const uint32_t m = big_endian(magic);
  if (magic[0] != 0 || magic[1] != 0 || magic[2] != 0x08 || magic[3] < 1 || magic[3] > 4)
    throw std::runtime_error(fmt::format(
        "read_idx: '{}' has a bad magic number 0x{:08x} at byte offset 0 (expected 0x000008NN: "
        "unsigned bytes in NN = 1..4 dimensions, e.g. 0x00000801 labels, 0x00000803 images)",
        path, m));
  const int rank = magic[3];
  Shape shape;
  for (int d = 0; d < rank; ++d) {
    unsigned char b[4];
    r.read(b, 4, "header");
    shape.push_back(static_cast<int64_t>(big_endian(b)));
  }
  // The element count, checked one dimension at a time so that the error names the field
  // (dimension d is the 4 bytes at offset 4 + 4 d). As checked_numel counts it, a 0 does not
  // excuse the other dimensions.
  int64_t product = 1;
  for (int d = 0; d < rank; ++d)
    product = base::checked_mul(
        product, std::max<int64_t>(shape[static_cast<size_t>(d)], 1),
        fmt::format("read_idx: '{}': the header's dimensions {} multiply past 2^63 - 1 at "
                    "dimension {} (byte offset {})",
                    path, shape_str(shape), d, 4 + 4 * d));
  const int64_t numel = base::checked_numel(shape, "read_idx");  // (cannot fail now)
  // Against what the file can hold before anything is allocated: a plain file its size after
  // the header, a gzip'd one at most kMaxDeflateRatio bytes per compressed byte.
  const auto bytes = static_cast<uint64_t>(numel);
  const uint64_t data_offset = r.offset();
  const uint64_t file_bytes = std::filesystem::file_size(path);
  if (r.gzipped()) {
    const uint64_t most = base::checked_mul(file_bytes, kMaxDeflateRatio, "read_idx");
    if (bytes > most)
      throw std::runtime_error(fmt::format(
          "read_idx: '{}': the header (byte offsets 4 to {}) gives shape {}, {} bytes of data "
          "from byte offset {}, but a gzip file of {} bytes holds at most {} uncompressed bytes",
          path, data_offset - 1, shape_str(shape), bytes, data_offset, file_bytes, most));
  } else if (bytes > file_bytes - std::min(file_bytes, data_offset)) {
    throw std::runtime_error(fmt::format(
        "read_idx: '{}' is truncated: the header (byte offsets 4 to {}) gives shape {}, {} bytes "
        "of data from byte offset {}, but the file has {} bytes after byte offset {}",
        path, data_offset - 1, shape_str(shape), bytes, data_offset,
        file_bytes - std::min(file_bytes, data_offset), data_offset));
  }
  Storage storage;
  try {
    storage = Storage::allocate(static_cast<size_t>(bytes), Device::cpu());
  } catch (const memory::OutOfMemoryError& e) {
    throw memory::OutOfMemoryError(
        fmt::format("read_idx: '{}': {} bytes for shape {} (header byte offsets 4 to {}): {}", path,
                    bytes, shape_str(shape), data_offset - 1, e.what()),
        e.requested());
  }
  ByteArray a{shape, std::move(storage)};
  r.read(a.storage.data(), bytes,
         fmt::format("data ({} bytes for shape {})", bytes, shape_str(shape)).c_str());
  return a;
}

MNIST::MNIST(const std::string& root, bool train, double mean, double std, int64_t rows,
             int64_t cols)
    : mean_(mean), std_(std) {
  if (!(std > 0)) throw std::invalid_argument(fmt::format("MNIST: std must be > 0, got {}", std));
  if ((rows != -1 && rows < 1) || (cols != -1 && cols < 1))
    throw std::invalid_argument(fmt::format(
        "MNIST: the image size must be at least 1x1 (or -1: any), got {}x{}", rows, cols));
  memory::CategoryScope scope(memory::Category::input);
  const std::string prefix = train ? "train" : "t10k";
  const std::string images_path = find_file(root, prefix + "-images-idx3-ubyte");
  const std::string labels_path = find_file(root, prefix + "-labels-idx1-ubyte");
  images_ = read_idx(images_path);
  if (images_.shape.size() != 3)
    throw std::runtime_error(
        fmt::format("MNIST: '{}' holds a {}-dimensional array {}, expected "
                    "images [N, rows, cols]",
                    images_path, images_.shape.size(), shape_str(images_.shape)));
  // The header's image size (byte offsets 8 to 15), before the labels are read: a 0x0 image
  // is no image, and another size than the dataset's would be read as scrambled images.
  const int64_t h = images_.size(1), w = images_.size(2);
  if (h < 1 || w < 1)
    throw std::runtime_error(
        fmt::format("MNIST: '{}': the header (byte offsets 8 to 15) gives {}x{} images; an "
                    "image needs at least 1x1 pixels",
                    images_path, h, w));
  if ((rows != -1 && h != rows) || (cols != -1 && w != cols))
    throw std::runtime_error(fmt::format(
        "MNIST: '{}': the header (byte offsets 8 to 15) gives {}x{} images, expected {}x{} "
        "(the dataset's image size)",
        images_path, h, w, rows == -1 ? std::string("any") : std::to_string(rows),
        cols == -1 ? std::string("any") : std::to_string(cols)));
  const ByteArray raw = read_idx(labels_path);
  if (raw.shape.size() != 1 || raw.size(0) != images_.size(0))
    throw std::runtime_error(fmt::format(
        "MNIST: '{}' holds labels of shape {}, expected [{}] to "
        "match the {} images in '{}'",
        labels_path, shape_str(raw.shape), images_.size(0), images_.size(0), images_path));
  const int64_t n = raw.size(0);
  labels_ = empty_host({n}, DType::int64, false);
  const uint8_t* src = raw.data();
  int64_t* dst = labels_.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (src[i] >= kClasses)
      throw std::runtime_error(fmt::format(
          "MNIST: '{}': label {} of example {} (byte offset {}) is out of range [0, {})",
          labels_path, src[i], i, 8 + i, kClasses));
    dst[i] = src[i];
  }
}

void MNIST::fill(const std::vector<int64_t>& indices, float* input, int64_t* target) const {
  const int64_t n = size();
  const int64_t pixels = images_.size(1) * images_.size(2);
  const uint8_t* img = images_.data();
  const int64_t* lab = labels_.data<int64_t>();
  // ((x / 255) - mean) / std as one multiply-add.
  const float scale = static_cast<float>(1.0 / (255.0 * std_));
  const float shift = static_cast<float>(-mean_ / std_);
  for (size_t b = 0; b < indices.size(); ++b) {
    const int64_t i = indices[b];
    check_index("MNIST", i, n);
    const uint8_t* src = img + i * pixels;
    float* dst = input + static_cast<int64_t>(b) * pixels;
    for (int64_t k = 0; k < pixels; ++k) dst[k] = static_cast<float>(src[k]) * scale + shift;
    target[b] = lab[i];
  }
}

Example MNIST::get(int64_t index) const {
  return fill_example(*this, &MNIST::fill, {index}, {1, images_.size(1), images_.size(2)}, {},
                      false);
}

Example MNIST::get_batch(const std::vector<int64_t>& indices, bool pinned) const {
  const int64_t b = static_cast<int64_t>(indices.size());
  return fill_example(*this, &MNIST::fill, indices, {b, 1, images_.size(1), images_.size(2)}, {b},
                      pinned);
}

}  // namespace tally::data
