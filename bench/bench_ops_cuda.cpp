// Per-op GPU timings at ResNet-50 (batch 64, 224x224) and GPT-2 124M (B=16, T=1024, bf16)
// shapes, timed with CUDA events (median of 20 after 5 warm-ups). Prints one JSON line per
// case; bench/ops_gpu.py runs PyTorch on the same cases and prints the ratio table. Cases
// named *_fwd_bwd time the forward and the autograd backward together (the leaves' .grad
// reset to none first, so nothing accumulates).
//   bench_ops_cuda [filter]
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "autograd/autocast.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "base/json.h"
#include "nn/functional.h"
#include "nn/layers.h"
#include "nn/rnn.h"
#include "tensor/attention/autograd.h"
#ifdef TALLY_WITH_CUDA
#include "tensor/cuda/cudnn.h"
#include "tensor/cuda/runtime.h"
#include "tensor/rnn/cuda.h"
#endif

using namespace tally;

#ifdef TALLY_WITH_CUDA
namespace {

const Device kGpu = Device::cuda(0);

double time_ms(const std::function<void()>& fn) {
  cudaStream_t s = cuda::stream(0);
  for (int i = 0; i < 5; ++i) fn();
  std::vector<float> ts;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 20; ++i) {
    cudaEventRecord(a, s);
    fn();
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    ts.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

// float32 convolutions and RNNs on cuDNN without TF32 while it lives (PyTorch's
// torch.backends.cudnn.allow_tf32 = False), restoring the setting after.
struct NoCudnnTf32 {
  bool saved = cuda::cudnn_allow_tf32();
  NoCudnnTf32() { cuda::set_cudnn_allow_tf32(false); }
  ~NoCudnnTf32() { cuda::set_cudnn_allow_tf32(saved); }
  NoCudnnTf32(const NoCudnnTf32&) = delete;
  NoCudnnTf32& operator=(const NoCudnnTf32&) = delete;
};

Tensor rnd(const Shape& s, DType d) {
  return ops::to(ops::randn(s, DType::float32, kGpu), d);
}

struct Case {
  std::string name, shape, dtype;
  double bytes;  // minimum bytes moved (each input read once, output written once)
  double flops;
  std::function<void()> fn;
};

}  // namespace

int main(int argc, char** argv) {
  const std::string filter = argc > 1 ? argv[1] : "";
  std::vector<Case> cases;
  // --- elementwise, memory bound
  {
    const Tensor a = rnd({64, 256, 56, 56}, DType::float32),
                 b = rnd({64, 256, 56, 56}, DType::float32);
    const double n = static_cast<double>(a.numel());
    cases.push_back({"add", "[64,256,56,56]", "float32", 12 * n, n, [=] { (void)ops::add(a, b); }});
    cases.push_back({"relu", "[64,256,56,56]", "float32", 8 * n, n, [=] { (void)relu(a); }});
    cases.push_back({"copy", "[64,256,56,56]", "float32", 8 * n, 0, [=] { (void)ops::clone(a); }});
  }
  {
    // 64M elements: the bandwidth targets of the vectorised fast path
    const Tensor a = rnd({64 << 20}, DType::float32), b = rnd({64 << 20}, DType::float32);
    const Tensor h = rnd({64 << 20}, DType::bfloat16), k = rnd({64 << 20}, DType::bfloat16);
    const double n = static_cast<double>(a.numel());
    cases.push_back({"add", "[67108864]", "float32", 12 * n, n, [=] { (void)ops::add(a, b); }});
    cases.push_back({"mul", "[67108864]", "float32", 12 * n, n, [=] { (void)ops::mul(a, b); }});
    // times a 0-D device tensor (a loss scale, a mean's 1 / count)
    const Tensor s = rnd({}, DType::float32);
    cases.push_back(
        {"mul_0d_tensor", "[67108864]", "float32", 8 * n, n, [=] { (void)ops::mul(a, s); }});
    cases.push_back({"relu", "[67108864]", "float32", 8 * n, n, [=] { (void)relu(a); }});
    cases.push_back({"gelu", "[67108864]", "float32", 8 * n, 8 * n, [=] { (void)gelu(a); }});
    cases.push_back({"add", "[67108864]", "bfloat16", 6 * n, n, [=] { (void)ops::add(h, k); }});
    cases.push_back({"gelu", "[67108864]", "bfloat16", 4 * n, 8 * n, [=] { (void)gelu(h); }});
  }
  {
    const Tensor x = rnd({16, 1024, 3072}, DType::bfloat16);
    const double n = static_cast<double>(x.numel());
    cases.push_back(
        {"gelu_tanh", "[16,1024,3072]", "bfloat16", 4 * n, 8 * n, [=] { (void)gelu(x, "tanh"); }});
    const Tensor r = rnd({16, 1024, 768}, DType::bfloat16),
                 s = rnd({16, 1024, 768}, DType::bfloat16);
    const double m = static_cast<double>(r.numel());
    cases.push_back({"add", "[16,1024,768]", "bfloat16", 6 * m, m, [=] { (void)ops::add(r, s); }});
    cases.push_back({"sum", "[16,1024,768]", "bfloat16", 2 * m, m, [=] { (void)ops::sum(r); }});
    // GPT-2's bias gradients: bfloat16 [16384, N] summed over the rows into float32
    for (int64_t N : {768, 2304, 3072}) {
      const Tensor g = rnd({16384, N}, DType::bfloat16);
      const double e = static_cast<double>(g.numel());
      cases.push_back({"sum_dim0_f32", fmt::format("[16384,{}]", N), "bfloat16", 2 * e, e,
                       [=] { (void)ops::sum(g, {0}, false, DType::float32); }});
    }
    // a float32 residual plus a bfloat16 branch (autocast), the branch widened in the kernel
    const Tensor r32 = rnd({16, 1024, 768}, DType::float32);
    cases.push_back(
        {"add_f32_bf16", "[16,1024,768]", "float32", 10 * m, m, [=] { (void)ops::add(r32, s); }});
  }
  // --- heavier ops: run when their CUDA kernels exist
  {
    const Tensor x = rnd({16384, 768}, DType::bfloat16), w = rnd({2304, 768}, DType::bfloat16);
    cases.push_back({"linear", "[16384,768]x[2304,768]^T", "bfloat16",
                     2.0 * (x.numel() + w.numel() + 16384.0 * 2304), 2.0 * 16384 * 768 * 2304,
                     [=] { (void)linear(x, w); }});
    const Tensor w2 = rnd({768, 768}, DType::float32), x2 = rnd({16384, 768}, DType::float32);
    cases.push_back({"linear", "[16384,768]x[768,768]^T", "float32",
                     4.0 * (x2.numel() * 2 + w2.numel()), 2.0 * 16384 * 768 * 768,
                     [=] { (void)linear(x2, w2); }});
  }
  {
    const Tensor x = rnd({16384, 768}, DType::bfloat16), g = rnd({768}, DType::float32),
                 b = rnd({768}, DType::float32);
    cases.push_back({"layer_norm", "[16384,768]", "bfloat16", 4.0 * x.numel(), 8.0 * x.numel(),
                     [=] { (void)layer_norm(x, {768}, g, b); }});
    // forward + backward of a float32 row (GPT's residual stream), and the same with the output
    // written in bfloat16 and its bfloat16 gradient read back (autocast's ln_1 / ln_2; PyTorch:
    // layer_norm then .to(bfloat16)).
    Tensor x32 = rnd({16384, 768}, DType::float32), g32 = rnd({768}, DType::float32),
           b32 = rnd({768}, DType::float32);
    x32.requires_grad_();
    g32.requires_grad_();
    b32.requires_grad_();
    const Tensor dy32 = rnd({16384, 768}, DType::float32),
                 dy16 = rnd({16384, 768}, DType::bfloat16);
    cases.push_back({"layer_norm_fwd_bwd", "[16384,768]", "float32", 20.0 * x32.numel(),
                     18.0 * x32.numel(), [=] {
                       x32.set_grad(Tensor());
                       g32.set_grad(Tensor());
                       b32.set_grad(Tensor());
                       layer_norm(x32, {768}, g32, b32).backward(dy32);
                     }});
    cases.push_back({"layer_norm_to_bf16_fwd_bwd", "[16384,768]", "float32", 16.0 * x32.numel(),
                     18.0 * x32.numel(), [=] {
                       x32.set_grad(Tensor());
                       g32.set_grad(Tensor());
                       b32.set_grad(Tensor());
                       layer_norm(x32, {768}, g32, b32, 1e-5, DType::bfloat16).backward(dy16);
                     }});
  }
  {
    const Tensor logits = rnd({16384, 50257}, DType::bfloat16);
    const Tensor y = ops::randint(0, 50257, {16384}, DType::int64, kGpu);
    cases.push_back({"cross_entropy", "[16384,50257]", "bfloat16", 2.0 * logits.numel(),
                     4.0 * logits.numel(), [=] { (void)cross_entropy(logits, y); }});
  }
  {
    const Tensor x = rnd({64, 64, 56, 56}, DType::float32), w = rnd({64, 64, 3, 3}, DType::float32);
    cases.push_back({"conv2d", "[64,64,56,56]*[64,64,3,3]", "float32",
                     4.0 * (2 * x.numel() + w.numel()), 2.0 * 64 * 64 * 56 * 56 * 64 * 9,
                     [=] { (void)conv2d(x, w, {}, 1, 1); }});
    const Tensor bn = rnd({64, 256, 56, 56}, DType::float32);
    Tensor rm = ops::zeros({256}, DType::float32, kGpu),
           rv = ops::ones({256}, DType::float32, kGpu);
    const Tensor gw = rnd({256}, DType::float32), gb = rnd({256}, DType::float32);
    cases.push_back({"batch_norm", "[64,256,56,56]", "float32", 12.0 * bn.numel(), 8.0 * bn.numel(),
                     [=] { (void)batch_norm(bn, rm, rv, gw, gb, true); }});
    const Tensor mp = rnd({64, 64, 112, 112}, DType::float32);
    cases.push_back({"max_pool2d", "[64,64,112,112] k3 s2", "float32", 4.0 * mp.numel() * 1.25,
                     9.0 * mp.numel() / 4, [=] { (void)max_pool2d(mp, 3, 2, 1); }});
  }
  // Attention at GPT-2's shape, in bfloat16 and in float32 (GPT-2 trained in fp32: the fused
  // float32 kernels on the CUDA cores).
  for (const DType dt : {DType::bfloat16, DType::float32}) {
    const double elem = dt == DType::bfloat16 ? 2.0 : 4.0;  // bytes per element
    const Tensor q = rnd({16, 12, 1024, 64}, dt), k = rnd({16, 12, 1024, 64}, dt),
                 v = rnd({16, 12, 1024, 64}, dt);
    const double fwd_flops = 4.0 * 16 * 12 * 1024 * 1024 * 64 / 2;  // causal: half the scores
    cases.push_back({"sdpa_causal", "[16,12,1024,64]", dtype_name(dt), elem * 4 * q.numel(),
                     fwd_flops,
                     [=] { (void)scaled_dot_product_attention(q, k, v, {}, 0.0, true); }});
    if (dt == DType::bfloat16)
      cases.push_back({"sdpa", "[16,12,1024,64]", dtype_name(dt), elem * 4 * q.numel(),
                       2 * fwd_flops, [=] { (void)scaled_dot_product_attention(q, k, v); }});
    // forward + backward: the backward recomputes S (2 more matmuls) and computes dV, dP, dQ,
    // dK: 2.5x the forward's FLOPs (FlashAttention's count). Bytes: q, k, v, out, dout read,
    // dq, dk, dv written, out written.
    Tensor qg = ops::clone(q), kg = ops::clone(k), vg = ops::clone(v);  // leaves of their own
    qg.requires_grad_();
    kg.requires_grad_();
    vg.requires_grad_();
    const Tensor g = rnd({16, 12, 1024, 64}, dt);
    cases.push_back({"sdpa_causal_fwd_bwd", "[16,12,1024,64]", dtype_name(dt),
                     elem * 10 * q.numel(), 3.5 * fwd_flops, [=] {
                       qg.set_grad(Tensor());
                       kg.set_grad(Tensor());
                       vg.set_grad(Tensor());
                       scaled_dot_product_attention(qg, kg, vg, {}, 0.0, true).backward(g);
                     }});
  }
  // --- backward: forward + backward of the matrix products (3x the forward's FLOPs)
  {
    Tensor x = rnd({16384, 768}, DType::bfloat16), w = rnd({2304, 768}, DType::bfloat16);
    x.requires_grad_();
    w.requires_grad_();
    const Tensor g = rnd({16384, 2304}, DType::bfloat16);
    cases.push_back({"linear_fwd_bwd", "[16384,768]x[2304,768]^T", "bfloat16",
                     2.0 * 3 * (x.numel() + w.numel() + 16384.0 * 2304),
                     3 * 2.0 * 16384 * 768 * 2304, [=] {
                       x.set_grad(Tensor());
                       w.set_grad(Tensor());
                       linear(x, w).backward(g);
                     }});
    // with a bias (its gradient a sum over the rows, as PyTorch's)
    Tensor bias = rnd({2304}, DType::bfloat16);
    bias.requires_grad_();
    cases.push_back({"linear_bias_fwd_bwd", "[16384,768]x[2304,768]^T+b", "bfloat16",
                     2.0 * 3 * (x.numel() + w.numel() + 16384.0 * 2304),
                     3 * 2.0 * 16384 * 768 * 2304, [=] {
                       x.set_grad(Tensor());
                       w.set_grad(Tensor());
                       bias.set_grad(Tensor());
                       linear(x, w, bias).backward(g);
                     }});
    Tensor a = rnd({16, 12, 1024, 64}, DType::bfloat16),
           b = rnd({16, 12, 64, 1024}, DType::bfloat16);
    a.requires_grad_();
    b.requires_grad_();
    const Tensor gm = rnd({16, 12, 1024, 1024}, DType::bfloat16);
    cases.push_back({"matmul_fwd_bwd", "[16,12,1024,64]x[16,12,64,1024]", "bfloat16",
                     2.0 * 3 * (a.numel() + b.numel() + gm.numel()),
                     3 * 2.0 * 192 * 1024 * 1024 * 64, [=] {
                       a.set_grad(Tensor());
                       b.set_grad(Tensor());
                       matmul(a, b).backward(gm);
                     }});
  }
  {
    Tensor x = rnd({64, 64, 56, 56}, DType::float32), w = rnd({64, 64, 3, 3}, DType::float32);
    x.requires_grad_();
    w.requires_grad_();
    const Tensor g = rnd({64, 64, 56, 56}, DType::float32);
    cases.push_back({"conv2d_fwd_bwd", "[64,64,56,56]*[64,64,3,3]", "float32",
                     4.0 * 3 * (2 * x.numel() + w.numel()), 3 * 2.0 * 64 * 64 * 56 * 56 * 64 * 9,
                     [=] {
                       x.set_grad(Tensor());
                       w.set_grad(Tensor());
                       conv2d(x, w, {}, 1, 1).backward(g);
                     }});
  }
  // --- attention with a mask and with grouped key/value heads (MultiheadAttention's key
  // padding, LLaMA-1B's 32 query heads over 8 key/value heads)
  {
    const Tensor q = rnd({16, 12, 1024, 64}, DType::bfloat16),
                 k = rnd({16, 12, 1024, 64}, DType::bfloat16),
                 v = rnd({16, 12, 1024, 64}, DType::bfloat16);
    // key padding: about half the keys of each sequence take part (true = take part)
    const Tensor mask =
        ge(rnd({16, 1, 1, 1024}, DType::float32), ops::zeros({}, DType::float32, kGpu));
    const double flops = 4.0 * 16 * 12 * 1024 * 1024 * 64;
    const double bytes = 2.0 * 4 * q.numel() + 16.0 * 1024;
    cases.push_back({"sdpa_mask", "[16,12,1024,64] bool[16,1,1,1024]", "bfloat16", bytes, flops,
                     [=] { (void)scaled_dot_product_attention(q, k, v, mask); }});
    Tensor qg = ops::clone(q), kg = ops::clone(k), vg = ops::clone(v);
    qg.requires_grad_();
    kg.requires_grad_();
    vg.requires_grad_();
    const Tensor g = rnd({16, 12, 1024, 64}, DType::bfloat16);
    cases.push_back({"sdpa_mask_fwd_bwd", "[16,12,1024,64] bool[16,1,1,1024]", "bfloat16",
                     2.0 * 10 * q.numel(), 3.5 * flops, [=] {
                       qg.set_grad(Tensor());
                       kg.set_grad(Tensor());
                       vg.set_grad(Tensor());
                       scaled_dot_product_attention(qg, kg, vg, mask).backward(g);
                     }});
  }
  {
    const Tensor q = rnd({8, 32, 2048, 64}, DType::bfloat16),
                 k = rnd({8, 8, 2048, 64}, DType::bfloat16),
                 v = rnd({8, 8, 2048, 64}, DType::bfloat16);
    const double flops = 4.0 * 8 * 32 * 2048 * 2048 * 64 / 2;  // causal: half the scores
    const double bytes = 2.0 * (2 * q.numel() + 2 * k.numel());
    cases.push_back(
        {"sdpa_gqa_causal", "[8,32|8,2048,64]", "bfloat16", bytes, flops,
         [=] { (void)scaled_dot_product_attention(q, k, v, {}, 0.0, true, std::nullopt, true); }});
    Tensor qg = ops::clone(q), kg = ops::clone(k), vg = ops::clone(v);
    qg.requires_grad_();
    kg.requires_grad_();
    vg.requires_grad_();
    const Tensor g = rnd({8, 32, 2048, 64}, DType::bfloat16);
    cases.push_back(
        {"sdpa_gqa_causal_fwd_bwd", "[8,32|8,2048,64]", "bfloat16",
         2.0 * (5 * q.numel() + 4 * k.numel()), 3.5 * flops, [=] {
           qg.set_grad(Tensor());
           kg.set_grad(Tensor());
           vg.set_grad(Tensor());
           scaled_dot_product_attention(qg, kg, vg, {}, 0.0, true, std::nullopt, true).backward(g);
         }});
  }
  // --- the recurrent cells' fused gate steps (one timestep: PyTorch's _thnn_fused_lstm_cell and
  // _thnn_fused_gru_cell) and whole LSTM / GRU layers (PyTorch: cuDNN's), float32
  {
    const int64_t B = 256, H = 1024;
    Tensor gx = rnd({B, 4 * H}, DType::float32), gh = rnd({B, 4 * H}, DType::float32),
           c0 = rnd({B, H}, DType::float32);
    const double n = static_cast<double>(B * H);
    // gates_x, gates_h, c_prev read; h, c and the activated gates written
    cases.push_back({"lstm_cell_gates", "[256,4096]", "float32", 4.0 * (9 * n + 6 * n), 30 * n,
                     [=] { (void)lstm_cell_gates(gx, gh, c0); }});
    gx.requires_grad_();
    gh.requires_grad_();
    c0.requires_grad_();
    const Tensor dh = rnd({B, H}, DType::float32);
    cases.push_back({"lstm_cell_gates_fwd_bwd", "[256,4096]", "float32", 4.0 * 30 * n, 60 * n, [=] {
                       gx.set_grad(Tensor());
                       gh.set_grad(Tensor());
                       c0.set_grad(Tensor());
                       auto hc = lstm_cell_gates(gx, gh, c0);
                       (hc.first + hc.second).backward(dh);
                     }});
    Tensor rx = rnd({B, 3 * H}, DType::float32), rh = rnd({B, 3 * H}, DType::float32),
           h0 = rnd({B, H}, DType::float32);
    cases.push_back({"gru_cell_gates", "[256,3072]", "float32", 4.0 * (7 * n + 5 * n), 20 * n,
                     [=] { (void)gru_cell_gates(rx, rh, h0); }});
    rx.requires_grad_();
    rh.requires_grad_();
    h0.requires_grad_();
    cases.push_back({"gru_cell_gates_fwd_bwd", "[256,3072]", "float32", 4.0 * 24 * n, 40 * n, [=] {
                       rx.set_grad(Tensor());
                       rh.set_grad(Tensor());
                       h0.set_grad(Tensor());
                       gru_cell_gates(rx, rh, h0).backward(dh);
                     }});
  }
  {
    // The LSTM LM's recurrent layers (bench/train.py's lstm row): 2 layers of 650, batch 64,
    // 35 steps, batch_first; forward and backward, the input's gradient included. float32
    // exactly on both sides (ops_gpu.py runs PyTorch's rows with cuDNN's TF32 off). The
    // layers run on cuDNN's RNN (tensor/rnn/cuda.h); the *_per_step rows switch that route off
    // (one product and one fused gate kernel per step), and lstm_fwd / gru_fwd time the
    // forward alone under no_grad (cuDNN's inference mode). Only the fwd_bwd rows on cuDNN
    // have a PyTorch row.
    const int64_t B = 64, T = 35, H = 650;
    nn::BuildOnDevice on(kGpu);
    auto lstm = std::make_shared<nn::LSTM>(H, H, 2, true, true);
    auto gru = std::make_shared<nn::GRU>(H, H, 2, true, true);
    Tensor x = rnd({B, T, H}, DType::float32);
    x.requires_grad_();
    const Tensor xi = rnd({B, T, H}, DType::float32);
    const Tensor g = rnd({B, T, H}, DType::float32);
    const double params = 2.0 * 4 * H * (2 * H + 2);       // per gate row: w_ih, w_hh, two biases
    const double products = 2.0 * 3 * B * T * params / 2;  // 2 FLOPs a weight; fwd + 2x bwd
    // The route as a row asks for it, restored after.
    struct Route {
      bool saved = cuda::cudnn_rnn_enabled();
      explicit Route(bool on) { cuda::set_cudnn_rnn_enabled(on); }
      ~Route() { cuda::set_cudnn_rnn_enabled(saved); }
    };
    for (bool cudnn : {true, false}) {
      const std::string sfx = cudnn ? "" : "_per_step";
      // (name, module, bytes and FLOPs relative to the LSTM's)
      for (const auto& [name, m, scale, elems] :
           {std::make_tuple(std::string("lstm"), std::static_pointer_cast<nn::Module>(lstm), 1.0,
                            12.0),
            std::make_tuple(std::string("gru"), std::static_pointer_cast<nn::Module>(gru), 0.75,
                            10.0)}) {
        const std::shared_ptr<nn::Module> mod = m;
        cases.push_back({name + "_fwd_bwd" + sfx, "[64,35,650] 2 layers", "float32",
                         4.0 * (3 * params * scale + 2 * elems * B * T * H), scale * products, [=] {
                           const NoCudnnTf32 exact;
                           const Route route(cudnn);
                           mod->zero_grad();
                           x.set_grad(Tensor());
                           (*mod)(x).backward(g);
                         }});
        cases.push_back({name + "_fwd" + sfx, "[64,35,650] 2 layers", "float32",
                         4.0 * (params * scale + elems / 2 * B * T * H), scale * products / 3, [=] {
                           const NoCudnnTf32 exact;
                           const Route route(cudnn);
                           const NoGradGuard no_grad;
                           (void)(*mod)(xi);
                         }});
      }
    }
  }
  // --- indexing: gather along rows, an embedding's index_select, and its backward's
  // scatter_add (random rows, atomics where they collide)
  {
    const Tensor x = rnd({4096, 4096}, DType::float32);
    const Tensor idx = ops::randint(0, 4096, {4096, 1024}, DType::int64, kGpu);
    const double n = static_cast<double>(idx.numel());
    cases.push_back({"gather", "[4096,4096] dim1 [4096,1024]", "float32", 16 * n, 0,
                     [=] { (void)gather(x, 1, idx); }});
    const Tensor table = rnd({50304, 768}, DType::float32);
    const Tensor rows = ops::randint(0, 50304, {16384}, DType::int64, kGpu);
    const double m = 16384.0 * 768;
    cases.push_back({"index_select", "[50304,768] dim0 [16384]", "float32", 8 * m + 8 * 16384.0, 0,
                     [=] { (void)index_select(table, 0, rows); }});
    const Tensor src = rnd({16384, 768}, DType::float32);
    const Tensor sidx = ops::randint(0, 50304, {16384, 768}, DType::int64, kGpu);
    // out-of-place: x copied (read and written), then src and the index read, out updated
    cases.push_back({"scatter_add", "[50304,768] dim0 [16384,768]", "float32",
                     8.0 * table.numel() + 16 * m, m,
                     [=] { (void)scatter_add(table, 0, sidx, src); }});
    // The same scatter multiplying; index_add_ and index_fill_ of whole rows in place (on a
    // copy of the table), and a running product along the rows.
    cases.push_back({"scatter_multiply", "[50304,768] dim0 [16384,768]", "float32",
                     8.0 * table.numel() + 16 * m, m,
                     [=] { (void)scatter(table, 0, sidx, src, "multiply"); }});
    const Tensor rows_table = ops::clone(table);
    cases.push_back({"index_add_", "[50304,768] dim0 [16384]", "float32", 12 * m + 8 * 16384.0, m,
                     [=] { index_add_(rows_table, 0, rows, src); }});
    cases.push_back({"index_fill_", "[50304,768] dim0 [16384]", "float32", 4 * m + 8 * 16384.0, 0,
                     [=] { index_fill_(rows_table, 0, rows, 0.5); }});
    cases.push_back({"cumprod", "[4096,4096] dim1", "float32", 8.0 * x.numel(),
                     static_cast<double>(x.numel()), [=] { (void)cumprod(x, 1); }});
  }
  // --- F.interpolate: trilinear x2 of a 5-D volume (a 3-D U-Net's decoder) and linear x2 of
  // long 3-D rows, forward and forward + backward (the gathering backward).
  {
    namespace F = nn::functional;
    using V = std::vector<double>;
    Tensor vol = rnd({8, 32, 32, 64, 64}, DType::float32),
           seq = rnd({64, 256, 2048}, DType::float32);
    const double nv = static_cast<double>(vol.numel()), ns = static_cast<double>(seq.numel());
    cases.push_back({"interpolate_trilinear", "[8,32,32,64,64] x2", "float32", 4 * (nv + 8 * nv),
                     15 * 8 * nv,
                     [=] { (void)F::interpolate(vol, std::nullopt, V{2.0}, "trilinear", false); }});
    cases.push_back({"interpolate_linear", "[64,256,2048] x2", "float32", 4 * (ns + 2 * ns),
                     3 * 2 * ns,
                     [=] { (void)F::interpolate(seq, std::nullopt, V{2.0}, "linear", false); }});
    vol.requires_grad_();
    seq.requires_grad_();
    const Tensor gv = rnd({8, 32, 64, 128, 128}, DType::float32),
                 gs = rnd({64, 256, 4096}, DType::float32);
    cases.push_back({"interpolate_trilinear_fwd_bwd", "[8,32,32,64,64] x2", "float32",
                     4 * (nv + 8 * nv) + 4 * (8 * nv + nv), 2 * 15 * 8 * nv, [=] {
                       vol.set_grad(Tensor());
                       F::interpolate(vol, std::nullopt, V{2.0}, "trilinear", false).backward(gv);
                     }});
    cases.push_back({"interpolate_linear_fwd_bwd", "[64,256,2048] x2", "float32",
                     4 * (ns + 2 * ns) + 4 * (2 * ns + ns), 2 * 3 * 2 * ns, [=] {
                       seq.set_grad(Tensor());
                       F::interpolate(seq, std::nullopt, V{2.0}, "linear", false).backward(gs);
                     }});
  }
  // --- what the attention rows above choose between (issue 50), no PyTorch counterpart:
  // compare with sdpa_gqa_causal* and sdpa_mask*. Grouped-query attention with the key/value
  // heads repeated by hand (then cuDNN's route, the path before the native one), and
  // MultiheadAttention's key padding as it passes it: a bfloat16 float mask (0 / -inf).
  {
    using Attn = std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)>;
    // The forward row of attn(q, k, v) and its forward + backward row (on leaf copies).
    const auto rows = [&](const std::string& name, const std::string& shape, const Tensor& q,
                          const Tensor& k, const Tensor& v, double bytes, double bwd_bytes,
                          double flops, const Attn& attn) {
      cases.push_back({name, shape, "bfloat16", bytes, flops, [=] { (void)attn(q, k, v); }});
      Tensor qg = ops::clone(q), kg = ops::clone(k), vg = ops::clone(v);
      for (Tensor* t : {&qg, &kg, &vg}) t->requires_grad_();
      const Tensor g = rnd(q.sizes(), DType::bfloat16);
      cases.push_back({name + "_fwd_bwd", shape, "bfloat16", bwd_bytes, 3.5 * flops, [=] {
                         for (const Tensor* t : {&qg, &kg, &vg}) t->set_grad(Tensor());
                         attn(qg, kg, vg).backward(g);
                       }});
    };
    const Tensor q = rnd({8, 32, 2048, 64}, DType::bfloat16),
                 k = rnd({8, 8, 2048, 64}, DType::bfloat16),
                 v = rnd({8, 8, 2048, 64}, DType::bfloat16);
    rows("sdpa_gqa_causal_repeat", "[8,32|8,2048,64]", q, k, v,
         2.0 * (2 * q.numel() + 2 * k.numel()), 2.0 * (5 * q.numel() + 4 * k.numel()),
         4.0 * 8 * 32 * 2048 * 2048 * 64 / 2,
         [](const Tensor& a, const Tensor& b, const Tensor& c) {
           const auto rep = [](const Tensor& t) {
             return t.unsqueeze(2).expand({8, 8, 4, 2048, 64}).reshape({8, 32, 2048, 64});
           };
           return scaled_dot_product_attention(a, rep(b), rep(c), {}, 0.0, true);
         });
    const Tensor q2 = rnd({16, 12, 1024, 64}, DType::bfloat16),
                 k2 = rnd({16, 12, 1024, 64}, DType::bfloat16),
                 v2 = rnd({16, 12, 1024, 64}, DType::bfloat16);
    const Tensor keep =
        ge(rnd({16, 1, 1, 1024}, DType::float32), ops::zeros({}, DType::float32, kGpu));
    const Tensor mask = ops::masked_fill(ops::zeros({16, 1, 1, 1024}, DType::bfloat16, kGpu),
                                         ops::binary_scalar(ops::BinaryOp::eq, keep, 0.0),
                                         -std::numeric_limits<double>::infinity());
    rows("sdpa_mask_float", "[16,12,1024,64] bf16[16,1,1,1024]", q2, k2, v2,
         2.0 * 4 * q2.numel() + 2.0 * 16 * 1024, 2.0 * 10 * q2.numel(),
         4.0 * 16 * 12 * 1024 * 1024 * 64,
         [mask](const Tensor& a, const Tensor& b, const Tensor& c) {
           return scaled_dot_product_attention(a, b, c, mask);
         });
  }
  // --- group_norm (issue 50), groups 32: float16 [128,256,32,32] and the DDPM U-Net's
  // [128,128,32,32] (float32, bfloat16, and bfloat16 under autocast as bench_train runs it:
  // the input cast to float32, float32 parameters), forward and forward + backward. The
  // parameters have the input's dtype (autocast: float32).
  {
    namespace F = nn::functional;
    const Shape big{128, 256, 32, 32}, unet{128, 128, 32, 32};
    const std::pair<Shape, DType> rows[] = {
        {big, DType::float16}, {unet, DType::float32}, {unet, DType::bfloat16}};
    for (const auto& row : rows) {
      const Shape& s = row.first;
      const DType d = row.second;
      const std::string shape = fmt::format("[{},{},{},{}] g32", s[0], s[1], s[2], s[3]);
      Tensor x = rnd(s, d), w = rnd({s[1]}, d), b = rnd({s[1]}, d);
      const Tensor dy = rnd(s, d);
      const double n = static_cast<double>(x.numel()), e = static_cast<double>(dtype_size(d));
      cases.push_back({"group_norm", shape, dtype_name(d), 2 * e * n, 8 * n,
                       [=] { (void)F::group_norm(x, 32, w, b); }});
      x.requires_grad_();
      w.requires_grad_();
      b.requires_grad_();
      cases.push_back({"group_norm_fwd_bwd", shape, dtype_name(d), 5 * e * n, 26 * n, [=] {
                         x.set_grad(Tensor());
                         w.set_grad(Tensor());
                         b.set_grad(Tensor());
                         F::group_norm(x, 32, w, b).backward(dy);
                       }});
    }
    Tensor x = rnd(unet, DType::bfloat16), w = rnd({128}, DType::float32),
           b = rnd({128}, DType::float32);
    const Tensor dy = rnd(unet, DType::float32);
    x.requires_grad_();
    w.requires_grad_();
    b.requires_grad_();
    const double n = static_cast<double>(x.numel());
    cases.push_back(
        {"group_norm_autocast_fwd_bwd", "[128,128,32,32] g32", "bfloat16", 18 * n, 26 * n, [=] {
           x.set_grad(Tensor());
           w.set_grad(Tensor());
           b.set_grad(Tensor());
           Tensor y;
           {
             AutocastGuard autocast(DeviceType::cuda, DType::bfloat16);
             y = F::group_norm(x, 32, w, b);
           }
           y.backward(dy);
         }});
  }
  // --- LLaMA-1B's fused ops (B8 T2048, bfloat16): SwiGLU's silu(gate) * up over [16384, 8192]
  // and the rotary embedding of q [8, 2048, 32, 64] with [2048, 1, 64] tables; PyTorch runs
  // HF's composites (F.silu(g) * u; q * cos + rotate_half(q) * sin).
  {
    Tensor g = rnd({16384, 8192}, DType::bfloat16), u = rnd({16384, 8192}, DType::bfloat16);
    const Tensor dy = rnd({16384, 8192}, DType::bfloat16);
    const double n = static_cast<double>(g.numel());
    cases.push_back(
        {"swiglu", "[16384,8192]", "bfloat16", 6 * n, 5 * n, [=] { (void)silu_mul(g, u); }});
    g.requires_grad_();
    u.requires_grad_();
    cases.push_back({"swiglu_fwd_bwd", "[16384,8192]", "bfloat16", 16 * n, 15 * n, [=] {
                       g.set_grad(Tensor());
                       u.set_grad(Tensor());
                       silu_mul(g, u).backward(dy);
                     }});
    Tensor q = rnd({8, 2048, 32, 64}, DType::bfloat16);
    const Tensor c = rnd({2048, 1, 64}, DType::bfloat16), sn = rnd({2048, 1, 64}, DType::bfloat16);
    const Tensor dq = rnd({8, 2048, 32, 64}, DType::bfloat16);
    const double m = static_cast<double>(q.numel());
    cases.push_back({"rotary", "[8,2048,32,64] [2048,1,64]", "bfloat16", 4 * m, 3 * m,
                     [=] { (void)rotary_embedding(q, c, sn); }});
    q.requires_grad_();
    cases.push_back({"rotary_fwd_bwd", "[8,2048,32,64] [2048,1,64]", "bfloat16", 8 * m, 6 * m, [=] {
                       q.set_grad(Tensor());
                       rotary_embedding(q, c, sn).backward(dq);
                     }});
  }
  for (const Case& c : cases) {
    if (!filter.empty() && c.name.find(filter) == std::string::npos) continue;
    try {
      const double ms = time_ms(c.fn);
      const double peak = c.dtype == "float32" ? 60e12 : 790e12;
      const double floor_ms = std::max(c.bytes / 4.3e12, c.flops / peak) * 1e3;
      const bool compute_bound = c.flops / peak > c.bytes / 4.3e12;
      fmt::print(
          "{{\"op\": \"{}\", \"shape\": \"{}\", \"dtype\": \"{}\", \"tally_ms\": {:.4f}, "
          "\"floor_ms\": {:.4f}, "
          "\"gbps\": {:.1f}, \"tflops\": {:.1f}, \"bound\": \"{}\"}}\n",
          c.name, c.shape, c.dtype, ms, floor_ms, c.bytes / ms / 1e6, c.flops / ms / 1e9,
          compute_bound ? "compute" : "memory");
    } catch (const std::exception& e) {
      fmt::print("{{\"op\": \"{}\", \"shape\": \"{}\", \"dtype\": \"{}\", \"error\": {}}}\n",
                 c.name, c.shape, c.dtype,
                 base::json_quote(std::string_view(e.what()).substr(0, 120)));
    }
    std::fflush(stdout);
  }
  return 0;
}
#else
int main() {
  fmt::print("bench_ops_cuda: built without CUDA\n");
  return 0;
}
#endif
