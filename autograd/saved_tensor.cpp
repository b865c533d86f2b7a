#include "autograd/saved_tensor.h"

#include <fmt/format.h>

#include <vector>

namespace tally {
namespace {
thread_local std::vector<std::shared_ptr<SavedTensorHooks>> tls_hooks;
}

Tensor product_output(const std::function<Tensor()>& compute) {
  if (!tls_hooks.empty() && tls_hooks.back()->product) {
    const std::shared_ptr<SavedTensorHooks> hooks = tls_hooks.back();  // compute may push more
    return hooks->product(compute);
  }
  return compute();
}

SavedTensorHooksScope::SavedTensorHooksScope(SavedTensorHooks hooks) {
  tls_hooks.push_back(std::make_shared<SavedTensorHooks>(std::move(hooks)));
}
SavedTensorHooksScope::~SavedTensorHooksScope() {
  tls_hooks.pop_back();
}

SavedTensor::SavedTensor(const Tensor& t, const char* what) : SavedTensor(t, what, true) {}

SavedTensor::SavedTensor(const Tensor& t, const char* what, bool apply_hooks) : what_(what) {
  if (!t.defined()) return;
  version_ = t.storage().version();
  if (apply_hooks && !tls_hooks.empty()) {
    hooks_ = tls_hooks.back();
    packed_ = hooks_->pack(t.detach());
    state_ = State::packed;
    return;
  }
  data_ = t.detach();
  state_ = State::held;
  const Storage& s = data_.storage();
  if (s.owned()) {
    counted_ = true;
    if (s.add_saved_ref() == 1 && s.category() == memory::Category::temporary)
      s.retag(memory::Category::activation);
  }
}

SavedTensor::~SavedTensor() {
  release();
}

SavedTensor::SavedTensor(SavedTensor&& o) noexcept {
  *this = std::move(o);
}

SavedTensor& SavedTensor::operator=(SavedTensor&& o) noexcept {
  if (this != &o) {
    release();
    state_ = o.state_;
    data_ = std::move(o.data_);
    packed_ = std::move(o.packed_);
    hooks_ = std::move(o.hooks_);
    version_ = o.version_;
    what_ = o.what_;
    counted_ = o.counted_;
    o.state_ = State::empty;
    o.counted_ = false;
  }
  return *this;
}

void SavedTensor::release() {
  if (state_ == State::empty || state_ == State::released) return;
  if (counted_) {
    const Storage& s = data_.storage();
    if (s.drop_saved_ref() == 0 && s.category() == memory::Category::activation)
      s.retag(memory::Category::temporary);
    counted_ = false;
  }
  data_ = Tensor();
  packed_.reset();
  hooks_.reset();
  state_ = State::released;
}

Tensor SavedTensor::unpack() const {
  switch (state_) {
    case State::empty:
      return Tensor();
    case State::released:
      throw std::runtime_error(fmt::format(
          "{}: trying to backward through the graph a second time (or access saved tensors "
          "after they have been freed); use backward(..., retain_graph=true) the first time",
          what_));
    case State::held:
      if (data_.storage().version() != version_)
        throw std::runtime_error(fmt::format(
            "{}: one of the tensors needed for gradient computation has been modified by an "
            "in-place operation (version {} saved, now {})",
            what_, version_, data_.storage().version()));
      return data_;
    case State::packed:
      return hooks_->unpack(packed_);
  }
  return Tensor();
}

}  // namespace tally
