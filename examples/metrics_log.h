// --metrics FILE.jsonl: one JSON object per logged step (JSON Lines), for plotting a run's
// curves without parsing its progress bar. Each record is formed by nlohmann-json; after each
// one the whole file is rewritten through base::write_file_atomic (a temporary file renamed
// into place), so FILE.jsonl always holds every record so far and is never half-written,
// even when the run dies. The records are few (one per --log-every steps).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "base/atomic_file.h"

namespace tally::examples {

class MetricsLog {
 public:
  // "" is off (write does nothing). The programs check the path before training
  // (check_output_file).
  explicit MetricsLog(std::string path) : path_(std::move(path)) {}

  bool enabled() const { return !path_.empty(); }

  // Appends one line (nlohmann keeps the keys sorted) and rewrites the file.
  void write(const nlohmann::json& record) {
    if (path_.empty()) return;
    text_ += record.dump();
    text_ += '\n';
    base::write_file_atomic(path_, text_, "--metrics");
  }

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string text_;
};

}  // namespace tally::examples
