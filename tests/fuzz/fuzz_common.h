// What every fuzz target shares (tests/fuzz/README.md): a scratch folder for the files a
// reader opens, a memory cap so that a header promising terabytes gets the allocator's
// OutOfMemoryError (a clear error) rather than the fuzzer's malloc limit, and the rule that
// a std::exception is a clear error (fine) while anything else is a failure: a crash, a
// hang, a sanitizer report, an exception of another type, or a failed FUZZ_CHECK.
#pragma once

#include <fuzzer/FuzzedDataProvider.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "memory/memory.h"

namespace tally::fuzz {

// A failed property: report it and abort, so that libFuzzer saves the input.
#define FUZZ_CHECK(cond)                                                                   \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)

// The CPU allocator holds at most this much: larger requests throw OutOfMemoryError.
inline constexpr size_t kMemoryCap = size_t{64} << 20;

// Once per process (the first call's `cap` counts): cap the CPU allocator at `cap` bytes;
// the scratch folder (removed at exit).
inline const std::filesystem::path& scratch_dir(size_t cap = kMemoryCap) {
  static const std::filesystem::path dir = [cap] {
    memory::CachingAllocator& a = memory::get_allocator(memory::Device::cpu());
    a.set_memory_fraction(static_cast<double>(cap) /
                          static_cast<double>(a.provider().total_memory()));
    std::string tmpl = (std::filesystem::temp_directory_path() / "tally-fuzz-XXXXXX").string();
    if (!mkdtemp(tmpl.data())) {
      std::perror("mkdtemp");
      std::abort();
    }
    static const std::string keep = tmpl;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(keep, ec);
    });
    return std::filesystem::path(tmpl);
  }();
  return dir;
}

inline void write_file(const std::filesystem::path& path, const void* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  out.close();
  FUZZ_CHECK(out.good());
}
inline void write_file(const std::filesystem::path& path, std::string_view bytes) {
  write_file(path, bytes.data(), bytes.size());
}

// Runs `f`; a std::exception is the clear error a bad input must give, and its message must
// say something. Returns whether `f` completed.
template <class F>
bool accepts(F&& f) {
  try {
    f();
    return true;
  } catch (const std::exception& e) {
    FUZZ_CHECK(e.what() != nullptr && e.what()[0] != '\0');
    return false;
  }
}

}  // namespace tally::fuzz
