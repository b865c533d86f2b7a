// The fused attention op: argument checks, the [B, H, T, D] layout both kernels take
// (leading dims kept as two strided dims when there are exactly two, so GPT's split-head
// views are read in place; otherwise reshaped), output allocation and the dispatch into
// tensor/attention/cpu.cpp and tensor/attention/cuda.cu.
#include "tensor/attention/ops.h"

#include <fmt/format.h>

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

void check_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  check_same_device(op, q.device(), k.device());
  check_same_device(op, q.device(), v.device());
  if (q.dim() < 2 || k.dim() < 2 || v.dim() < 2 || q.dim() != k.dim() || q.dim() != v.dim())
    throw std::invalid_argument(fmt::format("{}: q, k, v need the same rank >= 2, got {}, {}, {}",
                                            op, q.shape_string(), k.shape_string(),
                                            v.shape_string()));
  if (leading(q) != leading(k) || leading(q) != leading(v) || k.size(-1) != q.size(-1) ||
      v.size(-2) != k.size(-2))
    throw std::invalid_argument(fmt::format(
        "{}: shapes q {}, k {}, v {} do not agree (need k [..., S, E] and v [..., S, Ev] for q "
        "[..., L, E], same leading dims)",
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

bool flash_attention_supported(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.dim() < 2 || k.dim() != q.dim() || v.dim() != q.dim()) return false;
  if (q.device() != k.device() || q.device() != v.device()) return false;
  if (q.dtype() != k.dtype() || q.dtype() != v.dtype() || !is_floating(q.dtype())) return false;
  if (leading(q) != leading(k) || leading(q) != leading(v) || k.size(-1) != q.size(-1) ||
      v.size(-2) != k.size(-2))
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
                                             bool causal, double scale) {
  static const OpInfo info("flash_attention_forward");
  DispatchScope scope(info, q.device());
  check_inputs(info.name, q, k, v);
  const Tensor q4 = as4d(q), k4 = as4d(k), v4 = as4d(v);
  const int64_t B = q4.size(0), H = q4.size(1), L = q4.size(2), Ev = v4.size(3);
  FlashAttentionOutput r;
  r.out = q.dim() == 4 ? alloc_token_major(B, H, L, Ev, q.dtype(), q.device())
                       : alloc_output({B, H, L, Ev}, q.dtype(), q.device());
  r.lse = alloc_output({B, H, L}, q.dtype() == DType::float64 ? DType::float64 : DType::float32,
                       q.device());
  attention_backends.get(info, q.device(), &AttentionKernels::flash_attention_forward)(
      r.out, r.lse, q4, k4, v4, causal, scale);
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
                                             bool causal, double scale) {
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
  const DType lse_dtype = q.dtype() == DType::float64 ? DType::float64 : DType::float32;
  const Tensor q4 = as4d(q), k4 = as4d(k), v4 = as4d(v);
  const Tensor o4 = as4d(to(out, q.dtype())), do4 = as4d(to(dout, q.dtype()));
  const Tensor lse3 = contiguous(to(lse, lse_dtype));
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
      g.dq, g.dk, g.dv, do4, q4, k4, v4, o4, lse3, causal, scale);
  g.dq = view(g.dq, q.sizes());
  g.dk = view(g.dk, k.sizes());
  g.dv = view(g.dv, v.sizes());
  return g;
}

}  // namespace tally::ops
