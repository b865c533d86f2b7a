// key_averages(): the recorded spans grouped by name (and input shapes, or by module
// path), and .table() in the layout of PyTorch's profiler_util.py (docs/memory-formats.md
// §5.3): Name, Self CPU %, Self CPU, CPU total %, CPU total, CPU time avg, [Self CUDA,
// Self CUDA %, CUDA total, CUDA time avg], [CPU Mem, Self CPU Mem, CUDA Mem, Self CUDA Mem],
// # of Calls, [Input Shapes]; footer "Self CPU time total: ...".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "profiler/events.h"

namespace tally::profiler {

// One row (PyTorch's FunctionEventAvg). Times in microseconds, memory in bytes.
struct FunctionEventAvg {
  std::string key;           // op / range name, or module path
  std::string input_shapes;  // "[[8, 16], [32, 16], [32]]" when grouped by shape
  int64_t count = 0;
  double cpu_time_total = 0;       // inclusive
  double self_cpu_time_total = 0;  // exclusive of child ops/ranges
  double cuda_time_total = 0;      // kernels of this op and its children
  double self_cuda_time_total = 0;
  int64_t cpu_memory_usage = 0;  // net bytes allocated inside (incl. children), cpu device
  int64_t self_cpu_memory_usage = 0;
  int64_t cuda_memory_usage = 0;
  int64_t self_cuda_memory_usage = 0;

  double cpu_time() const { return count ? cpu_time_total / count : 0; }
  double cuda_time() const { return count ? cuda_time_total / count : 0; }
};

class EventList {
 public:
  EventList() = default;
  EventList(std::vector<FunctionEventAvg> rows, bool with_cuda, bool with_memory, bool with_shapes);

  const std::vector<FunctionEventAvg>& rows() const { return rows_; }
  size_t size() const { return rows_.size(); }
  const FunctionEventAvg& operator[](size_t i) const { return rows_.at(i); }
  // The row with this key (first match); throws std::out_of_range naming it.
  const FunctionEventAvg& at(const std::string& key) const;

  double self_cpu_time_total() const;   // µs, the footer's figure
  double self_cuda_time_total() const;  // µs

  // sort_by: cpu_time, cuda_time, cpu_time_total, cuda_time_total, self_cpu_time_total,
  // self_cuda_time_total, cpu_memory_usage, cuda_memory_usage, self_cpu_memory_usage,
  // self_cuda_memory_usage, count ("device_" spellings accepted for "cuda_"); descending.
  // row_limit < 0: all rows. Throws std::invalid_argument for an unknown sort key.
  std::string table(const std::string& sort_by = "", int row_limit = 100,
                    int max_name_column_width = 55, int max_shapes_column_width = 80) const;

 private:
  std::vector<FunctionEventAvg> rows_;
  bool with_cuda_ = false, with_memory_ = false, with_shapes_ = false;
};

// Group op and user spans by name (and shapes).
EventList build_key_averages(const ProfileData& data, bool group_by_input_shape);
// Group module spans by module path; CUDA time by the module of the launching op, memory
// by the module open when the allocator event happened (a module's Self CPU Mem is what
// its forward left allocated: its activations and outputs).
EventList build_module_averages(const ProfileData& data);

// PyTorch's cell formats: "12.345us" / "1.234ms" / "1.234s", "12.34 KB" / "-512 B".
std::string format_time_us(double us);
std::string format_memory(int64_t bytes);
std::string format_shapes(const std::vector<std::vector<int64_t>>& shapes);

}  // namespace tally::profiler
