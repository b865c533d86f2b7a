// An output folder written whole or not at all: the A/B runner's (ab/ab.h) report folder.
#pragma once

#include <fcntl.h>
#include <fmt/format.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace tally::ab {

// An output folder written whole or not at all (ab_memory --out, ab::run's Options::out): the run
// writes into a fresh folder next to it ("<out>.tmpXXXXXX", path()), and commit() swaps that folder
// into place (renameat2's RENAME_EXCHANGE, else: rename the old folder away, the new one in), then
// removes the old one. A run that fails leaves the old report whole and removes its own
// folder. What the old folder holds besides `is_output(name)` entries (a nested report, the
// user's own files) moves into the new one first. Where no folder can be made beside `out`
// (".", a mount point under a read-only folder), path() is `out` itself, as before.
class StagedOutputDir {
 public:
  StagedOutputDir(const std::string& out, std::function<bool(const std::string&)> is_output)
      : out_(out), path_(out), is_output_(std::move(is_output)) {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path real = fs::canonical(out, ec);  // a symbolic link: its folder is replaced
    if (ec || real.filename().empty() || real == real.root_path()) return;
    std::string name = real.string() + ".tmpXXXXXX";
    if (!::mkdtemp(name.data())) return;
    real_ = real.string();
    path_ = std::move(name);
  }
  ~StagedOutputDir() {
    if (!committed_ && path_ != out_) {
      std::error_code ec;
      std::filesystem::remove_all(path_, ec);
    }
  }
  StagedOutputDir(const StagedOutputDir&) = delete;
  StagedOutputDir& operator=(const StagedOutputDir&) = delete;

  // Where the run writes.
  const std::string& path() const { return path_; }
  // `p` (under path()) as it will be named once committed (under `out`): for what the run
  // prints and records.
  std::string shown(const std::string& p) const {
    if (path_ == out_ || !p.starts_with(path_)) return p;
    return out_ + p.substr(path_.size());
  }

  void commit() {
    namespace fs = std::filesystem;
    if (path_ == out_ || committed_) return;
    std::vector<std::string> carried;  // the old folder's other entries, moved into the new one
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(real_, ec)) {
      const std::string name = e.path().filename().string();
      if (is_output_(name) || fs::exists(fs::path(path_) / name, ec)) continue;
      if (::rename(e.path().c_str(), (fs::path(path_) / name).c_str()) == 0)
        carried.push_back(name);
    }
    int err = 0;
    if (::renameat2(AT_FDCWD, path_.c_str(), AT_FDCWD, real_.c_str(), RENAME_EXCHANGE) == 0) {
      committed_ = true;
      fs::remove_all(path_, ec);  // the old report, now at path_
      return;
    }
    // No atomic exchange here (an old kernel or file system): old away, new in, old removed.
    std::string old = real_ + ".oldXXXXXX";
    if (::mkdtemp(old.data()) && ::rename(real_.c_str(), old.c_str()) == 0) {
      if (::rename(path_.c_str(), real_.c_str()) == 0) {
        committed_ = true;
        fs::remove_all(old, ec);
        return;
      }
      err = errno;
      (void)::rename(old.c_str(), real_.c_str());
    } else {
      err = errno;
      ::rmdir(old.c_str());
    }
    for (const std::string& name : carried)
      (void)::rename((fs::path(path_) / name).c_str(), (fs::path(real_) / name).c_str());
    committed_ = true;  // the new report stays where it is, named in the error
    throw std::runtime_error(fmt::format(
        "cannot put the new report in place of '{}': {}; it is complete in '{}', and '{}' is "
        "unchanged",
        out_, std::strerror(err), path_, out_));
  }

 private:
  std::string out_;   // as given
  std::string path_;  // where the run writes (out_ when not staged)
  std::string real_;  // out_ with symbolic links resolved: the folder replaced
  std::function<bool(const std::string&)> is_output_;
  bool committed_ = false;
};

}  // namespace tally::ab
