// A safe reader for the pickle subset memory snapshots use: what Python's pickle.dump writes
// for dicts, lists, tuples, strings, bytes, ints, floats, bools and None (protocols 2 to 5,
// PyTorch's `_dump_snapshot`), and what Tally's PickleWriter writes (memory/pickle.h,
// docs/memory-formats.md §2). Classes, functions, persistent ids and every other opcode are
// refused: a pickle that names a class is not data this reader was made for, and loading it
// would run code in Python.
// Limits and errors: docs/notes.md §12.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

namespace tally::inspect {

class PickleValue;

// A list or a tuple's items.
struct PickleList {
  std::vector<PickleValue> items;
  bool shared = false;  // fetched from the memo: no longer appended to
  int height = 1;       // nesting below and including this container
};

// A dict with string keys, in insertion order (a repeated key keeps its first place and
// takes the new value, as in Python).
struct PickleDict {
  std::vector<std::pair<std::string, PickleValue>> items;
  bool shared = false;
  int height = 1;
  // The value of `key`, or nullptr.
  const PickleValue* find(std::string_view key) const;
  // Sets `key` (a new key goes last).
  void set(std::string key, PickleValue value);

 private:
  // Key -> position in items, kept once the dict outgrows a linear search.
  std::unordered_map<std::string, size_t> index_;
};

class PickleValue {
 public:
  enum class Type : uint8_t { none, boolean, integer, floating, string, bytes, list, tuple, dict };

  PickleValue() = default;  // None
  static PickleValue boolean(bool v);
  static PickleValue integer(int64_t v);
  static PickleValue floating(double v);
  static PickleValue string(std::string s);
  static PickleValue bytes(std::string s);
  static PickleValue list(std::shared_ptr<PickleList> l);
  static PickleValue tuple(std::shared_ptr<PickleList> t);
  static PickleValue dict(std::shared_ptr<PickleDict> d);

  Type type() const { return type_; }
  bool is_none() const { return type_ == Type::none; }
  bool is_bool() const { return type_ == Type::boolean; }
  bool is_int() const { return type_ == Type::integer; }
  bool is_float() const { return type_ == Type::floating; }
  bool is_string() const { return type_ == Type::string; }
  bool is_bytes() const { return type_ == Type::bytes; }
  bool is_list() const { return type_ == Type::list; }
  bool is_tuple() const { return type_ == Type::tuple; }
  bool is_dict() const { return type_ == Type::dict; }

  // The value; std::logic_error when the type differs (check it first).
  bool as_bool() const;
  int64_t as_int() const;
  double as_float() const;
  const std::string& as_string() const;             // string or bytes
  const std::vector<PickleValue>& as_list() const;  // list or tuple items
  const PickleDict& as_dict() const;

  // The shared container behind a list, tuple or dict (nullptr otherwise): equal pointers are
  // the same object, so a walker can cache what it derived from a shared frames list.
  const void* identity() const;
  // Nesting height: 0 for scalars and strings, 1 + the deepest child for containers.
  int height() const;

  // Python's name of the type ("int", "str", "list", "dict", ...), for error messages.
  std::string_view type_name() const;
  // The same with its article, for sentences: "an int", "a str", "None".
  std::string a_type_name() const;

 private:
  friend class Unpickler;
  using Value =
      std::variant<std::monostate, bool, int64_t, double, std::shared_ptr<const std::string>,
                   std::shared_ptr<PickleList>, std::shared_ptr<PickleDict>>;
  PickleValue(Type type, Value v) : type_(type), v_(std::move(v)) {}
  Type type_ = Type::none;
  Value v_;
};

// Deep equality (a DAG is compared as the tree it stands for; keep inputs small).
bool operator==(const PickleValue& a, const PickleValue& b);

struct UnpickleLimits {
  int max_depth = 256;  // nesting of containers and of MARKs
};

class UnpickleError : public std::runtime_error {
 public:
  UnpickleError(const std::string& message, size_t offset)
      : std::runtime_error(message), offset_(offset) {}
  // The byte offset of the opcode at fault (the input's size when it ends too early).
  size_t offset() const { return offset_; }

 private:
  size_t offset_;
};

// Decodes one pickle. `name` starts every error message (a file name; "<buffer>" by default).
// Bytes after STOP are an error (a snapshot is one pickle). Throws UnpickleError.
PickleValue unpickle(std::string_view bytes, std::string_view name = "<buffer>",
                     const UnpickleLimits& limits = {});

// Reads and decodes `path`. Throws std::runtime_error naming the path when it cannot be read,
// UnpickleError when it is not a pickle this reader takes.
PickleValue unpickle_file(const std::string& path, const UnpickleLimits& limits = {});

// Python's name of an opcode byte ("BINUNICODE"), or "unknown".
std::string_view pickle_opcode_name(uint8_t op);

}  // namespace tally::inspect
