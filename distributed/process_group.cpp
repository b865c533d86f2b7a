#include "distributed/process_group.h"

#include <fmt/format.h>

#include <stdexcept>

#include "tensor/ops.h"

namespace tally::distributed {
namespace {

struct DoneWork final : Work {
  void wait() override {}
};

void check_local(const Tensor& t, Device device, const char* op) {
  if (!t.defined())
    throw std::invalid_argument(fmt::format("ProcessGroup::{}: undefined tensor", op));
  if (!(t.device() == device))
    throw std::invalid_argument(fmt::format("ProcessGroup::{}: tensor on {} but the group is on {}",
                                            op, t.device().str(), device.str()));
}

}  // namespace

std::shared_ptr<Work> LocalProcessGroup::all_reduce(const Tensor& t, ReduceOp) {
  check_local(t, device_, "all_reduce");
  return std::make_shared<DoneWork>();
}

std::shared_ptr<Work> LocalProcessGroup::broadcast(const Tensor& t, int root) {
  check_local(t, device_, "broadcast");
  if (root != 0)
    throw std::invalid_argument(
        fmt::format("ProcessGroup::broadcast: root {} of world size 1", root));
  return std::make_shared<DoneWork>();
}

Tensor LocalProcessGroup::all_gather(const Tensor& t) {
  check_local(t, device_, "all_gather");
  return ops::unsqueeze(ops::clone(t), 0);
}

bool nccl_available() {
#ifdef TALLY_WITH_NCCL
  return true;
#else
  return false;
#endif
}

std::shared_ptr<ProcessGroup> init_process_group(Device device, const DistEnv& env,
                                                 std::chrono::milliseconds timeout) {
  if (env.world_size <= 1) return std::make_shared<LocalProcessGroup>(device);
  if (device.type != DeviceType::cuda)
    throw std::runtime_error(
        fmt::format("init_process_group: WORLD_SIZE={} needs CUDA devices (NCCL), got device {}",
                    env.world_size, device.str()));
  if (!nccl_available())
    throw std::runtime_error(
        fmt::format("init_process_group: WORLD_SIZE={} needs NCCL, and this build has none "
                    "(TALLY_WITH_NCCL off)",
                    env.world_size));
#ifdef TALLY_WITH_NCCL
  return make_nccl_process_group(device, env, timeout);
#else
  (void)timeout;
  return nullptr;
#endif
}

}  // namespace tally::distributed
