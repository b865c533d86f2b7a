// The fused attention op: argument checks, the [B, H, T, D] layout both kernels take
// (leading dims kept as two strided dims when there are exactly two, so GPT's split-head
// views are read in place; otherwise reshaped), output allocation and the dispatch into
// tensor/attention/cpu.cpp and tensor/attention/cuda.cu.
#include "tensor/attention/ops.h"

#include <fmt/format.h>

#include <atomic>

#include "base/env.h"
#include "memory/meta.h"
#include "tensor/attention/kernels.h"
#include "tensor/dispatch.h"
#include "tensor/op_alloc.h"

namespace tally::ops {

namespace {

Shape leading(const Tensor& t) {
  return Shape(t.sizes().begin(), t.sizes().end() - 2);
}

// t [..., T, D] as [B, H, T, D]. On CUDA the last dim must be dense and the other strides
// and the offset multiples of 8 elements (16-byte vector loads); otherwise a contiguous copy.
Tensor as4d(const Tensor& t) {
  Tensor r;
  if (t.dim() == 4)
    r = t;
  else if (t.dim() == 3)
    r = unsqueeze(t, 0);
  else
    r = reshape(t, {1, -1, t.size(-2), t.size(-1)});
  if (memory::behaves_as(r.device()) == DeviceType::cuda) {
    bool ok = r.strides()[3] == 1 && r.storage_offset() % 8 == 0;
    for (int d = 0; d < 3; ++d)
      ok = ok &&
           (r.strides()[static_cast<size_t>(d)] % 8 == 0 || r.sizes()[static_cast<size_t>(d)] == 1);
    if (!ok) r = contiguous(r);
  }
  return r;
}

// Whether k's and v's leading dims agree with q's: the same, or (grouped-query attention) the
// same but for dim -3, where k's and v's equal head count divides q's.
bool heads_agree(const Tensor& q, const Tensor& k, const Tensor& v) {
  const Shape lq = leading(q), lk = leading(k);
  if (lk != leading(v) || lq.size() != lk.size()) return false;
  if (lq == lk) return true;
  const size_t h = lq.size() - 1;
  for (size_t i = 0; i < h; ++i)
    if (lq[i] != lk[i]) return false;
  return lk[h] > 0 && lq[h] % lk[h] == 0;
}

// The attention weights' shape [..., L, S] (q's leading dims).
Shape weights_shape(const Tensor& q, const Tensor& k) {
  Shape w = leading(q);
  w.push_back(q.size(-2));
  w.push_back(k.size(-2));
  return w;
}

bool mask_fits(const Tensor& mask, const Shape& weights) {
  if (mask.dtype() != DType::bool_ && !is_floating(mask.dtype())) return false;
  if (mask.dim() > static_cast<int64_t>(weights.size())) return false;
  for (int64_t i = 1; i <= mask.dim(); ++i) {
    const int64_t m = mask.size(-i), w = weights[weights.size() - static_cast<size_t>(i)];
    if (m != w && m != 1) return false;
  }
  return true;
}

DType lse_dtype(const Tensor& q) {
  return q.dtype() == DType::float64 ? DType::float64 : DType::float32;
}

// The mask as the kernels take it: [B, H, L, S] like as4d's q, a broadcast view of the mask
// (stride 0 on broadcast dims; a copy only when q has more than 4 dims and the view cannot
// merge them), a float mask in lse's dtype at its own shape. Undefined stays undefined.
Tensor mask4d(const char* op, const Tensor& mask, const Tensor& q, const Tensor& k) {
  if (!mask.defined()) return mask;
  check_same_device(op, q.device(), mask.device());
  const Shape w = weights_shape(q, k);
  if (!mask_fits(mask, w))
    throw std::invalid_argument(fmt::format(
        "{}: mask must be bool (True = take part) or floating and broadcast to the attention "
        "weights' shape {}, got {} {}",
        op, shape_str(w), dtype_name(mask.dtype()), mask.shape_string()));
  Tensor m = mask.dtype() == DType::bool_ ? mask : to(mask, lse_dtype(q));
  m = expand(m, w);
  if (m.dim() == 4) return m;
  if (m.dim() == 3) return unsqueeze(m, 0);
  return reshape(m, {1, -1, q.size(-2), k.size(-2)});
}

void check_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  check_same_device(op, q.device(), k.device());
  check_same_device(op, q.device(), v.device());
  if (q.dim() < 2 || k.dim() < 2 || v.dim() < 2 || q.dim() != k.dim() || q.dim() != v.dim())
    throw std::invalid_argument(fmt::format("{}: q, k, v need the same rank >= 2, got {}, {}, {}",
                                            op, q.shape_string(), k.shape_string(),
                                            v.shape_string()));
  if (!heads_agree(q, k, v) || k.size(-1) != q.size(-1) || v.size(-2) != k.size(-2))
    throw std::invalid_argument(fmt::format(
        "{}: shapes q {}, k {}, v {} do not agree (need k [..., S, E] and v [..., S, Ev] for q "
        "[..., L, E], same leading dims, or k and v with heads (dim -3) dividing q's)",
        op, q.shape_string(), k.shape_string(), v.shape_string()));
  if (q.dtype() != k.dtype() || q.dtype() != v.dtype() || !is_floating(q.dtype()))
    throw std::invalid_argument(fmt::format("{}: q, k, v need one floating dtype, got {}, {}, {}",
                                            op, dtype_name(q.dtype()), dtype_name(k.dtype()),
                                            dtype_name(v.dtype())));
  if (memory::behaves_as(q.device()) == DeviceType::cuda && !flash_attention_supported(q, k, v))
    throw std::invalid_argument(fmt::format(
        "{}: the CUDA kernel takes float32 with head dim E == Ev <= 128 (<= 64 where a block "
        "has less than 169 KB of shared memory), or float16/bfloat16 with E == Ev <= 128 and a "
        "multiple of 8, got {} q {}, v {}",
        op, dtype_name(q.dtype()), q.shape_string(), v.shape_string()));
}

// [B, H, T, D] laid out in memory as [B, T, H, D]: the heads of a token side by side, as in
// a transformer's [B, T, C]. The output's transpose(1, 2) is then contiguous (GPT's
// `y.transpose(1, 2).contiguous().view(B, T, C)` copies nothing) and its gradient arrives
// in the same order, read in place.
Tensor alloc_token_major(int64_t B, int64_t H, int64_t T, int64_t D, DType dtype, Device device) {
  const Tensor base = alloc_output({B, T, H, D}, dtype, device);
  return as_strided(base, {B, H, T, D}, {T * H * D, D, H * D, 1}, 0);
}

// Strides of the [B, H, T, D] heads of one part of a [B, T, 3, H, D] tensor.
Shape packed_strides(int64_t H, int64_t T, int64_t D) {
  return {T * 3 * H * D, D, 3 * H * D, 1};
}

// Whether q, k, v are the three parts of one [B, T, 3, H, D] tensor: a [B, T, 3C] projection
// split into q, k, v and viewed as heads (GPT's c_attn). Their gradients then go to one such
// buffer, and the split's backward joins them without a copy (tensor/shape/autograd.cpp).
bool packed_qkv(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.dim() != 4 || q.sizes() != k.sizes() || q.sizes() != v.sizes()) return false;
  if (!q.storage().is_same(k.storage()) || !q.storage().is_same(v.storage())) return false;
  if (q.strides() != k.strides() || q.strides() != v.strides()) return false;
  const int64_t C = q.size(1) * q.size(3);
  const Shape packed = packed_strides(q.size(1), q.size(2), q.size(3));
  for (size_t d = 0; d < 4; ++d)
    if (q.sizes()[d] > 1 && q.strides()[d] != packed[d]) return false;
  return k.storage_offset() == q.storage_offset() + C &&
         v.storage_offset() == q.storage_offset() + 2 * C;
}

}  // namespace

bool flash_attention_supported(const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& mask) {
  if (q.dim() < 2 || k.dim() != q.dim() || v.dim() != q.dim()) return false;
  if (q.device() != k.device() || q.device() != v.device()) return false;
  if (q.dtype() != k.dtype() || q.dtype() != v.dtype() || !is_floating(q.dtype())) return false;
  if (!heads_agree(q, k, v) || k.size(-1) != q.size(-1) || v.size(-2) != k.size(-2)) return false;
  if (mask.defined() && (mask.device() != q.device() || !mask_fits(mask, weights_shape(q, k))))
    return false;
  if (memory::behaves_as(q.device()) != DeviceType::cuda) return true;
  const int64_t E = q.size(-1);
  if (q.dtype() == DType::float32) {
    // The CUDA table's shared-memory check (no CUDA table in a CPU-only build: false), or
    // the meta table's for a dry run of a CUDA target.
    const AttentionKernels* table =
        q.device().is_meta() ? attention_backends.meta : attention_backends.cuda;
    return table && table->flash_attention_fp32_fits && v.size(-1) == E && E <= 128 && E > 0 &&
           table->flash_attention_fp32_fits(q.device().index, E);
  }
  return (q.dtype() == DType::float16 || q.dtype() == DType::bfloat16) && v.size(-1) == E &&
         E <= 128 && E % 8 == 0 && E > 0;
}

FlashAttentionOutput flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             bool causal, double scale, const Tensor& mask) {
  static const OpInfo info("flash_attention_forward");
  DispatchScope scope(info, q.device());
  check_inputs(info.name, q, k, v);
  const Tensor m4 = mask4d(info.name, mask, q, k);
  const Tensor q4 = as4d(q), k4 = as4d(k), v4 = as4d(v);
  const int64_t B = q4.size(0), H = q4.size(1), L = q4.size(2), Ev = v4.size(3);
  FlashAttentionOutput r;
  r.out = q.dim() == 4 ? alloc_token_major(B, H, L, Ev, q.dtype(), q.device())
                       : alloc_output({B, H, L, Ev}, q.dtype(), q.device());
  r.lse = alloc_output({B, H, L}, lse_dtype(q), q.device());
  attention_backends.get(info, q.device(), &AttentionKernels::flash_attention_forward)(
      r.out, r.lse, q4, k4, v4, causal, scale, m4);
  Shape os = leading(q), ls = leading(q);
  os.push_back(L);
  os.push_back(Ev);
  ls.push_back(L);
  r.out = view(r.out, os);
  r.lse = view(r.lse, ls);
  return r;
}

FlashAttentionGrads flash_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                             const Tensor& v, const Tensor& out, const Tensor& lse,
                                             bool causal, double scale, const Tensor& mask) {
  static const OpInfo info("flash_attention_backward");
  DispatchScope scope(info, q.device());
  check_inputs(info.name, q, k, v);
  check_same_device(info.name, q.device(), dout.device());
  check_same_device(info.name, q.device(), out.device());
  check_same_device(info.name, q.device(), lse.device());
  Shape os = leading(q), ls = leading(q);
  os.push_back(q.size(-2));
  os.push_back(v.size(-1));
  ls.push_back(q.size(-2));
  if (dout.sizes() != os || out.sizes() != os || lse.sizes() != ls)
    throw std::invalid_argument(
        fmt::format("{}: dout {}, out {}, lse {} do not match q {}, v {} (need out {} and lse {})",
                    info.name, dout.shape_string(), out.shape_string(), lse.shape_string(),
                    q.shape_string(), v.shape_string(), shape_str(os), shape_str(ls)));
  const Tensor m4 = mask4d(info.name, mask, q, k);
  const Tensor q4 = as4d(q), k4 = as4d(k), v4 = as4d(v);
  const Tensor o4 = as4d(to(out, q.dtype())), do4 = as4d(to(dout, q.dtype()));
  const Tensor lse3 = contiguous(to(lse, lse_dtype(q)));
  FlashAttentionGrads g;
  if (packed_qkv(q4, k4, v4)) {
    const int64_t B = q4.size(0), H = q4.size(1), T = q4.size(2), D = q4.size(3), C = H * D;
    const Tensor buf = alloc_output({B, T, 3 * C}, q.dtype(), q.device());
    const Shape st = packed_strides(H, T, D);
    g.dq = as_strided(buf, q4.sizes(), st, 0);
    g.dk = as_strided(buf, q4.sizes(), st, C);
    g.dv = as_strided(buf, q4.sizes(), st, 2 * C);
  } else {
    g.dq = alloc_output(q4.sizes(), q.dtype(), q.device());
    g.dk = alloc_output(k4.sizes(), q.dtype(), q.device());
    g.dv = alloc_output(v4.sizes(), q.dtype(), q.device());
  }
  attention_backends.get(info, q.device(), &AttentionKernels::flash_attention_backward)(
      g.dq, g.dk, g.dv, do4, q4, k4, v4, o4, lse3, causal, scale, m4);
  g.dq = view(g.dq, q.sizes());
  g.dk = view(g.dk, k.sizes());
  g.dv = view(g.dv, v.sizes());
  return g;
}

namespace {
std::atomic<int> g_gqa_repeat{-1};  // -1 until the first read: then TALLY_GQA_REPEAT or the setter
}  // namespace

void set_gqa_repeat(bool repeat) {
  g_gqa_repeat.store(repeat ? 1 : 0);
}

bool gqa_repeat() {
  int v = g_gqa_repeat.load();
  if (v < 0) {
    g_gqa_repeat.compare_exchange_strong(v, base::env_switch("TALLY_GQA_REPEAT", false) ? 1 : 0);
    v = g_gqa_repeat.load();
  }
  return v == 1;
}

namespace {

Tensor rotary_impl(const OpInfo& info, const Tensor& x, const Tensor& cos, const Tensor& sin,
                   bool backward) {
  check_same_device(info.name, x.device(), cos.device());
  check_same_device(info.name, x.device(), sin.device());
  DispatchScope scope(info, x);
  if (!is_floating(x.dtype()) || cos.dtype() != x.dtype() || sin.dtype() != x.dtype())
    throw std::invalid_argument(
        fmt::format("{}: x, cos and sin must share one floating dtype, got {}, {}, {}", info.name,
                    dtype_name(x.dtype()), dtype_name(cos.dtype()), dtype_name(sin.dtype())));
  if (x.dim() == 0 || x.size(-1) % 2 != 0)
    throw std::invalid_argument(
        fmt::format("{}: x {} needs a last dim of even size (rotate_half pairs its two halves)",
                    info.name, x.shape_string()));
  for (const Tensor* t : {&cos, &sin})
    if (broadcast_shapes(t->sizes(), x.sizes(), info.name) != x.sizes())
      throw std::invalid_argument(fmt::format("{}: table {} does not broadcast to x {}", info.name,
                                              t->shape_string(), x.shape_string()));
  Tensor out = alloc_output(x.sizes(), x.dtype(), x.device());
  attention_backends.get(info, x.device(), &AttentionKernels::rotary_embedding)(
      out, x, expand(cos, x.sizes()), expand(sin, x.sizes()), backward);
  return out;
}

}  // namespace

Tensor rotary_embedding(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  static const OpInfo info("rotary_embedding");
  return rotary_impl(info, x, cos, sin, false);
}

Tensor rotary_embedding_backward(const Tensor& grad, const Tensor& cos, const Tensor& sin) {
  static const OpInfo info("rotary_embedding_backward");
  return rotary_impl(info, grad, cos, sin, true);
}

}  // namespace tally::ops
