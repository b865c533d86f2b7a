// An output folder written whole or not at all: the A/B runner's (ab/ab.h) report folder.
#pragma once

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace tally::ab {

// An output folder written whole or not at all (ab_memory --out, ab::run's Options::out): the run
// writes into a fresh folder next to it ("<out>.tmpXXXXXX", path()), and commit() swaps that folder
// into place (renameat2's RENAME_EXCHANGE, else: rename the old folder away, the new one in), then
// removes the old one. A run that fails leaves the old report whole and removes its own
// folder. What the old folder holds besides `is_output(name)` entries (a nested report, the
// user's own files) moves into the new one first. Where no folder can be made beside `out`
// (".", a mount point under a read-only folder), path() is `out` itself, as before.
// A run holds an exclusive flock on its folder while it lives, so the next run for the same
// `out` removes the folders of runs that were killed (SIGKILL skips the destructor), as
// base::write_file_atomic does for files; a live run's folder stays.
class StagedOutputDir {
 public:
  StagedOutputDir(const std::string& out, std::function<bool(const std::string&)> is_output)
      : out_(out), path_(out), is_output_(std::move(is_output)) {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path real = fs::canonical(out, ec);  // a symbolic link: its folder is replaced
    if (ec || real.filename().empty() || real == real.root_path()) return;
    remove_stale(real);  // before this run needs the space
    for (int attempt = 0; attempt < 100; ++attempt) {
      std::string name = real.string() + ".tmpXXXXXX";
      if (!::mkdtemp(name.data())) return;
      const int fd = ::open(name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (fd >= 0) {
        int r = 0;
        do r = ::flock(fd, LOCK_EX);  // waits while another run's cleanup looks at it
        while (r != 0 && errno == EINTR);
        struct stat st {};
        if (r == 0 && ::fstat(fd, &st) == 0 && st.st_nlink == 0) {  // that cleanup removed it
          ::close(fd);
          continue;
        }
        lock_fd_ = fd;  // without flock (some network file systems): unlocked, never cleaned
      }
      real_ = real.string();
      path_ = std::move(name);
      return;
    }
  }
  ~StagedOutputDir() {
    if (!committed_ && path_ != out_) {
      std::error_code ec;
      std::filesystem::remove_all(path_, ec);
    }
    if (lock_fd_ >= 0) ::close(lock_fd_);
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
        "cannot put the new report in place of '{}': {}; it is complete in '{}' (until the next "
        "run for '{}'), and '{}' is unchanged",
        out_, std::strerror(err), path_, out_, out_));
  }

  // Removes the staging folders ("<real>.tmpXXXXXX") of earlier runs for `real` whose lock
  // this process can take: their run is dead. Best effort: what cannot be opened stays.
  static void remove_stale(const std::filesystem::path& real) {
    namespace fs = std::filesystem;
    const fs::path dir = real.parent_path();
    const std::string own = real.filename().string() + ".tmp";
    std::vector<std::string> candidates;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d)) {
        const std::string_view name = e->d_name;  // own + mkdtemp's 6 characters [A-Za-z0-9]
        if (name.size() == own.size() + 6 && name.starts_with(own) &&
            std::all_of(name.begin() + static_cast<std::ptrdiff_t>(own.size()), name.end(),
                        [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; }))
          candidates.emplace_back(name);
      }
      ::closedir(d);
    }
    for (const std::string& name : candidates) {
      const fs::path path = dir / name;
      const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (fd < 0) continue;
      struct stat held {
      }, now{};
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::fstat(fd, &held) == 0 &&
          ::lstat(path.c_str(), &now) == 0 && now.st_dev == held.st_dev &&
          now.st_ino == held.st_ino) {
        std::error_code ec;
        fs::remove_all(path, ec);
      }
      ::close(fd);  // releases the lock
    }
  }

 private:
  std::string out_;   // as given
  std::string path_;  // where the run writes (out_ when not staged)
  std::string real_;  // out_ with symbolic links resolved: the folder replaced
  std::function<bool(const std::string&)> is_output_;
  bool committed_ = false;
  int lock_fd_ = -1;  // holds the flock on path_'s folder
};

}  // namespace tally::ab
