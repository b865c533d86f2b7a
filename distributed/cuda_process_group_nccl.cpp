// The NCCL backend of ProcessGroup: one communicator per process (one GPU each), a
// dedicated communication stream, and CUDA events ordering it with Tally's compute stream:
//   compute stream --event--> comm stream: collective --event--> (Work::wait) compute stream.
// Tensors used by a collective are recorded on the comm stream (Storage::record_stream),
// so the caching allocator does not hand their blocks out again before the collective ends.
// Built only with CUDA and NCCL (TALLY_WITH_NCCL).
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <cstring>
#include <stdexcept>

#include "base/enum_table.h"
#include "distributed/process_group.h"
#include "tensor/cuda/runtime.h"
#include "tensor/ops.h"

namespace tally::distributed {
namespace {

void check_nccl(ncclResult_t r, const char* what, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess) return;
  const char* last = comm ? ncclGetLastError(comm) : ncclGetLastError(nullptr);
  throw std::runtime_error(fmt::format("{}: NCCL error {} ({}){}{}", what, static_cast<int>(r),
                                       ncclGetErrorString(r), last && *last ? ": " : "",
                                       last ? last : ""));
}

ncclDataType_t nccl_dtype(DType d, const char* op) {
  // By DType's order; bool travels as bytes.
  static constexpr ncclDataType_t kTypes[] = {ncclFloat32, ncclFloat16, ncclBfloat16, ncclFloat64,
                                              ncclInt32,   ncclInt64,   ncclUint8};
  const ncclDataType_t t = base::enum_table<DType::bool_>(d, kTypes, ncclNumTypes);
  if (t == ncclNumTypes)
    throw std::invalid_argument(
        fmt::format("ProcessGroupNCCL::{}: unsupported dtype {}", op, dtype_name(d)));
  return t;
}

class NcclWork final : public Work {
 public:
  NcclWork(int device, cudaEvent_t done) : device_(device), done_(done) {}
  ~NcclWork() override { cudaEventDestroy(done_); }
  void wait() override {
    cuda::DeviceGuard g(device_);
    cuda::check(cudaStreamWaitEvent(cuda::stream(device_), done_, 0),
                "ProcessGroupNCCL: cudaStreamWaitEvent");
  }
  void synchronize() override {
    wait();
    cuda::check(cudaEventSynchronize(done_), "ProcessGroupNCCL: cudaEventSynchronize");
  }

 private:
  int device_;
  cudaEvent_t done_;
};

class NcclProcessGroup final : public ProcessGroup {
 public:
  NcclProcessGroup(Device device, const DistEnv& env, std::chrono::milliseconds timeout)
      : device_(device), rank_(env.rank), size_(env.world_size) {
    // This process's GPU becomes the current device for good (torch.cuda.set_device): code
    // that launches on the current device, and NCCL itself, then use the right GPU.
    cuda::check(cudaSetDevice(device_.index), "init_process_group: cudaSetDevice");
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    if (rank_ == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::vector<uint8_t> bytes(reinterpret_cast<uint8_t*>(&id),
                               reinterpret_cast<uint8_t*>(&id) + sizeof(id));
    bytes = exchange_bytes({.host = env.master_addr,
                            .port = env.master_port,
                            .rank = rank_,
                            .world_size = size_,
                            .timeout = timeout},
                           bytes);
    if (bytes.size() != sizeof(id))
      throw std::runtime_error(
          fmt::format("init_process_group: received a unique id of {} bytes, expected {}",
                      bytes.size(), sizeof(id)));
    std::memcpy(&id, bytes.data(), sizeof(id));
    check_nccl(
        ncclCommInitRank(&comm_, size_, id, rank_),
        fmt::format("ncclCommInitRank (rank {} of {}, {})", rank_, size_, device_.str()).c_str());
    cuda::check(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking),
                "ProcessGroupNCCL: comm stream");
    cuda::check(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming),
                "ProcessGroupNCCL: cudaEventCreate");
  }

  ~NcclProcessGroup() override {
    cuda::DeviceGuard g(device_.index);
    cudaStreamSynchronize(comm_stream_);
    if (comm_) ncclCommDestroy(comm_);
    cudaEventDestroy(ready_);
    cudaStreamDestroy(comm_stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return device_; }
  std::string backend() const override { return "nccl"; }

  std::shared_ptr<Work> all_reduce(const Tensor& t, ReduceOp op) override {
    check(t, "all_reduce");
    return enqueue({t}, [&](cudaStream_t s) {
      check_nccl(ncclAllReduce(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()),
                               nccl_dtype(t.dtype(), "all_reduce"),
                               op == ReduceOp::avg ? ncclAvg : ncclSum, comm_, s),
                 "ncclAllReduce", comm_);
    });
  }

  std::shared_ptr<Work> broadcast(const Tensor& t, int root) override {
    check(t, "broadcast");
    if (root < 0 || root >= size_)
      throw std::invalid_argument(
          fmt::format("ProcessGroupNCCL::broadcast: root {} of world size {}", root, size_));
    return enqueue({t}, [&](cudaStream_t s) {
      check_nccl(ncclBroadcast(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()),
                               nccl_dtype(t.dtype(), "broadcast"), root, comm_, s),
                 "ncclBroadcast", comm_);
    });
  }

  Tensor all_gather(const Tensor& t) override {
    check(t, "all_gather");
    Shape shape = t.sizes();
    shape.insert(shape.begin(), size_);
    Tensor out = ops::empty(shape, t.dtype(), device_);
    enqueue({t, out}, [&](cudaStream_t s) {
      check_nccl(ncclAllGather(t.data_ptr(), out.data_ptr(), static_cast<size_t>(t.numel()),
                               nccl_dtype(t.dtype(), "all_gather"), comm_, s),
                 "ncclAllGather", comm_);
    })->wait();
    return out;
  }

  void barrier() override {
    Tensor one = ops::ones({1}, DType::float32, device_);
    all_reduce(one, ReduceOp::sum)->synchronize();
  }

 private:
  void check(const Tensor& t, const char* op) const {
    if (!t.defined())
      throw std::invalid_argument(fmt::format("ProcessGroupNCCL::{}: undefined tensor", op));
    if (!(t.device() == device_))
      throw std::invalid_argument(
          fmt::format("ProcessGroupNCCL::{}: tensor on {} but the group (rank {}) is on {}", op,
                      t.device().str(), rank_, device_.str()));
    if (!t.is_contiguous())
      throw std::invalid_argument(fmt::format(
          "ProcessGroupNCCL::{}: tensor of shape {} is not contiguous", op, t.shape_string()));
  }

  // Orders the comm stream after the compute stream, runs `launch` there, and returns the
  // Work whose event marks its end.
  template <typename Launch>
  std::shared_ptr<Work> enqueue(std::initializer_list<Tensor> tensors, Launch&& launch) {
    cuda::DeviceGuard g(device_.index);
    cudaStream_t compute = cuda::stream(device_.index);
    cuda::check(cudaEventRecord(ready_, compute), "ProcessGroupNCCL: cudaEventRecord");
    cuda::check(cudaStreamWaitEvent(comm_stream_, ready_, 0),
                "ProcessGroupNCCL: cudaStreamWaitEvent");
    launch(comm_stream_);
    for (const Tensor& t : tensors)
      t.storage().record_stream(reinterpret_cast<memory::StreamId>(comm_stream_));
    cudaEvent_t done = nullptr;
    cuda::check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming),
                "ProcessGroupNCCL: cudaEventCreate");
    cuda::check(cudaEventRecord(done, comm_stream_), "ProcessGroupNCCL: cudaEventRecord");
    return std::make_shared<NcclWork>(device_.index, done);
  }

  Device device_;
  int rank_;
  int size_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
};

}  // namespace

std::shared_ptr<ProcessGroup> make_nccl_process_group(Device device, const DistEnv& env,
                                                      std::chrono::milliseconds timeout) {
  if (device.type != DeviceType::cuda)
    throw std::invalid_argument(
        fmt::format("make_nccl_process_group: device {} is not CUDA", device.str()));
  return std::make_shared<NcclProcessGroup>(device, env, timeout);
}

}  // namespace tally::distributed
