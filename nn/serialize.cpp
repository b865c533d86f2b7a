// safetensors reader and writer, with the small JSON reader/writer the header needs.
#include "nn/serialize.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <stdexcept>
#include <variant>

#include "memory/atomic_file.h"
#include "memory/checked.h"
#include "memory/enum_table.h"
#include "memory/json.h"

namespace tally::nn {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian bytes; a big-endian host needs byte swaps");

namespace {

// safetensors' dtype names, by DType's order.
constexpr const char* kStDtypes[] = {"F32", "F16", "BF16", "F64", "I32", "I64", "BOOL", "U8"};

const char* st_dtype(DType d) {
  return memory::enum_table<DType::uint8>(d, kStDtypes, "?");
}

bool parse_st_dtype(const std::string& s, DType* d) {
  for (size_t i = 0; i < std::size(kStDtypes); ++i)
    if (s == kStDtypes[i]) {
      *d = static_cast<DType>(i);
      return true;
    }
  return false;
}

// ---- a JSON reader for the header: objects, arrays, strings, integers, literals ----
struct JValue;
using JObject = std::vector<std::pair<std::string, JValue>>;
using JArray = std::vector<JValue>;
struct JValue {
  std::variant<std::nullptr_t, bool, double, std::string, JArray, JObject> v;
  size_t offset = 0;  // file byte offset where the value starts
};

class JsonReader {
 public:
  JsonReader(const std::string& text, size_t base, const std::string& path)
      : s_(text), base_(base), path_(path) {}

  JValue parse_document() {
    JValue v = value();
    ws();
    if (i_ != s_.size()) fail("trailing characters after the JSON header");
    return v;
  }

  [[noreturn]] void fail(const std::string& what) const { fail_at(base_ + i_, what); }
  [[noreturn]] void fail_at(size_t off, const std::string& what) const {
    throw std::runtime_error(
        fmt::format("load_safetensors: {}: corrupt header at byte {}: {}", path_, off, what));
  }

 private:
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t'))
      ++i_;
  }
  // Skips `c` when it is next.
  bool consume(char c) {
    if (i_ >= s_.size() || s_[i_] != c) return false;
    ++i_;
    return true;
  }
  // The comma-separated items of an object or array, after its opening bracket and up to
  // its `close`; `item` reads one.
  template <typename Item>
  void items(char close, Item item) {
    ws();
    if (consume(close)) return;
    for (;;) {
      item();
      ws();
      if (consume(',')) continue;
      if (consume(close)) return;
      fail(fmt::format("expected ',' or '{}'", close));
    }
  }
  JValue value() {
    if (++depth_ > 64) fail("JSON nested too deeply");
    ws();
    if (i_ >= s_.size()) fail("unexpected end of the JSON header");
    JValue out;
    out.offset = base_ + i_;
    const char c = s_[i_];
    if (c == '{') {
      ++i_;
      JObject obj;
      items('}', [&] {
        ws();
        if (i_ >= s_.size() || s_[i_] != '"') fail("expected a string key");
        std::string key = string();
        ws();
        if (!consume(':')) fail("expected ':'");
        obj.emplace_back(std::move(key), value());
      });
      out.v = std::move(obj);
    } else if (c == '[') {
      ++i_;
      JArray arr;
      items(']', [&] { arr.push_back(value()); });
      out.v = std::move(arr);
    } else if (c == '"') {
      out.v = string();
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      size_t j = i_;
      if (s_[j] == '-') ++j;
      while (j < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[j])) || s_[j] == '.' ||
                               s_[j] == 'e' || s_[j] == 'E' || s_[j] == '+' || s_[j] == '-'))
        ++j;
      const std::string num = s_.substr(i_, j - i_);
      char* end = nullptr;
      const double d = std::strtod(num.c_str(), &end);
      if (end != num.c_str() + num.size()) fail("bad number '" + num + "'");
      out.v = d;
      i_ = j;
    } else if (s_.compare(i_, 4, "true") == 0) {
      out.v = true, i_ += 4;
    } else if (s_.compare(i_, 5, "false") == 0) {
      out.v = false, i_ += 5;
    } else if (s_.compare(i_, 4, "null") == 0) {
      out.v = nullptr, i_ += 4;
    } else {
      fail(fmt::format("unexpected character '{}'", c));
    }
    --depth_;
    return out;
  }
  std::string string() {
    ++i_;  // opening quote
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) break;
      const char e = s_[i_++];
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          if (i_ + 4 > s_.size()) fail("truncated \\u escape");
          uint32_t cp = static_cast<uint32_t>(std::stoul(s_.substr(i_, 4), nullptr, 16));
          i_ += 4;
          if (cp >= 0xD800 && cp <= 0xDBFF && i_ + 6 <= s_.size() && s_[i_] == '\\' &&
              s_[i_ + 1] == 'u') {
            const uint32_t lo =
                static_cast<uint32_t>(std::stoul(s_.substr(i_ + 2, 4), nullptr, 16));
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            i_ += 6;
          }
          // UTF-8 encode
          if (cp < 0x80) {
            out += static_cast<char>(cp);
          } else if (cp < 0x800) {
            out += static_cast<char>(0xC0 | (cp >> 6));
            out += static_cast<char>(0x80 | (cp & 0x3F));
          } else if (cp < 0x10000) {
            out += static_cast<char>(0xE0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
          } else {
            out += static_cast<char>(0xF0 | (cp >> 18));
            out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
          }
          break;
        }
        default:
          fail(fmt::format("bad escape '\\{}'", e));
      }
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;  // closing quote
    return out;
  }

  const std::string& s_;
  size_t base_;
  const std::string& path_;
  size_t i_ = 0;
  int depth_ = 0;
};

int64_t as_uint(const JsonReader& r, const JValue& v, const std::string& what) {
  const double* d = std::get_if<double>(&v.v);
  // The range first: converting a double past int64 to int64 is undefined.
  if (!d || !(*d >= 0 && *d <= 9.0e15) || *d != static_cast<double>(static_cast<int64_t>(*d)))
    r.fail_at(v.offset, what + " must be a non-negative integer");
  return static_cast<int64_t>(*d);
}

}  // namespace

void save_safetensors(const std::string& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::set<std::string> names;
  std::string header = "{";
  bool first = true;
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool f = true;
    for (const auto& [k, v] : metadata) {
      header += (f ? "" : ",") + memory::json_quote(k) + ":" + memory::json_quote(v);
      f = false;
    }
    header += "}";
    first = false;
  }
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
    std::string shape = "[";
    for (int64_t d = 0; d < c.dim(); ++d) shape += (d ? "," : "") + std::to_string(c.size(d));
    shape += "]";
    header +=
        fmt::format("{}{}:{{\"dtype\":\"{}\",\"shape\":{},\"data_offsets\":[{},{}]}}",
                    first ? "" : ",", memory::json_quote(name), st_dtype(c.dtype()), shape, offset,
                    memory::checked_add(offset, uint64_t{c.nbytes()}, "save_safetensors"));
    first = false;
    offset += c.nbytes();
    cpu.push_back(c);
  }
  header += "}";
  while ((8 + header.size()) % 8 != 0) header += ' ';  // align the data to 8 bytes

  // Atomic: a write cut short (disk full, a file-size limit) leaves the previous file intact.
  memory::write_file_atomic(
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

  JsonReader reader(header, 8, path);
  const JValue doc = reader.parse_document();
  const JObject* root = std::get_if<JObject>(&doc.v);
  if (!root) reader.fail_at(8, "the header is not a JSON object");

  struct Entry {
    std::string name;
    DType dtype;
    Shape shape;
    uint64_t begin, end;
  };
  std::vector<Entry> entries;
  std::set<std::string> seen;
  for (const auto& [name, v] : *root) {
    if (!seen.insert(name).second)
      reader.fail_at(v.offset, fmt::format("duplicate tensor name '{}'", name));
    const JObject* obj = std::get_if<JObject>(&v.v);
    if (name == "__metadata__") {
      if (!obj) reader.fail_at(v.offset, "__metadata__ is not an object");
      for (const auto& [k, mv] : *obj) {
        const std::string* s = std::get_if<std::string>(&mv.v);
        if (!s)
          reader.fail_at(mv.offset, fmt::format("__metadata__ value for '{}' is not a string", k));
        if (metadata) (*metadata)[k] = *s;
      }
      continue;
    }
    if (!obj) reader.fail_at(v.offset, fmt::format("entry '{}' is not an object", name));
    const JValue *jd = nullptr, *js = nullptr, *jo = nullptr;
    for (const auto& [k, f] : *obj) {
      if (k == "dtype")
        jd = &f;
      else if (k == "shape")
        js = &f;
      else if (k == "data_offsets")
        jo = &f;
    }
    if (!jd || !js || !jo)
      reader.fail_at(v.offset, fmt::format("tensor '{}' lacks dtype, shape or data_offsets", name));
    Entry e;
    e.name = name;
    const std::string* ds = std::get_if<std::string>(&jd->v);
    if (!ds || !parse_st_dtype(*ds, &e.dtype))
      reader.fail_at(jd->offset, fmt::format("tensor '{}': unsupported dtype {}", name,
                                             ds ? "'" + *ds + "'" : std::string("(not a string)")));
    const JArray* sa = std::get_if<JArray>(&js->v);
    if (!sa) reader.fail_at(js->offset, fmt::format("tensor '{}': shape is not an array", name));
    for (const JValue& d : *sa)
      e.shape.push_back(as_uint(reader, d, "tensor '" + name + "': a shape entry"));
    const JArray* oa = std::get_if<JArray>(&jo->v);
    if (!oa || oa->size() != 2)
      reader.fail_at(jo->offset,
                     fmt::format("tensor '{}': data_offsets is not [begin, end]", name));
    e.begin = static_cast<uint64_t>(as_uint(reader, (*oa)[0], "data_offsets begin"));
    e.end = static_cast<uint64_t>(as_uint(reader, (*oa)[1], "data_offsets end"));
    uint64_t expect;
    if (!memory::try_nbytes(e.shape, dtype_size(e.dtype), &expect))
      reader.fail_at(js->offset,
                     fmt::format("tensor '{}': shape {} of {} holds more than 2^63 - 1 bytes "
                                 "(its dimensions multiply past 64 bits)",
                                 name, shape_str(e.shape), *ds));
    if (e.end < e.begin || e.end - e.begin != expect)
      reader.fail_at(jo->offset,
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
  std::sort(entries.begin(), entries.end(),
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
