// The IDX reader (nn/data/mnist.cpp): read_idx over a plain file, a file named .gz holding
// the raw bytes (a damaged gzip stream) and a real gzip of the bytes; and MNIST over an images
// file and a labels file cut from the input, then every example it reports. The first byte
// picks the mode, the rest is the file. What read_idx returns must hold the bytes its header
// promises: every byte of the data is read back.
#include <zlib.h>

#include "fuzz_common.h"
#include "nn/data/mnist.h"

using namespace tally;

namespace {

void write_gzip(const std::filesystem::path& path, const uint8_t* data, size_t size) {
  gzFile gz = gzopen(path.c_str(), "wb");
  FUZZ_CHECK(gz != nullptr);
  if (size) FUZZ_CHECK(gzwrite(gz, data, static_cast<unsigned>(size)) == static_cast<int>(size));
  FUZZ_CHECK(gzclose(gz) == Z_OK);
}

void check_array(const data::ByteArray& a, const uint8_t* file, size_t size) {
  FUZZ_CHECK(a.shape.size() >= 1 && a.shape.size() <= 4);
  const auto n = static_cast<size_t>(a.numel());
  const size_t header = 4 + 4 * a.shape.size();
  FUZZ_CHECK(header + n <= size);
  uint64_t sum = 0;
  for (size_t i = 0; i < n; ++i) {
    FUZZ_CHECK(a.data()[i] == file[header + i]);
    sum += a.data()[i];
  }
  (void)sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path& dir = fuzz::scratch_dir();
  if (size < 1) return 0;
  const uint8_t mode = data[0] % 4;
  const uint8_t* body = data + 1;
  const size_t n = size - 1;
  switch (mode) {
    case 0: {  // plain IDX
      const auto path = dir / "plain.idx";
      fuzz::write_file(path, body, n);
      // zlib reads a gzip stream through a plain name too; then the bytes are not the file's.
      const bool gzip_inside = n >= 2 && body[0] == 0x1f && body[1] == 0x8b;
      fuzz::accepts([&] {
        const data::ByteArray a = data::read_idx(path.string());
        if (!gzip_inside) check_array(a, body, n);
      });
      break;
    }
    case 1: {  // the raw bytes as a .gz: a damaged or foreign gzip stream
      const auto path = dir / "raw.idx.gz";
      fuzz::write_file(path, body, n);
      fuzz::accepts([&] { data::read_idx(path.string()); });
      break;
    }
    case 2: {  // a valid gzip of the bytes
      const auto path = dir / "packed.idx.gz";
      write_gzip(path, body, n);
      fuzz::accepts([&] { check_array(data::read_idx(path.string()), body, n); });
      break;
    }
    default: {  // MNIST: images and labels, split where the next two bytes say
      if (n < 2) return 0;
      const size_t cut = std::min<size_t>(n - 2, (size_t{body[0]} << 8) | body[1]);
      const auto root = dir / "mnist";
      std::filesystem::create_directories(root);
      fuzz::write_file(root / "t10k-images-idx3-ubyte", body + 2, cut);
      fuzz::write_file(root / "t10k-labels-idx1-ubyte", body + 2 + cut, n - 2 - cut);
      fuzz::accepts([&] {
        const data::MNIST m(root.string(), /*train=*/false, 0.1307, 0.3081, /*rows=*/-1,
                            /*cols=*/-1);
        FUZZ_CHECK(m.size() == m.labels().numel());
        for (int64_t i = 0; i < m.size(); ++i) {
          const data::Example ex = m.get(i);
          const int64_t label = ex.target.item<int64_t>();
          FUZZ_CHECK(label >= 0 && label < data::MNIST::kClasses);
        }
        if (m.size() > 0) {
          const data::Example b = m.get_batch({0, m.size() - 1});
          FUZZ_CHECK(b.input.size(0) == 2);
        }
      });
      break;
    }
  }
  return 0;
}
