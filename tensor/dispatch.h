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
#include <vector>

#include "memory/context.h"
#include "tensor/dtype.h"
#include "tensor/storage.h"

namespace tally {

struct OpInfo {
  explicit OpInfo(const char* n) : name(n), id(memory::intern(n)) {}
  const char* name;
  memory::StrId id;
};

// The tensor inputs of an op as the profiler records them (record_shapes): pointers to
// their sizes and their dtypes, valid only during DispatchObserver::on_enter.
struct OpInputs {
  static constexpr int kMax = 8;
  const std::vector<int64_t>* sizes[kMax] = {};
  DType dtypes[kMax] = {};
  int count = 0;
};

// Observers of op entry/exit (the profiler). Called only when installed: when none is,
// an op pays one pointer check. `inputs` is null when the op did not name its inputs.
struct DispatchObserver {
  virtual ~DispatchObserver() = default;
  virtual void on_enter(const OpInfo& op, Device device, const OpInputs* inputs) = 0;
  virtual void on_exit(const OpInfo& op, Device device) = 0;
};
void set_dispatch_observer(DispatchObserver* observer);
DispatchObserver* dispatch_observer();

namespace detail {
// `temporary` unless a more specific category is set (never `unknown`).
memory::Category dispatch_op_category();
}  // namespace detail

class DispatchScope {
 public:
  DispatchScope(const OpInfo& op, Device device);
  // The device is the first tensor's; the tensors' shapes go to the observer (undefined
  // tensors, e.g. an absent bias, are skipped).
  template <typename T0, typename... Ts>
    requires requires(const T0& t) {
      t.sizes();
      t.device();
    }
  DispatchScope(const OpInfo& op, const T0& first, const Ts&... rest)
      : op_(op),
        device_(first.device()),
        op_scope_(op.id),
        category_scope_(detail::dispatch_op_category()),
        observer_(dispatch_observer()) {
    if (observer_) {
      OpInputs in;
      add_input(in, first);
      (add_input(in, rest), ...);
      observer_->on_enter(op_, device_, &in);
    }
  }
  ~DispatchScope();
  DispatchScope(const DispatchScope&) = delete;
  DispatchScope& operator=(const DispatchScope&) = delete;

 private:
  template <typename T>
  static void add_input(OpInputs& in, const T& t) {
    if (in.count == OpInputs::kMax || !t.defined()) return;
    in.sizes[in.count] = &t.sizes();
    in.dtypes[in.count] = t.dtype();
    ++in.count;
  }

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
