// safetensors: round trips of state dicts and every dtype, tied weights, the Python
// stdlib reader (tests/nn/check_safetensors.py) on our files, clear errors on corrupt
// files, and a save cut short that leaves the previous file intact.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "nn/models/gpt.h"
#include "nn/models/resnet.h"
#include "nn/serialize.h"
#include "testing/file_limit.h"
#include "testing/gradcheck.h"

using namespace tally;
using namespace tally::nn;
using namespace tally::testing;
namespace fs = std::filesystem;

namespace {
fs::path temp_dir() {
  fs::path d = fs::temp_directory_path() / ("tally_nn_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}
std::string load_error(const fs::path& p) {
  return tally::testing::error_of<std::runtime_error>([&] { load_safetensors(p.string()); });
}
}  // namespace

TEST(Safetensors, StateDictRoundTrip) {
  const fs::path file = temp_dir() / "tiny.safetensors";
  auto a = resnet_tiny({.num_classes = 10, .in_channels = 1});
  (*a)(ops::randn({4, 1, 28, 28}));  // move the BN running stats away from 0/1
  save_safetensors(file.string(), a->state_dict(), {{"format", "pt"}, {"model", "resnet_tiny"}});
  std::map<std::string, std::string> meta;
  NamedTensors loaded = load_safetensors(file.string(), &meta);
  EXPECT_EQ(meta.at("format"), "pt");
  EXPECT_EQ(meta.at("model"), "resnet_tiny");
  NamedTensors sd = a->state_dict();
  ASSERT_EQ(loaded.size(), sd.size());
  for (size_t i = 0; i < sd.size(); ++i) {
    EXPECT_EQ(loaded[i].first, sd[i].first);
    EXPECT_EQ(loaded[i].second.dtype(), sd[i].second.dtype()) << sd[i].first;
    EXPECT_EQ(loaded[i].second.sizes(), sd[i].second.sizes());
    EXPECT_EQ(loaded[i].second.tolist(), sd[i].second.tolist()) << sd[i].first;
  }
  auto b = resnet_tiny({.num_classes = 10, .in_channels = 1});
  b->load_state_dict(loaded);
  a->eval();
  b->eval();
  Tensor x = ops::randn({2, 1, 28, 28});
  EXPECT_EQ((*a)(x).tolist(), (*b)(x).tolist());
  // The data section starts 8-byte aligned.
  const std::string raw = read_file(file);
  uint64_t n;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(raw[8], '{');
}

TEST(Safetensors, AllDtypesAndPythonReader) {
  const fs::path dir = temp_dir();
  const fs::path file = dir / "dtypes.safetensors";
  NamedTensors ts;
  const std::vector<double> v{1.5, -2.0, 0.25, 3.0, 0.0, 7.0};
  for (DType d : {DType::float32, DType::float16, DType::bfloat16, DType::float64, DType::int32,
                  DType::int64, DType::bool_})
    ts.emplace_back(std::string("t_") + dtype_name(d), ops::from_vector(v, {2, 3}, d));
  ts.emplace_back("scalar", ops::full({}, 42.0, DType::int64));
  ts.emplace_back("empty", ops::zeros({0, 4}));
  ts.emplace_back("noncontig", ops::transpose(ops::from_vector(v, {2, 3}), 0, 1));
  save_safetensors(file.string(), ts, {{"note", "quote\" and \\ and \xc3\xa9"}});
  std::map<std::string, std::string> meta;
  NamedTensors back = load_safetensors(file.string(), &meta);
  EXPECT_EQ(meta.at("note"), "quote\" and \\ and \xc3\xa9");
  ASSERT_EQ(back.size(), ts.size());
  std::ofstream manifest(dir / "manifest.json");
  manifest << "{";
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_EQ(back[i].first, ts[i].first);
    EXPECT_EQ(back[i].second.dtype(), ts[i].second.dtype());
    EXPECT_EQ(back[i].second.tolist(), ts[i].second.tolist()) << ts[i].first;
    double sum = 0;
    for (double x : ts[i].second.tolist()) sum += x;
    manifest << (i ? "," : "") << "\"" << ts[i].first
             << "\":{\"shape\":" << shape_str(ts[i].second.sizes()) << ",\"sum\":" << sum
             << ",\"first\":" << (ts[i].second.numel() ? ts[i].second.tolist()[0] : 0.0) << "}";
  }
  manifest << "}";
  manifest.close();
  const std::string cmd = std::string(TALLY_PYTHON) + " " + TALLY_SOURCE_DIR +
                          "/tests/nn/check_safetensors.py " + file.string() + " --expect " +
                          (dir / "manifest.json").string();
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

TEST(Safetensors, TiedWeightsSavedUnderBothNames) {
  const fs::path file = temp_dir() / "gpt.safetensors";
  GPT gpt(GPTConfig::preset("tiny"));
  save_safetensors(file.string(), gpt.state_dict());
  NamedTensors back = load_safetensors(file.string());
  int found = 0;
  for (auto& [n, t] : back) found += (n == "lm_head.weight" || n == "transformer.wte.weight");
  EXPECT_EQ(found, 2);
  GPT other(GPTConfig::preset("tiny"));
  other.load_state_dict(back);
  EXPECT_EQ(other.lm_head->weight.tolist(), gpt.lm_head->weight.tolist());
  EXPECT_TRUE(other.lm_head->weight.is_same(other.transformer->wte->weight));
}

TEST(Safetensors, CorruptFilesNameFileAndOffset) {
  const fs::path dir = temp_dir();
  const fs::path good = dir / "good.safetensors";
  save_safetensors(good.string(), {{"a", ops::ones({4})}, {"b", ops::ones({2, 2}, DType::int64)}});
  const std::string raw = read_file(good);
  uint64_t n;
  std::memcpy(&n, raw.data(), 8);

  const fs::path p = dir / "bad.safetensors";
  write_file(p, raw.substr(0, 5));
  std::string e = load_error(p);
  EXPECT_TRUE(contains(e, p.string()) && contains(e, "shorter than the 8-byte")) << e;

  write_file(p, raw.substr(0, raw.size() - 3));
  e = load_error(p);
  EXPECT_TRUE(contains(e, p.string()) && contains(e, "tensor 'b'") && contains(e, "truncated"))
      << e;

  std::string big = raw;
  const uint64_t huge = 1ull << 40;
  std::memcpy(big.data(), &huge, 8);
  write_file(p, big);
  e = load_error(p);
  EXPECT_TRUE(contains(e, "header length") && contains(e, "at byte 0")) << e;

  std::string garbled = raw;
  garbled[8 + 5] = '#';
  write_file(p, garbled);
  e = load_error(p);
  EXPECT_TRUE(contains(e, "corrupt header at byte 13")) << e;

  std::string wrong_dtype = raw;
  const size_t pos = wrong_dtype.find("\"F32\"");
  wrong_dtype.replace(pos, 5, "\"Q32\"");
  write_file(p, wrong_dtype);
  e = load_error(p);
  EXPECT_TRUE(contains(e, "unsupported dtype 'Q32'") && contains(e, "byte " + std::to_string(pos)))
      << e;

  std::string wrong_shape = raw;
  const size_t sp = wrong_shape.find("[4]");
  wrong_shape.replace(sp, 3, "[5]");
  write_file(p, wrong_shape);
  e = load_error(p);
  EXPECT_TRUE(contains(e, "tensor 'a'") && contains(e, "need 20")) << e;

  EXPECT_TRUE(contains(load_error(dir / "does_not_exist.safetensors"), "cannot open"));
}

// A save cut short (RLIMIT_FSIZE in a forked child, standing in for a full disk) fails
// naming the file and leaves the previous weights intact and loadable, with no temporary
// file beside them.
TEST(Safetensors, SaveCutShortKeepsPreviousFile) {
  const fs::path dir = temp_dir() / "cut_short";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path file = dir / "w.safetensors";
  const Tensor good = ops::randn({1000});
  save_safetensors(file.string(), {{"w", good}});
  const std::string before = read_file(file);

  const tally::testing::LimitedRun r = tally::testing::run_with_file_size_limit(64 * 1024, [&] {
    save_safetensors(file.string(), {{"w", ops::randn({200000})}});
  });
  ASSERT_TRUE(r.threw) << "status " << r.status << ": " << r.what;
  EXPECT_TRUE(contains(r.what, "save_safetensors: cannot write '" + file.string() + "'")) << r.what;
  EXPECT_TRUE(contains(r.what, std::strerror(EFBIG))) << r.what;

  EXPECT_EQ(read_file(file), before);
  const NamedTensors loaded = load_safetensors(file.string());
  ASSERT_EQ(loaded.size(), 1u);
  EXPECT_EQ(loaded[0].second.tolist(), good.tolist());
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"w.safetensors"});
}

namespace {
// A safetensors file of `header` (padded to 8 bytes) and `data`.
std::string st_file(std::string header, const std::string& data = "") {
  while (header.size() % 8 != 0) header += ' ';
  const uint64_t n = header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}
}  // namespace

// Shapes whose sizes overflow are corrupt headers naming the file and the shape's byte offset
// (issue 22: [2^32, 2^32] with no data used to load as a tensor of 0 elements).
TEST(Safetensors, OverflowingShapesAreCorruptHeaders) {
  const fs::path p = temp_dir() / "overflow.safetensors";
  const std::string h1 =
      R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})";
  write_file(p, st_file(h1));
  std::string e = load_error(p);
  const std::string at = "corrupt header at byte " + std::to_string(8 + h1.find("[4294967296"));
  EXPECT_TRUE(contains(e, p.string()) && contains(e, at) && contains(e, "tensor 'w'") &&
              contains(e, "[4294967296, 4294967296]") && contains(e, "more than 2^63 - 1 bytes"))
      << e;
  // Elements fit in 63 bits, bytes do not: [2^31, 2^31] of int32 is 2^64 bytes.
  const std::string h2 =
      R"({"__metadata__":{"k":"v"},"i":{"dtype":"I32","shape":[2147483648,2147483648],"data_offsets":[0,0]}})";
  write_file(p, st_file(h2));
  e = load_error(p);
  EXPECT_TRUE(contains(e, p.string()) &&
              contains(e, "at byte " + std::to_string(8 + h2.find("[2147483648"))) &&
              contains(e, "tensor 'i'"))
      << e;
  // Three dimensions that each pass the 9e15 limit on one number but multiply past 2^64.
  const std::string h3 =
      R"({"z":{"dtype":"BOOL","shape":[3000000,3000000,3000000,0],"data_offsets":[0,0]}})";
  write_file(p, st_file(h3));
  e = load_error(p);
  EXPECT_TRUE(contains(e, "at byte " + std::to_string(8 + h3.find("[3000000"))) &&
              contains(e, "tensor 'z'"))
      << e;
}

// Huge shapes that do not wrap: data_offsets must hold shape x dtype bytes, and the bytes
// must be in the file, before anything is allocated.
TEST(Safetensors, HugeShapesAreCheckedAgainstOffsetsAndFileSize) {
  const fs::path p = temp_dir() / "huge.safetensors";
  const std::string h1 = R"({"w":{"dtype":"F32","shape":[1000000,1000000],"data_offsets":[0,16]}})";
  write_file(p, st_file(h1, std::string(16, '\0')));
  std::string e = load_error(p);
  EXPECT_TRUE(contains(e, p.string()) &&
              contains(e, "at byte " + std::to_string(8 + h1.find("\"data_offsets\"") + 15)) &&
              contains(e, "data_offsets [0, 16] hold 16 bytes") &&
              contains(e, "need 4000000000000"))
      << e;
  const std::string h2 =
      R"({"w":{"dtype":"F32","shape":[1000000,1000000],"data_offsets":[0,4000000000000]}})";
  write_file(p, st_file(h2, std::string(16, '\0')));
  e = load_error(p);
  EXPECT_TRUE(contains(e, p.string()) && contains(e, "corrupt file at byte") &&
              contains(e, "ends at data byte 4000000000000") && contains(e, "only 16 data bytes"))
      << e;
  // A valid file of a 0-element tensor with a large other dimension still loads.
  const std::string h3 = R"({"e":{"dtype":"F32","shape":[0,1000000],"data_offsets":[0,0]}})";
  write_file(p, st_file(h3));
  const NamedTensors t = load_safetensors(p.string());
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].second.sizes(), (Shape{0, 1000000}));
}

// The header nlohmann-json forms: compact, in the given order, __metadata__ first, names
// escaped, padded with spaces to align the data to 8 bytes (what safetensors writes and reads).
TEST(Safetensors, HeaderBytes) {
  const fs::path p = temp_dir() / "bytes.safetensors";
  save_safetensors(p.string(),
                   {{"w", ops::ones({2, 3})}, {"a\"b\xc3\xa9", ops::ones({0}, DType::int64)}},
                   {{"format", "pt"}});
  const std::string raw = read_file(p);
  uint64_t n;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  EXPECT_EQ(raw.size(), 8 + n + 24);
  std::string header = raw.substr(8, n);
  while (!header.empty() && header.back() == ' ') header.pop_back();
  EXPECT_EQ(
      header,
      R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
      "\"a\\\"b\xc3\xa9\":{\"dtype\":\"I64\",\"shape\":[0],\"data_offsets\":[24,24]}}");
  const NamedTensors back = load_safetensors(p.string());
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0].first, "w");
  EXPECT_EQ(back[1].first, "a\"b\xc3\xa9");
}

// Names and metadata must be UTF-8 (JSON text is): an error naming the file, nothing written.
TEST(Safetensors, SaveRejectsNamesThatAreNotUtf8) {
  const fs::path p = temp_dir() / "not_utf8.safetensors";
  fs::remove(p);
  std::string e = tally::testing::error_of<std::invalid_argument>([&] {
    save_safetensors(p.string(), {{"w\xff", ops::ones({1})}});
  });
  EXPECT_TRUE(contains(e, p.string()) && contains(e, "tensor name") &&
              contains(e, "not valid UTF-8"))
      << e;
  e = tally::testing::error_of<std::invalid_argument>([&] {
    save_safetensors(p.string(), {{"w", ops::ones({1})}}, {{"k", "\xc3"}});
  });
  EXPECT_TRUE(contains(e, "metadata value") && contains(e, "not valid UTF-8")) << e;
  EXPECT_FALSE(fs::exists(p));
}

// Tensors of zero bytes share their offset with the next tensor: they load in file order.
TEST(Safetensors, EqualOffsetsLoadInFileOrder) {
  const fs::path p = temp_dir() / "ties.safetensors";
  save_safetensors(p.string(),
                   {{"z", ops::zeros({0})}, {"m", ops::zeros({0, 3})}, {"a", ops::ones({2})}});
  const NamedTensors back = load_safetensors(p.string());
  ASSERT_EQ(back.size(), 3u);
  EXPECT_EQ(back[0].first, "z");
  EXPECT_EQ(back[1].first, "m");
  EXPECT_EQ(back[2].first, "a");
}

// Every header error names the file and a byte offset in the file: syntax errors (nlohmann's)
// the byte where the parser stopped, semantic errors the tensor and where its bad value starts.
TEST(Safetensors, HeaderErrorsNameFileTensorAndOffset) {
  const fs::path p = temp_dir() / "header.safetensors";
  auto error = [&](const std::string& header, const std::string& data = "") {
    write_file(p, st_file(header, data));
    return load_error(p);
  };
  // `part` at the byte offset of `at` in `header` (the file's offset: 8 + the index).
  auto at = [](const std::string& header, const std::string& part, size_t from = 0) {
    return "corrupt header at byte " + std::to_string(8 + header.find(part, from)) + ":";
  };
  auto expect = [&](const std::string& e, std::initializer_list<std::string> parts) {
    EXPECT_TRUE(contains(e, "load_safetensors: " + p.string() + ": ")) << e;
    for (const std::string& part : parts) EXPECT_TRUE(contains(e, part)) << part << " in " << e;
  };
  const std::string w = R"("w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})";

  // Syntax.
  std::string h = R"({"a":#})";
  expect(error(h), {at(h, "#"), "syntax error"});
  h = R"({"a\q":1})";
  expect(error(h), {at(h, "q"), "invalid string"});
  h = R"({"w":{"dtype":"F32")";  // cut short: the parser stops at the end of the header
  write_file(p, st_file(h));
  expect(load_error(p), {"corrupt header at byte " + std::to_string(read_file(p).size()) + ":",
                         "unexpected end of input"});
  h = "{" + w + "} x";
  expect(error(h, std::string(4, '\0')), {at(h, "x"), "syntax error"});
  h = "{" + w + ",\"t\":\"\xff\"}";
  expect(error(h, std::string(4, '\0')), {at(h, "\xff"), "invalid string"});
  EXPECT_FALSE(contains(load_error(p), "\xff"));  // the message stays UTF-8
  h = std::string(70, '[') + std::string(70, ']');
  expect(error(h), {"corrupt header at byte 72:", "nested too deeply"});

  // The header's shape.
  expect(error("[1, 2]"), {"corrupt header at byte 8:", "not a JSON object"});
  h = "{" + w + ", \"w\" : {}}";
  expect(error(h, std::string(4, '\0')), {at(h, "\"w\"", 2), "duplicate tensor name 'w'"});
  h = R"({"w": [1]})";
  expect(error(h), {at(h, "[1]"), "entry 'w' is not an object"});
  h = R"({"__metadata__": {"k": "v", "n": 1}})";
  expect(error(h), {at(h, "1"), "__metadata__ value for 'n' is not a string"});

  // A tensor entry's fields.
  h = R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})";
  expect(error(h, std::string(4, '\0')), {at(h, "{", 1), "tensor 'w' lacks shape"});
  h = R"({"w": {"shape": [1], "data_offsets": [0, 4]}})";
  expect(error(h, std::string(4, '\0')), {at(h, "{", 1), "tensor 'w' lacks dtype"});
  h = R"({"w": {"dtype": "F32", "shape": [1]}})";
  expect(error(h, std::string(4, '\0')), {at(h, "{", 1), "tensor 'w' lacks data_offsets"});
  h = R"({"w": {"dtype": 7, "shape": [1], "data_offsets": [0, 4]}})";
  expect(error(h, std::string(4, '\0')),
         {at(h, "7"), "tensor 'w': unsupported dtype (not a string)"});
  h = R"({"w": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}})";
  expect(error(h, std::string(4, '\0')), {at(h, "\"1\""), "tensor 'w': shape is not an array"});
  h = R"({"w": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 4]}})";
  expect(error(h, std::string(4, '\0')),
         {at(h, "-1"), "tensor 'w': a shape entry must be a non-negative integer"});
  h = R"({"w": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}})";
  expect(error(h, std::string(4, '\0')), {at(h, "1.0"), "a shape entry must be"});
  h = R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0 , 4.5 ]}})";
  expect(error(h, std::string(4, '\0')),
         {at(h, "4.5"), "tensor 'w': data_offsets end must be a non-negative integer"});
  h = R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [9223372036854775808, 4]}})";
  expect(error(h, std::string(4, '\0')),
         {at(h, "9223"), "tensor 'w': data_offsets begin must be a non-negative integer"});
  h = R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}})";
  expect(error(h, std::string(4, '\0')),
         {at(h, "[0"), "tensor 'w': data_offsets is not [begin, end]"});
  // Escaped names: the offsets still count the header's bytes.
  h = R"({"a\"\u00e9": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})";
  expect(error(h, std::string(4, '\0')),
         {at(h, "[4"), "tensor 'a\"\xc3\xa9': data_offsets [4, 0] hold 0 bytes"});

  // The data section.
  h = R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
          "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}})";
  expect(error(h, std::string(8, '\0')), {"corrupt file at byte", "tensors 'a' and 'b' overlap"});
  h = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  expect(error(h, std::string(4, '\0')), {"tensor 'a' ends at data byte 8", "only 4 data bytes"});
}

// nlohmann's exceptions other than parse_error (a number out of a double's range:
// out_of_range.406) are corrupt headers too, naming the file, the tensor and the number's byte.
TEST(Safetensors, NumberOverflowNamesFileTensorAndOffset) {
  const fs::path p = temp_dir() / "overflow_number.safetensors";
  const std::string h = R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 1e400]}})";
  write_file(p, st_file(h, std::string(4, '\0')));
  const std::string e = load_error(p);
  EXPECT_TRUE(contains(e, "load_safetensors: " + p.string() + ": ")) << e;
  EXPECT_TRUE(contains(e, "corrupt header at byte " + std::to_string(8 + h.find("1e400")) + ":"))
      << e;
  EXPECT_TRUE(contains(e, "tensor 'w': number overflow parsing '1e400'")) << e;
  EXPECT_FALSE(contains(e, "json.exception")) << e;
  const std::string m = R"({"__metadata__": {"k": "v"}, "x": -1e999})";
  write_file(p, st_file(m));
  const std::string e2 = load_error(p);
  EXPECT_TRUE(contains(e2, "corrupt header at byte " + std::to_string(8 + m.find("-1e999")) + ":"))
      << e2;
  EXPECT_TRUE(contains(e2, "tensor 'x': number overflow")) << e2;
  // A folder is said to be one.
  EXPECT_TRUE(contains(load_error(temp_dir()), "is a directory, not a file"));
}
