// The one dispatch point (design rule 7). Every op, CPU or CUDA, enters through a
// DispatchScope and picks its kernel from a KernelTable by device. The scope is where the
// allocation context gets the op's name (and `temporary` when nothing more specific is
// set), and where the profiler's op events and NVTX ranges hook in.
//
//   Tensor ops::relu(const Tensor& x) {
//     static const OpInfo info("relu");
//     DispatchScope scope(info, x.device());
//     return relu_kernels.get(info, x.device())(x);
//   }
#pragma once

#include <fmt/format.h>

#include <stdexcept>

#include "memory/context.h"
#include "tensor/storage.h"

namespace tally {

struct OpInfo {
  explicit OpInfo(const char* n) : name(n), id(memory::intern(n)) {}
  const char* name;
  memory::StrId id;
};

// Observers of op entry/exit (the profiler). Called only when installed.
struct DispatchObserver {
  virtual ~DispatchObserver() = default;
  virtual void on_enter(const OpInfo& op, Device device) = 0;
  virtual void on_exit(const OpInfo& op, Device device) = 0;
};
void set_dispatch_observer(DispatchObserver* observer);
DispatchObserver* dispatch_observer();

class DispatchScope {
 public:
  DispatchScope(const OpInfo& op, Device device);
  ~DispatchScope();
  DispatchScope(const DispatchScope&) = delete;
  DispatchScope& operator=(const DispatchScope&) = delete;

 private:
  const OpInfo& op_;
  Device device_;
  memory::OpScope op_scope_;
  memory::CategoryScope category_scope_;
  DispatchObserver* observer_;
};

// Kernels of one op by device type. Constant-initialised, so a CUDA translation unit can
// fill its slot during static initialisation.
template <typename Fn>
struct KernelTable {
  Fn* cpu = nullptr;
  Fn* cuda = nullptr;

  Fn* get(const OpInfo& op, Device d) const {
    Fn* k = d.type == DeviceType::cpu ? cpu : cuda;
    if (!k)
      throw std::runtime_error(fmt::format("{}: no kernel for device {}{}", op.name, d.str(),
                                           d.type == DeviceType::cuda
                                               ? " (this op has no CUDA kernel yet)"
                                               : ""));
    return k;
  }
};

// Devices of all operands must agree.
void check_same_device(const char* op, Device a, Device b);

}  // namespace tally
