#include "memory/pickle.h"

#include <bit>
#include <cstring>

namespace tally::memory {
namespace {

// Opcodes of docs/memory-formats.md §2 (names as in CPython's pickletools).
constexpr char kProto = '\x80';
constexpr char kStop = '.';
constexpr char kNone = 'N';
constexpr char kNewTrue = '\x88';
constexpr char kNewFalse = '\x89';
constexpr char kBinInt1 = 'K';
constexpr char kBinInt2 = 'M';
constexpr char kBinInt = 'J';
constexpr char kLong1 = '\x8a';
constexpr char kBinFloat = 'G';
constexpr char kBinUnicode = 'X';
constexpr char kEmptyList = ']';
constexpr char kEmptyDict = '}';
constexpr char kEmptyTuple = ')';
constexpr char kMark = '(';
constexpr char kAppends = 'e';
constexpr char kSetItems = 'u';
constexpr char kTuple2 = '\x86';
constexpr char kBinPut = 'q';
constexpr char kLongBinPut = 'r';
constexpr char kBinGet = 'h';
constexpr char kLongBinGet = 'j';

constexpr size_t kFlushAt = size_t{1} << 16;

// Length of the valid UTF-8 sequence starting at s[i], or 0 if it is invalid (bad lead
// byte, truncated, overlong, surrogate or above U+10FFFF).
size_t utf8_sequence_length(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  size_t n;
  uint32_t cp;
  if ((c & 0xE0) == 0xC0) {
    n = 2;
    cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3;
    cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(k) & 0x3F);
  }
  static constexpr uint32_t kMinForLength[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMinForLength[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

bool is_ascii(std::string_view s) {
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  }
  return true;
}

// `s` with every invalid UTF-8 byte replaced by U+FFFD.
std::string sanitize_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  for (size_t i = 0; i < s.size();) {
    const size_t n = utf8_sequence_length(s, i);
    if (n == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  return out;
}

}  // namespace

PickleWriter::PickleWriter(std::ostream& out) : out_(out) {
  buf_.reserve(kFlushAt + 1024);
  put(kProto);
  put('\x02');
}

// ---- byte output

void PickleWriter::put_bytes(const void* p, size_t n) {
  buf_.append(static_cast<const char*>(p), n);
}

void PickleWriter::put_le(uint64_t v, int nbytes) {
  for (int i = 0; i < nbytes; ++i) put(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void PickleWriter::maybe_flush() {
  if (buf_.size() >= kFlushAt) flush();
}

void PickleWriter::flush() {
  out_.write(buf_.data(), static_cast<std::streamsize>(buf_.size()));
  flushed_ += buf_.size();
  buf_.clear();
}

// ---- memo

// A memo opcode and its index: the 1-byte form below 256, the 4-byte form above.
void PickleWriter::put_memo_op(char op_1byte, char op_4byte, uint32_t idx) {
  if (idx < 256) {
    put(op_1byte);
    put(static_cast<char>(idx));
  } else {
    put(op_4byte);
    put_le(idx, 4);
  }
}

uint32_t PickleWriter::write_memo_put() {
  const uint32_t idx = next_memo_++;
  put_memo_op(kBinPut, kLongBinPut, idx);
  return idx;
}

void PickleWriter::write_memo_get(uint32_t idx) {
  put_memo_op(kBinGet, kLongBinGet, idx);
}

// ---- structure bookkeeping

void PickleWriter::before_value(bool is_string) {
  if (finished_) throw std::logic_error("PickleWriter: value written after finish()");
  if (stack_.empty()) {
    if (top_written_) throw std::logic_error("PickleWriter: more than one top-level value");
    return;
  }
  Frame& f = stack_.back();
  if (f.kind == Kind::dict && f.items % 2 == 0 && !is_string) {
    throw std::logic_error("PickleWriter: dict keys must be strings");
  }
  if (f.kind != Kind::tuple && !f.mark_open) {
    put(kMark);
    f.mark_open = true;
    f.in_batch = 0;
  }
}

void PickleWriter::after_value() {
  maybe_flush();
  if (stack_.empty()) {
    top_written_ = true;
    return;
  }
  Frame& f = stack_.back();
  ++f.items;
  if (f.kind == Kind::tuple) return;
  ++f.in_batch;
  const size_t per_item = f.kind == Kind::dict ? 2 : 1;
  if (f.in_batch == kBatchSize * per_item) close_batch(f);
}

void PickleWriter::close_batch(Frame& f) {
  if (!f.mark_open) return;
  put(f.kind == Kind::dict ? kSetItems : kAppends);
  f.mark_open = false;
  f.in_batch = 0;
}

void PickleWriter::expect_open(Kind kind, const char* what) const {
  if (stack_.empty() || stack_.back().kind != kind) {
    throw std::logic_error(std::string("PickleWriter: ") + what + " without a matching begin");
  }
}

// ---- scalars

void PickleWriter::none() {
  before_value(false);
  put(kNone);
  after_value();
}

void PickleWriter::boolean(bool v) {
  before_value(false);
  put(v ? kNewTrue : kNewFalse);
  after_value();
}

void PickleWriter::write_int(int64_t v) {
  before_value(false);
  if (v >= 0 && v <= 0xFF) {
    put(kBinInt1);
    put_le(static_cast<uint64_t>(v), 1);
  } else if (v >= 0 && v <= 0xFFFF) {
    put(kBinInt2);
    put_le(static_cast<uint64_t>(v), 2);
  } else if (v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max()) {
    put(kBinInt);
    put_le(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
  } else {
    // Shortest two's complement little-endian form: drop high bytes that only repeat the
    // sign, keeping one whose top bit still carries it (so 2^63-1 takes 8 bytes and
    // 2^31 takes 5: 00 00 00 80 00).
    const auto u = static_cast<uint64_t>(v);
    int n = 8;
    while (n > 1) {
      const auto top = static_cast<uint8_t>(u >> (8 * (n - 1)));
      const auto next = static_cast<uint8_t>(u >> (8 * (n - 2)));
      const bool redundant = (top == 0x00 && !(next & 0x80)) || (top == 0xFF && (next & 0x80));
      if (!redundant) break;
      --n;
    }
    put(kLong1);
    put(static_cast<char>(n));
    put_le(u, n);
  }
  after_value();
}

void PickleWriter::floating(double v) {
  before_value(false);
  put(kBinFloat);
  const auto bits = std::bit_cast<uint64_t>(v);
  for (int i = 7; i >= 0; --i) put(static_cast<char>((bits >> (8 * i)) & 0xFF));
  after_value();
}

void PickleWriter::write_unicode(std::string_view s) {
  if (!is_ascii(s)) {
    const std::string clean = sanitize_utf8(s);
    if (clean != s) {
      write_unicode(clean);
      return;
    }
  }
  if (s.size() > std::numeric_limits<uint32_t>::max()) {
    throw std::out_of_range("PickleWriter: string longer than 4 GiB");
  }
  put(kBinUnicode);
  put_le(s.size(), 4);
  put_bytes(s.data(), s.size());
}

void PickleWriter::string(std::string_view s) {
  before_value(true);
  write_unicode(s);
  after_value();
}

void PickleWriter::memo_string(std::string_view s) {
  before_value(true);
  if (auto it = string_memo_.find(s); it != string_memo_.end()) {
    write_memo_get(it->second);
  } else {
    write_unicode(s);
    string_memo_.emplace(std::string(s), write_memo_put());
  }
  after_value();
}

void PickleWriter::key(std::string_view k) {
  if (stack_.empty() || stack_.back().kind != Kind::dict || stack_.back().items % 2 != 0) {
    throw std::logic_error("PickleWriter: key() where no dict key is expected");
  }
  memo_string(k);
}

// ---- containers

void PickleWriter::memoize(std::string_view memo_key) {
  if (!memo_key.empty()) ref_memo_.insert_or_assign(std::string(memo_key), write_memo_put());
}

void PickleWriter::begin_container(Kind kind, char empty_opcode, std::string_view memo_key) {
  before_value(false);
  put(empty_opcode);
  memoize(memo_key);
  stack_.push_back(Frame{kind});
}

void PickleWriter::end_container(Kind kind, const char* what) {
  expect_open(kind, what);
  if (kind == Kind::dict && stack_.back().items % 2 != 0)
    throw std::logic_error("PickleWriter: dict key without value");
  close_batch(stack_.back());
  stack_.pop_back();
  after_value();
}

void PickleWriter::begin_list(std::string_view memo_key) {
  begin_container(Kind::list, kEmptyList, memo_key);
}

void PickleWriter::end_list() {
  end_container(Kind::list, "end_list()");
}

void PickleWriter::begin_dict(std::string_view memo_key) {
  begin_container(Kind::dict, kEmptyDict, memo_key);
}

void PickleWriter::end_dict() {
  end_container(Kind::dict, "end_dict()");
}

void PickleWriter::begin_tuple() {
  before_value(false);
  stack_.push_back(Frame{Kind::tuple});
}

void PickleWriter::end_tuple(std::string_view memo_key) {
  expect_open(Kind::tuple, "end_tuple()");
  switch (stack_.back().items) {
    case 0:
      put(kEmptyTuple);
      break;
    case 2:
      put(kTuple2);
      break;
    default:
      throw std::logic_error("PickleWriter: only tuples of 0 or 2 items are supported");
  }
  memoize(memo_key);
  stack_.pop_back();
  after_value();
}

bool PickleWriter::has_ref(std::string_view memo_key) const {
  return ref_memo_.find(memo_key) != ref_memo_.end();
}

bool PickleWriter::write_ref(std::string_view memo_key) {
  auto it = ref_memo_.find(memo_key);
  if (it == ref_memo_.end()) return false;
  before_value(false);
  write_memo_get(it->second);
  after_value();
  return true;
}

void PickleWriter::finish() {
  if (finished_) throw std::logic_error("PickleWriter: finish() called twice");
  if (!stack_.empty()) throw std::logic_error("PickleWriter: finish() with an open container");
  if (!top_written_) throw std::logic_error("PickleWriter: finish() before any value");
  put(kStop);
  finished_ = true;
  flush();
  out_.flush();
}

}  // namespace tally::memory
