// Differentiable softmax family: forward, what is saved, and backward, one function each.
// softmax/log_softmax save their output; cross_entropy saves the logits, the targets and
// each row's log-sum-exp (never the softmax: its backward recomputes it from one read of
// the logits, the fused classifier of llm.c);
// nll_loss saves the targets only; linear_cross_entropy computes its inputs' gradients
// chunk by chunk in the forward and saves only those.
#include "tensor/softmax/autograd.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "autograd/autocast.h"
#include "autograd/node.h"
#include "base/checked.h"
#include "memory/context.h"
#include "tensor/dispatch.h"
#include "tensor/linalg/ops.h"
#include "tensor/op_alloc.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

namespace {

// softmax and log_softmax: float32 under autocast; the backward reads the output.
Tensor softmax_op(const char* name, const char* backward_name,
                  Tensor (*forward)(const Tensor&, int64_t),
                  Tensor (*backward)(const Tensor&, const Tensor&, int64_t), const Tensor& x_,
                  int64_t dim) {
  const auto [x] = autocast::fp32(name, x_);
  Tensor out = forward(x, dim);
  record(backward_name, {x}, {out}, {out},
         [dim, backward](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {backward(g[0], ctx.saved(0), dim)};
         });
  return out;
}

}  // namespace

Tensor softmax(const Tensor& x, int64_t dim, CallSite site) {
  memory::CallSiteScope call_site(site);
  return softmax_op("softmax", "SoftmaxBackward", &o::softmax, &o::softmax_backward, x, dim);
}

Tensor log_softmax(const Tensor& x, int64_t dim, CallSite site) {
  memory::CallSiteScope call_site(site);
  return softmax_op("log_softmax", "LogSoftmaxBackward", &o::log_softmax, &o::log_softmax_backward,
                    x, dim);
}

Tensor cross_entropy(const Tensor& input_, const Tensor& target, int64_t ignore_index,
                     double label_smoothing, const std::string& reduction, CallSite site) {
  memory::CallSiteScope call_site(site);
  // Under autocast, float16/bfloat16 logits are read as they are and the loss is float32
  // (PyTorch: log_softmax(x, dtype=float32) + nll_loss), so no float32 copy of the logits is
  // made or kept; the gradient comes back in the logits' dtype. Otherwise float32 policy.
  const bool low = input_.defined() && autocast::is_active(input_.device()) &&
                   (input_.dtype() == DType::float16 || input_.dtype() == DType::bfloat16);
  const Tensor input = low ? input_ : autocast::fp32("cross_entropy", input_)[0];
  const o::LossReduction red = o::parse_loss_reduction(reduction, "cross_entropy");
  o::CrossEntropyOutput r =
      o::cross_entropy_with_lse(input, target, ignore_index, label_smoothing, red,
                                low ? std::optional<DType>(DType::float32) : std::nullopt);
  // Saved: the logits, the targets and each row's log-sum-exp (the backward reads the logits
  // once: p = exp(x - lse)).
  record("CrossEntropyBackward", {input}, {r.loss}, {input, target, r.lse},
         [ignore_index, label_smoothing, red](BackwardContext& ctx,
                                              const TensorList& g) -> TensorList {
           return {o::cross_entropy_backward(g[0], ctx.saved(0), ctx.saved(1), ignore_index,
                                             label_smoothing, red, ctx.saved(2))};
         });
  return r.loss;
}

Tensor cross_entropy(const Tensor& input, const Tensor& target, int64_t ignore_index,
                     const std::string& reduction, double label_smoothing, CallSite site) {
  memory::CallSiteScope call_site(site);
  return cross_entropy(input, target, ignore_index, label_smoothing, reduction);
}

Tensor nll_loss(const Tensor& input_, const Tensor& target, int64_t ignore_index,
                const std::string& reduction, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [input] = autocast::fp32("nll_loss", input_);
  const o::LossReduction red = o::parse_loss_reduction(reduction, "nll_loss");
  Tensor out = o::nll_loss(input, target, ignore_index, red);
  record("NllLossBackward", {input}, {out}, {target},
         [sizes = input.sizes(), ignore_index, red](BackwardContext& ctx,
                                                    const TensorList& g) -> TensorList {
           return {o::nll_loss_backward(g[0], sizes, ctx.saved(0), ignore_index, red)};
         });
  return out;
}

// ---------------------------------------------------------------- linear_cross_entropy

int64_t linear_cross_entropy_chunk_rows(int64_t N, int64_t V, int64_t element_size,
                                        int64_t chunk_rows, int64_t max_chunk_bytes) {
  if (chunk_rows < 0)
    throw std::invalid_argument(
        fmt::format("linear_cross_entropy: chunk_rows must be >= 0 (0: chosen from "
                    "max_chunk_bytes), got {}",
                    chunk_rows));
  if (max_chunk_bytes <= 0)
    throw std::invalid_argument(fmt::format(
        "linear_cross_entropy: max_chunk_bytes must be positive, got {}", max_chunk_bytes));
  int64_t rows = chunk_rows;
  if (rows == 0) {
    const char* what = "linear_cross_entropy: the bytes of one logits row";
    const int64_t v = std::max<int64_t>(V, 1);
    const int64_t Vp = base::checked_add<int64_t>(v, (64 - v % 64) % 64, what);
    rows = max_chunk_bytes / base::checked_mul(Vp, element_size, what);
    if (rows >= 64) rows -= rows % 64;
    rows = std::max<int64_t>(rows, 1);
  }
  return std::max<int64_t>(std::min(rows, N), 1);
}

namespace {

// linear_cross_entropy's shapes, devices and target dtype (dtypes are checked after autocast).
void check_linear_cross_entropy(const Tensor& hidden, const Tensor& weight, const Tensor& target) {
  const char* op = "linear_cross_entropy";
  if (!hidden.defined() || !weight.defined() || !target.defined())
    throw std::invalid_argument(
        fmt::format("{}: hidden, weight and target must all be defined", op));
  const std::string shapes = fmt::format("hidden {}, weight {}, target {}", hidden.shape_string(),
                                         weight.shape_string(), target.shape_string());
  if (hidden.dim() != 2 || weight.dim() != 2 || target.dim() != 1)
    throw std::invalid_argument(fmt::format(
        "{}: expected hidden [N, C], weight [V, C] and target [N], got {}", op, shapes));
  if (hidden.size(1) != weight.size(1))
    throw std::invalid_argument(fmt::format("{}: hidden has {} features but weight expects {} ({})",
                                            op, hidden.size(1), weight.size(1), shapes));
  if (target.size(0) != hidden.size(0))
    throw std::invalid_argument(fmt::format("{}: {} targets for {} rows of hidden ({})", op,
                                            target.size(0), hidden.size(0), shapes));
  if (target.dtype() != DType::int64)
    throw std::invalid_argument(fmt::format("{}: target must be int64 class indices, got {} ({})",
                                            op, dtype_name(target.dtype()), shapes));
  check_same_device(op, hidden.device(), weight.device());
  check_same_device(op, hidden.device(), target.device());
}

void check_operand_dtypes(const Tensor& hidden, const Tensor& weight) {
  if (hidden.dtype() != weight.dtype() || !is_floating(hidden.dtype()))
    throw std::invalid_argument(fmt::format(
        "linear_cross_entropy: hidden and weight must have one floating dtype, got {} {} and "
        "{} {}",
        dtype_name(hidden.dtype()), hidden.shape_string(), dtype_name(weight.dtype()),
        weight.shape_string()));
}

}  // namespace

Tensor linear_cross_entropy(const Tensor& hidden_, const Tensor& weight_, const Tensor& target,
                            int64_t ignore_index, const std::string& reduction, int64_t chunk_rows,
                            int64_t max_chunk_bytes, CallSite site) {
  memory::CallSiteScope call_site(site);
  static const OpInfo info("linear_cross_entropy");
  check_linear_cross_entropy(hidden_, weight_, target);
  if (reduction != "mean" && reduction != "sum")
    throw std::invalid_argument(fmt::format(
        "linear_cross_entropy: reduction must be 'mean' or 'sum', got '{}'{}", reduction,
        reduction == "none" ? " ('none' is not supported: the per-row losses' gradient cannot be "
                              "formed from the saved gradients)"
                            : ""));
  const o::LossReduction red = o::parse_loss_reduction(reduction, info.name);
  // linear's autocast rule for the product's operands; the loss as cross_entropy's.
  const auto [hidden, weight] = autocast::lower(info.name, hidden_, weight_);
  check_operand_dtypes(hidden, weight);
  const DType dt = hidden.dtype();
  const Device device = hidden.device();
  const bool low = dt == DType::float16 || dt == DType::bfloat16;
  const DType loss_dtype = low && autocast::is_active(device) ? DType::float32 : dt;
  const bool need_h = autograd::needs_grad({hidden}), need_w = autograd::needs_grad({weight});
  const bool grad = need_h || need_w;
  const int64_t N = hidden.size(0), C = hidden.size(1), V = weight.size(0);
  const int64_t rows = linear_cross_entropy_chunk_rows(N, V, static_cast<int64_t>(dtype_size(dt)),
                                                       chunk_rows, max_chunk_bytes);
  const bool mean = red == o::LossReduction::mean;
  // A class count that is not a multiple of 64 (V = 50257) gives every product an odd
  // dimension and logits rows that are not 16-byte aligned: cuBLASLt then picks slow kernels
  // for all three. Such a weight is copied once per call into a [Vp, C] buffer, Vp = V rounded
  // up to 64, whose last Vp - V rows are zero; the logits are [rows, Vp] products, exactly 0
  // in the padding columns, of which the cross-entropy sees the first V columns; and d(weight)
  // is the first V rows of a [Vp, C] product. Every GEMM then has aligned dimensions and
  // leading dimensions.
  const bool padded = V % 64 != 0;
  const int64_t Vp = padded ? base::checked_add<int64_t>(V, 64 - V % 64, info.name) : V;

  DispatchScope scope(info, hidden, weight, target);
  Tensor wpad = weight;  // [Vp, C]
  if (padded) {
    wpad = o::zeros({Vp, C}, dt, device);
    o::copy_(o::narrow(wpad, 0, 0, V), weight);
  }
  const Tensor wt = o::transpose(wpad, 0, 1);  // [C, Vp]
  // The mean's divisor, the number of counted targets: a 0-D float64 tensor on the device
  // (never read back, so no synchronisation).
  Tensor count;
  if (mean)
    count =
        o::sum(o::to(o::binary_scalar(o::BinaryOp::ne, target, static_cast<double>(ignore_index)),
                     DType::float64));
  // The incoming gradient of each chunk's summed loss: the reduction's scale (1 / count or 1)
  // in the logits' dtype; 1 for 16-bit logits, whose mean scale is applied in float32 below
  // (1 / count in 16 bits would bias every gradient by its rounding).
  Tensor g, scale32;
  if (grad) {
    if (mean) {
      const Tensor inv = o::unary(o::UnaryOp::reciprocal, count);
      if (low)
        scale32 = o::to(inv, DType::float32);
      else
        g = o::to(inv, dt);
    }
    if (!g.defined()) g = o::full({}, 1.0, dt, device);
  }
  // d(weight)'s accumulator, [Vp, C]: float32 for 16-bit operands, whose products the GEMM
  // adds into it in float32 (mm_out with a float32 out: no 16-bit [Vp, C] temporary a chunk).
  const DType acc = low ? DType::float32 : dt;
  // d(weight) is kept in the dtype backward delivers the weight's gradient in: float32 for
  // autocast's cast of a float32 parameter (autograd::grad_dtype; GPT's tied wte), straight
  // from the float32 accumulator (no rounding to 16 bits and no conversion back), else dt.
  const DType gw_dtype =
      acc == DType::float32 && autograd::grad_dtype(weight) == DType::float32 ? acc : dt;
  Tensor loss, grad_h, grad_w;
  Tensor w_scale;  // 0-D float32: what the backward still owes grad_w (a mean's 1 / count)
  if (need_h) grad_h = alloc_output({N, C}, dt, device);
  if (need_w && N > 0) grad_w = o::empty({Vp, C}, acc, device);
  try {
    for (int64_t start = 0; start < N; start += rows) {
      const int64_t r = std::min(rows, N - start);
      const Tensor h = o::narrow(hidden, 0, start, r);
      const Tensor t = o::narrow(target, 0, start, r);
      // One [r, Vp] buffer a chunk: the logits (their first V columns; the padding columns
      // are 0), then their gradient written over them in place (the backward reads each
      // element once, before writing it, given the lse; the padding stays 0).
      Tensor full = o::mm(h, wt);
      const Tensor logits = padded ? o::narrow(full, 1, 0, V) : full;
      // The loss and, when a gradient is wanted, d(logits) over the logits in place: one
      // pass over each row on CUDA (ops::cross_entropy_and_backward).
      const std::optional<DType> loss_dt =
          low ? std::optional<DType>(DType::float32) : std::nullopt;
      const Tensor chunk_loss =
          grad ? o::cross_entropy_and_backward(logits, t, g, ignore_index, 0.0,
                                               o::LossReduction::sum, loss_dt, logits)
                     .loss
               : o::cross_entropy_with_lse(logits, t, ignore_index, 0.0, o::LossReduction::sum,
                                           loss_dt)
                     .loss;
      if (loss.defined())
        o::add_(loss, chunk_loss);
      else
        loss = chunk_loss;
      if (!grad) continue;
      const Tensor& dlogits = full;  // [r, Vp]
      if (need_h) {
        const Tensor dst = o::narrow(grad_h, 0, start, r);  // rows of a contiguous [N, C]
        if (scale32.defined()) {
          // The float32 product, scaled, rounded once by the copy.
          const Tensor d32 = o::empty({r, C}, DType::float32, device);
          o::mm_out(d32, dlogits, wpad);
          o::copy_(dst, o::mul(d32, scale32));
        } else {
          o::mm_out(dst, dlogits, wpad);
        }
      }
      if (need_w) o::mm_out(grad_w, o::transpose(dlogits, 0, 1), h, /*accumulate=*/start > 0);
    }
  } catch (const std::out_of_range& e) {
    throw std::out_of_range(
        fmt::format("linear_cross_entropy: {} (hidden {}, weight {}, target {})", e.what(),
                    hidden.shape_string(), weight.shape_string(), target.shape_string()));
  }
  if (!loss.defined()) loss = o::zeros({}, low ? DType::float32 : dt, device);  // N = 0
  if (mean) loss = o::div(loss, count);                                         // float64
  loss = o::to(loss, loss_dtype);
  if (need_w) {
    if (!grad_w.defined()) grad_w = o::zeros({V, C}, acc, device);  // N = 0
    if (padded && N > 0) grad_w = o::narrow(grad_w, 0, 0, V);       // the first V rows: contiguous
    if (scale32.defined()) {
      // A float32 d(weight) stays unscaled: the backward multiplies it by the mean's scale and
      // the loss gradient at once (one pass over [V, C] rather than two). One that is rounded
      // to 16 bits is scaled first, in float32.
      if (gw_dtype == acc)
        w_scale = scale32;
      else
        grad_w = o::mul(grad_w, scale32);
    }
    grad_w = o::to(grad_w, gw_dtype);
  }
  // Saved: the inputs' gradients for a loss gradient of 1 (the backward scales them), but for
  // w_scale, which the backward applies to d(weight) with the loss gradient.
  record("LinearCrossEntropyBackward", {hidden, weight}, {loss}, {grad_h, grad_w},
         [w_scale](BackwardContext& ctx, const TensorList& g) -> TensorList {
           TensorList out(2);
           for (size_t i = 0; i < 2; ++i) {
             if (!ctx.needs_input_grad(i)) continue;
             const Tensor s = ctx.saved(i);
             Tensor factor = o::to(g[0], s.dtype());
             if (i == 1 && w_scale.defined()) factor = o::mul(factor, w_scale);  // 0-D
             out[i] = o::mul(s, factor);
           }
           return out;
         });
  return loss;
}

}  // namespace tally
