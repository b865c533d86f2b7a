// Files and commands in tests: a per-test temporary name, whole-file reads and writes, and a
// shell command's output (ctest runs tests in parallel, so names carry the test and the pid).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>

namespace tally::testing {

// <temp>/<stem>_<test name>_<pid><ext>.
inline std::filesystem::path temp_file(const std::string& stem, const std::string& ext = "") {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::filesystem::temp_directory_path() /
         (stem + "_" + info->name() + "_" + std::to_string(::getpid()) + ext);
}

// The whole file, as bytes ("" when it cannot be read).
inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline void write_file(const std::filesystem::path& p, std::string_view bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// What `cmd` prints (stdout and stderr); its std::system status in *status.
inline std::string run(const std::string& cmd, int* status) {
  const std::filesystem::path out = temp_file("tally_cmd_out");
  *status = std::system((cmd + " > " + out.string() + " 2>&1").c_str());
  std::string text = read_file(out);
  std::filesystem::remove(out);
  return text;
}

#ifdef TALLY_SOURCE_DIR
// A committed file of tests/memory/fixtures/ (PyTorch's own snapshots among them).
inline std::string fixture(const std::string& name) {
  return std::string(TALLY_SOURCE_DIR) + "/tests/memory/fixtures/" + name;
}
#endif

#ifdef TALLY_PYTHON
// What the Python script `code` prints, run with the interpreter CMake found and `args`; a
// failure of the script fails the test, with what it printed.
inline std::string run_python(const std::string& code, const std::string& args) {
  const std::filesystem::path script = temp_file("tally_script", ".py");
  write_file(script, code);
  int status = 0;
  std::string out = run(std::string(TALLY_PYTHON) + " " + script.string() + " " + args, &status);
  std::filesystem::remove(script);
  EXPECT_EQ(status, 0) << "python " << args << ":\n" << out;
  return out;
}
#endif

inline bool contains(std::string_view s, std::string_view part) {
  return s.find(part) != std::string_view::npos;
}

}  // namespace tally::testing
