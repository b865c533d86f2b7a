// The per-element math of the fused LSTM and GRU cells, written once for the CPU reference
// (tensor/rnn/cpu.cpp) and the CUDA kernels (tensor/rnn/cuda.cu): values arrive loaded into
// the accumulation type A; loads, stores and loops stay with each backend. The formulas and
// their order are PyTorch's (aten/src/ATen/native/cuda/RNN.cu).
#pragma once

#include "tensor/elementwise/math.h"

namespace tally::math {

template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE A rnn_sigmoid(A x) {
  return A(1) / (A(1) + exp(-x));
}

// One LSTM element: the pre-activations (x + h projections) in, the activated gates and the
// new state out.
template <typename A>
struct LstmStep {
  A i, f, g, o, c, h;
};
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE LstmStep<A> lstm_step(A pi, A pf, A pg, A po, A c_prev) {
  LstmStep<A> s;
  s.i = rnn_sigmoid(pi);
  s.f = rnn_sigmoid(pf);
  s.g = tanh(pg);
  s.o = rnn_sigmoid(po);
  s.c = s.f * c_prev + s.i * s.g;
  s.h = s.o * tanh(s.c);
  return s;
}

// One LSTM element's gradients: d(pre-activations) of i, f, g, o and d(c_prev).
template <typename A>
struct LstmGrad {
  A di, df, dg, do_, dc_prev;
};
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE LstmGrad<A> lstm_step_backward(A gh, A gc, A c_prev, A c, A i,
                                                                    A f, A g, A o) {
  const A tc = tanh(c);
  const A dc = gc + gh * o * (A(1) - tc * tc);
  LstmGrad<A> r;
  r.do_ = gh * tc * o * (A(1) - o);
  r.di = dc * g * i * (A(1) - i);
  r.df = dc * c_prev * f * (A(1) - f);
  r.dg = dc * i * (A(1) - g * g);
  r.dc_prev = dc * f;
  return r;
}

template <typename A>
struct GruStep {
  A r, z, n, h;
};
// One GRU element: the input projections xr, xz, xn and the hidden ones hr, hz, hn (with b_hh).
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE GruStep<A> gru_step(A xr, A xz, A xn, A hr, A hz, A hn,
                                                         A h_prev) {
  GruStep<A> s;
  s.r = rnn_sigmoid(xr + hr);
  s.z = rnn_sigmoid(xz + hz);
  s.n = tanh(xn + s.r * hn);
  s.h = (A(1) - s.z) * s.n + s.z * h_prev;
  return s;
}

// One GRU element's gradients: d(pre-activations) of r, z and of n's input part (the hidden
// part is dn * r), the hidden projection hn's, and d(h_prev).
template <typename A>
struct GruGrad {
  A dr, dz, dn, dhn, dh_prev;
};
template <typename A>
TALLY_HOST_DEVICE TALLY_FORCE_INLINE GruGrad<A> gru_step_backward(A gh, A h_prev, A r, A z, A n,
                                                                  A hn) {
  GruGrad<A> d;
  d.dn = gh * (A(1) - z) * (A(1) - n * n);
  d.dz = gh * (h_prev - n) * z * (A(1) - z);
  d.dr = d.dn * hn * r * (A(1) - r);
  d.dhn = d.dn * r;
  d.dh_prev = gh * z;
  return d;
}

}  // namespace tally::math
