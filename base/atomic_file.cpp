#include "base/atomic_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <streambuf>
#include <vector>

namespace tally::base {
namespace {

// A stream buffer over a file descriptor that checks every write(2): on the first failure it
// keeps errno and fails every later write, so the ostream above it goes bad.
class FdBuf final : public std::streambuf {
 public:
  explicit FdBuf(int fd) : fd_(fd), buf_(kSize) { reset(); }
  int error() const { return err_; }

 protected:
  int_type overflow(int_type c) override {
    if (!drain()) return traits_type::eof();
    if (!traits_type::eq_int_type(c, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(c);
      pbump(1);
    }
    return traits_type::not_eof(c);
  }

  std::streamsize xsputn(const char* s, std::streamsize n) override {
    if (err_ || n <= 0) return err_ ? 0 : n;
    const auto room = static_cast<std::streamsize>(epptr() - pptr());
    if (n <= room) {
      std::memcpy(pptr(), s, static_cast<size_t>(n));
      pbump(static_cast<int>(n));
      return n;
    }
    if (!drain()) return 0;
    if (n < static_cast<std::streamsize>(kSize)) {
      std::memcpy(pptr(), s, static_cast<size_t>(n));
      pbump(static_cast<int>(n));
      return n;
    }
    return write_all(s, static_cast<size_t>(n)) ? n : 0;  // large blocks bypass the buffer
  }

  int sync() override { return drain() ? 0 : -1; }

 private:
  static constexpr size_t kSize = size_t{1} << 16;

  void reset() { setp(buf_.data(), buf_.data() + buf_.size()); }

  bool drain() {
    if (err_) return false;
    const bool ok = write_all(pbase(), static_cast<size_t>(pptr() - pbase()));
    reset();
    return ok;
  }

  bool write_all(const char* p, size_t n) {
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, std::min(n, size_t{1} << 30));
      if (w < 0) {
        if (errno == EINTR) continue;
        err_ = errno;
        return false;
      }
      if (w == 0) {  // no progress and no errno: report it as an I/O error
        err_ = EIO;
        return false;
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
    return true;
  }

  int fd_;
  int err_ = 0;
  std::vector<char> buf_;
};

// "<prefix>XXXXXX" with 6 characters that differ between calls, threads and processes.
std::string unique_name(const std::string& prefix) {
  static std::atomic<uint64_t> counter{0};
  uint64_t x = counter.fetch_add(1) * 0x9E3779B97F4A7C15ull ^
               static_cast<uint64_t>(::getpid()) << 32 ^
               static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  x ^= x >> 30;  // splitmix64's finaliser: every input bit reaches every output character
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  static constexpr char kChars[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::string s = prefix;
  for (int i = 0; i < 6; ++i, x /= 62) s += kChars[x % 62];
  return s;
}

// Whether `name` is `prefix` followed by the 6 characters unique_name appends.
bool is_temp_name(std::string_view name, std::string_view prefix) {
  if (name.size() != prefix.size() + 6 || !name.starts_with(prefix)) return false;
  return std::all_of(
      name.begin() + static_cast<std::ptrdiff_t>(prefix.size()), name.end(), [](char c) {
        return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
      });
}

// Removes the temporary files that earlier writes of `target` left behind (a writer killed
// half-way: "<target>.tmpXXXXXX", and the folder's ".tally-tmpXXXXXX" of long names).
// A writer holds an exclusive flock on its temporary file from its creation until after the
// rename, so a file whose lock this process can take has no live writer (the lock dies with
// the process, whatever killed it; no pid is reused or guessed, no clock is trusted). A writer
// that created its file but has not locked it yet finds it unlinked (st_nlink 0) once locked,
// and starts again with a new name. Best effort: a file that cannot be opened or locked (a file
// system without locks) stays.
void remove_stale_temps(const std::string& target) {
  namespace fs = std::filesystem;
  const fs::path t(target);
  const fs::path dir = t.parent_path().empty() ? fs::path(".") : t.parent_path();
  const std::string own = t.filename().string() + ".tmp";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  std::vector<std::string> candidates;
  while (const dirent* e = ::readdir(d)) {
    const std::string_view name = e->d_name;
    if (is_temp_name(name, own) || is_temp_name(name, ".tally-tmp")) candidates.emplace_back(name);
  }
  ::closedir(d);
  for (const std::string& name : candidates) {
    const std::string path = (dir / name).string();
    int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0 && errno == EACCES)  // kept a write-only file's mode: flock needs any descriptor
      fd = ::open(path.c_str(), O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat held {
    }, now{};
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0 && ::fstat(fd, &held) == 0 && S_ISREG(held.st_mode) &&
        ::lstat(path.c_str(), &now) == 0 && now.st_dev == held.st_dev && now.st_ino == held.st_ino)
      ::unlink(path.c_str());
    ::close(fd);  // releases the lock
  }
}

class AtomicWriter {
 public:
  AtomicWriter(const std::string& path, std::string_view who) : path_(path), who_(who) {}

  ~AtomicWriter() { discard(); }

  void run(const std::function<void(std::ostream&)>& write) {
    struct stat st {};
    const bool exists = resolve(st);
    existed_ = exists;
    if (exists && S_ISDIR(st.st_mode)) fail(EISDIR, "the target is a folder");
    in_place_ = exists && !S_ISREG(st.st_mode);
    if (in_place_) {
      open_in_place();
    } else {
      remove_stale_temps(target_);  // before this write needs the space
      open_temp(exists ? &st : nullptr);
    }

    FdBuf buf(fd_);
    std::ostream out(&buf);
    write(out);  // an exception leaves through the destructor, which removes the temporary
    out.flush();
    if (buf.error()) fail(buf.error(), fmt::format("writing '{}'", file()));
    if (!out) fail(0, fmt::format("the stream writing '{}' failed", file()));
    if (!in_place_ && ::fsync(fd_) != 0)
      fail(errno, fmt::format("flushing '{}' to disk (fsync)", file()));
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail(errno, fmt::format("closing '{}'", file()));
    if (in_place_) return;
    if (::rename(temp_.c_str(), target_.c_str()) != 0)
      fail(errno, fmt::format("renaming '{}' to '{}'", temp_, target_));
    temp_.clear();
    unlock();
    sync_folder();
  }

 private:
  // Follows symbolic links from path_ to the file to replace (target_); fills `st` and returns
  // true when it exists. A dangling link names the file to create.
  bool resolve(struct stat& st) {
    target_ = path_;
    for (int hops = 0; hops < 40; ++hops) {
      if (::lstat(target_.c_str(), &st) != 0) return false;  // open() reports why, if it fails
      if (!S_ISLNK(st.st_mode)) return true;
      std::vector<char> link(static_cast<size_t>(std::max<off_t>(st.st_size, 255)) + 1);
      const ssize_t n = ::readlink(target_.c_str(), link.data(), link.size());
      if (n < 0) fail(errno, fmt::format("reading the symbolic link '{}'", target_));
      const std::filesystem::path to(std::string(link.data(), static_cast<size_t>(n)));
      target_ = to.is_absolute() ? to.string()
                                 : (std::filesystem::path(target_).parent_path() / to).string();
    }
    fail(ELOOP, fmt::format("following the symbolic links from '{}'", path_));
  }

  void open_temp(const struct stat* old) {
    int err = 0;
    for (int attempt = 0; attempt < 100; ++attempt) {
      std::string name = unique_name(target_ + ".tmp");
      fd_ = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd_ < 0 && errno == ENAMETOOLONG) {  // the target's name is near NAME_MAX
        std::filesystem::path dir = std::filesystem::path(target_).parent_path();
        name = unique_name((dir / ".tally-tmp").string());
        fd_ = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      }
      if (fd_ >= 0 && !lock_temp()) {  // another write's cleanup removed it: a new name
        ::close(fd_);
        fd_ = -1;
        err = EEXIST;
        continue;
      }
      if (fd_ >= 0) {
        temp_ = std::move(name);
        // The replacement keeps the old file's permission bits (best effort: the content is
        // what matters, and a file system without modes refuses).
        if (old) (void)::fchmod(fd_, old->st_mode & 07777);
        return;
      }
      err = errno;
      if (err != EEXIST && err != EINTR) break;
    }
    fail(err, fmt::format("creating a temporary file '{}.tmpXXXXXX' next to it", target_));
  }

  // Locks the new temporary file until it is renamed or removed (remove_stale_temps), through
  // a duplicate descriptor that outlives fd_'s close. False when the file was unlinked before
  // the lock was taken. It waits for the lock: another write's cleanup may hold it for the
  // moment it takes to look at the file (and remove it), and a writer that went on unlocked
  // could have its file removed under it. A file system without flock: unlocked, and never
  // cleaned up by others.
  bool lock_temp() {
    int r = 0;
    do r = ::flock(fd_, LOCK_EX);
    while (r != 0 && errno == EINTR);
    if (r != 0) return true;
    struct stat st {};
    if (::fstat(fd_, &st) == 0 && st.st_nlink == 0) {
      ::flock(fd_, LOCK_UN);
      return false;
    }
    lock_fd_ = ::fcntl(fd_, F_DUPFD_CLOEXEC, 0);
    return true;
  }

  void unlock() noexcept {
    if (lock_fd_ >= 0) ::close(lock_fd_);
    lock_fd_ = -1;
  }

  void open_in_place() {
    do {
      fd_ = ::open(target_.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
    } while (fd_ < 0 && errno == EINTR);
    if (fd_ < 0) fail(errno, fmt::format("opening '{}' for writing", target_));
  }

  // fsync the folder so that the rename itself survives a crash. Best effort: the new file is
  // in place already, and some file systems refuse to fsync a folder.
  void sync_folder() const {
    std::filesystem::path dir = std::filesystem::path(target_).parent_path();
    if (dir.empty()) dir = ".";
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return;
    (void)::fsync(fd);
    ::close(fd);
  }

  const std::string& file() const { return in_place_ ? target_ : temp_; }

  void discard() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    if (!temp_.empty()) ::unlink(temp_.c_str());
    temp_.clear();
    unlock();  // after the unlink: no other writer sees this file unlocked
  }

  [[noreturn]] void fail(int err, const std::string& step) {
    discard();
    const std::string why = err ? std::strerror(err) : "I/O error";
    std::string msg = who_.empty() ? std::string() : std::string(who_) + ": ";
    msg += fmt::format("cannot write '{}': {} ({})", path_, why, step);
    if (existed_ && !in_place_) msg += fmt::format("; '{}' is unchanged", path_);
    throw std::runtime_error(msg);
  }

  std::string path_;    // as the caller named it (error messages)
  std::string target_;  // the file to replace, symbolic links followed
  std::string temp_;    // the temporary file while it exists
  std::string_view who_;
  int fd_ = -1;
  int lock_fd_ = -1;       // holds the temporary file's flock until the rename
  bool existed_ = false;   // the target existed: a failure leaves it unchanged
  bool in_place_ = false;  // a device or FIFO, written in place
};

}  // namespace

void write_file_atomic(const std::string& path, const std::function<void(std::ostream&)>& write,
                       std::string_view who) {
  if (path.empty())
    throw std::invalid_argument(
        fmt::format("{}{}cannot write a file with an empty name", who, who.empty() ? "" : ": "));
  AtomicWriter(path, who).run(write);
}

int probe_in_place_write(const std::string& path) noexcept {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return errno;
  int fd = -1;
  do {
    fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return S_ISFIFO(st.st_mode) && errno == ENXIO ? 0 : errno;
  const ssize_t w = ::write(fd, "", 0);
  const int err = w < 0 && errno != EAGAIN ? errno : 0;
  ::close(fd);
  return err;
}

void write_file_atomic(const std::string& path, std::string_view bytes, std::string_view who) {
  write_file_atomic(
      path, [bytes](std::ostream& out) { out.write(bytes.data(), std::ssize(bytes)); }, who);
}

}  // namespace tally::base
