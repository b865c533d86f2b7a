#include "tensor/dispatch.h"

#include <fmt/format.h>

#include <atomic>
#include <stdexcept>

namespace tally {
namespace {
std::atomic<DispatchObserver*> g_observer{nullptr};
}

void set_dispatch_observer(DispatchObserver* observer) {
  g_observer.store(observer);
}
DispatchObserver* dispatch_observer() {
  return g_observer.load(std::memory_order_acquire);
}

// An op's output with no more specific category is a temporary until autograd saves it
// (activation) or accumulates it into .grad (gradient): never `unknown`.
memory::Category detail::dispatch_op_category() {
  const memory::Category c = memory::current_tag().category;
  return c == memory::Category::unknown ? memory::Category::temporary : c;
}

DispatchScope::DispatchScope(const OpInfo& op, Device device)
    : op_(op),
      device_(device),
      op_scope_(op.id),
      category_scope_(detail::dispatch_op_category()),
      observer_(dispatch_observer()) {
  if (observer_) observer_->on_enter(op_, device_, nullptr);
}

DispatchScope::~DispatchScope() {
  if (observer_) observer_->on_exit(op_, device_);
}

void throw_no_kernel(const OpInfo& op, Device d) {
  throw std::runtime_error(
      fmt::format("{}: no kernel for device {}{}", op.name, d.str(),
                  d.type == DeviceType::cuda   ? " (this op has no CUDA kernel yet)"
                  : d.type == DeviceType::meta ? " (this op has no meta kernel: a dry run cannot "
                                                 "count its memory)"
                                               : ""));
}

void check_same_device(const char* op, Device a, Device b) {
  if (!(a == b))
    throw std::invalid_argument(fmt::format(
        "{}: expected all tensors on the same device, got {} and {}", op, a.str(), b.str()));
}

}  // namespace tally
