// CUDA recurrent cells: one thread per [B, H] state element (a grid-stride loop), each reading
// its gate columns and writing its outputs, the CPU kernels' math (tensor/rnn/math.h) in
// acc_t. A step's gates are a few hundred KiB at most, so one launch per step is memory-bound
// and the matmuls around it dominate; the fusion saves the launches and the round trips of the
// separate add, sigmoid/tanh and state updates.
#include "tensor/cuda/device_types.cuh"
#include "tensor/cuda/grid.cuh"
#include "tensor/cuda/runtime.h"
#include "tensor/rnn/cuda_cudnn.h"
#include "tensor/rnn/kernels.h"
#include "tensor/rnn/math.h"

namespace tally::cuda {

namespace {

template <typename T>
T* ptr(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr;
}

#define TALLY_RNN_LOOP(e, n)                                                             \
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < (n); \
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)

template <typename T>
__global__ void lstm_forward_kernel(T* __restrict__ h, T* __restrict__ c, T* __restrict__ ws,
                                    const T* __restrict__ gx, const T* __restrict__ gh,
                                    const T* __restrict__ cp, int64_t H, int64_t n) {
  using A = dacc_t<T>;
  TALLY_RNN_LOOP(e, n) {
    const int64_t b = e / H, j = e - b * H, g0 = b * 4 * H + j;
    const auto s =
        math::lstm_step<A>(load(gx[g0]) + load(gh[g0]), load(gx[g0 + H]) + load(gh[g0 + H]),
                           load(gx[g0 + 2 * H]) + load(gh[g0 + 2 * H]),
                           load(gx[g0 + 3 * H]) + load(gh[g0 + 3 * H]), load(cp[e]));
    ws[g0] = store<T>(s.i);
    ws[g0 + H] = store<T>(s.f);
    ws[g0 + 2 * H] = store<T>(s.g);
    ws[g0 + 3 * H] = store<T>(s.o);
    c[e] = store<T>(s.c);
    h[e] = store<T>(s.h);
  }
}

template <typename T>
__global__ void lstm_backward_kernel(T* __restrict__ gg, T* __restrict__ gcp,
                                     const T* __restrict__ gh, const T* __restrict__ gc,
                                     const T* __restrict__ cp, const T* __restrict__ cn,
                                     const T* __restrict__ ws, int64_t H, int64_t n) {
  using A = dacc_t<T>;
  TALLY_RNN_LOOP(e, n) {
    const int64_t b = e / H, j = e - b * H, g0 = b * 4 * H + j;
    const auto d = math::lstm_step_backward<A>(
        gh ? load(gh[e]) : A(0), gc ? load(gc[e]) : A(0), load(cp[e]), load(cn[e]), load(ws[g0]),
        load(ws[g0 + H]), load(ws[g0 + 2 * H]), load(ws[g0 + 3 * H]));
    gg[g0] = store<T>(d.di);
    gg[g0 + H] = store<T>(d.df);
    gg[g0 + 2 * H] = store<T>(d.dg);
    gg[g0 + 3 * H] = store<T>(d.do_);
    gcp[e] = store<T>(d.dc_prev);
  }
}

template <typename T>
__global__ void gru_forward_kernel(T* __restrict__ h, T* __restrict__ ws, const T* __restrict__ gx,
                                   const T* __restrict__ gh, const T* __restrict__ hp, int64_t H,
                                   int64_t n) {
  using A = dacc_t<T>;
  TALLY_RNN_LOOP(e, n) {
    const int64_t b = e / H, j = e - b * H, g0 = b * 3 * H + j, w0 = b * 4 * H + j;
    const auto s =
        math::gru_step<A>(load(gx[g0]), load(gx[g0 + H]), load(gx[g0 + 2 * H]), load(gh[g0]),
                          load(gh[g0 + H]), load(gh[g0 + 2 * H]), load(hp[e]));
    ws[w0] = store<T>(s.r);
    ws[w0 + H] = store<T>(s.z);
    ws[w0 + 2 * H] = store<T>(s.n);
    ws[w0 + 3 * H] = gh[g0 + 2 * H];
    h[e] = store<T>(s.h);
  }
}

template <typename T>
__global__ void gru_backward_kernel(T* __restrict__ gx, T* __restrict__ ghh, T* __restrict__ ghp,
                                    const T* __restrict__ gh, const T* __restrict__ hp,
                                    const T* __restrict__ ws, int64_t H, int64_t n) {
  using A = dacc_t<T>;
  TALLY_RNN_LOOP(e, n) {
    const int64_t b = e / H, j = e - b * H, g0 = b * 3 * H + j, w0 = b * 4 * H + j;
    const auto d =
        math::gru_step_backward<A>(gh ? load(gh[e]) : A(0), load(hp[e]), load(ws[w0]),
                                   load(ws[w0 + H]), load(ws[w0 + 2 * H]), load(ws[w0 + 3 * H]));
    gx[g0] = ghh[g0] = store<T>(d.dr);
    gx[g0 + H] = ghh[g0 + H] = store<T>(d.dz);
    gx[g0 + 2 * H] = store<T>(d.dn);
    ghh[g0 + 2 * H] = store<T>(d.dhn);
    ghp[e] = store<T>(d.dh_prev);
  }
}

// Enqueues go.template operator()<T>(blocks, stream) for `t`'s dtype on Tally's stream.
template <typename F>
void launch(const char* name, const char* op, const Tensor& t, int64_t n, F&& go) {
  NvtxRange range(name);
  DeviceGuard guard(t.device().index);
  cudaStream_t st = stream(t.device().index);
  TALLY_DISPATCH_FLOAT(t.dtype(), op,
                       [&] { go.template operator()<dev_t<scalar_t>>(blocks_for(n), st); });
  check_launch(name);
}

void lstm_cell_forward(const Tensor& h, const Tensor& c, const Tensor& workspace,
                       const Tensor& gates_x, const Tensor& gates_h, const Tensor& c_prev) {
  const int64_t H = h.size(1), n = h.numel();
  launch("lstm_cell_gates (CUDA)", "lstm_cell_gates", h, n,
         [&]<typename T>(int blocks, cudaStream_t st) {
           lstm_forward_kernel<T><<<blocks, kThreads, 0, st>>>(
               ptr<T>(h), ptr<T>(c), ptr<T>(workspace), ptr<const T>(gates_x),
               ptr<const T>(gates_h), ptr<const T>(c_prev), H, n);
         });
}

void lstm_cell_backward(const Tensor& grad_gates, const Tensor& grad_c_prev, const Tensor& grad_h,
                        const Tensor& grad_c, const Tensor& c_prev, const Tensor& c,
                        const Tensor& workspace) {
  const int64_t H = c.size(1), n = c.numel();
  launch("lstm_cell_gates_backward (CUDA)", "lstm_cell_gates_backward", c, n,
         [&]<typename T>(int blocks, cudaStream_t st) {
           lstm_backward_kernel<T><<<blocks, kThreads, 0, st>>>(
               ptr<T>(grad_gates), ptr<T>(grad_c_prev), ptr<const T>(grad_h), ptr<const T>(grad_c),
               ptr<const T>(c_prev), ptr<const T>(c), ptr<const T>(workspace), H, n);
         });
}

void gru_cell_forward(const Tensor& h, const Tensor& workspace, const Tensor& gates_x,
                      const Tensor& gates_h, const Tensor& h_prev) {
  const int64_t H = h.size(1), n = h.numel();
  launch("gru_cell_gates (CUDA)", "gru_cell_gates", h, n,
         [&]<typename T>(int blocks, cudaStream_t st) {
           gru_forward_kernel<T>
               <<<blocks, kThreads, 0, st>>>(ptr<T>(h), ptr<T>(workspace), ptr<const T>(gates_x),
                                             ptr<const T>(gates_h), ptr<const T>(h_prev), H, n);
         });
}

void gru_cell_backward(const Tensor& grad_gates_x, const Tensor& grad_gates_h,
                       const Tensor& grad_h_prev, const Tensor& grad_h, const Tensor& h_prev,
                       const Tensor& workspace) {
  const int64_t H = h_prev.size(1), n = h_prev.numel();
  launch("gru_cell_gates_backward (CUDA)", "gru_cell_gates_backward", h_prev, n,
         [&]<typename T>(int blocks, cudaStream_t st) {
           gru_backward_kernel<T><<<blocks, kThreads, 0, st>>>(
               ptr<T>(grad_gates_x), ptr<T>(grad_gates_h), ptr<T>(grad_h_prev),
               ptr<const T>(grad_h), ptr<const T>(h_prev), ptr<const T>(workspace), H, n);
         });
}

__global__ void fill_int32_kernel(int32_t* __restrict__ dst, int32_t value, int64_t n) {
  TALLY_RNN_LOOP(e, n) dst[e] = value;
}

}  // namespace

const RnnKernels rnn_kernels{TALLY_RNN_KERNELS, .cudnn_rnn_forward = &cudnn_rnn_forward,
                             .cudnn_rnn_backward = &cudnn_rnn_backward,
                             .cudnn_rnn_sizes = &cudnn_rnn_sizes};

void fill_int32(int32_t* dst, int64_t n, int32_t value, int device) {
  if (n <= 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 1024));
  fill_int32_kernel<<<blocks, kThreads, 0, stream(device)>>>(dst, value, n);
  check_launch("fill_int32 (cuDNN RNN sequence lengths)");
}

}  // namespace tally::cuda
