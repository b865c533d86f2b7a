#include "memory/cuda_provider.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "base/checked.h"
#include "memory/cuda_device_guard.h"

namespace tally::memory {
namespace {

void check(cudaError_t err, const char* what, int device) {
  if (err != cudaSuccess)
    throw std::runtime_error(fmt::format("{} on cuda:{} failed: {} ({})", what, device,
                                         cudaGetErrorString(err), cudaGetErrorName(err)));
}

// The driver functions expandable segments use, found once through the runtime. The 12.0
// ABI of each is asked for: the virtual memory API has not changed since CUDA 10.2.
// clang-format off
#define TALLY_DRIVER_FUNCTIONS(X)                                                \
  X(cuGetErrorName) X(cuGetErrorString) X(cuDeviceGet) X(cuDeviceGetAttribute)   \
  X(cuMemGetAllocationGranularity) X(cuMemAddressReserve) X(cuMemAddressFree)    \
  X(cuMemCreate) X(cuMemRelease) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)
// clang-format on

struct DriverApi {
#define TALLY_DRIVER_POINTER(name) decltype(&::name) name = nullptr;
  TALLY_DRIVER_FUNCTIONS(TALLY_DRIVER_POINTER)
#undef TALLY_DRIVER_POINTER
  std::string missing;  // why the API is unavailable; empty when every function was found
};

const DriverApi& driver() {
  static const DriverApi api = [] {
    DriverApi a;
    auto find = [&](const char* symbol, void** fn) {
      if (!a.missing.empty()) return;
      cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
      const cudaError_t err =
          cudaGetDriverEntryPointByVersion(symbol, fn, 12000, cudaEnableDefault, &found);
      if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || !*fn) {
        cudaGetLastError();
        a.missing = fmt::format(
            "cudaGetDriverEntryPointByVersion(\"{}\", 12000) failed: {} ({}), query result {}",
            symbol, cudaGetErrorString(err), cudaGetErrorName(err), static_cast<int>(found));
      }
    };
#define TALLY_DRIVER_FIND(name) find(#name, reinterpret_cast<void**>(&a.name));
    TALLY_DRIVER_FUNCTIONS(TALLY_DRIVER_FIND)
#undef TALLY_DRIVER_FIND
    return a;
  }();
  return api;
}

// "cuMemCreate(20971520 bytes) on cuda:0 failed: out of memory (CUDA_ERROR_OUT_OF_MEMORY)".
void check_driver(CUresult r, const std::string& what, int device) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* text = nullptr;
  driver().cuGetErrorName(r, &name);
  driver().cuGetErrorString(r, &text);
  throw std::runtime_error(fmt::format("{} on cuda:{} failed: {} ({})", what, device,
                                       text ? text : "unknown error",
                                       name ? name : std::to_string(static_cast<int>(r))));
}

const DriverApi& driver_or_throw(int device) {
  const DriverApi& api = driver();
  if (!api.missing.empty())
    throw std::runtime_error(fmt::format(
        "expandable_segments on cuda:{}: the CUDA driver's virtual memory API is unavailable: {}",
        device, api.missing));
  return api;
}

// PyTorch's ExpandableSegment: one physical allocation (cuMemCreate) per page, mapped at its
// place in the reserved range and made accessible to the device.
class CudaExpandableSegment final : public ExpandableSegment {
 public:
  CudaExpandableSegment(int device, CUdeviceptr base, size_t page_size, size_t pages,
                        const CUmemAllocationProp& prop)
      : ExpandableSegment(static_cast<uintptr_t>(base), page_size, pages),
        device_(device),
        prop_(prop) {}

  ~CudaExpandableSegment() override {
    // Errors are ignored: this may run at process exit, after the driver shut down.
    const DriverApi& api = driver();
    int prev = 0;
    cudaGetDevice(&prev);
    if (prev != device_) cudaSetDevice(device_);
    if (!handles_.empty()) cudaDeviceSynchronize();
    for (size_t i = 0; i < handles_.size(); ++i) {
      if (!handles_[i]) continue;
      api.cuMemUnmap(address(i), page_size_);
      api.cuMemRelease(handles_[i]);
    }
    api.cuMemAddressFree(static_cast<CUdeviceptr>(base_), size());
    cudaGetLastError();
    if (prev != device_) cudaSetDevice(prev);
  }

  bool map(size_t offset, size_t bytes) override {
    const DriverApi& api = driver();
    CudaDeviceGuard g(device_, check);
    const size_t first = offset / page_size_;
    const size_t count = bytes / page_size_;
    if (handles_.size() < first + count) handles_.resize(first + count, 0);
    size_t created = 0;
    size_t mapped = 0;
    // On failure nothing stays mapped or created; false for out of memory, else throw.
    auto fail = [&](CUresult r, const std::string& what) {
      for (size_t i = first; i < first + mapped; ++i) api.cuMemUnmap(address(i), page_size_);
      for (size_t i = first; i < first + created; ++i) {
        api.cuMemRelease(handles_[i]);
        handles_[i] = 0;
      }
      trim();
      if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
      check_driver(r, what, device_);
      return false;
    };
    for (; created < count; ++created) {
      CUmemGenericAllocationHandle h = 0;
      const CUresult r = api.cuMemCreate(&h, page_size_, &prop_, 0);
      if (r != CUDA_SUCCESS) return fail(r, fmt::format("cuMemCreate({} bytes)", page_size_));
      handles_[first + created] = h;
    }
    for (; mapped < count; ++mapped) {
      const size_t i = first + mapped;
      const CUresult r = api.cuMemMap(address(i), page_size_, 0, handles_[i], 0);
      if (r != CUDA_SUCCESS)
        return fail(r, fmt::format("cuMemMap({} bytes at {:#x})", page_size_, address(i)));
    }
    CUmemAccessDesc access{};
    access.location = prop_.location;  // the device the pages are on
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    const CUresult r = api.cuMemSetAccess(address(first), bytes, &access, 1);
    if (r != CUDA_SUCCESS)
      return fail(r, fmt::format("cuMemSetAccess({} bytes at {:#x})", bytes, address(first)));
    return true;
  }

  void unmap(size_t offset, size_t bytes, size_t& done) override {
    const DriverApi& api = driver();
    CudaDeviceGuard g(device_, check);
    done = 0;
    // Unlike cudaFree, cuMemUnmap and cuMemRelease do not wait for the GPU: wait first.
    // PyTorch waits for the segment's stream; Tally for the device (the allocator has just
    // done so before releasing anything, so this costs nothing, and works when the stream
    // the segment was made for has been destroyed since).
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (before unmapping pages)", device_);
    const size_t first = offset / page_size_;
    for (size_t i = first; i < first + bytes / page_size_; ++i) {
      check_driver(api.cuMemUnmap(address(i), page_size_),
                   fmt::format("cuMemUnmap({} bytes at {:#x})", page_size_, address(i)), device_);
      const CUmemGenericAllocationHandle h = handles_[i];
      handles_[i] = 0;
      done += page_size_;  // unmapped: the allocator must forget it even if the release fails
      check_driver(api.cuMemRelease(h), "cuMemRelease", device_);
    }
    trim();
  }

 private:
  CUdeviceptr address(size_t page) const {
    return static_cast<CUdeviceptr>(base_ + page * page_size_);
  }
  void trim() {
    while (!handles_.empty() && !handles_.back()) handles_.pop_back();
  }

  int device_;
  CUmemAllocationProp prop_;
  std::vector<CUmemGenericAllocationHandle> handles_;  // by page; 0 = not mapped
};

}  // namespace

CudaProvider::CudaProvider(int device) : device_(device) {}

// Asked once: the visible devices are fixed when the runtime initialises
// (CUDA_VISIBLE_DEVICES is read then), and get_allocator asks on every CUDA allocation.
int CudaProvider::device_count() {
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky "no device" error
      return 0;
    }
    return n;
  }();
  return count;
}

int CudaProvider::multiprocessor_count(int device) {
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(
        fmt::format("cudaDeviceGetAttribute(multiProcessorCount) failed for cuda:{}", device));
  }
  return n;
}

std::string CudaProvider::product_name(int device) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(fmt::format("cudaGetDeviceProperties failed for cuda:{}", device));
  }
  return prop.name;
}

bool CudaProvider::virtual_memory_supported(int device) {
  if (device < 0 || device >= device_count()) return false;  // (initialises the runtime)
  const DriverApi& api = driver();
  if (!api.missing.empty()) return false;
  CUdevice dev = 0;
  int supported = 0;
  return api.cuDeviceGet(&dev, device) == CUDA_SUCCESS &&
         api.cuDeviceGetAttribute(&supported,
                                  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                  dev) == CUDA_SUCCESS &&
         supported != 0;
}

std::unique_ptr<ExpandableSegment> CudaProvider::create_expandable_segment(StreamId /*stream*/,
                                                                           size_t page_size,
                                                                           size_t pages) {
  const DriverApi& api = driver_or_throw(device_);
  CudaDeviceGuard g(device_, check);
  // The driver calls below and the segment's need the device's context: cudaSetDevice makes
  // the runtime's primary context (CUDA 12+) and current.
  check(cudaSetDevice(device_), "cudaSetDevice", device_);
  CUdevice dev = 0;
  check_driver(api.cuDeviceGet(&dev, device_), "cuDeviceGet", device_);
  int supported = 0;
  check_driver(api.cuDeviceGetAttribute(
                   &supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
               "cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)",
               device_);
  if (!supported)
    throw std::runtime_error(fmt::format(
        "expandable_segments: cuda:{} does not support the CUDA virtual memory API "
        "(cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) is 0); "
        "set expandable_segments:False in TALLY_ALLOC_CONF",
        device_));
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  // As PyTorch: pages NCCL can register for GPUDirect RDMA where the device allows it.
  int rdma = 0;
  if (api.cuDeviceGetAttribute(&rdma, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                               dev) == CUDA_SUCCESS &&
      rdma)
    prop.allocFlags.gpuDirectRDMACapable = 1;
  size_t granularity = 0;
  check_driver(
      api.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
      "cuMemGetAllocationGranularity", device_);
  if (granularity == 0 || page_size % granularity != 0)
    throw std::invalid_argument(fmt::format(
        "expandable_segments on cuda:{}: pages of {} bytes are not a multiple of the device's "
        "allocation granularity, {} bytes (cuMemGetAllocationGranularity)",
        device_, page_size, granularity));
  const size_t bytes = base::checked_mul(
      page_size, pages, "CudaProvider::create_expandable_segment: the segment's size");
  CUdeviceptr base = 0;
  check_driver(api.cuMemAddressReserve(&base, bytes, 0, 0, 0),
               fmt::format("cuMemAddressReserve({} bytes)", bytes), device_);
  return std::make_unique<CudaExpandableSegment>(device_, base, page_size, pages, prop);
}

std::string CudaProvider::device_name() const {
  return fmt::format("cuda:{}", device_);
}

void* CudaProvider::allocate(size_t bytes) {
  CudaDeviceGuard g(device_, check);
  void* p = nullptr;
  // The allocator makes a graph-private pool's segments while a graph is captured.
  const RelaxedCapture relaxed;
  const cudaError_t err = cudaMalloc(&p, bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // not sticky: clear it so later launches do not see it
    return nullptr;
  }
  check(err, "cudaMalloc", device_);
  return p;
}

void CudaProvider::deallocate(void* ptr, size_t /*bytes*/) {
  CudaDeviceGuard g(device_, check);
  check(cudaFree(ptr), "cudaFree", device_);
}

size_t CudaProvider::total_memory() const {
  CudaDeviceGuard g(device_, check);
  size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo", device_);
  return total;
}

size_t CudaProvider::free_memory() const {
  CudaDeviceGuard g(device_, check);
  size_t free = 0, total = 0;
  check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo", device_);
  return free;
}

void CudaProvider::synchronize() {
  CudaDeviceGuard g(device_, check);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", device_);
}

EventId CudaProvider::record_event(StreamId stream) {
  CudaDeviceGuard g(device_, check);
  cudaEvent_t ev = nullptr;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate", device_);
  check(cudaEventRecord(ev, reinterpret_cast<cudaStream_t>(stream)), "cudaEventRecord", device_);
  return reinterpret_cast<EventId>(ev);
}

bool CudaProvider::query_event(EventId event) {
  CudaDeviceGuard g(device_, check);
  const cudaError_t err = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(err, "cudaEventQuery", device_);
  return true;
}

void CudaProvider::destroy_event(EventId event) {
  CudaDeviceGuard g(device_, check);
  cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event));
}

}  // namespace tally::memory
