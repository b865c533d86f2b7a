// The pickle reader of unpickle.h: a loop over opcodes with Python's stack and MARK stack,
// every read bounded by the bytes left, every container's nesting counted.
#include "inspect/unpickle.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <unordered_map>

#include "base/checked.h"
#include "base/enum_table.h"

namespace tally::inspect {

// ---- PickleDict, PickleValue

namespace {
constexpr size_t kLinearSearchMax = 16;  // dicts up to this size are searched in order
}  // namespace

const PickleValue* PickleDict::find(std::string_view key) const {
  if (items.size() <= kLinearSearchMax || index_.empty()) {
    for (const auto& [k, v] : items)
      if (k == key) return &v;
    return nullptr;
  }
  auto it = index_.find(std::string(key));
  return it == index_.end() ? nullptr : &items[it->second].second;
}

void PickleDict::set(std::string key, PickleValue value) {
  if (items.size() <= kLinearSearchMax) {
    for (auto& [k, v] : items) {
      if (k == key) {
        v = std::move(value);
        return;
      }
    }
  } else {
    if (index_.empty())
      for (size_t i = 0; i < items.size(); ++i) index_.emplace(items[i].first, i);
    if (auto it = index_.find(key); it != index_.end()) {
      items[it->second].second = std::move(value);
      return;
    }
    index_.emplace(key, items.size());
  }
  items.emplace_back(std::move(key), std::move(value));
}

PickleValue PickleValue::boolean(bool v) {
  return {Type::boolean, v};
}

PickleValue PickleValue::integer(int64_t v) {
  return {Type::integer, v};
}

PickleValue PickleValue::floating(double v) {
  return {Type::floating, v};
}

PickleValue PickleValue::string(std::string s) {
  return {Type::string, std::make_shared<const std::string>(std::move(s))};
}

PickleValue PickleValue::bytes(std::string s) {
  return {Type::bytes, std::make_shared<const std::string>(std::move(s))};
}

PickleValue PickleValue::list(std::shared_ptr<PickleList> l) {
  return {Type::list, std::move(l)};
}

PickleValue PickleValue::tuple(std::shared_ptr<PickleList> t) {
  return {Type::tuple, std::move(t)};
}

PickleValue PickleValue::dict(std::shared_ptr<PickleDict> d) {
  return {Type::dict, std::move(d)};
}

namespace {
[[noreturn]] void wrong_type(const PickleValue& v, const char* wanted) {
  throw std::logic_error(
      fmt::format("PickleValue: a {} read as {}", v.type_name(), std::string_view(wanted)));
}
}  // namespace

bool PickleValue::as_bool() const {
  if (type_ != Type::boolean) wrong_type(*this, "bool");
  return std::get<bool>(v_);
}

int64_t PickleValue::as_int() const {
  if (type_ != Type::integer) wrong_type(*this, "int");
  return std::get<int64_t>(v_);
}

double PickleValue::as_float() const {
  if (type_ != Type::floating) wrong_type(*this, "float");
  return std::get<double>(v_);
}

const std::string& PickleValue::as_string() const {
  if (type_ != Type::string && type_ != Type::bytes) wrong_type(*this, "str");
  return *std::get<std::shared_ptr<const std::string>>(v_);
}

const std::vector<PickleValue>& PickleValue::as_list() const {
  if (type_ != Type::list && type_ != Type::tuple) wrong_type(*this, "list");
  return std::get<std::shared_ptr<PickleList>>(v_)->items;
}

const PickleDict& PickleValue::as_dict() const {
  if (type_ != Type::dict) wrong_type(*this, "dict");
  return *std::get<std::shared_ptr<PickleDict>>(v_);
}

const void* PickleValue::identity() const {
  if (type_ == Type::list || type_ == Type::tuple)
    return std::get<std::shared_ptr<PickleList>>(v_).get();
  if (type_ == Type::dict) return std::get<std::shared_ptr<PickleDict>>(v_).get();
  return nullptr;
}

int PickleValue::height() const {
  if (type_ == Type::list || type_ == Type::tuple)
    return std::get<std::shared_ptr<PickleList>>(v_)->height;
  if (type_ == Type::dict) return std::get<std::shared_ptr<PickleDict>>(v_)->height;
  return 0;
}

std::string_view PickleValue::type_name() const {
  static constexpr std::string_view kNames[] = {"None",  "bool", "int",   "float", "str",
                                                "bytes", "list", "tuple", "dict"};
  return base::enum_table<Type::dict>(type_, kNames, std::string_view("?"));
}

std::string PickleValue::a_type_name() const {
  if (type_ == Type::none) return "None";
  return std::string(type_ == Type::integer ? "an " : "a ") + std::string(type_name());
}

bool operator==(const PickleValue& a, const PickleValue& b) {
  if (a.type() != b.type()) return false;
  if (a.identity() != nullptr && a.identity() == b.identity()) return true;
  switch (a.type()) {
    case PickleValue::Type::none:
      return true;
    case PickleValue::Type::boolean:
      return a.as_bool() == b.as_bool();
    case PickleValue::Type::integer:
      return a.as_int() == b.as_int();
    case PickleValue::Type::floating:
      // Bitwise, so that NaN equals the NaN it was written from.
      return std::bit_cast<uint64_t>(a.as_float()) == std::bit_cast<uint64_t>(b.as_float());
    case PickleValue::Type::string:
    case PickleValue::Type::bytes:
      return a.as_string() == b.as_string();
    case PickleValue::Type::list:
    case PickleValue::Type::tuple:
      return a.as_list() == b.as_list();
    case PickleValue::Type::dict:
      return a.as_dict().items == b.as_dict().items;
  }
  return false;
}

// ---- opcodes

namespace {

namespace op {
constexpr uint8_t MARK = '(', STOP = '.', POP = '0', POP_MARK = '1', DUP = '2', FLOAT = 'F',
                  INT = 'I', BININT = 'J', BININT1 = 'K', LONG = 'L', BININT2 = 'M', NONE = 'N',
                  PERSID = 'P', BINPERSID = 'Q', REDUCE = 'R', STRING = 'S', BINSTRING = 'T',
                  SHORT_BINSTRING = 'U', UNICODE = 'V', BINUNICODE = 'X', APPEND = 'a', BUILD = 'b',
                  GLOBAL = 'c', DICT = 'd', EMPTY_DICT = '}', APPENDS = 'e', GET = 'g',
                  BINGET = 'h', INST = 'i', LONG_BINGET = 'j', LIST = 'l', EMPTY_LIST = ']',
                  OBJ = 'o', PUT = 'p', BINPUT = 'q', LONG_BINPUT = 'r', SETITEM = 's', TUPLE = 't',
                  EMPTY_TUPLE = ')', SETITEMS = 'u', BINFLOAT = 'G', BINBYTES = 'B',
                  SHORT_BINBYTES = 'C', PROTO = 0x80, NEWOBJ = 0x81, EXT1 = 0x82, EXT2 = 0x83,
                  EXT4 = 0x84, TUPLE1 = 0x85, TUPLE2 = 0x86, TUPLE3 = 0x87, NEWTRUE = 0x88,
                  NEWFALSE = 0x89, LONG1 = 0x8a, LONG4 = 0x8b, SHORT_BINUNICODE = 0x8c,
                  BINUNICODE8 = 0x8d, BINBYTES8 = 0x8e, EMPTY_SET = 0x8f, ADDITEMS = 0x90,
                  FROZENSET = 0x91, NEWOBJ_EX = 0x92, STACK_GLOBAL = 0x93, MEMOIZE = 0x94,
                  FRAME = 0x95, BYTEARRAY8 = 0x96, NEXT_BUFFER = 0x97, READONLY_BUFFER = 0x98;
}  // namespace op

struct OpName {
  uint8_t code;
  const char* name;
};

constexpr OpName kOpNames[] = {
    {op::MARK, "MARK"},
    {op::STOP, "STOP"},
    {op::POP, "POP"},
    {op::POP_MARK, "POP_MARK"},
    {op::DUP, "DUP"},
    {op::FLOAT, "FLOAT"},
    {op::INT, "INT"},
    {op::BININT, "BININT"},
    {op::BININT1, "BININT1"},
    {op::LONG, "LONG"},
    {op::BININT2, "BININT2"},
    {op::NONE, "NONE"},
    {op::PERSID, "PERSID"},
    {op::BINPERSID, "BINPERSID"},
    {op::REDUCE, "REDUCE"},
    {op::STRING, "STRING"},
    {op::BINSTRING, "BINSTRING"},
    {op::SHORT_BINSTRING, "SHORT_BINSTRING"},
    {op::UNICODE, "UNICODE"},
    {op::BINUNICODE, "BINUNICODE"},
    {op::APPEND, "APPEND"},
    {op::BUILD, "BUILD"},
    {op::GLOBAL, "GLOBAL"},
    {op::DICT, "DICT"},
    {op::EMPTY_DICT, "EMPTY_DICT"},
    {op::APPENDS, "APPENDS"},
    {op::GET, "GET"},
    {op::BINGET, "BINGET"},
    {op::INST, "INST"},
    {op::LONG_BINGET, "LONG_BINGET"},
    {op::LIST, "LIST"},
    {op::EMPTY_LIST, "EMPTY_LIST"},
    {op::OBJ, "OBJ"},
    {op::PUT, "PUT"},
    {op::BINPUT, "BINPUT"},
    {op::LONG_BINPUT, "LONG_BINPUT"},
    {op::SETITEM, "SETITEM"},
    {op::TUPLE, "TUPLE"},
    {op::EMPTY_TUPLE, "EMPTY_TUPLE"},
    {op::SETITEMS, "SETITEMS"},
    {op::BINFLOAT, "BINFLOAT"},
    {op::BINBYTES, "BINBYTES"},
    {op::SHORT_BINBYTES, "SHORT_BINBYTES"},
    {op::PROTO, "PROTO"},
    {op::NEWOBJ, "NEWOBJ"},
    {op::EXT1, "EXT1"},
    {op::EXT2, "EXT2"},
    {op::EXT4, "EXT4"},
    {op::TUPLE1, "TUPLE1"},
    {op::TUPLE2, "TUPLE2"},
    {op::TUPLE3, "TUPLE3"},
    {op::NEWTRUE, "NEWTRUE"},
    {op::NEWFALSE, "NEWFALSE"},
    {op::LONG1, "LONG1"},
    {op::LONG4, "LONG4"},
    {op::SHORT_BINUNICODE, "SHORT_BINUNICODE"},
    {op::BINUNICODE8, "BINUNICODE8"},
    {op::BINBYTES8, "BINBYTES8"},
    {op::EMPTY_SET, "EMPTY_SET"},
    {op::ADDITEMS, "ADDITEMS"},
    {op::FROZENSET, "FROZENSET"},
    {op::NEWOBJ_EX, "NEWOBJ_EX"},
    {op::STACK_GLOBAL, "STACK_GLOBAL"},
    {op::MEMOIZE, "MEMOIZE"},
    {op::FRAME, "FRAME"},
    {op::BYTEARRAY8, "BYTEARRAY8"},
    {op::NEXT_BUFFER, "NEXT_BUFFER"},
    {op::READONLY_BUFFER, "READONLY_BUFFER"},
};

}  // namespace

std::string_view pickle_opcode_name(uint8_t code) {
  for (const OpName& o : kOpNames)
    if (o.code == code) return o.name;
  return "unknown";
}

// ---- the reader

class Unpickler {
 public:
  Unpickler(std::string_view in, std::string_view name, const UnpickleLimits& limits)
      : in_(in), name_(name), limits_(limits) {}

  PickleValue run() {
    if (in_.empty()) throw UnpickleError(fmt::format("{}: empty file: not a pickle", name_), 0);
    while (pos_ < in_.size()) {
      at_ = pos_;
      code_ = static_cast<uint8_t>(in_[pos_++]);
      if (code_ == op::STOP) return stop();
      step();
    }
    throw UnpickleError(
        fmt::format("{}: the pickle ends at byte {} without STOP (the file is truncated)", name_,
                    in_.size()),
        in_.size());
  }

 private:
  // "<name>: byte N: opcode X (0xNN): <what>"
  [[noreturn]] void fail(const std::string& what) const {
    throw UnpickleError(fmt::format("{}: byte {}: opcode {} (0x{:02x}): {}", name_, at_,
                                    pickle_opcode_name(code_), code_, what),
                        at_);
  }

  // The next n bytes of the opcode's argument (`what` names it), or an error when the input
  // ends first.
  std::string_view take(uint64_t n, const char* what) {
    const size_t left = in_.size() - pos_;
    if (n > left)
      fail(fmt::format("truncated: {} needs {} bytes, {} left (the file ends at byte {})", what, n,
                       left, in_.size()));
    std::string_view s = in_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }

  uint64_t take_le(int n, const char* what) {
    const std::string_view b = take(static_cast<uint64_t>(n), what);
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(b[static_cast<size_t>(i)]);
    return v;
  }

  // The first stack index above the innermost MARK.
  size_t frame_start() const { return marks_.empty() ? 0 : marks_.back(); }

  void push(PickleValue v) { stack_.push_back(std::move(v)); }

  PickleValue pop(const char* what) {
    if (stack_.size() <= frame_start())
      fail(fmt::format("needs {} on the stack, and the stack is empty{}", what,
                       marks_.empty() ? "" : " above the last MARK"));
    PickleValue v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }

  PickleValue& top(const char* what) {
    if (stack_.size() <= frame_start())
      fail(fmt::format("needs {} on the stack, and the stack is empty{}", what,
                       marks_.empty() ? "" : " above the last MARK"));
    return stack_.back();
  }

  // The items above the innermost MARK, and the MARK removed.
  std::vector<PickleValue> pop_mark() {
    if (marks_.empty()) fail("no MARK to close");
    const size_t start = marks_.back();
    marks_.pop_back();
    std::vector<PickleValue> items(std::make_move_iterator(stack_.begin() + start),
                                   std::make_move_iterator(stack_.end()));
    stack_.resize(start);
    return items;
  }

  void check_height(int h) {
    if (h > limits_.max_depth)
      fail(fmt::format("containers nest more than {} deep", limits_.max_depth));
  }

  int height_of(const std::vector<PickleValue>& items) {
    int h = 1;
    for (const PickleValue& v : items) h = std::max(h, v.height() + 1);
    check_height(h);
    return h;
  }

  PickleValue make_tuple(std::vector<PickleValue> items) {
    auto t = std::make_shared<PickleList>();
    t->height = height_of(items);
    t->items = std::move(items);
    return PickleValue::tuple(std::move(t));
  }

  PickleList& list_target(PickleValue& v) {
    if (!v.is_list()) fail(fmt::format("appends to {}, expected a list", v.a_type_name()));
    auto& l = *std::get<std::shared_ptr<PickleList>>(v.v_);
    if (l.shared)
      fail("appends to a list already referenced from the memo (a recursive structure: refused)");
    return l;
  }

  PickleDict& dict_target(PickleValue& v) {
    if (!v.is_dict()) fail(fmt::format("sets items of {}, expected a dict", v.a_type_name()));
    auto& d = *std::get<std::shared_ptr<PickleDict>>(v.v_);
    if (d.shared)
      fail(
          "sets items of a dict already referenced from the memo (a recursive structure: refused)");
    return d;
  }

  void append(PickleList& l, PickleValue item) {
    const int h = item.height() + 1;
    check_height(h);
    l.height = std::max(l.height, h);
    l.items.push_back(std::move(item));
  }

  void set_item(PickleDict& d, PickleValue key, PickleValue value) {
    if (!key.is_string())
      fail(fmt::format("a dict key is {}; only str keys are supported", key.a_type_name()));
    const int h = value.height() + 1;
    check_height(h);
    d.height = std::max(d.height, h);
    d.set(key.as_string(), std::move(value));
  }

  void memo_put(uint64_t index) {
    const PickleValue& v = top("a value to memoize");
    memo_.insert_or_assign(index, v);
  }

  void memo_get(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) fail(fmt::format("memo index {} was never stored", index));
    PickleValue v = it->second;
    // A fetched container is shared from now on: appending to it could make a cycle.
    if (v.is_list() || v.is_tuple()) std::get<std::shared_ptr<PickleList>>(v.v_)->shared = true;
    if (v.is_dict()) std::get<std::shared_ptr<PickleDict>>(v.v_)->shared = true;
    push(std::move(v));
  }

  // SHORT_BINUNICODE, BINUNICODE, BINUNICODE8 and their BINBYTES twins: the length in 1, 4
  // or 8 bytes, then the UTF-8 string or the bytes.
  void text() {
    const bool bytes =
        code_ == op::SHORT_BINBYTES || code_ == op::BINBYTES || code_ == op::BINBYTES8;
    const int width = code_ == op::SHORT_BINUNICODE || code_ == op::SHORT_BINBYTES ? 1
                      : code_ == op::BINUNICODE8 || code_ == op::BINBYTES8         ? 8
                                                                                   : 4;
    const uint64_t n = take_le(width, bytes ? "the bytes' length" : "the string's length");
    std::string s(take(n, bytes ? "the bytes" : "the string"));
    push(bytes ? PickleValue::bytes(std::move(s)) : PickleValue::string(std::move(s)));
  }

  // A little-endian two's complement integer of n bytes (LONG1, LONG4) as int64.
  void long_int(uint64_t n) {
    const std::string_view b = take(n, "the integer");
    if (n == 0) {
      push(PickleValue::integer(0));
      return;
    }
    // Bytes above the eighth must only repeat the sign of the eighth.
    const bool negative = static_cast<uint8_t>(b[n - 1]) & 0x80;
    const size_t used = std::min<size_t>(n, 8);
    for (size_t i = used; i < n; ++i)
      if (static_cast<uint8_t>(b[i]) != (negative ? 0xFF : 0x00))
        fail(fmt::format("a {}-byte integer does not fit in 64 bits", n));
    uint64_t u = 0;
    for (size_t i = used; i-- > 0;) u = (u << 8) | static_cast<uint8_t>(b[i]);
    if (used < 8 && negative) u |= ~uint64_t{0} << (8 * used);  // sign-extend
    if (n > 8 && (static_cast<uint8_t>(b[7]) & 0x80) != (negative ? 0x80 : 0))
      fail(fmt::format("a {}-byte integer does not fit in 64 bits", n));
    push(PickleValue::integer(static_cast<int64_t>(u)));
  }

  PickleValue stop() {
    if (!marks_.empty()) fail(fmt::format("{} MARK(s) left open", marks_.size()));
    if (stack_.size() != 1)
      fail(fmt::format("expects one value on the stack, found {}", stack_.size()));
    if (pos_ != in_.size())
      fail(fmt::format("{} bytes follow STOP (the file holds more than one pickle, or garbage)",
                       in_.size() - pos_));
    return std::move(stack_.back());
  }

  void step() {
    switch (code_) {
      case op::PROTO: {
        const auto proto = take_le(1, "the protocol number");
        if (proto > 5) fail(fmt::format("protocol {} is newer than 5", proto));
        return;
      }
      case op::FRAME:
        // The frame's length is a hint for buffering; the opcodes inside are read as usual.
        if (const uint64_t n = take_le(8, "the frame length"); n > in_.size() - pos_)
          fail(
              fmt::format("truncated: the frame holds {} bytes, {} left (the file ends at byte {})",
                          n, in_.size() - pos_, in_.size()));
        return;
      case op::MARK:
        if (marks_.size() >= static_cast<size_t>(limits_.max_depth))
          fail(fmt::format("MARKs nest more than {} deep", limits_.max_depth));
        marks_.push_back(stack_.size());
        return;
      case op::POP:
        if (stack_.size() > frame_start())
          stack_.pop_back();
        else
          pop_mark();
        return;
      case op::POP_MARK:
        pop_mark();
        return;
      case op::NONE:
        push(PickleValue());
        return;
      case op::NEWTRUE:
      case op::NEWFALSE:
        push(PickleValue::boolean(code_ == op::NEWTRUE));
        return;
      case op::BININT:
        push(PickleValue::integer(static_cast<int32_t>(take_le(4, "the integer"))));
        return;
      case op::BININT1:  // unsigned, 1 or 2 bytes
      case op::BININT2:
        push(PickleValue::integer(
            static_cast<int64_t>(take_le(code_ == op::BININT1 ? 1 : 2, "the integer"))));
        return;
      case op::LONG1:
        long_int(take_le(1, "the integer's length"));
        return;
      case op::LONG4: {
        const auto n = static_cast<int32_t>(take_le(4, "the integer's length"));
        if (n < 0) fail(fmt::format("negative integer length {}", n));
        long_int(static_cast<uint64_t>(n));
        return;
      }
      case op::BINFLOAT: {
        const std::string_view b = take(8, "the float");
        uint64_t bits = 0;
        for (char c : b) bits = (bits << 8) | static_cast<uint8_t>(c);  // big-endian
        push(PickleValue::floating(std::bit_cast<double>(bits)));
        return;
      }
      case op::SHORT_BINUNICODE:
      case op::BINUNICODE:
      case op::BINUNICODE8:
      case op::SHORT_BINBYTES:
      case op::BINBYTES:
      case op::BINBYTES8:
        text();
        return;
      case op::EMPTY_LIST:
        push(PickleValue::list(std::make_shared<PickleList>()));
        return;
      case op::EMPTY_DICT:
        push(PickleValue::dict(std::make_shared<PickleDict>()));
        return;
      case op::EMPTY_TUPLE:
        push(make_tuple({}));
        return;
      case op::TUPLE1:
      case op::TUPLE2:
      case op::TUPLE3: {
        const size_t n = code_ - op::TUPLE1 + 1;
        if (stack_.size() < frame_start() + n)
          fail(fmt::format("needs {} values on the stack, found {}", n,
                           stack_.size() - frame_start()));
        std::vector<PickleValue> items(std::make_move_iterator(stack_.end() - n),
                                       std::make_move_iterator(stack_.end()));
        stack_.resize(stack_.size() - n);
        push(make_tuple(std::move(items)));
        return;
      }
      case op::TUPLE:
        push(make_tuple(pop_mark()));
        return;
      case op::LIST: {
        auto l = std::make_shared<PickleList>();
        std::vector<PickleValue> items = pop_mark();
        l->height = height_of(items);
        l->items = std::move(items);
        push(PickleValue::list(std::move(l)));
        return;
      }
      case op::DICT: {
        std::vector<PickleValue> items = pop_mark();
        if (items.size() % 2 != 0) fail("an odd number of values after MARK (a key without value)");
        auto d = std::make_shared<PickleDict>();
        for (size_t i = 0; i < items.size(); i += 2)
          set_item(*d, std::move(items[i]), std::move(items[i + 1]));
        push(PickleValue::dict(std::move(d)));
        return;
      }
      case op::APPEND: {
        PickleValue item = pop("the item to append");
        append(list_target(top("the list to append to")), std::move(item));
        return;
      }
      case op::APPENDS: {
        std::vector<PickleValue> items = pop_mark();
        PickleList& l = list_target(top("the list to append to"));
        for (PickleValue& v : items) append(l, std::move(v));
        return;
      }
      case op::SETITEM: {
        PickleValue value = pop("the value");
        PickleValue key = pop("the key");
        set_item(dict_target(top("the dict")), std::move(key), std::move(value));
        return;
      }
      case op::SETITEMS: {
        std::vector<PickleValue> items = pop_mark();
        if (items.size() % 2 != 0) fail("an odd number of values after MARK (a key without value)");
        PickleDict& d = dict_target(top("the dict"));
        for (size_t i = 0; i < items.size(); i += 2)
          set_item(d, std::move(items[i]), std::move(items[i + 1]));
        return;
      }
      case op::MEMOIZE:
        memo_put(memo_.size());
        return;
      case op::BINPUT:  // the index in 1 byte, LONG_ in 4
      case op::LONG_BINPUT:
        memo_put(take_le(code_ == op::BINPUT ? 1 : 4, "the memo index"));
        return;
      case op::BINGET:
      case op::LONG_BINGET:
        memo_get(take_le(code_ == op::BINGET ? 1 : 4, "the memo index"));
        return;
      case op::GLOBAL:
      case op::STACK_GLOBAL:
      case op::REDUCE:
      case op::BUILD:
      case op::INST:
      case op::OBJ:
      case op::NEWOBJ:
      case op::NEWOBJ_EX:
      case op::EXT1:
      case op::EXT2:
      case op::EXT4:
      case op::PERSID:
      case op::BINPERSID:
        fail(
            "classes, functions and persistent ids are not supported: this pickle holds Python "
            "objects, not the plain dicts and lists of a memory snapshot");
      default:
        break;
    }
    if (pickle_opcode_name(code_) == "unknown")
      fail("not a pickle opcode (the file is not a pickle, or it is corrupt)");
    fail(
        "not supported: memory snapshots use protocol 2-5 binary opcodes for dicts, lists, "
        "tuples, strings, numbers and None only");
  }

  std::string_view in_;
  std::string_view name_;
  UnpickleLimits limits_;
  size_t pos_ = 0;
  size_t at_ = 0;     // offset of the current opcode
  uint8_t code_ = 0;  // the current opcode
  std::vector<PickleValue> stack_;
  std::vector<size_t> marks_;  // stack sizes at each open MARK
  std::unordered_map<uint64_t, PickleValue> memo_;
};

PickleValue unpickle(std::string_view bytes, std::string_view name, const UnpickleLimits& limits) {
  return Unpickler(bytes, name, limits).run();
}

PickleValue unpickle_file(const std::string& path, const UnpickleLimits& limits) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))  // (an ifstream reads a folder as an empty file)
    throw std::runtime_error(fmt::format("{}: is a directory, not a file", path));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad())
    throw std::runtime_error(fmt::format("{}: cannot read: {}", path, std::strerror(errno)));
  const std::string bytes = std::move(ss).str();
  return unpickle(bytes, path, limits);
}

}  // namespace tally::inspect
