// What every example program does with its command line and environment before any work
// starts:
//   - strict validators for numeric flags: integers in a range (decimal only; no silent
//     saturation at INT64_MAX, no hex, no empty string), finite reals in a range (NaN and
//     inf rejected), seeds as non-negative 64-bit integers (no wrap-around of "-1");
//   - output paths checked writable (a probe file is created and removed in the target
//     folder) and TALLY_ALLOC_CONF parsed, before the first step;
//   - run_cli(), which parses the command line, checks the environment, runs the program's
//     body and turns every error (a CLI11 parse or validation error, or any exception the
//     body throws) into one line "PROGRAM: message" on stderr and exit status 2. Nothing
//     escapes main, so no bad input aborts.
// A program's main with run_cli: docs/notes.md §28.
#pragma once

#include <fcntl.h>
#include <fmt/format.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "base/atomic_file.h"
#include "base/checked.h"
#include "memory/alloc_config.h"

namespace tally::examples {

// The exit status of every error of an example program (bad flag, bad environment, bad
// dataset, failed run).
inline constexpr int kExitError = 2;

// A bound for counts (batch, steps, ...): products of two of them fit in int64_t.
inline constexpr int64_t kMaxCount = int64_t{1} << 31;

// An integer flag in [lo, hi].
inline CLI::Validator int_range(int64_t lo, int64_t hi = kMaxCount) {
  const std::string desc =
      hi == kMaxCount ? fmt::format("(>= {})", lo) : fmt::format("(in [{}, {}])", lo, hi);
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        int64_t v = 0;
        const char* end = s.data() + s.size();
        const auto [ptr, ec] = std::from_chars(s.data(), end, v);
        if (s.empty() || ec == std::errc::invalid_argument || ptr != end)
          return fmt::format("expected an integer, got '{}'", s);
        if (hi != kMaxCount && (ec == std::errc::result_out_of_range || v < lo || v > hi))
          return fmt::format("must be in [{}, {}], got {}", lo, hi, s);
        if (ec == std::errc::result_out_of_range || v > hi)
          return fmt::format("must be at most {}, got {}", hi, s);
        if (v < lo) return fmt::format("must be >= {}, got {}", lo, s);
        return {};
      },
      desc);
}

// A seed: a non-negative integer that fits in 64 bits ("-1" is not 2^64 - 1).
inline CLI::Validator seed_value() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        uint64_t v = 0;
        const char* end = s.data() + s.size();
        const auto [ptr, ec] = std::from_chars(s.data(), end, v);
        if (s.empty() || ec == std::errc::invalid_argument || ptr != end)
          return fmt::format("expected a non-negative integer, got '{}'", s);
        if (ec == std::errc::result_out_of_range)
          return fmt::format("must be below 2^64, got {}", s);
        return {};
      },
      "(>= 0)");
}

// Bounds of a real flag: [lo, hi], or (lo, hi] with lo_open, [lo, hi) with hi_open.
struct RealBounds {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false;
  bool hi_open = false;
};

// A finite real flag within `b`: NaN and inf are rejected whatever the bounds.
inline CLI::Validator real_range(RealBounds b) {
  std::string desc;
  const bool has_lo = std::isfinite(b.lo), has_hi = std::isfinite(b.hi);
  if (has_lo && has_hi)
    desc = fmt::format("in {}{}, {}{}", b.lo_open ? '(' : '[', b.lo, b.hi, b.hi_open ? ')' : ']');
  else if (has_lo)
    desc = fmt::format("{} {}", b.lo_open ? ">" : ">=", b.lo);
  else if (has_hi)
    desc = fmt::format("{} {}", b.hi_open ? "<" : "<=", b.hi);
  else
    desc = "finite";
  return CLI::Validator(
      [b, desc](std::string& s) -> std::string {
        errno = 0;
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size())
          return fmt::format("expected a number, got '{}'", s);
        if (!std::isfinite(v) || errno == ERANGE)
          return fmt::format("expected a finite number, got '{}'", s);
        const bool low = b.lo_open ? !(v > b.lo) : !(v >= b.lo);
        const bool high = b.hi_open ? !(v < b.hi) : !(v <= b.hi);
        if (low || high) return fmt::format("must be {}, got {}", desc, s);
        return {};
      },
      "(" + desc + ")");
}
// A finite real > 0 (rates, scales).
inline CLI::Validator positive_real() {
  return real_range({.lo = 0, .lo_open = true});
}
// A finite real >= 0 (weight decay, a clipping norm where 0 is off).
inline CLI::Validator non_negative_real() {
  return real_range({.lo = 0});
}

// A flag checked by `validator` (int_range, real_range, seed_value, ...), its default shown
// in --help:
//   ex::add_checked_option(app, "--batch", a.batch, "batch size", ex::int_range(1));
template <class T>
CLI::Option* add_checked_option(CLI::App& app, const std::string& name, T& value,
                                const std::string& help, const CLI::Validator& validator) {
  return app.add_option(name, value, help)->check(validator)->capture_default_str();
}

// f(), with an error it throws prefixed by the flag whose value it was given:
//   cfg = ex::for_flag("--preset", [&] { return nn::GPTConfig::preset(a.preset); });
template <class F>
auto for_flag(std::string_view flag, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    throw std::invalid_argument(fmt::format("{}: {}", flag, e.what()));
  }
}

namespace detail {
// Creates a file in `dir`, writes a byte to it (a full disk or quota fails here, not after the
// run) and removes it; throws naming `flag` and `path` if it cannot.
inline void probe_folder(const std::filesystem::path& dir, std::string_view flag,
                         std::string_view path) {
  std::string name = (dir / ".tally-write-check-XXXXXX").string();
  const int fd = ::mkstemp(name.data());
  if (fd < 0)
    throw std::invalid_argument(fmt::format("{} {}: cannot create a file in the folder '{}': {}",
                                            flag, path, dir.string(), std::strerror(errno)));
  ssize_t w = 0;
  do {
    w = ::write(fd, "\n", 1);
  } while (w < 0 && errno == EINTR);
  const int err = w == 1 ? 0 : w < 0 ? errno : EIO;
  ::close(fd);
  ::unlink(name.c_str());
  if (err)
    throw std::invalid_argument(fmt::format("{} {}: cannot write a file in the folder '{}': {}",
                                            flag, path, dir.string(), std::strerror(err)));
}

}  // namespace detail

// `path` (the value of `flag`) names a file this program can write: not a folder, its folder
// exists and takes a new file with a byte in it, and an existing file there is writable; an
// existing device or FIFO takes a write. Checked by writing, before the run, so an unwritable
// output does not lose a finished run.
inline void check_output_file(const std::string& path, std::string_view flag) {
  namespace fs = std::filesystem;
  if (path.empty()) throw std::invalid_argument(fmt::format("{}: empty path", flag));
  std::error_code ec;
  const fs::path p(path);
  if (fs::is_directory(p, ec))
    throw std::invalid_argument(
        fmt::format("{} {}: is a folder, expected a file name", flag, path));
  const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  if (!fs::is_directory(dir, ec))
    throw std::invalid_argument(
        fmt::format("{} {}: '{}' {}", flag, path, dir.string(),
                    fs::exists(dir, ec) ? "is not a folder" : "does not exist"));
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {  // written in place
    if (const int err = base::probe_in_place_write(path))
      throw std::invalid_argument(
          fmt::format("{} {}: writing to it fails: {}", flag, path, std::strerror(err)));
    return;
  }
  detail::probe_folder(dir, flag, path);
  if (fs::exists(p, ec) && ::access(path.c_str(), W_OK) != 0)
    throw std::invalid_argument(fmt::format("{} {}: the file exists and is not writable: {}", flag,
                                            path, std::strerror(errno)));
}

// `dir` (the value of `flag`) is an output folder: created if missing, and it takes a new file.
inline void check_output_dir(const std::string& dir, std::string_view flag) {
  namespace fs = std::filesystem;
  if (dir.empty()) throw std::invalid_argument(fmt::format("{}: empty path", flag));
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw std::invalid_argument(fmt::format("{} {}: exists and is not a folder", flag, dir));
  fs::create_directories(dir, ec);
  if (ec)
    throw std::invalid_argument(
        fmt::format("{} {}: cannot create the folder: {}", flag, dir, ec.message()));
  detail::probe_folder(dir, flag, dir);
}

// The environment every program reads: TALLY_ALLOC_CONF (parsed now, not at the first
// allocation; its oom_snapshot file must be writable).
inline void check_environment() {
  const memory::AllocatorConfig cfg = memory::AllocatorConfig::from_env();
  if (!cfg.oom_snapshot_path.empty())
    check_output_file(cfg.oom_snapshot_path, "TALLY_ALLOC_CONF oom_snapshot");
}

// Parses argv into `app`, checks the environment and returns body()'s exit status. --help
// prints the help and returns 0. Every error, from CLI11 or any exception the body throws,
// prints "PROGRAM: message" to stderr and returns kExitError. `program` is read when an
// error is printed, so a body may add to it (train_ddp adds its rank).
template <class Body>
int run_cli(const std::string& program, CLI::App& app, int argc, char** argv, Body&& body) {
  try {
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      if (e.get_exit_code() == 0) return app.exit(e);  // --help
      std::fflush(stdout);
      fmt::print(stderr, "{}: {} (see {} --help)\n", program, e.what(), program);
      return kExitError;
    }
    check_environment();
    return body();
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "{}: {}\n", program, e.what());
  } catch (...) {
    std::fflush(stdout);
    fmt::print(stderr, "{}: unknown error\n", program);
  }
  return kExitError;
}

// The memory flags the training programs share: --checkpoint, --amp, --offload,
// --memory-budget (the planner's) and --estimate (a dry run instead of the run).
inline void add_memory_options(CLI::App& app, std::string& checkpoint, std::string& amp,
                               std::string& memory_budget, std::string& estimate,
                               std::string& offload) {
  app.add_option("--checkpoint", checkpoint,
                 "none | blocks | N-blocks | N-segments | selective | auto (the planner: fastest "
                 "plan within --memory-budget, with the optimizer, --step-in-backward and "
                 "--grad-accum the flags leave free)")
      ->capture_default_str();
  app.add_option("--amp", amp, "off | fp16 | bf16 | auto (with --checkpoint auto)")
      ->capture_default_str();
  app.add_option("--memory-budget", memory_budget,
                 "device memory the run may reserve, for --checkpoint auto (6GiB, 900MiB, 512KiB, "
                 "bytes)");
  app.add_option("--offload", offload,
                 "none | activations | N-blocks (what autograd saves goes to pinned host memory, "
                 "prefetched one block ahead in backward) | link (only what the host link "
                 "carries while the forward computes) | auto (with --checkpoint auto)")
      ->capture_default_str();
  app.add_option(
      "--estimate", estimate,
      "predict the run's memory on TARGET (cpu | h100 | h200 | cuda) with a shapes-only dry "
      "run of a few steps, print it and stop; no GPU needed");
}

}  // namespace tally::examples
