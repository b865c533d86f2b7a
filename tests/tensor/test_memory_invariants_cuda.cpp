// Design rule 2 on CUDA, for raw ops (test_memory_invariants.cpp's MLP and CNN on the GPU's
// allocator): after forward the bytes tagged `activation` are exactly the bytes held by
// saved tensors, after backward none are left and `gradient` equals the parameters' size,
// nothing is `unknown`. Plus the `workspace` category: cuBLASLt's workspace (a linear
// forward + backward), cuDNN's (a conv2d forward + backward; its fused attention's backward)
// come from the caching allocator under the op that used them, and are returned when the op has
// been enqueued. Skips without a device.
#include <unordered_set>

#include "memory/invariants.h"
#include "tensor/attention/autograd.h"
#include "tensor/attention/cuda.h"
#include "tensor/conv/autograd.h"
#include "tensor/cuda/cudnn.h"
#include "tensor/linalg/cuda.h"
#include "tensor/norm/autograd.h"
#include "tensor/pool/autograd.h"
#include "tensor/softmax/autograd.h"
#include "testing/cuda_testing.h"

namespace tally {
namespace {

using memory::Category;
using testing::kGpu;

memory::CachingAllocator& gpu_alloc() {
  return memory::get_allocator(kGpu);
}
int64_t bytes(Category c) {
  return gpu_alloc().stats().cat_bytes(c).current;
}

// Sum of the blocks held by the graph's saved tensors, each storage once, leaving out
// parameters and inputs (saved, but not activations).
int64_t saved_activation_bytes(const Tensor& root) {
  std::unordered_set<const void*> storages;
  std::unordered_set<autograd::Node*> seen;
  std::vector<autograd::Node*> stack{root.autograd_meta()->grad_fn.get()};
  int64_t total = 0;
  while (!stack.empty()) {
    autograd::Node* n = stack.back();
    stack.pop_back();
    if (!n || !seen.insert(n).second) continue;
    for (const SavedTensor* s : n->saved_tensors()) {
      const Tensor& t = s->held();
      if (!t.defined() || !storages.insert(t.storage().key()).second) continue;
      EXPECT_TRUE(t.is_cuda()) << n->name() << " saved a host tensor";
      const Category c = t.storage().category();
      if (c == Category::parameter || c == Category::input) continue;
      EXPECT_EQ(c, Category::activation)
          << n->name() << " saved a " << memory::category_name(c) << " block";
      total += static_cast<int64_t>(t.storage().block_bytes());
    }
    for (const autograd::Edge& e : n->next_edges) stack.push_back(e.fn.get());
  }
  return total;
}

Tensor param(const Shape& shape, uint64_t seed, double scale) {
  Tensor host = testing::rand_tensor(shape, DType::float32, seed, -scale, scale);
  memory::CategoryScope c(Category::parameter);
  Tensor t = ops::to(host, kGpu, DType::float32);
  t.requires_grad_(true);
  return t;
}

Tensor input(const Tensor& host) {
  memory::CategoryScope c(Category::input);
  return ops::to(host, kGpu, host.dtype());
}

int64_t block_bytes(const TensorList& ts) {
  int64_t n = 0;
  for (const Tensor& t : ts) n += static_cast<int64_t>(t.storage().block_bytes());
  return n;
}

void restart_history() {
  gpu_alloc().record_memory_history(false);
  gpu_alloc().record_memory_history(true, 100'000);
}

// Allocations in the history tagged `category` (and, for workspaces, returned by the end).
struct Scan {
  int64_t unknown = 0;
  int64_t workspace_allocs = 0;
  int64_t workspace_frees = 0;
  std::vector<std::string> workspace_ops;
  size_t workspace_max = 0;
};

Scan scan() {
  Scan s;
  std::unordered_set<uint64_t> live;
  for (const memory::TraceEntry& e : gpu_alloc().history()) {
    const bool tags =
        e.action == memory::TraceAction::alloc || e.action == memory::TraceAction::retag;
    if (tags && e.tag.category == Category::unknown) {
      ++s.unknown;
      ADD_FAILURE() << memory::trace_action_name(e.action) << " of " << e.size
                    << " B tagged unknown (op '" << memory::interned(e.tag.op) << "', "
                    << e.tag.loc.file << ":" << e.tag.loc.line << ")";
    }
    if (e.action == memory::TraceAction::alloc && e.tag.category == Category::workspace) {
      ++s.workspace_allocs;
      live.insert(e.addr);
      s.workspace_ops.push_back(memory::interned(e.tag.op));
      s.workspace_max = std::max(s.workspace_max, e.size);
    }
    if (e.action == memory::TraceAction::free_requested && live.erase(e.addr)) ++s.workspace_frees;
  }
  return s;
}

bool has_op_prefix(const std::vector<std::string>& ops, const std::string& prefix) {
  for (const std::string& op : ops)
    if (op.rfind(prefix, 0) == 0) return true;
  return false;
}

void check_step(const TensorList& params, const std::function<Tensor()>& forward) {
  memory::synchronize(kGpu);
  const int64_t act0 = bytes(Category::activation), grad0 = bytes(Category::gradient);
  restart_history();
  gpu_alloc().reset_peak_memory_stats();
  Tensor loss;
  {
    memory::PhaseScope phase("forward");
    loss = forward();
  }
  const int64_t act = bytes(Category::activation) - act0;
  EXPECT_GT(act, 0);
  EXPECT_EQ(act, saved_activation_bytes(loss)) << "activation bytes == bytes held by saved tensors";
  loss.backward();
  memory::synchronize(kGpu);
  EXPECT_EQ(bytes(Category::activation), act0) << "no activation left after backward";
  EXPECT_EQ(bytes(Category::gradient) - grad0, block_bytes(params)) << "gradient == parameters";
  for (const Tensor& p : params) EXPECT_EQ(p.grad().storage().category(), Category::gradient);
  EXPECT_EQ(bytes(Category::workspace), 0) << "workspaces are returned after each op";
  const auto& s = gpu_alloc().stats();
  EXPECT_EQ(s.category_at_peak[static_cast<size_t>(Category::unknown)], 0) << "unknown at the peak";
  EXPECT_GT(s.category_at_peak[static_cast<size_t>(Category::activation)], 0);
  const Scan h = scan();
  EXPECT_EQ(h.unknown, 0);
  EXPECT_EQ(h.workspace_frees, h.workspace_allocs) << "every workspace block is returned";
  memory::testing::expect_consistent(gpu_alloc());
  gpu_alloc().record_memory_history(false);
}

TEST(MemoryInvariantsCuda, Mlp) {
  REQUIRE_GPU();
  const TensorList params = {param({64, 32}, 1, 0.2), param({64}, 2, 0.1), param({10, 64}, 3, 0.2),
                             param({10}, 4, 0.1)};
  const Tensor x = input(testing::rand_tensor({16, 32}, DType::float32, 5));
  const Tensor y = input(ops::randint(0, 10, {16}));
  check_step(params, [&] {
    const Tensor h = gelu(linear(x, params[0], params[1]));
    const Tensor h2 = dropout(h, 0.1);
    return cross_entropy(linear(h2, params[2], params[3]), y);
  });
}

TEST(MemoryInvariantsCuda, Cnn) {
  REQUIRE_GPU();
  const TensorList params = {param({8, 3, 3, 3}, 5, 0.3), param({8}, 6, 0.1),
                             param({8}, 7, 0.1),          param({16, 8, 3, 3}, 8, 0.2),
                             param({10, 16}, 9, 0.2),     param({10}, 10, 0.1)};
  Tensor running_mean, running_var;
  {
    memory::CategoryScope c(Category::parameter);
    running_mean = ops::zeros({8}, DType::float32, kGpu);
    running_var = ops::ones({8}, DType::float32, kGpu);
  }
  const Tensor x = input(testing::rand_tensor({4, 3, 16, 16}, DType::float32, 11));
  const Tensor y = input(ops::randint(0, 10, {4}));
  check_step(params, [&] {
    Tensor h = conv2d(x, params[0], {}, {1, 1}, {1, 1});
    h = relu(batch_norm(h, running_mean, running_var, params[1], params[2], /*training=*/true));
    h = max_pool2d(h, 2);
    h = relu(conv2d(h, params[3], {}, {2, 2}, {1, 1}));
    h = adaptive_avg_pool2d(h, {1, 1}).flatten(1);
    return cross_entropy(linear(h, params[4], params[5]), y);
  });
}

// cuBLASLt: every product of a linear forward + backward takes matmul_workspace_bytes() from
// the allocator as `workspace` under its op and returns it at the end of the op; with the
// size set to 0 no workspace is taken at all.
TEST(MemoryInvariantsCuda, LinearWorkspaceFromAllocator) {
  REQUIRE_GPU();
  const Tensor w = param({256, 128}, 21, 0.1), b = param({256}, 22, 0.1);
  Tensor x = input(testing::rand_tensor({64, 128}, DType::float32, 23));
  x.requires_grad_(true);  // so backward makes both products (grad input, grad weight)
  const size_t ws = cuda::matmul_workspace_bytes();
  ASSERT_GT(ws, 0u) << "the default cuBLASLt workspace is 32 MiB (CUBLASLT_WORKSPACE_SIZE unset)";
  memory::synchronize(kGpu);
  restart_history();
  gpu_alloc().reset_peak_memory_stats();
  {
    memory::PhaseScope phase("forward");
    Tensor loss = sum(linear(x, w, b));
    loss.backward();
  }
  memory::synchronize(kGpu);
  const Scan h = scan();
  EXPECT_GE(h.workspace_allocs, 3) << "forward, grad input and grad weight each take one";
  EXPECT_TRUE(has_op_prefix(h.workspace_ops, "mm")) << "backward's products (mm) take one too";
  EXPECT_EQ(h.workspace_frees, h.workspace_allocs);
  EXPECT_EQ(h.workspace_max, gpu_alloc().round_size(ws)) << "the configured workspace size";
  EXPECT_TRUE(has_op_prefix(h.workspace_ops, "linear")) << "tagged with the op that used it";
  EXPECT_EQ(bytes(Category::workspace), 0);
  EXPECT_GE(gpu_alloc().stats().cat_bytes(Category::workspace).peak, static_cast<int64_t>(ws));
  gpu_alloc().record_memory_history(false);

  // 0 disables the workspace: the products run without one.
  cuda::set_matmul_workspace_bytes(0);
  restart_history();
  {
    Tensor loss = sum(linear(x, w, b));
    loss.backward();
  }
  memory::synchronize(kGpu);
  cuda::set_matmul_workspace_bytes(ws);
  // The products take none; the reductions (sum's partials) still take their scratch.
  for (const std::string& op : scan().workspace_ops)
    EXPECT_EQ(op.rfind("sum", 0), 0u) << "a workspace under op '" << op << "'";
  gpu_alloc().record_memory_history(false);
}

// cuDNN: with cudnn.benchmark on, the algorithm search's scratch output and the chosen
// algorithms' workspaces come from the allocator as `workspace` under conv2d and its
// backward ops; all are returned; the search's results match the heuristic path's.
TEST(MemoryInvariantsCuda, Conv2dWorkspaceFromAllocator) {
  REQUIRE_GPU();
  const Tensor w = param({32, 16, 3, 3}, 31, 0.1);
  const Tensor x = input(testing::rand_tensor({8, 16, 32, 32}, DType::float32, 32));
  for (const bool benchmark : {true, false}) {
    SCOPED_TRACE(benchmark ? "cudnn.benchmark on" : "cudnn.benchmark off");
    const bool saved = cuda::cudnn_benchmark();
    cuda::set_cudnn_benchmark(benchmark);
    memory::synchronize(kGpu);
    restart_history();
    gpu_alloc().reset_peak_memory_stats();
    {
      memory::PhaseScope phase("forward");
      Tensor loss = sum(conv2d(x, w, {}, {1, 1}, {1, 1}));
      loss.backward();
    }
    memory::synchronize(kGpu);
    cuda::set_cudnn_benchmark(saved);
    const Scan h = scan();
    if (benchmark) {
      EXPECT_GT(h.workspace_allocs, 0) << "the benchmark's scratch output is a workspace";
      EXPECT_TRUE(has_op_prefix(h.workspace_ops, "conv2d"));
    }
    for (const std::string& op : h.workspace_ops)  // cuDNN's, and the loss's sum partials
      EXPECT_TRUE(op.rfind("conv2d", 0) == 0 || op.rfind("sum", 0) == 0)
          << "a workspace under op '" << op << "'";
    EXPECT_EQ(h.workspace_frees, h.workspace_allocs) << "every workspace block is returned";
    EXPECT_EQ(bytes(Category::workspace), 0);
    EXPECT_EQ(h.unknown, 0);
    gpu_alloc().record_memory_history(false);
    w.set_grad(Tensor());
  }
}

// cuDNN's fused attention: its backward's float32 dQ accumulator and plan workspace are one
// `workspace` block under flash_attention_backward, returned once enqueued; nothing is
// `unknown`, and the forward saves only what the fused path saves.
TEST(MemoryInvariantsCuda, CudnnAttentionWorkspaceFromAllocator) {
  REQUIRE_GPU();
  const bool saved = cuda::cudnn_sdp_enabled();
  cuda::set_cudnn_sdp_enabled(true);
  const int64_t B = 2, H = 4, T = 256, D = 64;
  const Tensor host = testing::rand_tensor({B, H, T, D}, DType::float32, 41, -1, 1);
  Tensor q = input(ops::to(host, DType::bfloat16));
  q.requires_grad_(true);
  memory::synchronize(kGpu);
  restart_history();
  const cuda::CudnnSdpCounts before = cuda::cudnn_sdp_counts();
  {
    memory::PhaseScope phase("forward");
    Tensor loss = sum(scaled_dot_product_attention(q, q, q, {}, 0.0, true).to(DType::float32));
    loss.backward();
  }
  memory::synchronize(kGpu);
  cuda::set_cudnn_sdp_enabled(saved);
  const cuda::CudnnSdpCounts after = cuda::cudnn_sdp_counts();
  EXPECT_EQ(after.backward - before.backward, 1) << "the backward ran on cuDNN";
  const Scan h = scan();
  EXPECT_GT(h.workspace_allocs, 0) << "the dQ accumulator is a workspace";
  EXPECT_TRUE(has_op_prefix(h.workspace_ops, "flash_attention_backward"));
  EXPECT_EQ(h.workspace_frees, h.workspace_allocs) << "every workspace block is returned";
  EXPECT_EQ(bytes(Category::workspace), 0);
  EXPECT_EQ(h.unknown, 0);
  gpu_alloc().record_memory_history(false);
}

}  // namespace
}  // namespace tally
