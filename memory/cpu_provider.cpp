#include "memory/cpu_provider.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string_view>

#include "base/checked.h"

namespace tally::memory {
namespace {

// Whether the system can give `bytes` and keep CpuProvider::kOsReserve (small requests are
// not asked about: reading /proc/meminfo costs about 3 us).
bool system_can_give(size_t bytes, CpuProvider::AvailableFn available) {
  if (bytes < CpuProvider::kOsCheckBytes) return true;
  const size_t a = available();
  return a >= CpuProvider::kOsReserve && bytes <= a - CpuProvider::kOsReserve;
}

// Addresses reserved with mmap(PROT_NONE) (no memory, no commit charge); mprotect makes
// pages readable and writable (the kernel backs them on first touch); mmap(MAP_FIXED,
// PROT_NONE) over pages drops their memory and keeps the addresses reserved. Mapped pages
// count against the provider's capacity, as its allocations do.
class CpuExpandableSegment final : public ExpandableSegment {
 public:
  CpuExpandableSegment(void* base, size_t page_size, size_t pages, std::atomic<size_t>& used,
                       size_t capacity, CpuProvider::AvailableFn available)
      : ExpandableSegment(reinterpret_cast<uintptr_t>(base), page_size, pages),
        used_(used),
        capacity_(capacity),
        available_(available) {}

  ~CpuExpandableSegment() override {
    munmap(reinterpret_cast<void*>(base_), size());
    used_ -= mapped_;
  }

  bool map(size_t offset, size_t bytes) override {
    if (!system_can_give(bytes, available_)) return false;
    size_t used = used_.load();
    do {
      if (bytes > capacity_ - used) return false;
    } while (!used_.compare_exchange_weak(used, used + bytes));
    void* at = reinterpret_cast<void*>(base_ + offset);
    if (mprotect(at, bytes, PROT_READ | PROT_WRITE) != 0) {
      const int err = errno;
      used_ -= bytes;
      if (err == ENOMEM) return false;  // the kernel's commit limit
      throw std::runtime_error(fmt::format(
          "mprotect(PROT_READ | PROT_WRITE) of {} bytes at {} (expandable segment on cpu) "
          "failed: {}",
          bytes, at, std::strerror(err)));
    }
    mapped_ += bytes;
    return true;
  }

  void unmap(size_t offset, size_t bytes, size_t& done) override {
    done = 0;
    void* at = reinterpret_cast<void*>(base_ + offset);
    if (mmap(at, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1,
             0) == MAP_FAILED)
      throw std::runtime_error(fmt::format(
          "mmap(MAP_FIXED, PROT_NONE) of {} bytes at {} (unmapping pages of an expandable "
          "segment on cpu) failed: {}",
          bytes, at, std::strerror(errno)));
    done = bytes;
    mapped_ -= bytes;
    used_ -= bytes;
  }

 private:
  std::atomic<size_t>& used_;  // the provider's, which outlives its segments
  size_t capacity_;
  CpuProvider::AvailableFn available_;
  size_t mapped_ = 0;
};

}  // namespace

size_t HostMemoryProvider::physical_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page)
                               : (size_t{1} << 34);
}

size_t CpuProvider::os_available_memory() {
  // MemAvailable: what can be allocated without swapping, page cache included (Linux 3.14+).
  const int fd = open("/proc/meminfo", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::numeric_limits<size_t>::max();
  std::array<char, 4096> buf{};
  const ssize_t n = read(fd, buf.data(), buf.size() - 1);
  close(fd);
  if (n <= 0) return std::numeric_limits<size_t>::max();
  const std::string_view text(buf.data(), static_cast<size_t>(n));
  constexpr std::string_view kKey = "MemAvailable:";
  size_t at = text.find(kKey);
  if (at == std::string_view::npos) return std::numeric_limits<size_t>::max();
  at = text.find_first_not_of(' ', at + kKey.size());
  if (at == std::string_view::npos) return std::numeric_limits<size_t>::max();
  uint64_t kib = 0;
  const auto [ptr, ec] = std::from_chars(text.data() + at, text.data() + text.size(), kib);
  if (ec != std::errc() || kib > std::numeric_limits<size_t>::max() / 1024)
    return std::numeric_limits<size_t>::max();
  return static_cast<size_t>(kib) * 1024;  // the file's "kB" are KiB
}

bool CpuProvider::host_can_hold(uint64_t count, uint64_t item_bytes, uint64_t& bytes,
                                uint64_t& available) {
  available = os_available_memory();
  if (__builtin_mul_overflow(count, item_bytes, &bytes)) {
    bytes = std::numeric_limits<uint64_t>::max();
    return false;
  }
  return available == std::numeric_limits<size_t>::max() || bytes + kOsReserve <= available;
}

CpuProvider::CpuProvider(size_t capacity, AvailableFn available)
    : HostMemoryProvider(capacity ? capacity : physical_memory()), available_(available) {}

size_t CpuProvider::free_memory() const {
  const size_t left = capacity_ - used_.load();
  const size_t a = available_();
  const size_t system = a > kOsReserve ? a - kOsReserve : 0;
  return left < system ? left : system;
}

void* CpuProvider::allocate(size_t bytes) {
  const size_t rounded = base::checked_round_up(bytes, kAlignment, "CpuProvider::allocate");
  if (!system_can_give(rounded, available_)) return nullptr;
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

std::unique_ptr<ExpandableSegment> CpuProvider::create_expandable_segment(StreamId /*stream*/,
                                                                          size_t page_size,
                                                                          size_t pages) {
  const long system_page = sysconf(_SC_PAGESIZE);
  if (page_size == 0 || (system_page > 0 && page_size % static_cast<size_t>(system_page) != 0))
    throw std::invalid_argument(fmt::format(
        "expandable_segments on cpu: pages of {} bytes are not a multiple of the system's page "
        "size, {} bytes",
        page_size, system_page));
  const size_t bytes = base::checked_mul(
      page_size, pages, "CpuProvider::create_expandable_segment: the segment's size");
  void* base = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED)
    throw std::runtime_error(fmt::format(
        "mmap(PROT_NONE) reserving {} bytes for an expandable segment on cpu failed: {}", bytes,
        std::strerror(errno)));
  return std::make_unique<CpuExpandableSegment>(base, page_size, pages, used_, capacity_,
                                                available_);
}

}  // namespace tally::memory
