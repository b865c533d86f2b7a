// Says plainly what is wrong with a path given as an input file or folder: a folder where a
// file is expected is "a directory, not a file" (not an "empty file"), a file where a folder
// is expected is "not a directory" (not a "missing directory").
#pragma once

#include <fmt/format.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tally::base {

// Throws std::runtime_error "WHO: 'PATH' is a directory, not a file" when `path` is a folder
// (symbolic links followed). A missing path is left to the caller's own message.
inline void refuse_directory(const std::string& path, std::string_view who) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw std::runtime_error(fmt::format("{}: '{}' is a directory, not a file", who, path));
}

// Throws std::runtime_error "WHO: 'PATH' is not a directory (a file)" when `path` exists and
// is not a folder, or "WHO: directory 'PATH' does not exist" when nothing is there; `hint`
// ends the second message (what to install, what the folder should hold).
inline void require_directory(const std::string& path, std::string_view who,
                              std::string_view hint = {}) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (fs::is_directory(st)) return;
  if (fs::exists(st))
    throw std::runtime_error(fmt::format("{}: '{}' is not a directory ({}){}", who, path,
                                         fs::is_regular_file(st) ? "a file" : "not a folder",
                                         hint));
  throw std::runtime_error(fmt::format("{}: directory '{}' does not exist{}", who, path, hint));
}

}  // namespace tally::base
