// PickleWriter: a streaming encoder for the subset of Python's pickle protocol 2 that
// PyTorch's memory viewer reads (docs/memory-formats.md §2): None, bools, ints, floats,
// str, lists, dicts, tuples of 0 or 2 items, and memo references. Snapshots are written
// with it so they open unchanged in `pickle.load`, `torch.cuda._memory_viz` and
// pytorch.org/memory_viz. Nothing else of pickle (classes, bytes, protocol 4+ framing) is
// needed, so none of it is here.
// Encoding details: docs/notes.md §13.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace tally::memory {

class PickleWriter {
 public:
  // Items per MARK batch, as CPython's pickler.
  static constexpr size_t kBatchSize = 1000;

  // Writes the PROTO 2 header to `out`. `out` must outlive the writer.
  explicit PickleWriter(std::ostream& out);
  PickleWriter(const PickleWriter&) = delete;
  PickleWriter& operator=(const PickleWriter&) = delete;
  // Does not write STOP: a writer destroyed before finish() leaves an incomplete pickle.
  ~PickleWriter() = default;

  // ---- scalars
  void none();
  void boolean(bool v);
  // Any integer type that fits in int64 (unsigned values above INT64_MAX throw
  // std::out_of_range; cast to int64_t first to get PyTorch's "SIZE_MAX is -1").
  template <std::integral T>
  void integer(T v) {
    if constexpr (std::is_unsigned_v<T>) {
      if (static_cast<uint64_t>(v) > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        throw std::out_of_range("PickleWriter: unsigned integer does not fit in int64");
      }
    }
    write_int(static_cast<int64_t>(v));
  }
  void integer(bool) = delete;  // use boolean()
  void floating(double v);
  // UTF-8 text; invalid UTF-8 is replaced by U+FFFD so the pickle always loads.
  void string(std::string_view s);
  // As string(), but each distinct string is written once; repeats are memo references.
  void memo_string(std::string_view s);

  // ---- containers. A non-empty memo_key remembers the container for write_ref().
  void begin_list(std::string_view memo_key = {});
  void end_list();
  // Inside a dict, values alternate key (key(), string() or memo_string()) and value.
  void begin_dict(std::string_view memo_key = {});
  void end_dict();
  // A dict key: memo_string() that also checks a key is expected here.
  void key(std::string_view k);
  // Tuples of 0 or 2 items (EMPTY_TUPLE, TUPLE2): all the snapshot format needs. A tuple
  // is built after its items, so its memo key is given at the end.
  void begin_tuple();
  void end_tuple(std::string_view memo_key = {});

  // ---- references to memoized containers
  // True if a container was memoized under `memo_key`.
  bool has_ref(std::string_view memo_key) const;
  // Writes a reference (BINGET) to the container memoized under `memo_key` and returns
  // true; returns false and writes nothing when there is none.
  bool write_ref(std::string_view memo_key);

  // Writes STOP and flushes. Exactly one complete top-level value must have been written.
  void finish();

  // Memo entries used so far (strings and containers).
  size_t memo_size() const { return next_memo_; }
  // Bytes produced so far, including what is still buffered.
  size_t bytes_written() const { return flushed_ + buf_.size(); }

 private:
  enum class Kind : uint8_t { list, dict, tuple };
  struct Frame {
    Kind kind;
    bool mark_open = false;  // a MARK batch is open (list/dict)
    size_t in_batch = 0;     // values in the open batch (dict: keys and values)
    size_t items = 0;        // values written into this container in total
  };

  void write_int(int64_t v);
  void write_unicode(std::string_view s);
  void write_memo_get(uint32_t idx);
  uint32_t write_memo_put();
  void put_memo_op(char op_1byte, char op_4byte, uint32_t idx);
  // Called before / after every complete value: open and close MARK batches and check
  // dict key positions. `is_string` says whether the value may serve as a dict key.
  void before_value(bool is_string);
  void after_value();
  void close_batch(Frame& f);
  void expect_open(Kind kind, const char* what) const;
  // A list or dict: its empty-container opcode, then its items in MARK batches.
  void begin_container(Kind kind, char empty_opcode, std::string_view memo_key);
  void end_container(Kind kind, const char* what);
  // Remembers the container just built under memo_key (nothing for an empty key).
  void memoize(std::string_view memo_key);

  void put(char c) { buf_.push_back(c); }
  void put_bytes(const void* p, size_t n);
  void put_le(uint64_t v, int nbytes);
  void maybe_flush();
  void flush();

  std::ostream& out_;
  std::string buf_;
  size_t flushed_ = 0;
  std::vector<Frame> stack_;
  bool top_written_ = false;
  bool finished_ = false;
  uint32_t next_memo_ = 0;
  // Transparent hashing: look up string_views without building a std::string.
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using MemoMap = std::unordered_map<std::string, uint32_t, Hash, std::equal_to<>>;
  MemoMap string_memo_;
  MemoMap ref_memo_;
};

}  // namespace tally::memory
