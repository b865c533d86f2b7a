// CPU recurrent cells: one loop over the [B, H] elements of the state, each reading its four
// (LSTM) or three (GRU) gate columns; large batches run in parallel over the elements
// (tensor/cpu/parallel.h), each computed as serially. The math is tensor/rnn/math.h.
#include "tensor/cpu/parallel.h"
#include "tensor/rnn/kernels.h"
#include "tensor/rnn/math.h"

namespace tally::cpu {

namespace {

template <typename T>
T* ptr(const Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr;
}

// fn(b, j) over the [B, H] state elements.
template <typename F>
void for_each_element(int64_t B, int64_t H, F&& fn) {
  parallel_for(B * H, kParallelGrain / 8, [&](int64_t e0, int64_t e1) {
    for (int64_t e = e0; e < e1; ++e) fn(e / H, e % H);
  });
}

void lstm_cell_forward(const Tensor& h, const Tensor& c, const Tensor& workspace,
                       const Tensor& gates_x, const Tensor& gates_h, const Tensor& c_prev) {
  const int64_t B = h.size(0), H = h.size(1);
  TALLY_DISPATCH_FLOAT(h.dtype(), "lstm_cell_gates", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t *gx = ptr<scalar_t>(gates_x), *gh = ptr<scalar_t>(gates_h),
                   *cp = ptr<scalar_t>(c_prev);
    scalar_t *ho = ptr<scalar_t>(h), *co = ptr<scalar_t>(c), *ws = ptr<scalar_t>(workspace);
    for_each_element(B, H, [&](int64_t b, int64_t j) {
      const int64_t g0 = b * 4 * H + j;
      auto pre = [&](int k) {
        return static_cast<A>(gx[g0 + k * H]) + static_cast<A>(gh[g0 + k * H]);
      };
      const auto s =
          math::lstm_step<A>(pre(0), pre(1), pre(2), pre(3), static_cast<A>(cp[b * H + j]));
      ws[g0] = static_cast<scalar_t>(s.i);
      ws[g0 + H] = static_cast<scalar_t>(s.f);
      ws[g0 + 2 * H] = static_cast<scalar_t>(s.g);
      ws[g0 + 3 * H] = static_cast<scalar_t>(s.o);
      co[b * H + j] = static_cast<scalar_t>(s.c);
      ho[b * H + j] = static_cast<scalar_t>(s.h);
    });
  });
}

void lstm_cell_backward(const Tensor& grad_gates, const Tensor& grad_c_prev, const Tensor& grad_h,
                        const Tensor& grad_c, const Tensor& c_prev, const Tensor& c,
                        const Tensor& workspace) {
  const int64_t B = c.size(0), H = c.size(1);
  TALLY_DISPATCH_FLOAT(c.dtype(), "lstm_cell_gates_backward", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t *gh = ptr<scalar_t>(grad_h), *gc = ptr<scalar_t>(grad_c),
                   *cp = ptr<scalar_t>(c_prev), *cn = ptr<scalar_t>(c),
                   *ws = ptr<scalar_t>(workspace);
    scalar_t *gg = ptr<scalar_t>(grad_gates), *gcp = ptr<scalar_t>(grad_c_prev);
    for_each_element(B, H, [&](int64_t b, int64_t j) {
      const int64_t e = b * H + j, g0 = b * 4 * H + j;
      const auto d = math::lstm_step_backward<A>(
          gh ? static_cast<A>(gh[e]) : A(0), gc ? static_cast<A>(gc[e]) : A(0),
          static_cast<A>(cp[e]), static_cast<A>(cn[e]), static_cast<A>(ws[g0]),
          static_cast<A>(ws[g0 + H]), static_cast<A>(ws[g0 + 2 * H]),
          static_cast<A>(ws[g0 + 3 * H]));
      gg[g0] = static_cast<scalar_t>(d.di);
      gg[g0 + H] = static_cast<scalar_t>(d.df);
      gg[g0 + 2 * H] = static_cast<scalar_t>(d.dg);
      gg[g0 + 3 * H] = static_cast<scalar_t>(d.do_);
      gcp[e] = static_cast<scalar_t>(d.dc_prev);
    });
  });
}

void gru_cell_forward(const Tensor& h, const Tensor& workspace, const Tensor& gates_x,
                      const Tensor& gates_h, const Tensor& h_prev) {
  const int64_t B = h.size(0), H = h.size(1);
  TALLY_DISPATCH_FLOAT(h.dtype(), "gru_cell_gates", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t *gx = ptr<scalar_t>(gates_x), *gh = ptr<scalar_t>(gates_h),
                   *hp = ptr<scalar_t>(h_prev);
    scalar_t *ho = ptr<scalar_t>(h), *ws = ptr<scalar_t>(workspace);
    for_each_element(B, H, [&](int64_t b, int64_t j) {
      const int64_t g0 = b * 3 * H + j, w0 = b * 4 * H + j, e = b * H + j;
      auto x = [&](int k) { return static_cast<A>(gx[g0 + k * H]); };
      auto y = [&](int k) { return static_cast<A>(gh[g0 + k * H]); };
      const auto s = math::gru_step<A>(x(0), x(1), x(2), y(0), y(1), y(2), static_cast<A>(hp[e]));
      ws[w0] = static_cast<scalar_t>(s.r);
      ws[w0 + H] = static_cast<scalar_t>(s.z);
      ws[w0 + 2 * H] = static_cast<scalar_t>(s.n);
      ws[w0 + 3 * H] = gh[g0 + 2 * H];
      ho[e] = static_cast<scalar_t>(s.h);
    });
  });
}

void gru_cell_backward(const Tensor& grad_gates_x, const Tensor& grad_gates_h,
                       const Tensor& grad_h_prev, const Tensor& grad_h, const Tensor& h_prev,
                       const Tensor& workspace) {
  const int64_t B = h_prev.size(0), H = h_prev.size(1);
  TALLY_DISPATCH_FLOAT(h_prev.dtype(), "gru_cell_gates_backward", [&] {
    using A = acc_t<scalar_t>;
    const scalar_t *gh = ptr<scalar_t>(grad_h), *hp = ptr<scalar_t>(h_prev),
                   *ws = ptr<scalar_t>(workspace);
    scalar_t *gx = ptr<scalar_t>(grad_gates_x), *ghh = ptr<scalar_t>(grad_gates_h),
             *ghp = ptr<scalar_t>(grad_h_prev);
    for_each_element(B, H, [&](int64_t b, int64_t j) {
      const int64_t g0 = b * 3 * H + j, w0 = b * 4 * H + j, e = b * H + j;
      const auto d = math::gru_step_backward<A>(
          gh ? static_cast<A>(gh[e]) : A(0), static_cast<A>(hp[e]), static_cast<A>(ws[w0]),
          static_cast<A>(ws[w0 + H]), static_cast<A>(ws[w0 + 2 * H]),
          static_cast<A>(ws[w0 + 3 * H]));
      gx[g0] = ghh[g0] = static_cast<scalar_t>(d.dr);
      gx[g0 + H] = ghh[g0 + H] = static_cast<scalar_t>(d.dz);
      gx[g0 + 2 * H] = static_cast<scalar_t>(d.dn);
      ghh[g0 + 2 * H] = static_cast<scalar_t>(d.dhn);
      ghp[e] = static_cast<scalar_t>(d.dh_prev);
    });
  });
}

}  // namespace

// No whole-layer kernel: nn::LSTM / nn::GRU run their per-timestep path on the CPU.
const RnnKernels rnn_kernels{TALLY_RNN_KERNELS, .cudnn_rnn_forward = nullptr,
                             .cudnn_rnn_backward = nullptr, .cudnn_rnn_sizes = nullptr};

}  // namespace tally::cpu
