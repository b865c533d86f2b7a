// Design rule 2, checked on raw ops, on every device of the binary (test_memory_invariants on
// the CPU, test_memory_invariants_cuda on cuda:0, skipping without a device): after a forward
// pass (an MLP, a CNN) the bytes tagged `activation` are exactly the bytes held by saved
// tensors, all on the device; after backward none are left and `gradient` equals the
// parameters' size; no allocation of the step is `unknown`, at the peak or in the history;
// workspaces are returned after each op. On CUDA only (MemoryInvariantsCuda), the `workspace`
// category of the libraries: cuBLASLt's workspace (a linear forward + backward), cuDNN's (a
// conv2d forward + backward; its fused attention's backward) come from the caching allocator
// under the op that used them, and are returned when the op has been enqueued.
#include <unordered_set>

#include "memory/invariants.h"
#include "tensor/attention/autograd.h"
#include "tensor/conv/autograd.h"
#include "tensor/norm/autograd.h"
#include "tensor/pool/autograd.h"
#include "tensor/softmax/autograd.h"
#include "testing/cuda_testing.h"
#include "testing/devices.h"

#if defined(TALLY_WITH_CUDA)
#include "tensor/attention/cuda.h"
#include "tensor/cuda/cudnn.h"
#include "tensor/linalg/cuda.h"
#endif

namespace tally {
namespace {

using memory::Category;
using testing::OnDevice;
using testing::VsCpu;

memory::CachingAllocator& alloc(Device d) {
  return memory::get_allocator(d);
}
int64_t bytes(Device d, Category c) {
  return alloc(d).stats().cat_bytes(c).current;
}

// Sum of the allocator blocks held by the saved tensors of the graph behind `root`, counting
// each storage once and leaving out parameters and inputs (they are not activations even when
// saved). Every saved tensor is on `d`.
int64_t saved_activation_bytes(const Tensor& root, Device d) {
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
      EXPECT_EQ(t.device(), d) << n->name() << " saved a tensor on " << t.device().str();
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

// A parameter on `d`: N(0, scale^2) values drawn on the CPU from `seed`, tagged `parameter`.
Tensor param(Device d, const Shape& shape, uint64_t seed, double scale) {
  Generator g(seed);
  const Tensor host = ops::mul(ops::randn(shape, DType::float32, Device::cpu(), &g), scale);
  memory::CategoryScope c(Category::parameter);
  Tensor t = ops::to(host, d, DType::float32, /*copy=*/true);
  t.requires_grad_(true);
  return t;
}

// A copy of `host` on `d`, tagged `input`.
Tensor input(Device d, const Tensor& host) {
  memory::CategoryScope c(Category::input);
  return ops::to(host, d, host.dtype(), /*copy=*/true);
}

int64_t block_bytes(const TensorList& ts) {
  int64_t n = 0;
  for (const Tensor& t : ts) n += static_cast<int64_t>(t.storage().block_bytes());
  return n;
}

void restart_history(Device d) {
  alloc(d).record_memory_history(false);
  alloc(d).record_memory_history(true, 100'000);
}

// Allocations in the history tagged `category` (and, for workspaces, returned by the end).
struct Scan {
  int64_t unknown = 0;
  int64_t workspace_allocs = 0;
  int64_t workspace_frees = 0;
  std::vector<std::string> workspace_ops;
  size_t workspace_max = 0;
};

Scan scan(Device d) {
  Scan s;
  std::unordered_set<uint64_t> live;
  for (const memory::TraceEntry& e : alloc(d).history()) {
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

[[maybe_unused]] bool has_op_prefix(const std::vector<std::string>& ops,
                                    const std::string& prefix) {
  for (const std::string& op : ops)
    if (op.rfind(prefix, 0) == 0) return true;
  return false;
}

void check_step(Device d, const TensorList& params, const std::function<Tensor()>& forward) {
  memory::synchronize(d);
  const int64_t act0 = bytes(d, Category::activation), grad0 = bytes(d, Category::gradient);
  restart_history(d);
  alloc(d).reset_peak_memory_stats();
  Tensor loss;
  {
    memory::PhaseScope phase("forward");
    loss = forward();
  }
  const int64_t act = bytes(d, Category::activation) - act0;
  EXPECT_GT(act, 0);
  EXPECT_EQ(act, saved_activation_bytes(loss, d))
      << "activation bytes == bytes held by saved tensors";
  loss.backward();
  memory::synchronize(d);
  EXPECT_EQ(bytes(d, Category::activation), act0) << "no activation left after backward";
  EXPECT_EQ(bytes(d, Category::gradient) - grad0, block_bytes(params)) << "gradient == parameters";
  for (const Tensor& p : params) EXPECT_EQ(p.grad().storage().category(), Category::gradient);
  EXPECT_EQ(bytes(d, Category::workspace), 0) << "workspaces are returned after each op";
  const auto& s = alloc(d).stats();
  EXPECT_EQ(s.category_at_peak[static_cast<size_t>(Category::unknown)], 0) << "unknown at the peak";
  EXPECT_GT(s.category_at_peak[static_cast<size_t>(Category::activation)], 0);
  const Scan h = scan(d);
  EXPECT_EQ(h.unknown, 0);
  EXPECT_EQ(h.workspace_frees, h.workspace_allocs) << "every workspace block is returned";
  memory::testing::expect_consistent(alloc(d));
  alloc(d).record_memory_history(false);
}

class MemoryInvariants : public OnDevice {};

TEST_P(MemoryInvariants, Mlp) {
  const TensorList params = {param(dev(), {64, 32}, 1, 0.2), param(dev(), {64}, 2, 0.1),
                             param(dev(), {10, 64}, 3, 0.2), param(dev(), {10}, 4, 0.1)};
  const Tensor x = input(dev(), ops::randn({16, 32}));
  const Tensor y = input(dev(), ops::randint(0, 10, {16}));
  check_step(dev(), params, [&] {
    const Tensor h = gelu(linear(x, params[0], params[1]));
    const Tensor h2 = dropout(h, 0.1);
    return cross_entropy(linear(h2, params[2], params[3]), y);
  });
}

TEST_P(MemoryInvariants, Cnn) {
  const TensorList params = {
      param(dev(), {8, 3, 3, 3}, 5, 0.3), param(dev(), {8}, 6, 0.1),
      param(dev(), {8}, 7, 0.1),          param(dev(), {16, 8, 3, 3}, 8, 0.2),
      param(dev(), {10, 16}, 9, 0.2),     param(dev(), {10}, 10, 0.1)};
  Tensor running_mean, running_var;
  {
    memory::CategoryScope c(Category::parameter);
    running_mean = ops::zeros({8}, DType::float32, dev());
    running_var = ops::ones({8}, DType::float32, dev());
  }
  const Tensor x = input(dev(), ops::randn({4, 3, 16, 16}));
  const Tensor y = input(dev(), ops::randint(0, 10, {4}));
  check_step(dev(), params, [&] {
    Tensor h = conv2d(x, params[0], {}, {1, 1}, {1, 1});
    h = relu(batch_norm(h, running_mean, running_var, params[1], params[2], /*training=*/true));
    h = max_pool2d(h, 2);
    h = relu(conv2d(h, params[3], {}, {2, 2}, {1, 1}));
    h = adaptive_avg_pool2d(h, {1, 1}).flatten(1);
    return cross_entropy(linear(h, params[4], params[5]), y);
  });
}

// The same network in channels_last (images and convolution weights NHWC in memory): the
// layout conversions, the NHWC kernels and the weight gradients in the weights' layout keep
// every invariant.
TEST_P(MemoryInvariants, CnnChannelsLast) {
  constexpr MemoryFormat kCL = MemoryFormat::channels_last;
  auto cl_param = [&](const Shape& shape, uint64_t seed, double scale) {
    const Tensor p = param(dev(), shape, seed, scale);
    memory::CategoryScope c(Category::parameter);
    Tensor t = ops::contiguous(p.detach(), kCL);
    t.requires_grad_(true);
    return t;
  };
  const TensorList params = {cl_param({8, 3, 3, 3}, 5, 0.3), param(dev(), {8}, 6, 0.1),
                             param(dev(), {8}, 7, 0.1),      cl_param({16, 8, 3, 3}, 8, 0.2),
                             param(dev(), {10, 16}, 9, 0.2), param(dev(), {10}, 10, 0.1)};
  Tensor running_mean, running_var;
  {
    memory::CategoryScope c(Category::parameter);
    running_mean = ops::zeros({8}, DType::float32, dev());
    running_var = ops::ones({8}, DType::float32, dev());
  }
  Tensor x = input(dev(), ops::randn({4, 3, 16, 16}));
  {
    memory::CategoryScope c(Category::input);
    x = ops::contiguous(x, kCL);
  }
  const Tensor y = input(dev(), ops::randint(0, 10, {4}));
  check_step(dev(), params, [&] {
    Tensor h = conv2d(x, params[0], {}, {1, 1}, {1, 1});
    EXPECT_TRUE(h.is_contiguous(kCL) && !h.is_contiguous());
    h = relu(batch_norm(h, running_mean, running_var, params[1], params[2], /*training=*/true));
    h = max_pool2d(h, 2);
    h = relu(conv2d(h, params[3], {}, {2, 2}, {1, 1}));
    h = adaptive_avg_pool2d(h, {1, 1}).flatten(1);
    return cross_entropy(linear(h, params[4], params[5]), y);
  });
  EXPECT_TRUE(params[0].grad().is_contiguous(kCL) && params[3].grad().is_contiguous(kCL));
}

// A residual block's tail: add_relu never holds the sum, so its forward peaks one output
// buffer lower than add then relu, and the one buffer it keeps is its saved output.
TEST_P(MemoryInvariants, AddReluHoldsNoSum) {
  const TensorList params = {param(dev(), {32, 16}, 11, 0.3), param(dev(), {32, 16}, 12, 0.3)};
  const int64_t one = static_cast<int64_t>(alloc(dev()).round_size(32 * 16 * sizeof(float)));
  const auto forward_peak = [&](bool fused) {
    memory::synchronize(dev());
    const auto base = static_cast<int64_t>(alloc(dev()).memory_allocated());
    alloc(dev()).reset_peak_memory_stats();
    const Tensor y = fused ? add_relu(params[0], params[1]) : relu(add(params[0], params[1]));
    EXPECT_EQ(bytes(dev(), Category::activation), one) << "the output, saved by the backward";
    return static_cast<int64_t>(alloc(dev()).max_memory_allocated()) - base;
  };
  EXPECT_EQ(forward_peak(false), 2 * one) << "add then relu: the sum and the output";
  EXPECT_EQ(forward_peak(true), one) << "add_relu: the output alone";
  check_step(dev(), params, [&] { return sum(add_relu(params[0], params[1])); });
}

// Given up (std::move) and held by nothing else, add_relu's first operand becomes its output:
// no new buffer, the block is handed to add_relu's context (its free and alloc in the
// history), and the values are those of add_relu on a fresh buffer. Held elsewhere (another
// handle, a view), the operand keeps its buffer and its values.
TEST_P(MemoryInvariants, AddReluOverItsDyingInput) {
  const Tensor x = param(dev(), {32, 16}, 13, 0.5);
  const Tensor b = param(dev(), {32, 16}, 14, 0.5);
  const std::vector<double> want = add_relu(x * 2.0, b).to(Device::cpu()).tolist();
  auto& a = alloc(dev());
  memory::synchronize(dev());
  a.record_memory_history(true);
  Tensor dying = x * 2.0;
  const void* block = dying.data_ptr();
  const auto before = a.memory_allocated();
  const auto allocs = a.stats().allocation[0].allocated;
  const Tensor y = add_relu(std::move(dying), b);
  const auto history = a.history();
  a.record_memory_history(false);
  EXPECT_FALSE(dying.defined()) << "the caller's handle is given up";
  EXPECT_EQ(y.data_ptr(), block) << "written over its input";
  EXPECT_EQ(a.memory_allocated(), before);
  EXPECT_EQ(a.stats().allocation[0].allocated, allocs) << "no allocation";
  EXPECT_EQ(memory::interned(a.block_tag(block).op), "add_relu");
  EXPECT_EQ(y.storage().category(), Category::activation) << "saved by its backward";
  EXPECT_EQ(y.to(Device::cpu()).tolist(), want);
  ASSERT_GE(history.size(), 3u);
  const auto& last = history.back();
  EXPECT_EQ(last.action, memory::TraceAction::retag) << "saved: activation";
  const auto& handed = history[history.size() - 2];
  EXPECT_EQ(handed.action, memory::TraceAction::alloc);
  EXPECT_EQ(handed.addr, reinterpret_cast<uint64_t>(block));
  EXPECT_EQ(history[history.size() - 3].action, memory::TraceAction::free_completed);

  // Held elsewhere: a new buffer, the operand untouched.
  Tensor kept = x * 2.0;
  const Tensor other = kept;
  const std::vector<double> kept_values = kept.to(Device::cpu()).tolist();
  const Tensor z = add_relu(std::move(kept), b);
  EXPECT_NE(z.data_ptr(), other.data_ptr());
  EXPECT_EQ(other.to(Device::cpu()).tolist(), kept_values);
  Tensor base = x * 2.0;
  Tensor view = base.reshape({16, 32}).reshape({32, 16});
  const Tensor w = add_relu(std::move(view), b);
  EXPECT_NE(w.data_ptr(), base.data_ptr()) << "a view: its base still holds the buffer";
  Tensor both = x * 2.0;
  const Tensor doubled = add_relu(std::move(both), both);  // b is a: nothing is given up
  EXPECT_EQ(doubled.to(Device::cpu()).tolist(),
            add_relu(x * 2.0, x * 2.0).to(Device::cpu()).tolist());
  check_step(dev(), {x, b}, [&] { return sum(add_relu(x * 2.0, b)); });
}

TALLY_ON_DEVICES(MemoryInvariants);

#if defined(TALLY_WITH_CUDA)  // the CUDA libraries' workspaces and settings
// The CUDA libraries' workspaces (CUDA internals: accelerators only).
class MemoryInvariantsCuda : public VsCpu {};

// cuBLASLt: every product of a linear forward + backward takes matmul_workspace_bytes() from
// the allocator as `workspace` under its op and returns it at the end of the op; with the
// size set to 0 no workspace is taken at all.
TEST_P(MemoryInvariantsCuda, LinearWorkspaceFromAllocator) {
  const Tensor w = param(dev(), {256, 128}, 21, 0.1), b = param(dev(), {256}, 22, 0.1);
  Tensor x = input(dev(), testing::rand_tensor({64, 128}, DType::float32, 23));
  x.requires_grad_(true);  // so backward makes both products (grad input, grad weight)
  const size_t ws = cuda::matmul_workspace_bytes();
  ASSERT_GT(ws, 0u) << "the default cuBLASLt workspace is 32 MiB (CUBLASLT_WORKSPACE_SIZE unset)";
  memory::synchronize(dev());
  restart_history(dev());
  alloc(dev()).reset_peak_memory_stats();
  {
    memory::PhaseScope phase("forward");
    Tensor loss = sum(linear(x, w, b));
    loss.backward();
  }
  memory::synchronize(dev());
  const Scan h = scan(dev());
  EXPECT_GE(h.workspace_allocs, 3) << "forward, grad input and grad weight each take one";
  EXPECT_TRUE(has_op_prefix(h.workspace_ops, "mm")) << "backward's products (mm) take one too";
  EXPECT_EQ(h.workspace_frees, h.workspace_allocs);
  EXPECT_EQ(h.workspace_max, alloc(dev()).round_size(ws)) << "the configured workspace size";
  EXPECT_TRUE(has_op_prefix(h.workspace_ops, "linear")) << "tagged with the op that used it";
  EXPECT_EQ(bytes(dev(), Category::workspace), 0);
  EXPECT_GE(alloc(dev()).stats().cat_bytes(Category::workspace).peak, static_cast<int64_t>(ws));
  alloc(dev()).record_memory_history(false);

  // 0 disables the workspace: the products run without one.
  cuda::set_matmul_workspace_bytes(0);
  restart_history(dev());
  {
    Tensor loss = sum(linear(x, w, b));
    loss.backward();
  }
  memory::synchronize(dev());
  cuda::set_matmul_workspace_bytes(ws);
  // The products take none; the reductions (sum's partials) still take their scratch.
  for (const std::string& op : scan(dev()).workspace_ops)
    EXPECT_EQ(op.rfind("sum", 0), 0u) << "a workspace under op '" << op << "'";
  alloc(dev()).record_memory_history(false);
}

// cuDNN: with cudnn.benchmark on, the algorithm search's scratch output and the chosen
// algorithms' workspaces come from the allocator as `workspace` under conv2d and its
// backward ops; all are returned; the search's results match the heuristic path's.
TEST_P(MemoryInvariantsCuda, Conv2dWorkspaceFromAllocator) {
  const Tensor w = param(dev(), {32, 16, 3, 3}, 31, 0.1);
  const Tensor x = input(dev(), testing::rand_tensor({8, 16, 32, 32}, DType::float32, 32));
  for (const bool benchmark : {true, false}) {
    SCOPED_TRACE(benchmark ? "cudnn.benchmark on" : "cudnn.benchmark off");
    const bool saved = cuda::cudnn_benchmark();
    cuda::set_cudnn_benchmark(benchmark);
    memory::synchronize(dev());
    restart_history(dev());
    alloc(dev()).reset_peak_memory_stats();
    {
      memory::PhaseScope phase("forward");
      Tensor loss = sum(conv2d(x, w, {}, {1, 1}, {1, 1}));
      loss.backward();
    }
    memory::synchronize(dev());
    cuda::set_cudnn_benchmark(saved);
    const Scan h = scan(dev());
    if (benchmark) {
      EXPECT_GT(h.workspace_allocs, 0) << "the benchmark's scratch output is a workspace";
      EXPECT_TRUE(has_op_prefix(h.workspace_ops, "conv2d"));
    }
    for (const std::string& op : h.workspace_ops)  // cuDNN's, and the loss's sum partials
      EXPECT_TRUE(op.rfind("conv2d", 0) == 0 || op.rfind("sum", 0) == 0)
          << "a workspace under op '" << op << "'";
    EXPECT_EQ(h.workspace_frees, h.workspace_allocs) << "every workspace block is returned";
    EXPECT_EQ(bytes(dev(), Category::workspace), 0);
    EXPECT_EQ(h.unknown, 0);
    alloc(dev()).record_memory_history(false);
    w.set_grad(Tensor());
  }
}

// cuDNN's fused attention: its backward's float32 dQ accumulator and plan workspace are one
// `workspace` block under flash_attention_backward, returned once enqueued; nothing is
// `unknown`, and the forward saves only what the fused path saves.
TEST_P(MemoryInvariantsCuda, CudnnAttentionWorkspaceFromAllocator) {
  const bool saved = cuda::cudnn_sdp_enabled();
  cuda::set_cudnn_sdp_enabled(true);
  const int64_t B = 2, H = 4, T = 256, D = 64;
  const Tensor host = testing::rand_tensor({B, H, T, D}, DType::float32, 41, -1, 1);
  Tensor q = input(dev(), ops::to(host, DType::bfloat16));
  q.requires_grad_(true);
  memory::synchronize(dev());
  restart_history(dev());
  const cuda::CudnnSdpCounts before = cuda::cudnn_sdp_counts();
  {
    memory::PhaseScope phase("forward");
    Tensor loss = sum(scaled_dot_product_attention(q, q, q, {}, 0.0, true).to(DType::float32));
    loss.backward();
  }
  memory::synchronize(dev());
  cuda::set_cudnn_sdp_enabled(saved);
  const cuda::CudnnSdpCounts after = cuda::cudnn_sdp_counts();
  EXPECT_EQ(after.backward - before.backward, 1) << "the backward ran on cuDNN";
  const Scan h = scan(dev());
  EXPECT_GT(h.workspace_allocs, 0) << "the dQ accumulator is a workspace";
  EXPECT_TRUE(has_op_prefix(h.workspace_ops, "flash_attention_backward"));
  EXPECT_EQ(h.workspace_frees, h.workspace_allocs) << "every workspace block is returned";
  EXPECT_EQ(bytes(dev(), Category::workspace), 0);
  EXPECT_EQ(h.unknown, 0);
  alloc(dev()).record_memory_history(false);
}

TALLY_VS_CPU(MemoryInvariantsCuda);
#endif  // TALLY_WITH_CUDA

}  // namespace
}  // namespace tally
