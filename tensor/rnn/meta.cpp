// Meta kernels of the recurrent-cell family (tensor/meta/target.h): neither backend's cell
// kernels allocate scratch; each costs the bytes it reads and writes. The whole-layer (cuDNN)
// entries, on a meta device replaying this machine's GPU (target "cuda"), allocate what
// tensor/rnn/cuda_cudnn.cpp allocates, in its order, with the sizes cuDNN gives for the
// problem on that GPU; for any other target (a recorded GPU: cuDNN answers only on the GPU
// itself) they take nothing and note it (memory::note_unreplayed), so the dry run replays the
// per-timestep path and its report says so (docs/cudnn_rnn.md).
#include "tensor/meta/target.h"
#include "tensor/rnn/kernels.h"

namespace tally::meta {

namespace {

// cuDNN's sizes for the problem of x when this dry run can replay them, else false (noted
// when the route would have been asked).
bool replayed_sizes(const CudnnRnnSpec& spec, const Tensor& x, CudnnRnnSizes* sz) {
  *sz = {};
  if (!replays_cuda(x)) return false;
  const RnnKernels* cuda = rnn_backends.cuda;
  if (!cuda || !cuda->cudnn_rnn_sizes || target(x).name != "cuda") {
    memory::note_unreplayed(x.device(),
                            "cudnn_rnn: cuDNN's RNN sizes (asked of the GPU itself: replayed "
                            "the per-timestep LSTM/GRU path instead)");
    return false;
  }
  const int64_t T = x.size(spec.batch_first ? 1 : 0), B = x.size(spec.batch_first ? 0 : 1);
  cuda->cudnn_rnn_sizes(spec, x.dtype(), T, B, sz);
  return sz->ok;
}

// The FLOPs of one pass over every layer's products (2 a weight, each timestep and row).
double rnn_flops(const CudnnRnnSpec& s, const Tensor& x) {
  const int64_t D = s.directions(), G = s.lstm ? 4 : 3, H = s.hidden_size;
  double weights = 0;
  for (int64_t layer = 0; layer < s.num_layers; ++layer)
    weights += static_cast<double>(D * G * H * ((layer == 0 ? s.input_size : D * H) + H));
  return 2.0 * weights * static_cast<double>(x.size(0) * x.size(1));
}

void cudnn_rnn_forward(const CudnnRnnSpec& spec, const Tensor& x, const Tensor& h0,
                       const Tensor& c0, const TensorList& weights, CudnnRnnOutputs* out) {
  (void)h0, (void)c0, (void)weights;
  out->taken = false;
  CudnnRnnSizes sz;
  if (!replayed_sizes(spec, x, &sz)) return;
  const Device dev = x.device();
  const int64_t D = spec.directions(), H = spec.hidden_size, LD = spec.num_layers * D;
  const int64_t T = x.size(spec.batch_first ? 1 : 0), B = x.size(spec.batch_first ? 0 : 1);
  out->output =
      alloc_output(spec.batch_first ? Shape{B, T, D * H} : Shape{T, B, D * H}, x.dtype(), dev);
  out->h_n = alloc_output({LD, B, H}, x.dtype(), dev);
  out->c_n = spec.lstm ? alloc_output({LD, B, H}, x.dtype(), dev) : Tensor();
  const size_t reserve = spec.training ? sz.reserve : 0;
  out->reserve =
      reserve > 0 ? alloc_output({static_cast<int64_t>(reserve)}, DType::uint8, dev) : Tensor();
  const Storage w = alloc_scratch_bytes(sz.weight, dev);
  const Storage ws = alloc_scratch_bytes(sz.work, dev);
  const Storage lens = alloc_scratch_bytes(static_cast<size_t>(B) * sizeof(int32_t), dev);
  cost(x, rnn_flops(spec, x),
       2.0 * static_cast<double>(sz.weight) + static_cast<double>(reserve) +
           tensor_bytes(x, out->output, out->h_n, out->c_n),
       /*tf32=*/true);  // cudnn_allow_tf32()'s default, as the convolutions' meta kernels
  out->taken = true;
}

void cudnn_rnn_backward(const CudnnRnnSpec& spec, const Tensor& x, const Tensor& h0,
                        const Tensor& c0, const TensorList& weights, const Tensor& output,
                        const Tensor& reserve, const Tensor& grad_output, const Tensor& grad_h_n,
                        const Tensor& grad_c_n, CudnnRnnGrads* grads) {
  (void)grad_h_n, (void)grad_c_n;
  CudnnRnnSpec train = spec;
  train.training = true;
  CudnnRnnSizes sz;
  if (!replayed_sizes(train, x, &sz))  // the forward replayed them: only a broken target gets here
    throw std::logic_error("cudnn_rnn backward (meta): cuDNN's sizes are gone");
  const Device dev = x.device();
  Tensor dy = grad_output;
  if (!dy.defined()) dy = alloc_output(output.sizes(), output.dtype(), dev);
  CudnnRnnGrads& g = *grads;
  g.dweights.clear();
  g.dx = alloc_output(x.sizes(), x.dtype(), dev);
  if (h0.defined()) g.dh0 = alloc_output(h0.sizes(), h0.dtype(), dev);
  if (spec.lstm && c0.defined()) g.dc0 = alloc_output(c0.sizes(), c0.dtype(), dev);
  const int64_t B = x.size(spec.batch_first ? 0 : 1);
  const Storage w = alloc_scratch_bytes(sz.weight, dev);
  const Storage ws = alloc_scratch_bytes(sz.work, dev);
  const Storage lens = alloc_scratch_bytes(static_cast<size_t>(B) * sizeof(int32_t), dev);
  const Storage dw = alloc_scratch_bytes(sz.weight, dev);
  for (const Tensor& p : weights) g.dweights.push_back(alloc_output(p.sizes(), p.dtype(), dev));
  cost(x, 2 * rnn_flops(spec, x),
       5.0 * static_cast<double>(sz.weight) + 2.0 * tensor_bytes(reserve) +
           tensor_bytes(x, output, dy, g.dx),
       /*tf32=*/true);
}

constexpr RnnKernels table() {
  RnnKernels t = all_nothing<RnnKernels>();
  t.cudnn_rnn_forward = &cudnn_rnn_forward;
  t.cudnn_rnn_backward = &cudnn_rnn_backward;
  t.cudnn_rnn_sizes = nullptr;
  return t;
}

}  // namespace

const RnnKernels rnn_kernels = table();

}  // namespace tally::meta
