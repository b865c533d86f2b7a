// safetensors reader and writer; the header's JSON is parsed and formed by nlohmann-json.
#include "nn/serialize.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <stdexcept>
#include <string_view>

#include "base/atomic_file.h"
#include "base/checked.h"
#include "base/enum_table.h"
#include "base/json.h"
#include "base/path_kind.h"

namespace tally::nn {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian bytes; a big-endian host needs byte swaps");

namespace {

// safetensors' dtype names, by DType's order.
constexpr const char* kStDtypes[] = {"F32", "F16", "BF16", "F64", "I32", "I64", "BOOL", "U8"};

const char* st_dtype(DType d) {
  return base::enum_table<DType::uint8>(d, kStDtypes, "?");
}

bool parse_st_dtype(const std::string& s, DType* d) {
  for (size_t i = 0; i < std::size(kStDtypes); ++i)
    if (s == kStDtypes[i]) {
      *d = static_cast<DType>(i);
      return true;
    }
  return false;
}

// ---- the header's JSON, through nlohmann-json ----
using Json = nlohmann::json;
using JsonPointer = Json::json_pointer;

constexpr uint64_t kHeaderStart = 8;  // the header's first byte in the file

[[noreturn]] void corrupt_header(const std::string& path, uint64_t offset,
                                 const std::string& what) {
  throw std::runtime_error(
      fmt::format("load_safetensors: {}: corrupt header at byte {}: {}", path, offset, what));
}

// An input iterator over the header that records how far the parser has read, so that the
// parser's callback can tell where a value lies in the file.
class TrackingIterator {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  TrackingIterator(const char* p, const char** read) : p_(p), read_(read) {}
  reference operator*() const { return *p_; }
  TrackingIterator& operator++() {
    *read_ = ++p_;
    return *this;
  }
  TrackingIterator operator++(int) {
    TrackingIterator before = *this;
    ++*this;
    return before;
  }
  bool operator==(const TrackingIterator& o) const { return p_ == o.p_; }

 private:
  const char* p_;
  const char** read_;
};

// Whether `s` is valid UTF-8 (nlohmann-json's serializer checks it).
bool is_utf8(const std::string& s) {
  try {
    (void)Json(s).dump();
    return true;
  } catch (const Json::type_error&) {
    return false;
  }
}

// The header: its JSON and its top-level names in file order (the tensors load in the order
// of their data offsets, names with equal offsets in file order).
struct Header {
  Json doc;
  std::vector<std::string> names;
};

// "tensor 'w': " while the parser reads the entry of tensor w, else "".
std::string in_tensor(const std::string& name) {
  return name.empty() || !is_utf8(name) ? std::string() : fmt::format("tensor '{}': ", name);
}

// Parses the header `text` with nlohmann-json. Syntax errors (nlohmann's parse_error, whose
// byte is 1-based in the header), every other nlohmann exception of the parse (a number out of
// range, "1e400": out_of_range.406), a tensor name given twice and nesting deeper than 64
// levels throw naming the file, the tensor being read (where known) and the byte offset in the
// file. With `find`, *found receives the file
// offset where the value at that JSON pointer starts: the semantic errors parse the header
// again for it (corrupt_value), so that a valid header is parsed once and keeps no offsets.
//
// Where a value starts: nlohmann's parser calls back once it has read a value to its end
// (a number: one character more, which it puts back), a key, or a bracket; the value starts
// at the first character after the previous callback's read position that is not white
// space or the one ':' or ',' before it.
Header parse_header(const std::string& text, const std::string& path,
                    const JsonPointer* find = nullptr, uint64_t* found = nullptr) {
  const char* const begin = text.data();
  const char* read = begin;
  size_t prev = 0;  // `read` at the previous callback
  auto value_start = [&] {
    size_t i = prev;
    auto skip_ws = [&] {
      while (i < text.size() &&
             (text[i] == ' ' || text[i] == '\t' || text[i] == '\n' || text[i] == '\r'))
        ++i;
    };
    skip_ws();
    if (i < text.size() && (text[i] == ':' || text[i] == ',')) {
      ++i;
      skip_ws();
    }
    return kHeaderStart + i;
  };
  // The containers the parser is in, for the JSON pointer of each value (with `find` only).
  struct Level {
    JsonPointer at;
    bool array;
    size_t next_index = 0;
    std::string key;
  };
  std::vector<Level> levels;
  Header h;
  std::set<std::string> seen;
  std::string tensor;  // the top-level entry being read, for the error messages
  auto callback = [&](int depth, Json::parse_event_t event, Json& parsed) {
    using E = Json::parse_event_t;
    if (event == E::key && depth == 1) {
      const std::string& name = parsed.get_ref<const std::string&>();
      if (!seen.insert(name).second)
        corrupt_header(path, value_start(), fmt::format("duplicate tensor name '{}'", name));
      h.names.push_back(name);
      tensor = name;
    } else if (depth == 1 &&
               (event == E::value || event == E::object_end || event == E::array_end)) {
      tensor.clear();  // the entry's value has ended
    }
    if ((event == E::object_start || event == E::array_start) && depth >= 64)
      corrupt_header(path, value_start(), "JSON nested too deeply");
    if (find) {
      if (event == E::key) {
        levels.back().key = parsed.get<std::string>();
      } else if (event == E::object_end || event == E::array_end) {
        levels.pop_back();
      } else {  // a value starts: object_start, array_start or value
        JsonPointer at;
        if (!levels.empty())
          at = levels.back().array ? levels.back().at / levels.back().next_index++
                                   : levels.back().at / levels.back().key;
        if (at == *find) *found = value_start();
        if (event != E::value) levels.push_back({std::move(at), event == E::array_start, 0, {}});
      }
    }
    prev = static_cast<size_t>(read - begin);
    return true;
  };
  try {
    h.doc = Json::parse(TrackingIterator(begin, &read),
                        TrackingIterator(begin + text.size(), &read), callback);
    return h;
  } catch (const Json::parse_error& e) {
    // "[json.exception.parse_error.101] parse error at line 1, column 6: syntax error ...":
    // the line and column are the header's, the byte offset below is the file's.
    // "last read: '...'" quotes the header's bytes: not when they are not UTF-8.
    std::string what = e.what();
    const size_t colon = what.find(": ");
    if (colon != std::string::npos) what.erase(0, colon + 2);
    if (!is_utf8(what)) what.erase(std::min(what.size(), what.find("; last read: ")));
    corrupt_header(path, kHeaderStart + (e.byte ? e.byte - 1 : 0), in_tensor(tensor) + what);
  } catch (const Json::exception& e) {
    // Errors with no byte of their own ("[json.exception.out_of_range.406] number overflow
    // parsing '1e400'"): the offset is where the value being read starts.
    std::string what = e.what();
    if (what.starts_with("[json.exception.")) what.erase(0, what.find("] ") + 2);
    if (!is_utf8(what)) what = "invalid value";
    corrupt_header(path, value_start(), in_tensor(tensor) + what);
  }
}

// A semantic error in the header: names the file and the file offset of the value at `at`.
[[noreturn]] void corrupt_value(const std::string& header, const std::string& path,
                                const JsonPointer& at, const std::string& what) {
  uint64_t offset = kHeaderStart;
  parse_header(header, path, &at, &offset);
  corrupt_header(path, offset, what);
}

// A size or offset: a non-negative JSON integer of at most 2^63 - 1 (base/checked.h), else
// nullopt. Fractions and exponents ("4.0", "1e3") are not integers, as in safetensors' own
// reader.
std::optional<uint64_t> as_size(const Json& v) {
  if (!v.is_number_unsigned()) return std::nullopt;
  const uint64_t u = v.get<uint64_t>();
  if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return u;
}

// std::invalid_argument naming the file unless `s` is valid UTF-8: JSON text is, and
// safetensors' readers reject a header that is not. The message shows `s` with U+FFFD for its
// invalid bytes (base::json_quote).
void require_utf8(const std::string& path, const std::string& s, std::string_view what) {
  if (!is_utf8(s))
    throw std::invalid_argument(fmt::format("save_safetensors: {}: {} {} is not valid UTF-8", path,
                                            what, base::json_quote(s)));
}

}  // namespace

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // In the given order (ordered_json), __metadata__ first, compact: {"__metadata__":{"k":"v"},
  // "name":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},...}.
  nlohmann::ordered_json doc = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json& m = doc["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) {
      require_utf8(path, k, "metadata key");
      require_utf8(path, v, "metadata value");
      m[k] = v;
    }
  }
  std::set<std::string> names;
  std::vector<Tensor> cpu;
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__" || !names.insert(name).second)
      throw std::invalid_argument(
          fmt::format("save_safetensors: {}: duplicate or reserved name '{}'", path, name));
    if (!t.defined())
      throw std::invalid_argument(
          fmt::format("save_safetensors: {}: tensor '{}' is undefined", path, name));
    Tensor c;
    {
      NoGradGuard ng;
      memory::CategoryScope cat(memory::Category::temporary);
      c = ops::contiguous(ops::to(t.detach(), Device::cpu(), t.dtype()));
    }
    const uint64_t end = base::checked_add(offset, uint64_t{c.nbytes()}, "save_safetensors");
    require_utf8(path, name, "tensor name");
    doc[name] = {
        {"dtype", st_dtype(c.dtype())}, {"shape", c.sizes()}, {"data_offsets", {offset, end}}};
    offset = end;
    cpu.push_back(c);
  }
  std::string header = doc.dump();
  while ((8 + header.size()) % 8 != 0) header += ' ';  // align the data to 8 bytes

  // Atomic: a write cut short (disk full, a file-size limit) leaves the previous file intact.
  base::write_file_atomic(
      path,
      [&](std::ostream& out) {
        const uint64_t n = header.size();
        out.write(reinterpret_cast<const char*>(&n), 8);
        out.write(header.data(), static_cast<std::streamsize>(header.size()));
        for (const Tensor& c : cpu)
          if (c.nbytes() && out)
            out.write(static_cast<const char*>(c.data_ptr()),
                      static_cast<std::streamsize>(c.nbytes()));
      },
      "save_safetensors");
}

NamedTensors load_safetensors(const std::string& path,
                              std::map<std::string, std::string>* metadata) {
  base::refuse_directory(path, "load_safetensors");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("load_safetensors: cannot open {}", path));
  in.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  auto corrupt = [&](uint64_t off, const std::string& what) {
    return std::runtime_error(
        fmt::format("load_safetensors: {}: corrupt file at byte {}: {}", path, off, what));
  };
  if (file_size < 8)
    throw corrupt(
        0, fmt::format("file is {} bytes, shorter than the 8-byte header length", file_size));
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  if (n > file_size - 8 || n > (100u << 20))
    throw corrupt(
        0, fmt::format("header length {} exceeds the file size {} (or 100 MiB)", n, file_size));
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  if (!in) throw corrupt(8, "cannot read the header");
  const uint64_t data_start = 8 + n, data_size = file_size - data_start;

  const Header h = parse_header(header, path);
  const Json& doc = h.doc;
  if (!doc.is_object()) corrupt_header(path, kHeaderStart, "the header is not a JSON object");

  struct Entry {
    std::string name;
    DType dtype;
    Shape shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  for (const std::string& name : h.names) {
    const Json& v = doc.at(name);
    const JsonPointer at = JsonPointer() / name;
    if (name == "__metadata__") {
      if (!v.is_object()) corrupt_value(header, path, at, "__metadata__ is not an object");
      for (const auto& [k, mv] : v.items()) {
        if (!mv.is_string())
          corrupt_value(header, path, at / k,
                        fmt::format("__metadata__ value for '{}' is not a string", k));
        if (metadata) (*metadata)[k] = mv.get<std::string>();
      }
      continue;
    }
    if (!v.is_object())
      corrupt_value(header, path, at, fmt::format("entry '{}' is not an object", name));
    for (const char* field : {"dtype", "shape", "data_offsets"})
      if (!v.contains(field))
        corrupt_value(header, path, at, fmt::format("tensor '{}' lacks {}", name, field));
    Entry e;
    e.name = name;
    const Json& jd = v.at("dtype");
    const Json& js = v.at("shape");
    const Json& jo = v.at("data_offsets");
    if (!jd.is_string() || !parse_st_dtype(jd.get<std::string>(), &e.dtype))
      corrupt_value(
          header, path, at / "dtype",
          fmt::format("tensor '{}': unsupported dtype {}", name,
                      jd.is_string() ? "'" + jd.get<std::string>() + "'" : "(not a string)"));
    if (!js.is_array())
      corrupt_value(header, path, at / "shape",
                    fmt::format("tensor '{}': shape is not an array", name));
    for (size_t i = 0; i < js.size(); ++i) {
      const std::optional<uint64_t> d = as_size(js[i]);
      if (!d)
        corrupt_value(
            header, path, at / "shape" / i,
            fmt::format("tensor '{}': a shape entry must be a non-negative integer", name));
      e.shape.push_back(static_cast<int64_t>(*d));
    }
    if (!jo.is_array() || jo.size() != 2)
      corrupt_value(header, path, at / "data_offsets",
                    fmt::format("tensor '{}': data_offsets is not [begin, end]", name));
    const std::optional<uint64_t> begin = as_size(jo[0]), end = as_size(jo[1]);
    if (!begin || !end)
      corrupt_value(header, path, at / "data_offsets" / size_t{begin ? 1u : 0u},
                    fmt::format("tensor '{}': data_offsets {} must be a non-negative integer", name,
                                begin ? "end" : "begin"));
    e.begin = *begin;
    e.end = *end;
    uint64_t expect;
    if (!base::try_nbytes(e.shape, dtype_size(e.dtype), &expect))
      corrupt_value(header, path, at / "shape",
                    fmt::format("tensor '{}': shape {} of {} holds more than 2^63 - 1 bytes "
                                "(its dimensions multiply past 64 bits)",
                                name, shape_str(e.shape), jd.get<std::string>()));
    if (e.end < e.begin || e.end - e.begin != expect)
      corrupt_value(header, path, at / "data_offsets",
                    fmt::format("tensor '{}': data_offsets [{}, {}] hold {} bytes, its dtype and "
                                "shape {} need {}",
                                name, e.begin, e.end, e.end >= e.begin ? e.end - e.begin : 0,
                                shape_str(e.shape), expect));
    if (e.end > data_size)
      throw corrupt(data_start + e.begin,
                    fmt::format("tensor '{}' ends at data byte {} but the file has only {} "
                                "data bytes (truncated?)",
                                name, e.end, data_size));
    entries.push_back(std::move(e));
  }
  std::stable_sort(entries.begin(), entries.end(),
                   [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < entries.size(); ++i)
    if (entries[i].begin < entries[i - 1].end)
      throw corrupt(
          data_start + entries[i].begin,
          fmt::format("tensors '{}' and '{}' overlap", entries[i - 1].name, entries[i].name));

  NamedTensors out;
  for (const Entry& e : entries) {
    Tensor t = ops::empty(e.shape, e.dtype, Device::cpu());
    if (t.nbytes()) {
      in.seekg(static_cast<std::streamoff>(data_start + e.begin));
      in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
      if (!in) throw corrupt(data_start + e.begin, fmt::format("cannot read tensor '{}'", e.name));
    }
    out.emplace_back(e.name, std::move(t));
  }
  return out;
}

}  // namespace tally::nn
