// `--offload link` on the GPU (nn/offload.h, tensor/host_link.h): the host link's speed is
// measured once (a pinned device-to-host copy) and cached under the GPU's name, and a training
// step of a user's model with the policy gives the loss of the step without offload. Skips
// without a device.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "autograd/ops.h"
#include "memory/cuda_provider.h"
#include "nn/offload.h"
#include "optim/plan_training.h"
#include "tensor/host_link.h"
#include "testing/cuda_testing.h"
#include "testing/residual_mlp.h"

namespace tally {
namespace {

using testing::kGpu;

TEST(OffloadLinkCuda, TheLinkIsMeasuredOnceAndCachedUnderTheGpusName) {
  REQUIRE_GPU();
  const auto dir =
      std::filesystem::temp_directory_path() / ("tally_link_cuda_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  setenv("XDG_CACHE_HOME", dir.c_str(), 1);
  const double bw = ops::host_link_bandwidth(kGpu);
  // PCIe Gen4 x16 to Gen5 x16 (and NVLink-C2C below 1 TB/s).
  EXPECT_GT(bw, 5e9);
  EXPECT_LT(bw, 1e12);
  const auto cache = ops::read_host_link_cache(ops::host_link_cache_path());
  ASSERT_EQ(cache.count(memory::CudaProvider::product_name(0)), 1u);
  EXPECT_EQ(cache.at(memory::CudaProvider::product_name(0)), bw);
  EXPECT_EQ(ops::host_link_bandwidth(kGpu), bw);  // once per process
  unsetenv("XDG_CACHE_HOME");
  std::filesystem::remove_all(dir);
}

TEST(OffloadLinkCuda, ATrainingStepEqualsOneWithoutOffload) {
  REQUIRE_GPU();
  auto loss = [](nn::Module& m, const std::vector<Tensor>& b) {
    return cross_entropy(m(b[0]), b[1]);
  };
  manual_seed(1);
  const std::vector<Tensor> batch = {randn({256, 16}).to(kGpu), randint(0, 10, {256}).to(kGpu)};
  auto run = [&](const std::string& offload) {
    manual_seed(0);
    auto net = std::make_shared<testing::MyNet>(16, 64, 4, 10);
    net->to(kGpu);
    nn::PlanCandidate c;
    c.offload = nn::parse_offload_spec(offload);
    return nn::train_candidate(*net, c, loss, batch, 2, nn::TrainingPlanOptions{}).item();
  };
  EXPECT_EQ(run("link"), run("none"));
}

}  // namespace
}  // namespace tally
