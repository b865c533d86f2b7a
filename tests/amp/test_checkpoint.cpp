// Activation checkpointing on the CPU: gradients bitwise equal with and without it (MLP
// and a small conv net, dropout on), lower peak `activation` bytes, the recompute phase in
// the allocation history, selective checkpointing, nesting, several consumers, autocast
// inside a segment, checkpoint_sequential, and the errors.
#include <cmath>

#include "amp_testing.h"
#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "memory/memory.h"
#include "nn/checkpoint.h"
#include "testing/gradcheck.h"

namespace tally {
namespace {

using memory::Category;
using nn::checkpoint;
using nn::CheckpointOptions;

using amp_testing::data;
using amp_testing::kCpu;
using amp_testing::param;

void clear_grads(const TensorList& ps) {
  for (const Tensor& p : ps) p.set_grad(Tensor());
}

// Gradients (and the loss) of one forward/backward, from a fixed RNG seed.
std::vector<std::vector<double>> run(const std::function<Tensor()>& loss_fn, const TensorList& ps) {
  clear_grads(ps);
  manual_seed(1234);
  Tensor loss = loss_fn();
  loss.backward();
  std::vector<std::vector<double>> r{ops::to_vector(loss)};
  for (const Tensor& p : ps) r.push_back(ops::to_vector(p.grad()));
  return r;
}

struct Mlp {
  TensorList ps;
  int layers;
  explicit Mlp(int layers_, int64_t width = 32, uint64_t seed = 10) : layers(layers_) {
    for (int i = 0; i < layers; ++i) {
      ps.push_back(
          param({width, width}, 1.0 / std::sqrt(static_cast<double>(width)), seed + 2 * i));
      ps.push_back(param({width}, 0.1, seed + 2 * i + 1));
    }
  }
  // Layers [from, to) of linear -> relu -> dropout.
  Tensor block(const Tensor& x, int from, int to, double p = 0.2) const {
    Tensor h = x;
    for (int i = from; i < to; ++i) h = dropout(relu(linear(h, ps[2 * i], ps[2 * i + 1])), p);
    return h;
  }
};

TEST(Checkpoint, MlpGradientsBitwiseEqualWithDropout) {
  const Mlp m(4);
  const Tensor x = data({16, 32}, 1);
  const auto plain = run([&] { return sum(m.block(x, 0, 4)); }, m.ps);
  const PhiloxState after_plain = get_rng_state();
  nn::reset_checkpoint_stats();
  const auto ckpt = run(
      [&] {
        Tensor h = checkpoint([&](const Tensor& t) { return m.block(t, 0, 2); }, x);
        h = checkpoint([&](const Tensor& t) { return m.block(t, 2, 4); }, h);
        return sum(h);
      },
      m.ps);
  EXPECT_EQ(plain, ckpt);
  // The recompute replays the RNG and then puts it back: the stream is not shifted.
  EXPECT_EQ(get_rng_state().offset, after_plain.offset);
  const nn::CheckpointStats st = nn::checkpoint_stats();
  EXPECT_EQ(st.segments, 2);
  EXPECT_EQ(st.recomputations, 2);
  EXPECT_GT(st.tensors_dropped, 0);
  EXPECT_EQ(st.tensors_recomputed, st.tensors_dropped);
}

TEST(Checkpoint, WithoutPreservedRngDropoutDiffers) {
  const Mlp m(2);
  const Tensor x = data({16, 32}, 1);
  const auto plain = run([&] { return sum(m.block(x, 0, 2, 0.5)); }, m.ps);
  CheckpointOptions opts;
  opts.preserve_rng_state = false;
  const auto ckpt = run(
      [&] {
        return sum(checkpoint([&](const Tensor& t) { return m.block(t, 0, 2, 0.5); }, x, opts));
      },
      m.ps);
  EXPECT_EQ(plain[0], ckpt[0]);  // the forward is the same
  EXPECT_NE(plain, ckpt);        // the recompute drew different masks
}

TEST(Checkpoint, ConvNetGradientsBitwiseEqualWithDropout) {
  const Tensor w1 = param({6, 3, 3, 3}, 0.3, 1), b1 = param({6}, 0.1, 2);
  const Tensor w2 = param({8, 6, 3, 3}, 0.2, 3), b2 = param({8}, 0.1, 4);
  const Tensor wf = param({5, 8 * 4 * 4}, 0.1, 5), g = param({8}, 1.0, 6);
  const TensorList ps = {w1, b1, w2, b2, wf, g};
  const Tensor x = data({4, 3, 8, 8}, 7);
  const Tensor y = from_vector({0, 1, 4, 2}, {4}, TensorOptions{}.with_dtype(DType::int64));
  const Tensor rm = zeros({8}), rv = ones({8});
  auto features = [&](const Tensor& t) {
    Tensor h = dropout(relu(conv2d(t, w1, b1, {1, 1}, {1, 1})), 0.25);
    h = conv2d(h, w2, b2, {1, 1}, {1, 1});
    h = batch_norm(h, rm, rv, g, Tensor(), true);
    return max_pool2d(relu(h), {2, 2});
  };
  auto head = [&](const Tensor& h) { return cross_entropy(linear(h.flatten(1), wf), y); };
  const auto plain = run([&] { return head(features(x)); }, ps);
  const auto ckpt = run([&] { return head(checkpoint(features, x)); }, ps);
  EXPECT_EQ(plain, ckpt);
}

// Peak bytes tagged `activation` during a forward, and what the forward leaves saved.
struct ForwardMemory {
  int64_t peak_activation;
  int64_t held_activation;
};

ForwardMemory forward_memory(const std::function<Tensor()>& forward) {
  memory::CachingAllocator& a = memory::get_allocator(kCpu);
  a.reset_peak_memory_stats();
  const int64_t base = a.stats().cat_bytes(Category::activation).current;
  Tensor out = forward();
  const memory::DeviceStats s = a.stats();
  return {s.cat_bytes(Category::activation).peak - base,
          s.cat_bytes(Category::activation).current - base};
}

TEST(Checkpoint, LowersPeakActivationMemory) {
  const Mlp m(8, 128);
  const Tensor x = data({64, 128}, 1);
  const ForwardMemory plain = forward_memory([&] { return sum(m.block(x, 0, 8)); });
  const ForwardMemory ckpt = forward_memory([&] {
    Tensor h = x;
    for (int s = 0; s < 4; ++s)
      h = checkpoint([&, s](const Tensor& t) { return m.block(t, 2 * s, 2 * s + 2); }, h);
    return sum(h);
  });
  const int64_t act = 64 * 128 * 4;           // one activation tensor
  EXPECT_GT(plain.peak_activation, 8 * act);  // every layer keeps its activations
  EXPECT_LT(ckpt.peak_activation, plain.peak_activation / 3);
  // What stays saved: the segment inputs (plus dropout masks of nothing: all recomputed).
  EXPECT_LE(ckpt.held_activation, 4 * act + 4096);
  EXPECT_GT(plain.held_activation, 3 * ckpt.held_activation);
}

TEST(Checkpoint, RecomputePhaseInAllocationHistory) {
  memory::CachingAllocator& a = memory::get_allocator(kCpu);
  const Mlp m(2);
  const Tensor x = data({8, 32}, 1);
  a.record_memory_history(true, 100000);
  {
    Tensor loss = sum(checkpoint([&](const Tensor& t) { return m.block(t, 0, 2); }, x));
    loss.backward();
  }
  const std::vector<memory::TraceEntry> h = a.history();
  a.record_memory_history(false);
  int recompute_allocs = 0, recompute_activation = 0, forward_or_backward = 0;
  for (const memory::TraceEntry& e : h) {
    const std::string& phase = memory::interned(e.tag.phase);
    if (phase == "recompute" && e.action == memory::TraceAction::alloc) ++recompute_allocs;
    if (phase == "recompute" && e.action == memory::TraceAction::retag &&
        e.tag.category == Category::activation)
      ++recompute_activation;
    if (phase == "backward" && e.action == memory::TraceAction::alloc) ++forward_or_backward;
  }
  EXPECT_GT(recompute_allocs, 0);
  EXPECT_GT(recompute_activation, 0);  // recomputed saved tensors are tagged activation
  EXPECT_GT(forward_or_backward, 0);
  // The same entries make it into the snapshot's trace.
  a.record_memory_history(true, 100000);
  {
    Tensor loss = sum(checkpoint([&](const Tensor& t) { return m.block(t, 0, 2); }, x));
    loss.backward();
  }
  const memory::SnapshotData snap = a.snapshot();
  a.record_memory_history(false);
  bool found = false;
  for (const auto& dev : snap.device_traces)
    for (const memory::TraceEntry& e : dev)
      found = found || memory::interned(e.tag.phase) == "recompute";
  EXPECT_TRUE(found);
}

TEST(Checkpoint, SelectivePolicyKeepsMatmulOutputs) {
  // linear -> gelu: gelu saves its input, the linear's output; the next linear saves the
  // gelu's output.
  const TensorList ps = {param({32, 32}, 0.2, 1), param({32, 32}, 0.2, 2), param({32, 32}, 0.2, 3)};
  const Tensor x = data({8, 32}, 4);
  auto seg = [&](const Tensor& t) {
    Tensor h = gelu(linear(t, ps[0]));
    h = gelu(linear(h, ps[1]));
    return linear(h, ps[2]);
  };
  const auto plain = run([&] { return sum(seg(x)); }, ps);
  CheckpointOptions opts;
  std::vector<std::string> seen;
  auto save_linear = nn::save_ops({"linear", "matmul", "mm", "bmm", "conv2d"});
  opts.policy = [&](const nn::SavedTensorInfo& info) {
    seen.emplace_back(info.op);
    return save_linear(info);
  };
  nn::reset_checkpoint_stats();
  const auto sel = run([&] { return sum(checkpoint(seg, x, opts)); }, ps);
  EXPECT_EQ(plain, sel);
  const nn::CheckpointStats st = nn::checkpoint_stats();
  EXPECT_EQ(st.tensors_kept, 2);  // the two linear outputs gelu saved
  int gelu_outputs = 0;
  for (const std::string& op : seen) gelu_outputs += op == "gelu";
  EXPECT_EQ(gelu_outputs, 2);  // the gelu outputs the next linears saved: recomputed
  EXPECT_EQ(st.tensors_dropped, static_cast<int64_t>(seen.size()) - 2);
  EXPECT_EQ(st.recomputations, 1);
  EXPECT_EQ(st.tensors_recomputed, st.tensors_dropped);
  // The recompute took the two kept linear outputs instead of multiplying again (the third
  // linear is not reached: early stop), and the gradients above are the plain run's bits.
  EXPECT_EQ(st.products_replayed, 2);

  // A policy that keeps everything never recomputes.
  CheckpointOptions all;
  all.policy = [](const nn::SavedTensorInfo&) { return true; };
  nn::reset_checkpoint_stats();
  const auto kept = run([&] { return sum(checkpoint(seg, x, all)); }, ps);
  EXPECT_EQ(plain, kept);
  EXPECT_EQ(nn::checkpoint_stats().recomputations, 0);
  EXPECT_EQ(nn::checkpoint_stats().tensors_dropped, 0);
}

TEST(Checkpoint, SeveralConsumersAndNesting) {
  const Mlp m(4);
  const Tensor x = data({8, 32}, 1);
  auto loss_of = [](const Tensor& y) { return add(sum(mul(y, y)), sum(mul(y, 3.0))); };
  const auto plain = run([&] { return loss_of(m.block(x, 0, 4)); }, m.ps);
  const auto several =
      run([&] { return loss_of(checkpoint([&](const Tensor& t) { return m.block(t, 0, 4); }, x)); },
          m.ps);
  EXPECT_EQ(plain, several);
  nn::reset_checkpoint_stats();
  const auto nested = run(
      [&] {
        return loss_of(checkpoint(
            [&](const Tensor& t) {
              Tensor h = m.block(t, 0, 1);
              h = checkpoint([&](const Tensor& u) { return m.block(u, 1, 3); }, h);
              return m.block(h, 3, 4);
            },
            x));
      },
      m.ps);
  EXPECT_EQ(plain, nested);
  // The outer segment ran twice (forward, recompute), so the inner one was entered twice;
  // both segments recomputed once for this backward.
  EXPECT_EQ(nn::checkpoint_stats().segments, 3);
  EXPECT_EQ(nn::checkpoint_stats().recomputations, 2);
}

TEST(Checkpoint, InputRequiringGradAndSeveralInputs) {
  const Mlp m(2);
  Tensor x = data({8, 32}, 1);
  x.requires_grad_(true);
  const Tensor z = data({8, 32}, 2);
  TensorList ps = m.ps;
  ps.push_back(x);
  auto seg = [&](const TensorList& in) { return m.block(add(in[0], in[1]), 0, 2); };
  const auto plain = run([&] { return sum(seg({x, z})); }, ps);
  const auto ckpt = run([&] { return sum(checkpoint(seg, TensorList{x, z})); }, ps);
  EXPECT_EQ(plain, ckpt);
}

TEST(Checkpoint, AutocastStateIsReplayed) {
  const Mlp m(3);
  const Tensor x = data({8, 32}, 1);
  auto loss = [&](bool ckpt) {
    AutocastGuard guard(DeviceType::cpu, DType::bfloat16);
    Tensor h =
        ckpt ? checkpoint([&](const Tensor& t) { return m.block(t, 0, 3); }, x) : m.block(x, 0, 3);
    EXPECT_EQ(h.dtype(), DType::bfloat16);
    return sum(h);  // float32 under autocast
  };
  const auto plain = run([&] { return loss(false); }, m.ps);
  const auto ckpt = run([&] { return loss(true); }, m.ps);  // backward runs outside autocast
  EXPECT_EQ(plain, ckpt);
  EXPECT_EQ(autocast_cache_size(), 0u);
}

TEST(Checkpoint, SequentialEqualsPlain) {
  const Mlp m(5);
  const Tensor x = data({8, 32}, 1);
  std::vector<std::function<Tensor(const Tensor&)>> stages;
  for (int i = 0; i < 5; ++i)
    stages.push_back([&m, i](const Tensor& t) { return m.block(t, i, i + 1); });
  const auto plain = run([&] { return sum(m.block(x, 0, 5)); }, m.ps);
  nn::reset_checkpoint_stats();
  const auto seq = run([&] { return sum(nn::checkpoint_sequential(stages, 2, x)); }, m.ps);
  EXPECT_EQ(plain, seq);
  EXPECT_EQ(nn::checkpoint_stats().segments, 1);  // all but the last segment
  nn::reset_checkpoint_stats();
  const auto seq5 = run([&] { return sum(nn::checkpoint_sequential(stages, 5, x)); }, m.ps);
  EXPECT_EQ(plain, seq5);
  EXPECT_EQ(nn::checkpoint_stats().segments, 4);
  testing::expect_error<std::invalid_argument>([&] { nn::checkpoint_sequential(stages, 0, x); },
                                               {"checkpoint_sequential", "segments"});
  testing::expect_error<std::invalid_argument>([&] { nn::checkpoint_sequential(stages, 6, x); },
                                               {"checkpoint_sequential", "[1, 5]"});
}

TEST(Checkpoint, GradcheckThroughANestedSegment) {
  const Tensor x = testing::rand_input({3, 4}, -1, 1, 1), w = testing::rand_input({4, 4}, -1, 1, 2);
  EXPECT_TRUE(testing::gradcheck(
      [](const TensorList& in) {
        return checkpoint(
            [](const TensorList& a) {
              const Tensor h = tanh(linear(a[0], a[1]));
              return checkpoint([&](const Tensor& u) { return mul(gelu(u), u); }, h);
            },
            in);
      },
      {x, w}));
}

TEST(Checkpoint, NoGradJustRunsTheFunction) {
  const Mlp m(2);
  const Tensor x = data({8, 32}, 1);
  nn::reset_checkpoint_stats();
  NoGradGuard ng;
  const Tensor y = checkpoint([&](const Tensor& t) { return m.block(t, 0, 2, 0.0); }, x);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(nn::checkpoint_stats().segments, 0);
}

TEST(Checkpoint, ARecomputeThatSavesDifferentlyThrows) {
  const Tensor w = param({8, 8}, 0.3, 1);
  const Tensor x = data({4, 8}, 2);
  int calls = 0;
  // The extra save comes after the last one backward needs: only a full recompute sees it.
  nn::CheckpointOptions full;
  full.early_stop = false;
  Tensor loss = sum(checkpoint(
      [&](const Tensor& t) {
        Tensor h = relu(linear(t, w));
        if (calls++ > 0) h = relu(h);  // the recompute saves one tensor more
        return h;
      },
      x, full));
  testing::expect_error<std::runtime_error>([&] { loss.backward(); }, {"checkpoint", "same ops"});
  // A recompute that saves a different shape before it has all it needs throws either way.
  calls = 0;
  loss = sum(checkpoint(
      [&](const Tensor& t) { return relu(linear(calls++ > 0 ? ops::narrow(t, 0, 0, 2) : t, w)); },
      x));
  testing::expect_error<std::runtime_error>([&] { loss.backward(); },
                                            {"checkpoint", "recomputed tensor 0"});
}

// Early stop: the recompute ends at the last tensor backward needs; with products saving their
// operands before they compute, a segment ending in a linear layer never runs that product
// again. The gradients are the plain run's, bit for bit, either way.
TEST(Checkpoint, EarlyStopSkipsWhatFollowsTheLastSave) {
  const Tensor w1 = param({16, 8}, 0.3, 1), w2 = param({8, 16}, 0.3, 3);
  const Tensor x = data({4, 8}, 2);
  int finished = 0;
  auto fn = [&](const Tensor& t) {
    Tensor h = linear(gelu(linear(t, w1)), w2);
    ++finished;
    return h;
  };
  const auto plain = run([&] { return sum(fn(x)); }, {w1, w2});
  for (bool early : {true, false}) {
    finished = 0;
    nn::reset_checkpoint_stats();
    nn::CheckpointOptions o;
    o.early_stop = early;
    const auto got = run([&] { return sum(checkpoint(fn, x, o)); }, {w1, w2});
    EXPECT_EQ(got, plain) << "early_stop " << early;
    const nn::CheckpointStats st = nn::checkpoint_stats();
    EXPECT_EQ(finished, early ? 1 : 2) << "early_stop " << early;  // forward (+ full recompute)
    EXPECT_EQ(st.recomputations, 1);
    EXPECT_EQ(st.early_stops, early ? 1 : 0);
    EXPECT_EQ(st.tensors_recomputed, st.tensors_dropped);
  }
}

TEST(Checkpoint, SecondBackwardWithoutRetainGraphThrows) {
  const Mlp m(2);
  const Tensor x = data({4, 32}, 2);
  Tensor loss = sum(checkpoint([&](const Tensor& t) { return m.block(t, 0, 2); }, x));
  loss.backward();
  EXPECT_THROW(loss.backward(), std::runtime_error);
}

}  // namespace
}  // namespace tally
