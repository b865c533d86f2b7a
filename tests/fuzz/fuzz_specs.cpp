// The short specs users type: sizes (memory::parse_bytes: --memory-budget, --memory-limit and
// the estimate's --capacity), the offload spec (nn::parse_offload_spec, --offload) and category
// names (memory::parse_category, the reports' filters). The first byte picks the parser, the
// rest is the text. What parses must print back to itself: a size is below 2^63 and its byte
// count parses to the same count; an offload spec's str() parses to the same spec (blocks >= 1
// for N-blocks); a category's name is the text.
#include <limits>

#include "fuzz_common.h"
#include "memory/category.h"
#include "memory/estimate.h"
#include "nn/offload.h"

using namespace tally;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 3) {
    case 0: {
      size_t bytes = 0;
      if (!fuzz::accepts([&] { bytes = memory::parse_bytes(text, "--memory-budget"); })) return 0;
      FUZZ_CHECK(bytes <= static_cast<size_t>(std::numeric_limits<int64_t>::max()));
      FUZZ_CHECK(memory::parse_bytes(std::to_string(bytes)) == bytes);
      if (!text.empty() && text.find_first_not_of("0123456789") == std::string::npos &&
          text.size() < 19)
        FUZZ_CHECK(bytes == std::stoull(text));
      break;
    }
    case 1: {
      nn::OffloadSpec spec;
      if (!fuzz::accepts([&] { spec = nn::parse_offload_spec(text); })) return 0;
      const nn::OffloadSpec again = nn::parse_offload_spec(spec.str());
      FUZZ_CHECK(again.kind == spec.kind && again.blocks == spec.blocks);
      if (spec.kind == nn::OffloadSpec::Kind::blocks) FUZZ_CHECK(spec.blocks >= 1);
      break;
    }
    default: {
      const std::optional<memory::Category> c = memory::parse_category(text);
      if (c) FUZZ_CHECK(memory::category_name(*c) == text);
      break;
    }
  }
  return 0;
}
