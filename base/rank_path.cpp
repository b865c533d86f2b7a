#include "base/rank_path.h"

#include <cstdlib>

namespace tally::base {

std::string per_rank_path(const std::string& path, int rank, int world_size) {
  if (world_size <= 1 || rank < 0) return path;
  const std::string tag = ".rank" + std::to_string(rank);
  const size_t slash = path.find_last_of('/');
  const size_t name_start = slash == std::string::npos ? 0 : slash + 1;
  const std::string name = path.substr(name_start);
  if (name.find(tag + ".") != std::string::npos ||
      (name.size() >= tag.size() && name.compare(name.size() - tag.size(), tag.size(), tag) == 0))
    return path;
  const size_t dot = name.find_last_of('.');
  if (dot == std::string::npos || dot == 0) return path + tag;
  return path.substr(0, name_start + dot) + tag + name.substr(dot);
}

std::string per_rank_path(const std::string& path) {
  const char* ws = std::getenv("WORLD_SIZE");
  const char* rk = std::getenv("RANK");
  if (!ws || !rk) return path;
  const int world = std::atoi(ws);
  const int rank = std::atoi(rk);
  return per_rank_path(path, rank, world);
}

}  // namespace tally::base
