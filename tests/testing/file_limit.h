// Runs code under a file-size limit, to test what a write cut short leaves behind: a forked
// child sets RLIMIT_FSIZE and ignores SIGXFSZ, so a write past the limit fails with EFBIG
// (as on a full disk) instead of killing the process.
#pragma once

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>

namespace tally::testing {

struct LimitedRun {
  bool threw = false;  // fn threw a std::exception; `what` is its message
  std::string what;    // the message, or why the child did not run fn
  int status = 0;      // the child's wait status
};

// Runs `fn` in a forked child whose regular-file writes stop at `limit_bytes`. The child is
// killed by SIGALRM after 60 s, so a hang fails the test instead of blocking it.
inline LimitedRun run_with_file_size_limit(rlim_t limit_bytes, const std::function<void()>& fn) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("run_with_file_size_limit: pipe failed");
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("run_with_file_size_limit: fork failed");
  if (pid == 0) {
    ::close(fds[0]);
    ::alarm(60);
    ::signal(SIGXFSZ, SIG_IGN);
    std::string msg;
    int code = 0;
    const rlimit rl{limit_bytes, limit_bytes};
    if (::setrlimit(RLIMIT_FSIZE, &rl) != 0) {
      msg = "setrlimit(RLIMIT_FSIZE) failed";
      code = 3;
    } else {
      try {
        fn();
      } catch (const std::exception& e) {
        msg = e.what();
        code = 1;
      } catch (...) {
        msg = "an exception not derived from std::exception";
        code = 2;
      }
    }
    const char* p = msg.data();
    size_t n = msg.size();
    while (n > 0) {
      const ssize_t w = ::write(fds[1], p, n);
      if (w <= 0) break;
      p += w;
      n -= static_cast<size_t>(w);
    }
    ::_exit(code);
  }
  ::close(fds[1]);
  LimitedRun r;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n > 0) {
      r.what.append(buf, static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;
    }
  }
  ::close(fds[0]);
  while (::waitpid(pid, &r.status, 0) < 0 && errno == EINTR) {
  }
  r.threw = WIFEXITED(r.status) && WEXITSTATUS(r.status) == 1;
  return r;
}

}  // namespace tally::testing
