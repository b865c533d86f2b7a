// The one dispatch point (design rule 7). Every op, CPU or CUDA, enters through a
// DispatchScope and picks its kernel from its family's kernel table by device. The scope is where
// the allocation context gets the op's name (and `temporary` when nothing more specific is set),
// and where the profiler's op events and NVTX ranges hook in.
//
//   Tensor ops::relu(const Tensor& x) {
//     static const OpInfo info("relu");
//     DispatchScope scope(info, x);
//     Tensor out = alloc_output(x.sizes(), x.dtype(), x.device());
//     elementwise_backends.get(info, x.device(), &ElementwiseKernels::unary)(UnaryOp::relu, out,
//     x); return out;
//   }
#pragma once

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

// Declares an op family's tables in its kernels.h: cpu::table, cuda::table and meta::table
// (defined in the backends' own files) and the registered Backends (defined in
// tensor/backends.cpp).
#define TALLY_DECLARE_KERNELS(Table, table, backends) \
  namespace cpu {                                     \
  extern const Table table;                           \
  }                                                   \
  namespace cuda {                                    \
  extern const Table table;                           \
  }                                                   \
  namespace meta {                                    \
  extern const Table table;                           \
  }                                                   \
  extern const Backends<Table> backends

// The error for an op without a kernel on device d.
[[noreturn]] void throw_no_kernel(const OpInfo& op, Device d);

// The kernels of one op family on each backend. An op family declares its kernel signatures
// once, as one kernel-table type: a struct of function pointers (tensor/norm/kernels.h:
// NormKernels). Each backend defines one constant table of that type in its own files
// (tensor/norm/cpu.cpp: cpu::norm_kernels; tensor/norm/cuda.cu: cuda::norm_kernels), and
// tensor/backends.cpp, the one registration point, puts them together:
//
//   const Backends<NormKernels> norm_backends{&cpu::norm_kernels, TALLY_CUDA_TABLE(...),
//                                             &meta::norm_kernels};
//
// so backend #ifdefs stand only in the backends' own files and there. An op picks its kernel
// by device:
//
//   norm_backends.get(info, x.device(), &NormKernels::layer_norm)(out, mean, rstd, ...);
//
// A backend without the family, or a table entry left null (an op the backend lacks), is an
// error naming the op and the device. All of it is constant-initialised (addresses of
// constants), so no static-initialisation order matters.
template <typename Table>
struct Backends;

// A backend's table for a registration line, or nullptr in a build without the backend: the
// one place the CUDA build switch is spelled for the ops.
#if defined(TALLY_WITH_CUDA)
#define TALLY_CUDA_TABLE(table) (&(table))
#else
#define TALLY_CUDA_TABLE(table) nullptr
#endif

template <typename Table>
struct Backends {
  const Table* cpu = nullptr;
  const Table* cuda = nullptr;
  // Shapes only (memory/meta.h): each entry allocates what the replayed backend's kernel
  // allocates and writes nothing.
  const Table* meta = nullptr;

  template <typename Fn>
  Fn* get(const OpInfo& op, Device d, Fn* Table::*kernel) const {
    const Table* table = d.type == DeviceType::cpu ? cpu : d.type == DeviceType::cuda ? cuda : meta;
    Fn* k = table ? table->*kernel : nullptr;
    if (!k) throw_no_kernel(op, d);
    return k;
  }
};

// Devices of all operands must agree.
void check_same_device(const char* op, Device a, Device b);

}  // namespace tally
