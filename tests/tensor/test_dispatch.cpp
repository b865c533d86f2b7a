// The dispatch point's kernel tables: a backend's entry is found by device, and an op a
// backend lacks (no table, or a null entry) is an error naming the op and the device.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "tensor/dispatch.h"

namespace tally {
namespace {

int twice(int x) {
  return 2 * x;
}
int thrice(int x) {
  return 3 * x;
}

struct ToyKernels {
  int (*scale)(int);
  int (*other)(int);
};

const ToyKernels kCpuToy{.scale = &twice, .other = nullptr};
const ToyKernels kCudaToy{.scale = &thrice, .other = &thrice};

std::string error_of(const Backends<ToyKernels>& b, const OpInfo& op, Device d,
                     int (*ToyKernels::*k)(int)) {
  try {
    b.get(op, d, k);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

TEST(Dispatch, PicksTheDevicesKernel) {
  static const OpInfo op("toy_scale");
  const Backends<ToyKernels> both{&kCpuToy, &kCudaToy};
  EXPECT_EQ(both.get(op, Device::cpu(), &ToyKernels::scale)(5), 10);
  EXPECT_EQ(both.get(op, Device::cuda(0), &ToyKernels::scale)(5), 15);
}

TEST(Dispatch, MissingKernelNamesTheOpAndDevice) {
  static const OpInfo op("toy_other");
  const Backends<ToyKernels> cpu_only{&kCpuToy, nullptr};
  const std::string null_entry = error_of(cpu_only, op, Device::cpu(), &ToyKernels::other);
  EXPECT_NE(null_entry.find("toy_other"), std::string::npos) << null_entry;
  EXPECT_NE(null_entry.find("cpu"), std::string::npos) << null_entry;
  const std::string no_table = error_of(cpu_only, op, Device::cuda(0), &ToyKernels::scale);
  EXPECT_NE(no_table.find("toy_other"), std::string::npos) << no_table;
  EXPECT_NE(no_table.find("cuda"), std::string::npos) << no_table;
}

}  // namespace
}  // namespace tally
