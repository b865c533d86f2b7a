// CPU reference of the fused attention op: per (batch, head, query row) the scores against
// every allowed key, the max-shifted softmax with its log-sum-exp, and the weighted sum of
// values; the backward recomputes the probabilities from the log-sum-exp, as the CUDA
// kernel does. Everything accumulates in double. An optional mask (bool, or a float bias in
// lse's dtype, [B, H, L, S] with broadcast strides) joins the scores; grouped-query heads
// read key/value head h / G, and the backward sums dk, dv over a group's query heads.
#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "tensor/attention/kernels.h"
#include "tensor/cpu/parallel.h"

namespace tally::cpu {
namespace {

// Strided element access to a [B, H, T, D] tensor.
template <typename T>
struct View4 {
  T* p;
  int64_t s0, s1, s2, s3;
  explicit View4(const Tensor& t)
      : p(static_cast<T*>(t.storage().data()) + t.storage_offset()),
        s0(t.strides()[0]),
        s1(t.strides()[1]),
        s2(t.strides()[2]),
        s3(t.strides()[3]) {}
  T& at(int64_t b, int64_t h, int64_t i, int64_t d) const {
    return p[b * s0 + h * s1 + i * s2 + d * s3];
  }
};

template <typename T>
double rd(const T& v) {
  return static_cast<double>(static_cast<acc_t<T>>(v));
}

template <typename T>
T wr(double v) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

// The keys query i may attend: [0, n).
inline int64_t keys_for(int64_t i, int64_t S, bool causal) {
  return causal ? std::min(S, i + 1) : S;
}

// The mask's term of score (b, h, i, j): 0 without a mask, -inf where a bool mask is false,
// else the float bias.
struct Bias {
  const void* p = nullptr;
  DType dtype = DType::bool_;
  int64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  explicit Bias(const Tensor& m) {
    if (!m.defined()) return;
    p = static_cast<const char*>(m.storage().data()) +
        m.storage_offset() * static_cast<int64_t>(dtype_size(m.dtype()));
    dtype = m.dtype();
    s0 = m.strides()[0];
    s1 = m.strides()[1];
    s2 = m.strides()[2];
    s3 = m.strides()[3];
  }
  double at(int64_t b, int64_t h, int64_t i, int64_t j) const {
    if (!p) return 0.0;
    const int64_t o = b * s0 + h * s1 + i * s2 + j * s3;
    if (dtype == DType::bool_)
      return static_cast<const bool*>(p)[o] ? 0.0 : -std::numeric_limits<double>::infinity();
    if (dtype == DType::float64) return static_cast<const double*>(p)[o];
    return static_cast<const float*>(p)[o];
  }
};

void flash_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, bool causal, double scale, const Tensor& mask) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3);
  const int64_t S = k.size(2), Ev = v.size(3), G = H / k.size(1);
  const Bias bias(mask);
  TALLY_DISPATCH_FLOAT(q.dtype(), "flash_attention_forward", [&] {
    using T = scalar_t;
    const View4<const T> Q(q), K(k), V(v);
    const View4<T> O(out);
    std::vector<double> s(static_cast<size_t>(S)), acc(static_cast<size_t>(Ev));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < L; ++i) {
          const int64_t n = keys_for(i, S, causal), hk = h / G;
          double m = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j < n; ++j) {
            double dot = 0;
            for (int64_t d = 0; d < E; ++d) dot += rd(Q.at(b, h, i, d)) * rd(K.at(b, hk, j, d));
            s[static_cast<size_t>(j)] = dot * scale + bias.at(b, h, i, j);
            m = std::max(m, s[static_cast<size_t>(j)]);
          }
          // A row without any allowed key (m == -inf): out 0, lse -inf.
          const bool live = m > -std::numeric_limits<double>::infinity();
          double l = 0;
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t j = 0; live && j < n; ++j) {
            const double p = std::exp(s[static_cast<size_t>(j)] - m);
            l += p;
            for (int64_t d = 0; d < Ev; ++d)
              acc[static_cast<size_t>(d)] += p * rd(V.at(b, hk, j, d));
          }
          for (int64_t d = 0; d < Ev; ++d)
            O.at(b, h, i, d) = wr<T>(live ? acc[static_cast<size_t>(d)] / l : 0.0);
          const double lv = live ? m + std::log(l) : -std::numeric_limits<double>::infinity();
          const int64_t li = (b * H + h) * L + i;
          if (lse.dtype() == DType::float64)
            static_cast<double*>(lse.data_ptr())[li] = lv;
          else
            static_cast<float*>(lse.data_ptr())[li] = static_cast<float>(lv);
        }
  });
}

void flash_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& lse, bool causal, double scale,
                              const Tensor& mask) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3);
  const int64_t Hk = k.size(1), S = k.size(2), Ev = v.size(3), G = H / Hk;
  const Bias bias(mask);
  TALLY_DISPATCH_FLOAT(q.dtype(), "flash_attention_backward", [&] {
    using T = scalar_t;
    const View4<const T> Q(q), K(k), V(v), O(out), dO(dout);
    const View4<T> dQ(dq), dK(dk), dV(dv);
    // Accumulate in double per (b, key/value head) over its G query heads, then round once.
    std::vector<double> gq(static_cast<size_t>(L * E)), gk(static_cast<size_t>(S * E)),
        gv(static_cast<size_t>(S * Ev));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t hk = 0; hk < Hk; ++hk) {
        std::fill(gk.begin(), gk.end(), 0.0);
        std::fill(gv.begin(), gv.end(), 0.0);
        for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
          std::fill(gq.begin(), gq.end(), 0.0);
          for (int64_t i = 0; i < L; ++i) {
            const int64_t li = (b * H + h) * L + i;
            const double lv = lse.dtype() == DType::float64
                                  ? static_cast<const double*>(lse.data_ptr())[li]
                                  : static_cast<const float*>(lse.data_ptr())[li];
            // A row without any allowed key has no gradient (and exp(s - lse) would be NaN).
            if (lv == -std::numeric_limits<double>::infinity()) continue;
            double Di = 0;  // rowsum(dO * O)
            for (int64_t d = 0; d < Ev; ++d) Di += rd(dO.at(b, h, i, d)) * rd(O.at(b, h, i, d));
            const int64_t n = keys_for(i, S, causal);
            for (int64_t j = 0; j < n; ++j) {
              double dot = 0;
              for (int64_t d = 0; d < E; ++d) dot += rd(Q.at(b, h, i, d)) * rd(K.at(b, hk, j, d));
              const double p = std::exp(dot * scale + bias.at(b, h, i, j) - lv);
              double dp = 0;
              for (int64_t d = 0; d < Ev; ++d) {
                const double g = rd(dO.at(b, h, i, d));
                gv[static_cast<size_t>(j * Ev + d)] += p * g;
                dp += g * rd(V.at(b, hk, j, d));
              }
              const double ds = p * (dp - Di) * scale;
              for (int64_t d = 0; d < E; ++d) {
                gq[static_cast<size_t>(i * E + d)] += ds * rd(K.at(b, hk, j, d));
                gk[static_cast<size_t>(j * E + d)] += ds * rd(Q.at(b, h, i, d));
              }
            }
          }
          for (int64_t i = 0; i < L; ++i)
            for (int64_t d = 0; d < E; ++d)
              dQ.at(b, h, i, d) = wr<T>(gq[static_cast<size_t>(i * E + d)]);
        }
        for (int64_t j = 0; j < S; ++j) {
          for (int64_t d = 0; d < E; ++d)
            dK.at(b, hk, j, d) = wr<T>(gk[static_cast<size_t>(j * E + d)]);
          for (int64_t d = 0; d < Ev; ++d)
            dV.at(b, hk, j, d) = wr<T>(gv[static_cast<size_t>(j * Ev + d)]);
        }
      }
  });
}

void rotary_embedding(const Tensor& out, const Tensor& x, const Tensor& cos, const Tensor& sin,
                      bool backward) {
  const int64_t D = out.dim() == 0 ? 0 : out.size(-1), h = D / 2;
  if (out.numel() == 0) return;
  const int64_t rows = out.numel() / D, lead = out.dim() - 1;
  TALLY_DISPATCH_FLOAT(out.dtype(), "rotary_embedding", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    T* o = static_cast<T*>(out.storage().data()) + out.storage_offset();
    const std::array<const Tensor*, 3> in{&x, &cos, &sin};
    parallel_for(rows, grain_of(D), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        // The row's offset in each input, from its index over the leading dims.
        std::array<const T*, 3> p;
        std::array<int64_t, 3> st;
        for (size_t k = 0; k < 3; ++k) {
          const Tensor& t = *in[k];
          int64_t off = t.storage_offset(), rem = r;
          for (int64_t d = lead - 1; d >= 0; --d) {
            const auto du = static_cast<size_t>(d);
            off += (rem % t.sizes()[du]) * t.strides()[du];
            rem /= t.sizes()[du];
          }
          p[k] = static_cast<const T*>(t.storage().data()) + off;
          st[k] = t.strides()[static_cast<size_t>(lead)];
        }
        T* orow = o + r * D;
        for (int64_t i = 0; i < h; ++i) {
          const A x1 = static_cast<A>(p[0][i * st[0]]), x2 = static_cast<A>(p[0][(i + h) * st[0]]);
          const A c1 = static_cast<A>(p[1][i * st[1]]), c2 = static_cast<A>(p[1][(i + h) * st[1]]);
          const A s1 = static_cast<A>(p[2][i * st[2]]), s2 = static_cast<A>(p[2][(i + h) * st[2]]);
          orow[i] = T(backward ? x1 * c1 + x2 * s2 : x1 * c1 - x2 * s1);
          orow[i + h] = T(backward ? x2 * c2 - x1 * s1 : x2 * c2 + x1 * s2);
        }
      }
    });
  });
}

}  // namespace

const AttentionKernels attention_kernels{
    .flash_attention_forward = &flash_attention_forward,
    .flash_attention_backward = &flash_attention_backward,
    .flash_attention_fp32_fits = nullptr,
    .rotary_embedding = &rotary_embedding,
};

}  // namespace tally::cpu
