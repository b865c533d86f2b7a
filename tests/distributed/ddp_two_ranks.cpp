// One rank of the 2-process DDP check, started by tools/tally_launch (ctest
// ddp_two_ranks_cuda). Exits 77 (skip) when fewer GPUs than ranks are visible. Each rank:
//   - checks the collectives: all_gather of its rank, all_reduce sum/avg, broadcast, barrier;
//   - trains 3 SGD steps of a small MLP (no batch norm) on its half of a global batch
//     through DDP (two buckets), and after each backward compares its gradients with
//     those of a plain copy of the model on the whole (concatenated) batch: relative
//     error <= 1e-5 in fp32; the models' parameters stay equal across ranks.
#include <fmt/format.h>

#include <cmath>
#include <cstdio>

#include "ddp_testing.h"
#include "memory/memory.h"

using namespace tally;

namespace {

int fail(const std::string& msg) {
  fmt::print(stderr, "FAIL: {}\n", msg);
  return 1;
}

double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

}  // namespace

int main() {
  try {
    const distributed::DistEnv env = distributed::DistEnv::from_env();
    if (!memory::cuda_available() || memory::cuda_device_count() < env.world_size) {
      fmt::print("SKIP: {} GPU(s) visible, {} ranks need one each\n",
                 memory::cuda_available() ? memory::cuda_device_count() : 0, env.world_size);
      return 77;
    }
    if (env.world_size < 2) return fail("run me with tools/tally_launch --nproc-per-node 2");
    const Device dev = Device::cuda(env.local_rank);
    auto pg = distributed::init_process_group(dev, env, std::chrono::seconds(60));
    if (pg->backend() != "nccl" || pg->rank() != env.rank || pg->size() != env.world_size)
      return fail(
          fmt::format("process group {} rank {} size {}", pg->backend(), pg->rank(), pg->size()));
    const int R = pg->size(), r = pg->rank();

    // ---- collectives ----
    {
      const std::vector<double> ranks =
          pg->all_gather(ops::from_vector({static_cast<double>(r)}, {}, DType::float32, dev))
              .tolist();
      for (int k = 0; k < R; ++k)
        if (ranks[static_cast<size_t>(k)] != k)
          return fail(fmt::format("all_gather: slot {} holds {}", k, ranks[k]));
      Tensor t = ops::from_vector({static_cast<double>(r + 1), 2.0}, {2}, DType::float32, dev);
      pg->all_reduce(t, distributed::ReduceOp::sum)->wait();
      const double sum = R * (R + 1) / 2.0;
      if (t.tolist() != std::vector<double>{sum, 2.0 * R}) return fail("all_reduce sum");
      Tensor a = ops::from_vector({static_cast<double>(r)}, {1}, DType::float32, dev);
      pg->all_reduce(a, distributed::ReduceOp::avg)->wait();
      if (std::abs(a.tolist()[0] - (R - 1) / 2.0) > 1e-6) return fail("all_reduce avg");
      Tensor b = ops::from_vector({static_cast<double>(r * 10 + 7)}, {1}, DType::int64, dev);
      pg->broadcast(b, 1)->wait();
      if (b.tolist()[0] != 17) return fail("broadcast from rank 1");
      pg->barrier();
    }

    // ---- DDP gradients == single-process gradients of the whole batch ----
    // Different seeds per rank: the initial broadcast must make the models equal.
    auto model = testing::make_mlp(100 + static_cast<uint64_t>(r), dev);
    distributed::DistributedDataParallel ddp(
        model, pg, {.bucket_cap_mb = 0.004, .first_bucket_cap_mb = 0.001});
    auto reference = testing::make_mlp(0, dev);
    reference->load_state_dict(model->state_dict());
    if (ddp.num_buckets() < 2) return fail("expected several buckets");
    optim::SGD opt(model->parameters(), optim::SGDOptions{.lr = 0.1});
    optim::SGD ref_opt(reference->parameters(), optim::SGDOptions{.lr = 0.1});
    const int64_t per_rank = 8;
    for (int step = 0; step < 3; ++step) {
      const testing::Batch full = testing::make_batch(step, per_rank * R, dev);
      const Tensor x = ops::contiguous(ops::narrow(full.x, 0, r * per_rank, per_rank));
      const Tensor y = ops::contiguous(ops::narrow(full.y, 0, r * per_rank, per_rank));
      opt.zero_grad(true);
      ref_opt.zero_grad(true);
      cross_entropy(ddp(x), y).backward();
      cross_entropy((*reference)(full.x), full.y).backward();
      const auto mp = model->parameters(), rp = reference->parameters();
      for (size_t i = 0; i < mp.size(); ++i) {
        const double e = rel_err(mp[i].grad().tolist(), rp[i].grad().tolist());
        if (!(e <= 1e-5))
          return fail(fmt::format("step {}: parameter {} ({}): relative error {:.3g} > 1e-5", step,
                                  i, ddp.parameter_names()[i], e));
      }
      opt.step();
      ref_opt.step();
      // Parameters identical on every rank: gather a checksum.
      double checksum = 0;
      for (const Tensor& p : model->parameters())
        for (double v : p.tolist()) checksum += v;
      const std::vector<double> all =
          pg->all_gather(ops::from_vector({checksum}, {}, DType::float64, dev)).tolist();
      for (double c : all)
        if (std::abs(c - all[0]) > 1e-6 * std::max(1.0, std::abs(all[0])))
          return fail(
              fmt::format("step {}: parameters differ across ranks ({} vs {})", step, c, all[0]));
    }
    if (!ddp.buckets_rebuilt()) return fail("buckets were not rebuilt after the first iteration");
    fmt::print(
        "rank {} of {}: OK ({} buckets, {} all-reduces, communication {} bytes)\n", r, R,
        ddp.num_buckets(), ddp.num_allreduces(),
        memory::get_allocator(dev).stats().cat_bytes(memory::Category::communication).current);
    pg->barrier();
    return 0;
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}
