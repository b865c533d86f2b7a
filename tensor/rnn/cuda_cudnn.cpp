// The cuDNN route of whole LSTM and GRU layers (tensor/rnn/cuda_cudnn.h), cuDNN's v8 RNN API as
// PyTorch's cudnn_rnn uses it: one plan per problem (device, handle, dtype, mode, sizes,
// layout, sequence length, batch, training, math type) holding the RNN, dropout (none), data
// and state descriptors, the weight-space, workspace and reserve sizes, and where each of
// Tally's per-layer parameters lies in cuDNN's flat weight space; built on first use and
// cached for the process, problems cuDNN declines remembered too (a counted fallback to the
// per-timestep path). Each call gathers the parameters into a flat weight space (device
// copies, one per contiguous run), and the backward scatters cuDNN's flat weight gradient back
// into one gradient per parameter. Workspace, flat weights and their gradient are scratch
// (Category::workspace); the reserve space is an output the autograd node saves (it becomes
// an activation).
#include "tensor/rnn/cuda_cudnn.h"

#include <cudnn.h>
#include <fmt/format.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "tensor/cuda/cudnn.h"
#include "tensor/cuda/runtime.h"
#include "tensor/op_alloc.h"
#include "tensor/rnn/cuda.h"
#include "tensor/storage.h"

namespace tally::cuda {

namespace {

// The setter's choice (1 on, 0 off), or -1: TALLY_CUDNN_RNN's (read once, at the first call).
std::atomic<int> g_enabled{-1};

bool enabled() {
  static const bool from_env = env_switch("TALLY_CUDNN_RNN", true);
  const int v = g_enabled.load();
  return v < 0 ? from_env : v == 1;
}
std::atomic<int64_t> g_forward{0}, g_backward{0}, g_fallback{0};

class RnnDescriptor : public OwnedDescriptor<cudnnRNNDescriptor_t, cudnnCreateRNNDescriptor,
                                             cudnnDestroyRNNDescriptor> {
 public:
  RnnDescriptor() : OwnedDescriptor("cudnnCreateRNNDescriptor") {}
};
class RnnDataDescriptor
    : public OwnedDescriptor<cudnnRNNDataDescriptor_t, cudnnCreateRNNDataDescriptor,
                             cudnnDestroyRNNDataDescriptor> {
 public:
  RnnDataDescriptor() : OwnedDescriptor("cudnnCreateRNNDataDescriptor") {}
};
class DropoutDescriptor
    : public OwnedDescriptor<cudnnDropoutDescriptor_t, cudnnCreateDropoutDescriptor,
                             cudnnDestroyDropoutDescriptor> {
 public:
  DropoutDescriptor() : OwnedDescriptor("cudnnCreateDropoutDescriptor") {}
};

// One contiguous run of a parameter inside the flat weight space: byte offsets into the
// weight space and into the parameter, and its length.
struct Segment {
  size_t flat = 0, param = 0, bytes = 0;
};

struct Plan {
  RnnDescriptor rnn;
  DropoutDescriptor dropout;
  RnnDataDescriptor x, y;
  TensorDescriptor h;  // [L * D, B, H], for h and c alike (no projection)
  size_t weight_bytes = 0, work_bytes = 0, reserve_bytes = 0;
  std::vector<std::vector<Segment>> segments;  // per tensor of the weight list
  bool covers_all = false;                     // the segments write every weight-space byte
};

struct Entry {
  std::unique_ptr<Plan> plan;  // null: cuDNN declined the problem
  std::string why;
};

// Everything a plan depends on.
using Key = std::tuple<int, cudnnHandle_t, int, bool, int64_t, int64_t, int64_t, bool, bool, bool,
                       bool, int64_t, int64_t, int>;

// The math type PyTorch's cuDNN RNN picks: tensor cores for 16-bit data, and for float32 only
// where cuDNN may use TF32 (torch.backends.cudnn.allow_tf32); float64 has only one.
cudnnMathType_t math_type(DType dtype) {
  if (dtype == DType::float64) return CUDNN_DEFAULT_MATH;
  if (dtype != DType::float32) return CUDNN_TENSOR_OP_MATH;
  return cudnn_allow_tf32() ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
}

int to_int(int64_t v, const char* what) {
  if (v < 0 || v > INT32_MAX)
    throw std::invalid_argument(
        fmt::format("cudnn_rnn: {} = {} does not fit cuDNN's int", what, v));
  return static_cast<int>(v);
}

// Element count of an N-d tensor descriptor (0 for none).
int64_t desc_numel(cudnnTensorDescriptor_t d) {
  cudnnDataType_t dt;
  int nb = 0, dims[8] = {}, strides[8] = {};
  check_cudnn(cudnnGetTensorNdDescriptor(d, 8, &dt, &nb, dims, strides),
              "cudnnGetTensorNdDescriptor");
  int64_t n = nb > 0 ? 1 : 0;
  for (int i = 0; i < nb; ++i) n *= dims[i];
  return n;
}

// Builds the plan of a problem; throws std::runtime_error (check_cudnn) or
// std::invalid_argument where cuDNN or the layout check declines it.
std::unique_ptr<Plan> build_plan(cudnnHandle_t handle, const CudnnRnnSpec& s, DType dtype,
                                 int64_t T, int64_t B, int device) {
  auto p = std::make_unique<Plan>();
  const cudnnDataType_t dt = cudnn_data_type(dtype);
  const int64_t D = s.directions(), G = s.lstm ? 4 : 3, H = s.hidden_size;
  const int I = to_int(s.input_size, "input_size"), Hi = to_int(H, "hidden_size");
  const int L = to_int(s.num_layers, "num_layers"), Ti = to_int(T, "the sequence length");
  const int Bi = to_int(B, "the batch size");
  const std::string ctx =
      fmt::format("{} input_size {}, hidden_size {}, num_layers {}, {}, T {}, B {}, {}",
                  s.lstm ? "LSTM" : "GRU", I, Hi, L,
                  s.bidirectional ? "bidirectional" : "unidirectional", Ti, Bi, dtype_name(dtype));
  // No dropout between the layers: the route is not taken for a training dropout > 0. Full-length
  // sequences in the unpacked layouts, which cuDNN accepts only with padded I/O enabled.
  check_cudnn(cudnnSetDropoutDescriptor(p->dropout.get(), handle, 0.0f, nullptr, 0, 0),
              "cudnnSetDropoutDescriptor", ctx);
  check_cudnn(cudnnSetRNNDescriptor_v8(
                  p->rnn.get(), CUDNN_RNN_ALGO_STANDARD, s.lstm ? CUDNN_LSTM : CUDNN_GRU,
                  s.bias ? CUDNN_RNN_DOUBLE_BIAS : CUDNN_RNN_NO_BIAS,
                  s.bidirectional ? CUDNN_BIDIRECTIONAL : CUDNN_UNIDIRECTIONAL, CUDNN_LINEAR_INPUT,
                  dt, dtype == DType::float64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT,
                  math_type(dtype), I, Hi, Hi, L, p->dropout.get(), CUDNN_RNN_PADDED_IO_ENABLED),
              "cudnnSetRNNDescriptor_v8", ctx);
  const std::vector<int> lengths(static_cast<size_t>(Bi), Ti);
  const cudnnRNNDataLayout_t layout = s.batch_first ? CUDNN_RNN_DATA_LAYOUT_BATCH_MAJOR_UNPACKED
                                                    : CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_UNPACKED;
  check_cudnn(cudnnSetRNNDataDescriptor(p->x.get(), dt, layout, Ti, Bi, I, lengths.data(), nullptr),
              "cudnnSetRNNDataDescriptor (x)", ctx);
  check_cudnn(cudnnSetRNNDataDescriptor(p->y.get(), dt, layout, Ti, Bi,
                                        to_int(D * H, "the output size"), lengths.data(), nullptr),
              "cudnnSetRNNDataDescriptor (y)", ctx);
  const int hdims[3] = {to_int(s.num_layers * D, "num_layers * directions"), Bi, Hi};
  const int hstrides[3] = {Bi * Hi, Hi, 1};
  check_cudnn(cudnnSetTensorNdDescriptor(p->h.get(), dt, 3, hdims, hstrides),
              "cudnnSetTensorNdDescriptor (h)", ctx);
  check_cudnn(cudnnGetRNNWeightSpaceSize(handle, p->rnn.get(), &p->weight_bytes),
              "cudnnGetRNNWeightSpaceSize", ctx);
  check_cudnn(
      cudnnGetRNNTempSpaceSizes(handle, p->rnn.get(),
                                s.training ? CUDNN_FWD_MODE_TRAINING : CUDNN_FWD_MODE_INFERENCE,
                                p->x.get(), &p->work_bytes, &p->reserve_bytes),
      "cudnnGetRNNTempSpaceSizes", ctx);
  if (!s.training) p->reserve_bytes = 0;

  // Where each gate's matrix and bias lies: cuDNN's linear-layer IDs 0..G-1 are the input
  // side (PyTorch's weight_ih rows, gate k at rows [k * H, (k + 1) * H)), G..2G-1 the
  // recurrent side (weight_hh); both orders are PyTorch's (LSTM i, f, g, o; GRU r, z, n).
  // The addresses are asked of a real weight space and kept as offsets.
  const Storage probe = alloc_scratch_bytes(p->weight_bytes, Device::cuda(device));
  char* base = static_cast<char*>(probe.data());
  const size_t es = dtype_size(dtype);
  const int64_t per_cell = s.tensors_per_cell();
  p->segments.assign(static_cast<size_t>(s.num_layers * D * per_cell), {});
  TensorDescriptor mdesc, bdesc;
  size_t covered = 0;
  for (int64_t cell = 0; cell < s.num_layers * D; ++cell) {
    const int64_t layer = cell / D, in = layer == 0 ? s.input_size : D * H;
    for (int64_t lin = 0; lin < 2 * G; ++lin) {
      const bool input_side = lin < G;
      const int64_t k = lin % G, cols = input_side ? in : H;
      void* m = nullptr;
      void* b = nullptr;
      check_cudnn(cudnnGetRNNWeightParams(handle, p->rnn.get(), static_cast<int32_t>(cell),
                                          p->weight_bytes, base, static_cast<int32_t>(lin),
                                          mdesc.get(), &m, bdesc.get(), &b),
                  "cudnnGetRNNWeightParams",
                  fmt::format("{}, pseudo-layer {}, linear layer {}", ctx, cell, lin));
      if (!m || desc_numel(mdesc.get()) != H * cols)
        throw std::invalid_argument(fmt::format(
            "cudnn_rnn: cuDNN's matrix of pseudo-layer {}, linear layer {} is not [{}, {}] ({})",
            cell, lin, H, cols, ctx));
      auto add = [&](int64_t tensor, size_t flat, size_t param, size_t bytes) {
        auto& segs = p->segments[static_cast<size_t>(cell * per_cell + tensor)];
        if (!segs.empty() && segs.back().flat + segs.back().bytes == flat &&
            segs.back().param + segs.back().bytes == param)
          segs.back().bytes += bytes;
        else
          segs.push_back({flat, param, bytes});
        covered += bytes;
      };
      const size_t mbytes = static_cast<size_t>(H * cols) * es;
      add(input_side ? 0 : 1, static_cast<size_t>(static_cast<char*>(m) - base), k * mbytes,
          mbytes);
      if (s.bias) {
        if (!b || desc_numel(bdesc.get()) != H)
          throw std::invalid_argument(fmt::format(
              "cudnn_rnn: cuDNN's bias of pseudo-layer {}, linear layer {} is not [{}] ({})", cell,
              lin, H, ctx));
        const size_t bbytes = static_cast<size_t>(H) * es;
        add(input_side ? 2 : 3, static_cast<size_t>(static_cast<char*>(b) - base), k * bbytes,
            bbytes);
      }
    }
  }
  p->covers_all = covered == p->weight_bytes;
  return p;
}

struct Cache {
  std::mutex mu;
  std::map<Key, std::shared_ptr<Entry>> entries;

  std::shared_ptr<Entry> get(cudnnHandle_t handle, const CudnnRnnSpec& s, DType dtype, int64_t T,
                             int64_t B, int device) {
    const Key key{device,
                  handle,
                  static_cast<int>(dtype),
                  s.lstm,
                  s.input_size,
                  s.hidden_size,
                  s.num_layers,
                  s.bias,
                  s.bidirectional,
                  s.batch_first,
                  s.training,
                  T,
                  B,
                  static_cast<int>(math_type(dtype))};
    std::lock_guard<std::mutex> lock(mu);
    auto it = entries.find(key);
    if (it != entries.end()) return it->second;
    auto e = std::make_shared<Entry>();
    try {
      e->plan = build_plan(handle, s, dtype, T, B, device);
    } catch (const std::exception& err) {
      e->why = err.what();
    }
    entries.emplace(key, e);
    return e;
  }
};

Cache& cache() {
  static Cache c;
  return c;
}

// (T, B) of x under the spec's layout.
std::pair<int64_t, int64_t> time_and_batch(const CudnnRnnSpec& s, const Tensor& x) {
  return s.batch_first ? std::make_pair(x.size(1), x.size(0))
                       : std::make_pair(x.size(0), x.size(1));
}

void* ptr_or_null(const Tensor& t) {
  return t.defined() ? t.data_ptr() : nullptr;
}

// The flat weight space of plan p filled from `weights` (scratch, on Tally's stream).
Storage pack_weights(const Plan& p, const TensorList& weights, int device) {
  Storage w = alloc_scratch_bytes(p.weight_bytes, Device::cuda(device));
  char* base = static_cast<char*>(w.data());
  const cudaStream_t st = stream(device);
  if (!p.covers_all)
    check(cudaMemsetAsync(base, 0, p.weight_bytes, st), "cudaMemsetAsync (cuDNN RNN weights)");
  for (size_t i = 0; i < weights.size(); ++i) {
    const char* src = static_cast<const char*>(weights[i].data_ptr());
    for (const Segment& seg : p.segments[i])
      check(cudaMemcpyAsync(base + seg.flat, src + seg.param, seg.bytes, cudaMemcpyDeviceToDevice,
                            st),
            "cudaMemcpyAsync (cuDNN RNN weights)");
  }
  return w;
}

// cuDNN's device copy of the sequence lengths: B values of T (scratch).
Storage sequence_lengths(int64_t T, int64_t B, int device) {
  Storage lens =
      alloc_scratch_bytes(static_cast<size_t>(B) * sizeof(int32_t), Device::cuda(device));
  fill_int32(static_cast<int32_t*>(lens.data()), B, static_cast<int32_t>(T), device);
  return lens;
}

}  // namespace

void set_cudnn_rnn_enabled(bool on) {
  g_enabled.store(on ? 1 : 0);
}
bool cudnn_rnn_enabled() {
  return enabled();
}
CudnnRnnCounts cudnn_rnn_counts() {
  return {g_forward.load(), g_backward.load(), g_fallback.load()};
}

void cudnn_rnn_sizes(const CudnnRnnSpec& spec, DType dtype, int64_t T, int64_t B,
                     CudnnRnnSizes* sizes) {
  *sizes = {};
  if (!enabled()) return;
  DeviceGuard guard(0);
  const auto e = cache().get(cudnn_handle(0), spec, dtype, T, B, 0);
  if (!e->plan) return;
  *sizes = {e->plan->weight_bytes, e->plan->work_bytes, e->plan->reserve_bytes, true};
}

void cudnn_rnn_forward(const CudnnRnnSpec& spec, const Tensor& x, const Tensor& h0,
                       const Tensor& c0, const TensorList& weights, CudnnRnnOutputs* out) {
  out->taken = false;
  if (!enabled()) return;
  const int device = x.device().index;
  DeviceGuard guard(device);
  const cudnnHandle_t handle = cudnn_handle(device);
  const auto [T, B] = time_and_batch(spec, x);
  const auto e = cache().get(handle, spec, x.dtype(), T, B, device);
  if (!e->plan) {
    g_fallback.fetch_add(1);
    return;
  }
  const Plan& p = *e->plan;
  NvtxRange range("cudnn_rnn (cuDNN)");
  const Device dev = x.device();
  const int64_t D = spec.directions(), H = spec.hidden_size, LD = spec.num_layers * D;
  out->output =
      alloc_output(spec.batch_first ? Shape{B, T, D * H} : Shape{T, B, D * H}, x.dtype(), dev);
  out->h_n = alloc_output({LD, B, H}, x.dtype(), dev);
  out->c_n = spec.lstm ? alloc_output({LD, B, H}, x.dtype(), dev) : Tensor();
  out->reserve = p.reserve_bytes > 0
                     ? alloc_output({static_cast<int64_t>(p.reserve_bytes)}, DType::uint8, dev)
                     : Tensor();
  const Storage w = pack_weights(p, weights, device);
  const Storage ws = alloc_scratch_bytes(p.work_bytes, dev);
  const Storage lens = sequence_lengths(T, B, device);
  check_cudnn(cudnnRNNForward(handle, p.rnn.get(),
                              spec.training ? CUDNN_FWD_MODE_TRAINING : CUDNN_FWD_MODE_INFERENCE,
                              static_cast<const int32_t*>(lens.data()), p.x.get(), x.data_ptr(),
                              p.y.get(), out->output.data_ptr(), p.h.get(), ptr_or_null(h0),
                              out->h_n.data_ptr(), p.h.get(), spec.lstm ? ptr_or_null(c0) : nullptr,
                              ptr_or_null(out->c_n), p.weight_bytes, w.data(), p.work_bytes,
                              ws.data(), p.reserve_bytes, ptr_or_null(out->reserve)),
              "cudnnRNNForward", x.shape_string());
  out->taken = true;
  g_forward.fetch_add(1);
}

void cudnn_rnn_backward(const CudnnRnnSpec& spec, const Tensor& x, const Tensor& h0,
                        const Tensor& c0, const TensorList& weights, const Tensor& output,
                        const Tensor& reserve, const Tensor& grad_output, const Tensor& grad_h_n,
                        const Tensor& grad_c_n, CudnnRnnGrads* grads) {
  const int device = x.device().index;
  DeviceGuard guard(device);
  const cudnnHandle_t handle = cudnn_handle(device);
  const auto [T, B] = time_and_batch(spec, x);
  CudnnRnnSpec train = spec;
  train.training = true;
  const auto e = cache().get(handle, train, x.dtype(), T, B, device);
  if (!e->plan)  // the forward ran this problem's plan, so only a broken cache gets here
    throw std::logic_error("cudnn_rnn backward: no cuDNN plan for the forward's problem: " +
                           e->why);
  const Plan& p = *e->plan;
  NvtxRange range("cudnn_rnn_backward (cuDNN)");
  const Device dev = x.device();
  const cudaStream_t st = stream(device);
  Tensor dy = grad_output;
  if (!dy.defined()) {
    dy = alloc_output(output.sizes(), output.dtype(), dev);
    check(cudaMemsetAsync(dy.data_ptr(), 0, dy.nbytes(), st), "cudaMemsetAsync (cuDNN RNN dy)");
  }
  CudnnRnnGrads& g = *grads;
  g.dweights.clear();
  g.dx = alloc_output(x.sizes(), x.dtype(), dev);
  if (h0.defined()) g.dh0 = alloc_output(h0.sizes(), h0.dtype(), dev);
  if (spec.lstm && c0.defined()) g.dc0 = alloc_output(c0.sizes(), c0.dtype(), dev);
  const Storage w = pack_weights(p, weights, device);
  const Storage ws = alloc_scratch_bytes(p.work_bytes, dev);
  const Storage lens = sequence_lengths(T, B, device);
  const auto* seq = static_cast<const int32_t*>(lens.data());
  check_cudnn(cudnnRNNBackwardData_v8(
                  handle, p.rnn.get(), seq, p.y.get(), output.data_ptr(), dy.data_ptr(), p.x.get(),
                  g.dx.data_ptr(), p.h.get(), ptr_or_null(h0), ptr_or_null(grad_h_n),
                  ptr_or_null(g.dh0), p.h.get(), spec.lstm ? ptr_or_null(c0) : nullptr,
                  spec.lstm ? ptr_or_null(grad_c_n) : nullptr, ptr_or_null(g.dc0), p.weight_bytes,
                  w.data(), p.work_bytes, ws.data(), p.reserve_bytes, ptr_or_null(reserve)),
              "cudnnRNNBackwardData_v8", x.shape_string());
  // CUDNN_WGRAD_MODE_ADD adds into dw: it starts at zero.
  const Storage dw = alloc_scratch_bytes(p.weight_bytes, dev);
  check(cudaMemsetAsync(dw.data(), 0, p.weight_bytes, st), "cudaMemsetAsync (cuDNN RNN dw)");
  check_cudnn(cudnnRNNBackwardWeights_v8(handle, p.rnn.get(), CUDNN_WGRAD_MODE_ADD, seq, p.x.get(),
                                         x.data_ptr(), p.h.get(), ptr_or_null(h0), p.y.get(),
                                         output.data_ptr(), p.weight_bytes, dw.data(), p.work_bytes,
                                         ws.data(), p.reserve_bytes, ptr_or_null(reserve)),
              "cudnnRNNBackwardWeights_v8", x.shape_string());
  const char* flat = static_cast<const char*>(dw.data());
  for (size_t i = 0; i < weights.size(); ++i) {
    Tensor gw = alloc_output(weights[i].sizes(), weights[i].dtype(), dev);
    char* dst = static_cast<char*>(gw.data_ptr());
    for (const Segment& seg : p.segments[i])
      check(cudaMemcpyAsync(dst + seg.param, flat + seg.flat, seg.bytes, cudaMemcpyDeviceToDevice,
                            st),
            "cudaMemcpyAsync (cuDNN RNN weight gradients)");
    g.dweights.push_back(gw);
  }
  g_backward.fetch_add(1);
}

}  // namespace tally::cuda
