// ProcessGroup: the collectives data parallelism needs (torch.distributed's all_reduce,
// broadcast, all_gather, barrier) over one process per device. Two backends:
//   - "local": world size 1, any device; every collective is a no-op (all_gather stacks the
//     one tensor), so the DDP wrapper runs unchanged on the CPU and in single-GPU runs;
//   - "nccl": CUDA tensors, one GPU per process; collectives run on a dedicated
//     communication stream, ordered after Tally's compute stream by a CUDA event and
//     awaited by the compute stream through another (Work::wait: no host synchronisation).
//
//   auto pg = distributed::init_process_group(Device::cuda(env.local_rank));  // from RANK, ...
//   pg->all_reduce(t, distributed::ReduceOp::avg)->wait();
#pragma once

#include <memory>
#include <string>

#include "distributed/rendezvous.h"
#include "tensor/tensor.h"

namespace tally::distributed {

enum class ReduceOp { sum, avg };

// An enqueued collective. wait() makes Tally's compute stream wait for it (CUDA: a
// cudaStreamWaitEvent, no host synchronisation); for the local backend it does nothing.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  // Blocks the host until the collective has finished (tests, measurement points).
  virtual void synchronize() { wait(); }
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Device device() const = 0;
  virtual std::string backend() const = 0;

  // In place: every rank's `t` becomes the sum (or mean) over ranks. `t` must be
  // contiguous, on device(), and the same shape and dtype on every rank.
  virtual std::shared_ptr<Work> all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum) = 0;
  // In place: every rank's `t` becomes root's.
  virtual std::shared_ptr<Work> broadcast(const Tensor& t, int root = 0) = 0;
  // A new tensor [size(), *t.shape] holding every rank's `t` in rank order (small tensors:
  // scalars, counters). The compute stream is already ordered after the gather.
  virtual Tensor all_gather(const Tensor& t) = 0;
  // Returns once every rank has reached it (a host synchronisation by design).
  virtual void barrier() = 0;
};

// World size 1 on any device.
class LocalProcessGroup final : public ProcessGroup {
 public:
  explicit LocalProcessGroup(Device device = Device::cpu()) : device_(device) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  Device device() const override { return device_; }
  std::string backend() const override { return "local"; }
  std::shared_ptr<Work> all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum) override;
  std::shared_ptr<Work> broadcast(const Tensor& t, int root = 0) override;
  Tensor all_gather(const Tensor& t) override;
  void barrier() override {}

 private:
  Device device_;
};

// Whether this build has the NCCL backend.
bool nccl_available();

// The process group of this process from torchrun's environment variables (DistEnv):
// WORLD_SIZE 1 (or unset): a LocalProcessGroup on `device`; otherwise NCCL on `device`
// (which must be CUDA; the ncclUniqueId travels from rank 0 over TCP at
// MASTER_ADDR:MASTER_PORT), which also makes `device` the process's current CUDA device
// (torch.cuda.set_device). Throws std::runtime_error when NCCL is needed but missing.
std::shared_ptr<ProcessGroup> init_process_group(
    Device device, const DistEnv& env = DistEnv::from_env(),
    std::chrono::milliseconds timeout = std::chrono::seconds(300));

// A NCCL process group (cuda_process_group_nccl.cpp; only in builds with NCCL).
std::shared_ptr<ProcessGroup> make_nccl_process_group(Device device, const DistEnv& env,
                                                      std::chrono::milliseconds timeout);

}  // namespace tally::distributed
