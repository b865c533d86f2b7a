#include "memory/cpu_provider.h"

#include <unistd.h>

#include <cstdlib>

#include "memory/checked.h"

namespace tally::memory {

size_t HostMemoryProvider::physical_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page)
                               : (size_t{1} << 34);
}

CpuProvider::CpuProvider(size_t capacity)
    : HostMemoryProvider(capacity ? capacity : physical_memory()) {}

void* CpuProvider::allocate(size_t bytes) {
  const size_t rounded = checked_round_up(bytes, kAlignment, "CpuProvider::allocate");
  size_t used = used_.load();
  do {
    if (bytes > capacity_ - used) return nullptr;
  } while (!used_.compare_exchange_weak(used, used + bytes));

  void* p = std::aligned_alloc(kAlignment, rounded);
  if (!p) used_ -= bytes;
  return p;
}

void CpuProvider::deallocate(void* ptr, size_t bytes) {
  std::free(ptr);
  used_ -= bytes;
}

}  // namespace tally::memory
