// The pickle reader (inspect/unpickle.h): what Tally's PickleWriter writes reads back
// exactly; what Python writes (protocols 2-5) and PyTorch's own snapshots
// (tests/memory/fixtures/torch211-*.pickle) read back as Python reads them (a canonical text
// of both sides compared); truncated input at every cut, foreign pickles and bad opcodes are
// UnpickleErrors naming the file, the byte offset and the opcode; recursion and deep nesting are
// refused; shared references stay shared.
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <sstream>

#include "inspect/unpickle.h"
#include "memory/pickle.h"
#include "testing/files.h"
#include "testing/pickle_tuples.h"

namespace tally::memory {
using namespace tally::inspect;
namespace {

namespace fs = std::filesystem;

using namespace tally::testing;

std::string hex(std::string_view s) {
  static const char* d = "0123456789abcdef";
  std::string h;
  for (unsigned char c : s) {
    h += d[c >> 4];
    h += d[c & 15];
  }
  return h;
}

// The canonical text both sides print: ints in decimal, floats as their bits, strings and
// bytes as hex, containers in order.
std::string canonical(const PickleValue& v) {
  switch (v.type()) {
    case PickleValue::Type::none:
      return "N";
    case PickleValue::Type::boolean:
      return v.as_bool() ? "T" : "F";
    case PickleValue::Type::integer:
      return std::to_string(v.as_int());
    case PickleValue::Type::floating: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "f%016llx",
                    static_cast<unsigned long long>(std::bit_cast<uint64_t>(v.as_float())));
      return buf;
    }
    case PickleValue::Type::string:
      return "s" + hex(v.as_string());
    case PickleValue::Type::bytes:
      return "b" + hex(v.as_string());
    case PickleValue::Type::list:
    case PickleValue::Type::tuple: {
      std::string s = v.is_list() ? "[" : "(";
      for (const PickleValue& x : v.as_list()) s += canonical(x) + ",";
      return s + (v.is_list() ? "]" : ")");
    }
    case PickleValue::Type::dict: {
      std::string s = "{";
      for (const auto& [k, x] : v.as_dict().items) s += "s" + hex(k) + ":" + canonical(x) + ",";
      return s + "}";
    }
  }
  return "?";
}

constexpr const char* kPythonCanonical = R"PY(
import pickle, struct, sys
def c(v):
    if v is None: return "N"
    if v is True: return "T"
    if v is False: return "F"
    if isinstance(v, int): return str(v)
    if isinstance(v, float): return "f" + struct.pack(">d", v).hex()
    if isinstance(v, str): return "s" + v.encode("utf-8", "surrogatepass").hex()
    if isinstance(v, bytes): return "b" + v.hex()
    if isinstance(v, list): return "[" + "".join(c(x) + "," for x in v) + "]"
    if isinstance(v, tuple): return "(" + "".join(c(x) + "," for x in v) + ")"
    if isinstance(v, dict): return "{" + "".join("s" + k.encode().hex() + ":" + c(x) + "," for k, x in v.items()) + "}"
    raise TypeError(type(v))
sys.stdout.write(c(pickle.load(open(sys.argv[1], "rb"))))
)PY";

// Python's canonical text of the pickle in `file`.
std::string python_canonical(const fs::path& file) {
  return run_python(kPythonCanonical, file.string());
}

UnpickleError error_of(std::string_view bytes, std::string_view name = "<buffer>") {
  try {
    unpickle(bytes, name);
  } catch (const UnpickleError& e) {
    return e;
  }
  ADD_FAILURE() << "no error for " << hex(bytes);
  return UnpickleError("", 0);
}

// ---- Tally's writer

std::string tally_pickle() {
  std::ostringstream out;
  PickleWriter w(out);
  w.begin_dict();
  w.key("ints");
  w.begin_list();
  for (int64_t v :
       {int64_t{0}, int64_t{255}, int64_t{256}, int64_t{65535}, int64_t{65536}, int64_t{-1},
        int64_t{std::numeric_limits<int32_t>::min()}, int64_t{std::numeric_limits<int32_t>::max()},
        int64_t{1} << 31, -(int64_t{1} << 31) - 1, std::numeric_limits<int64_t>::max(),
        std::numeric_limits<int64_t>::min()})
    w.integer(v);
  w.end_list();
  w.key("floats");
  w.begin_list();
  w.floating(1.5);
  w.floating(-0.0);
  w.floating(std::numeric_limits<double>::infinity());
  w.end_list();
  w.key("misc");
  w.begin_list();
  w.none();
  w.boolean(true);
  w.boolean(false);
  w.memo_string("frame");
  w.memo_string("frame");
  w.string("\xc3\xa9t\xc3\xa9");
  testing::write_both_tuple_sizes(w);
  w.end_list();
  w.key("shared");
  w.begin_list();
  w.begin_list("F");
  w.integer(7);
  w.end_list();
  w.write_ref("F");
  w.end_list();
  w.key("many");  // more than one MARK batch
  w.begin_list();
  for (int i = 0; i < 2500; ++i) w.integer(i);
  w.end_list();
  w.end_dict();
  w.finish();
  return out.str();
}

TEST(Unpickle, ReadsWhatTallysWriterWrites) {
  const PickleValue v = unpickle(tally_pickle());
  ASSERT_TRUE(v.is_dict());
  const PickleDict& d = v.as_dict();
  ASSERT_EQ(d.items.size(), 5u);
  EXPECT_EQ(d.items[0].first, "ints");
  const auto& ints = d.find("ints")->as_list();
  const std::vector<int64_t> want = {0,
                                     255,
                                     256,
                                     65535,
                                     65536,
                                     -1,
                                     std::numeric_limits<int32_t>::min(),
                                     std::numeric_limits<int32_t>::max(),
                                     int64_t{1} << 31,
                                     -(int64_t{1} << 31) - 1,
                                     std::numeric_limits<int64_t>::max(),
                                     std::numeric_limits<int64_t>::min()};
  ASSERT_EQ(ints.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(ints[i].as_int(), want[i]) << i;
  const auto& floats = d.find("floats")->as_list();
  EXPECT_EQ(floats[0].as_float(), 1.5);
  EXPECT_TRUE(std::signbit(floats[1].as_float()));
  EXPECT_TRUE(std::isinf(floats[2].as_float()));
  const auto& misc = d.find("misc")->as_list();
  ASSERT_EQ(misc.size(), 8u);
  EXPECT_TRUE(misc[0].is_none());
  EXPECT_TRUE(misc[1].as_bool());
  EXPECT_FALSE(misc[2].as_bool());
  EXPECT_EQ(misc[3].as_string(), "frame");
  EXPECT_EQ(misc[4].as_string(), "frame");
  EXPECT_EQ(misc[5].as_string(), "\xc3\xa9t\xc3\xa9");
  EXPECT_TRUE(misc[6].is_tuple());
  EXPECT_TRUE(misc[6].as_list().empty());
  ASSERT_TRUE(misc[7].is_tuple());
  EXPECT_EQ(misc[7].as_list().size(), 2u);
  // A memo reference is the same list, not a copy.
  const auto& shared = d.find("shared")->as_list();
  ASSERT_EQ(shared.size(), 2u);
  EXPECT_EQ(shared[0].identity(), shared[1].identity());
  EXPECT_EQ(shared[1].as_list()[0].as_int(), 7);
  const auto& many = d.find("many")->as_list();
  ASSERT_EQ(many.size(), 2500u);
  EXPECT_EQ(many[2499].as_int(), 2499);
  EXPECT_EQ(v.height(), 3);  // dict > list > list
  // Python reads the same thing.
  const fs::path p = temp_file("tally_unpickle_writer") += ".pickle";
  write_file(p, tally_pickle());
  EXPECT_EQ(python_canonical(p), canonical(v));
}

// ---- Python's pickles, protocols 2 to 5, and PyTorch's snapshots

TEST(Unpickle, ReadsPythonProtocols2To5) {
  const std::string make = R"PY(
import pickle, sys
shared = [7]
obj = {"segments": [], "ints": [0, 1, -1, 255, 256, 65535, 65536, -2**31, 2**31 - 1, 2**31,
       2**63 - 1, -2**63], "floats": [1.5, -0.0, float("inf"), 1e-300], "flags": [True, False, None],
       "text": ["x", "x", "\u00e9t\u00e9", "", "a" * 300], "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)],
       "nested": {"k": [[], {}]}, "shared": [shared, shared], "big": list(range(2500)),
       "bigdict": {str(i): i for i in range(40)}}
p = int(sys.argv[2])
if p >= 3:
    obj["bytes"] = [b"by", b"", b"x" * 300]
pickle.dump(obj, open(sys.argv[1], "wb"), protocol=p)
)PY";
  for (int proto = 2; proto <= 5; ++proto) {
    SCOPED_TRACE("protocol " + std::to_string(proto));
    const fs::path p = temp_file("tally_unpickle_p" + std::to_string(proto)) += ".pickle";
    run_python(make, p.string() + " " + std::to_string(proto));
    ASSERT_FALSE(::testing::Test::HasFailure());
    const PickleValue v = unpickle_file(p.string());
    EXPECT_EQ(canonical(v), python_canonical(p));
    EXPECT_EQ(v.as_dict().find("bigdict")->as_dict().find("39")->as_int(), 39);
    const auto& shared = v.as_dict().find("shared")->as_list();
    EXPECT_EQ(shared[0].identity(), shared[1].identity());
  }
}

TEST(Unpickle, ReadsPyTorchSnapshotsAsPythonDoes) {
  for (const char* name :
       {"torch211-snapshot-expandable.pickle", "torch211-snapshot-oom-segfree.pickle",
        "torch211-snapshot-pending-free.pickle"}) {
    SCOPED_TRACE(name);
    const PickleValue v = unpickle_file(fixture(name));
    ASSERT_TRUE(v.is_dict());
    EXPECT_TRUE(v.as_dict().find("segments")->is_list());
    EXPECT_FALSE(v.as_dict().find("device_traces")->as_list()[0].as_list().empty());
    EXPECT_EQ(canonical(v), python_canonical(fixture(name)));
  }
}

// ---- errors

TEST(Unpickle, TruncatedInputNamesTheOffsetAndOpcode) {
  const std::string full = read_file(fixture("torch211-snapshot-pending-free.pickle"));
  for (size_t cut : {size_t{1}, size_t{2}, size_t{11}, size_t{12}, size_t{100}, full.size() / 2,
                     full.size() - 2, full.size() - 1}) {
    SCOPED_TRACE(cut);
    const UnpickleError e = error_of(std::string_view(full).substr(0, cut), "cut.pickle");
    const std::string msg = e.what();
    EXPECT_TRUE(msg.starts_with("cut.pickle: ")) << msg;
    EXPECT_LE(e.offset(), cut) << msg;
    // Either an opcode whose argument runs past the end, or the end without STOP.
    EXPECT_TRUE(contains(msg, "truncated")) << msg;
    if (e.offset() < cut) {
      EXPECT_TRUE(contains(msg, "byte " + std::to_string(e.offset()) + ": opcode ")) << msg;
    }
  }
  // Every cut of a small pickle is an error, never a crash or a value.
  const std::string small = tally_pickle().substr(0, 400);
  for (size_t cut = 0; cut < small.size(); ++cut) {
    try {
      unpickle(std::string_view(small).substr(0, cut));
      ADD_FAILURE() << "cut " << cut << " read as a value";
    } catch (const UnpickleError& e) {
      EXPECT_TRUE(std::string(e.what()).starts_with("<buffer>: ")) << e.what();
    }
  }
}

TEST(Unpickle, TruncatedFileNamesTheFile) {
  const std::string full = read_file(fixture("torch211-snapshot-expandable.pickle"));
  const fs::path p = temp_file("tally_unpickle_truncated") += ".pickle";
  write_file(p, std::string_view(full).substr(0, 5000));
  try {
    unpickle_file(p.string());
    FAIL();
  } catch (const UnpickleError& e) {
    EXPECT_TRUE(std::string(e.what()).starts_with(p.string() + ": ")) << e.what();
  }
  try {
    unpickle_file((fs::temp_directory_path() / "no-such-tally-file.pickle").string());
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), "no-such-tally-file.pickle: cannot open")) << e.what();
  }
  // A folder is said to be one (issue 54: it read as an empty file).
  try {
    unpickle_file(fs::temp_directory_path().string());
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), "is a directory, not a file")) << e.what();
    EXPECT_FALSE(contains(e.what(), "empty file")) << e.what();
  }
}

TEST(Unpickle, BadOpcodesAreNamed) {
  struct Case {
    std::string bytes;
    size_t offset;
    const char* says;
  };
  using namespace std::string_literals;
  // Protocol 2's header, then `ops`: opcodes with their arguments, in pieces where a letter
  // opcode follows a hex escape.
  const auto proto2 = [](std::initializer_list<std::string> ops) {
    std::string out = "\x80\x02";
    for (const std::string& op : ops) out += op;
    return out;
  };
  const Case cases[] = {
      {""s, 0, "empty file"},
      {"\x80\x06K\x01."s, 0, "opcode PROTO (0x80): protocol 6 is newer than 5"},
      {proto2({"\xff"s}), 2, "opcode unknown (0xff): not a pickle opcode"},
      {proto2({"cos\nsystem\n."s}), 2, "opcode GLOBAL (0x63): classes, functions"},
      {"\x80\x04\x8c\x02osR."s, 6, "opcode REDUCE (0x52)"},
      {proto2({"I12\n."s}), 2, "opcode INT (0x49): not supported"},
      {proto2({"K\x01K\x02."s}), 6, "expects one value on the stack, found 2"},
      {proto2({"K\x01.K"s}), 4, "1 bytes follow STOP"},
      {proto2({"h\x05."s}), 2, "memo index 5 was never stored"},
      {proto2({"}K\x01K\x02s."s}), 7, "a dict key is an int"},
      {proto2({"}(K\x01u."s}), 6, "an odd number of values"},
      {proto2({"K\x01"s, "a."s}), 4, "opcode APPEND (0x61): needs the list to append to"},
      {proto2({"K\x01K\x02"s, "a."s}), 6, "appends to an int"},
      {proto2({"u."s}), 2, "no MARK to close"},
      {proto2({"(K\x01."s}), 5, "1 MARK(s) left open"},
      // 2^64 needs 9 bytes: too large for int64.
      {proto2({"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01."s}), 2, "does not fit in 64 bits"},
      {proto2({"\x8b\xff\xff\xff\xff."s}), 2, "negative integer length"},
      {proto2({"X\x10\x00\x00\x00"s, "abc."s}), 2, "the string needs 16 bytes, 4 left"},
      {"\x80\x04\x95\xff\x00\x00\x00\x00\x00\x00\x00K\x01."s, 2,
       "truncated: the frame holds 255 bytes, 3 left"},
      // A list that contains itself: [] memoized, fetched, appended to itself.
      {proto2({"]q\x00h\x00"s, "a."s}), 7, "a recursive structure: refused"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(hex(c.bytes));
    const UnpickleError e = error_of(c.bytes, "bad.pickle");
    const std::string msg = e.what();
    EXPECT_TRUE(msg.starts_with("bad.pickle: ")) << msg;
    EXPECT_TRUE(contains(msg, c.says)) << msg;
    EXPECT_EQ(e.offset(), c.offset) << msg;
    if (!c.bytes.empty() && c.offset < c.bytes.size()) {
      EXPECT_TRUE(contains(msg, "byte " + std::to_string(c.offset) + ": opcode ")) << msg;
    }
  }
}

TEST(Unpickle, LongIntegersThatFitAreRead) {
  using namespace std::string_literals;
  // 9 bytes whose top byte only repeats the sign: still an int64.
  EXPECT_EQ(unpickle("\x80\x02\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\xff."s).as_int(), -1);
  EXPECT_EQ(unpickle("\x80\x02\x8a\x00."s).as_int(), 0);
  EXPECT_EQ(unpickle("\x80\x02\x8b\x02\x00\x00\x00\x00\x80."s).as_int(), -32768);
  // 2^63 in 9 bytes: the eighth byte's sign bit disagrees with the ninth.
  EXPECT_THROW(unpickle("\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00."s), UnpickleError);
}

TEST(Unpickle, MarkStyleContainersAndBytes) {
  using namespace std::string_literals;
  // MARK ... LIST / TUPLE / DICT, TUPLE1/2/3, SETITEM, APPEND, POP, POP_MARK, SHORT_BINBYTES,
  // BINUNICODE8, as older protocols and other writers use them.
  const std::string p =
      "\x80\x02(K\x01K\x02l"   // [1, 2]
      "(K\x03t"                // (3,)
      "K\x04\x85"              // (4,)
      "K\x05K\x06K\x07\x87"    // (5, 6, 7)
      "(X\x01\x00\x00\x00kNd"  // {"k": None}
      "K\x09"                  // 9, then POP
      "0"
      "(K\x09K\x09"  // MARK 9 9, then POP_MARK
      "1"
      "C\x02hi"                                // b"hi"
      "\x8d\x01\x00\x00\x00\x00\x00\x00\x00z"  // "z"
      "]K\x08"
      "a"  // [8]
      "}X\x01\x00\x00\x00"
      "aK\x01s"              // {"a": 1}
      "\x87\x87\x87\x87."s;  // the last three as a tuple, four times
  EXPECT_EQ(canonical(unpickle(p)),
            "([1,2,],(3,),((4,),(5,6,7,),({s6b:N,},b6869,(s7a,[8,],{s61:1,},),),),)");
  // The same with a value left over, or a TUPLE2 short of values.
  EXPECT_THROW(unpickle(p.substr(0, p.size() - 2) + "."), UnpickleError);
  EXPECT_TRUE(contains(error_of("\x80\x02K\x01\x86."s).what(), "needs 2 values on the stack"));
}

TEST(Unpickle, NestingIsBounded) {
  // 300 lists inside each other, the way the stack machine builds them.
  std::string deep = "\x80\x02";
  for (int i = 0; i < 300; ++i) deep += "]";
  for (int i = 0; i < 299; ++i) deep += "a";
  deep += ".";
  const UnpickleError e = error_of(deep);
  EXPECT_TRUE(contains(e.what(), "containers nest more than 256 deep")) << e.what();
  // 300 MARKs.
  std::string marks = "\x80\x02" + std::string(300, '(') + ".";
  EXPECT_TRUE(contains(error_of(marks).what(), "MARKs nest more than 256 deep"));
  // Depth built through memo references: [[x]] over and over, each level fetched once.
  std::string chain = std::string("\x80\x02]q\x00", 5);
  for (int i = 1; i < 300; ++i) {
    chain += "]h";
    chain += static_cast<char>((i - 1) % 256);
    chain += "aq";
    chain += static_cast<char>(i % 256);
  }
  chain += ".";
  EXPECT_TRUE(contains(error_of(chain).what(), "containers nest more than 256 deep"));
  // 200 levels are fine.
  std::string ok = "\x80\x02";
  for (int i = 0; i < 200; ++i) ok += "]";
  for (int i = 0; i < 199; ++i) ok += "a";
  ok += ".";
  EXPECT_EQ(unpickle(ok).height(), 200);
}

TEST(Unpickle, SharedReferencesDoNotMultiply) {
  // L0 = [1]; Lk = [Lk-1, Lk-1] for 60 levels: 2^60 leaves if copied, 60 lists when shared.
  // Each level is memoized and popped; the next fetches it twice.
  std::string p = std::string(
      "\x80\x02]K\x01"
      "aq\x00",
      8);
  for (int i = 1; i <= 60; ++i) {
    p += "0](h";
    p += static_cast<char>(i - 1);
    p += "h";
    p += static_cast<char>(i - 1);
    p += "eq";
    p += static_cast<char>(i);
  }
  p += ".";
  const PickleValue v = unpickle(p);
  EXPECT_EQ(v.height(), 61);
  EXPECT_EQ(v.as_list()[0].identity(), v.as_list()[1].identity());
}

}  // namespace
}  // namespace tally::memory
