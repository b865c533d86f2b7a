// The safetensors reader (nn/serialize.cpp), header and body. The first byte picks the mode:
// raw (the rest is the whole file, length prefix included) or framed (the harness writes the
// 8-byte length of a JSON header cut from the input at a point the next two bytes give, then
// the header, then the rest as the data section), so that mutations land in the JSON. What
// loads must survive save_safetensors and load again unchanged: names, order, dtypes, shapes,
// bytes and metadata.
#include <map>

#include "fuzz_common.h"
#include "nn/serialize.h"

using namespace tally;

namespace {

void check_round_trip(const nn::NamedTensors& a, const std::map<std::string, std::string>& meta,
                      const std::filesystem::path& path) {
  nn::save_safetensors(path.string(), a, meta);
  std::map<std::string, std::string> meta2;
  const nn::NamedTensors b = nn::load_safetensors(path.string(), &meta2);
  FUZZ_CHECK(meta2 == meta);
  FUZZ_CHECK(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const Tensor& x = a[i].second;
    const Tensor& y = b[i].second;
    FUZZ_CHECK(a[i].first == b[i].first);
    FUZZ_CHECK(x.dtype() == y.dtype());
    FUZZ_CHECK(x.sizes() == y.sizes());
    FUZZ_CHECK(x.nbytes() == y.nbytes());
    if (x.nbytes()) FUZZ_CHECK(std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::filesystem::path& dir = fuzz::scratch_dir();
  if (size < 1) return 0;
  const auto path = dir / "in.safetensors";
  if (data[0] % 2 == 0) {
    fuzz::write_file(path, data + 1, size - 1);
  } else {
    if (size < 3) return 0;
    const size_t rest = size - 3;
    const size_t cut = std::min<size_t>(rest, (size_t{data[1]} << 8) | data[2]);
    std::string file(8, '\0');
    const uint64_t n = cut;
    std::memcpy(file.data(), &n, 8);
    file.append(reinterpret_cast<const char*>(data + 3), rest);
    fuzz::write_file(path, file);
  }
  std::map<std::string, std::string> meta;
  nn::NamedTensors loaded;
  if (!fuzz::accepts([&] { loaded = nn::load_safetensors(path.string(), &meta); })) return 0;
  // The loaded tensors come back in the order of their data offsets, each holding the bytes
  // its entry promises.
  for (const auto& [name, t] : loaded) {
    FUZZ_CHECK(name != "__metadata__");
    FUZZ_CHECK(t.nbytes() == static_cast<size_t>(t.numel()) * dtype_size(t.dtype()));
  }
  check_round_trip(loaded, meta, dir / "out.safetensors");
  return 0;
}
