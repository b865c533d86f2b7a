// Device-parameterised op tests. Every op family has one test file,
// tests/tensor/<family>/test_<family>.cpp, compiled twice (tally_device_test in
// tests/CMakeLists.txt): test_<family> runs its cases on the CPU (ctest label cpu) and
// test_<family>_cuda runs the very same cases on CUDA device 0 (label gpu; each case skips,
// with a message, when no device is present). The file is written once, against dev().
//
// Two kinds of suites:
//   - OnDevice suites (TALLY_ON_DEVICES): hand-computed values, float64 gradient checks,
//     saved tensors and errors; they run on every device the binary is built for.
//   - VsCpu suites (TALLY_VS_CPU): a device's kernel against the CPU reference kernel over
//     random inputs, dtypes and layouts; they run on the accelerators only (on the CPU they
//     would compare the reference with itself), so the CPU binary leaves them out.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "memory/memory.h"
#include "testing/gradcheck.h"

namespace tally::testing {

// The devices this binary's suites run on.
inline std::vector<Device> test_devices() {
#ifdef TALLY_TEST_CUDA
  return {Device::cuda(0)};
#else
  return {Device::cpu()};
#endif
}

// The accelerators among them (empty in the CPU binary).
inline std::vector<Device> accelerator_devices() {
  std::vector<Device> out;
  for (const Device& d : test_devices())
    if (d.type != DeviceType::cpu) out.push_back(d);
  return out;
}

// "cpu", "cuda0": the parameter's part of a test's name.
inline std::string device_test_name(const ::testing::TestParamInfo<Device>& info) {
  return info.param.type == DeviceType::cpu ? "cpu" : "cuda" + std::to_string(info.param.index);
}

// The fixture of a device-parameterised suite: dev() is the device under test; a case on a
// CUDA device skips when the build or the machine has none.
class OnDevice : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override {
    if (dev().type == DeviceType::cuda && !memory::cuda_available())
      GTEST_SKIP() << "no CUDA device present";
  }
  Device dev() const { return GetParam(); }
  bool on_cpu() const { return dev().type == DeviceType::cpu; }
  // Options for tensors made directly on the device under test.
  TensorOptions on(TensorOptions o) const { return o.with_device(dev()); }
  // A copy of t on the device under test (same dtype; not recorded by autograd).
  Tensor put(const Tensor& t) const { return ops::to(t, dev(), t.dtype()); }
  // A leaf on the device under test with t's values, requiring grad.
  Tensor leaf(const Tensor& t) const {
    Tensor d = ops::to(t, dev(), t.dtype(), /*copy=*/true);
    d.requires_grad_(true);
    return d;
  }
};

// A fixture for VsCpu suites: the same as OnDevice, run on accelerators only.
class VsCpu : public OnDevice {};

// gradcheck (float64 central differences, on the CPU) of fn computed on `device`: the CPU
// leaves are copied to the device inside the differentiated function (Tensor::to is
// differentiable), fn runs there, its output comes back to the CPU. The analytic gradient
// is the device's backward.
inline ::testing::AssertionResult gradcheck_on(Device device, const Fn& fn,
                                               const TensorList& inputs, double eps = 1e-6,
                                               double atol = 1e-6, double rtol = 1e-4) {
  if (device.type == DeviceType::cpu) return gradcheck(fn, inputs, eps, atol, rtol);
  const Fn moved = [&](const TensorList& in) {
    TensorList on;
    for (const Tensor& t : in) on.push_back(t.defined() ? t.to(device) : t);
    return fn(on).to(Device::cpu());
  };
  return gradcheck(moved, inputs, eps, atol, rtol);
}

}  // namespace tally::testing

// Instantiates a suite of TEST_P cases on every device of this binary.
#define TALLY_ON_DEVICES(Suite)                                                            \
  INSTANTIATE_TEST_SUITE_P(, Suite, ::testing::ValuesIn(::tally::testing::test_devices()), \
                           ::tally::testing::device_test_name)

// Instantiates a VsCpu suite on this binary's accelerators (none in the CPU binary).
#define TALLY_VS_CPU(Suite)                                                                       \
  GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Suite);                                           \
  INSTANTIATE_TEST_SUITE_P(, Suite, ::testing::ValuesIn(::tally::testing::accelerator_devices()), \
                           ::tally::testing::device_test_name)
