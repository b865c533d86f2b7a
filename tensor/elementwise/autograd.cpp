// Differentiable elementwise ops, activations and basic reductions: forward, what is
// saved, and backward, one function each.
#include "tensor/elementwise/autograd.h"

#include <cmath>
#include <utility>

#include "autograd/autocast.h"
#include "autograd/node.h"
#include "memory/context.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

namespace {

// Gradient for an input of shape/dtype like `like`, from a broadcast gradient.
Tensor reduce_like(const Tensor& g, const Shape& shape, DType dtype) {
  return o::to(o::sum_to(g, shape), dtype);
}

Tensor as_dtype(const Tensor& mask, DType dtype) {
  return o::to(mask, dtype);
}

// What the backward of a unary op reads: the op's input or its output.
enum class Saves { input, output };

// out = op(a), recorded with the gradient grad(g, saved), saved the input or the output.
Tensor unary_op(o::UnaryOp op, const char* backward_name, Saves saves, const Tensor& a,
                Tensor (*grad)(const Tensor& g, const Tensor& saved)) {
  Tensor out = o::unary(op, a);
  record(backward_name, {a}, {out}, {saves == Saves::input ? a : out},
         [grad](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {grad(g[0], ctx.saved(0))};
         });
  return out;
}

// The gradient g * d(x) of a unary op whose derivative is the unary op D of its input.
template <o::UnaryOp D>
Tensor times_unary(const Tensor& g, const Tensor& x) {
  return o::mul(g, o::unary(D, x));
}

TensorOptions factory_opts(TensorOptions opts) {
  return opts;
}

Tensor finish_factory(Tensor t, const TensorOptions& opts) {
  if (opts.requires_grad) t.requires_grad_(true);
  return t;
}

}  // namespace

// ---------------------------------------------------------------- factories

Tensor empty(const Shape& s, TensorOptions opts, CallSite site) {
  memory::CallSiteScope call_site(site);
  return finish_factory(o::empty(s, opts.dtype, opts.device), opts);
}
Tensor zeros(const Shape& s, TensorOptions opts, CallSite site) {
  memory::CallSiteScope call_site(site);
  return finish_factory(o::zeros(s, opts.dtype, opts.device), opts);
}
Tensor ones(const Shape& s, TensorOptions opts, CallSite site) {
  memory::CallSiteScope call_site(site);
  return finish_factory(o::ones(s, opts.dtype, opts.device), opts);
}
Tensor full(const Shape& s, double v, TensorOptions opts, CallSite site) {
  memory::CallSiteScope call_site(site);
  return finish_factory(o::full(s, v, opts.dtype, opts.device), opts);
}
Tensor arange(double end, TensorOptions opts, CallSite site) {
  return arange(0, end, 1, opts, site);
}
Tensor arange(double start, double end, double step, TensorOptions opts, CallSite site) {
  memory::CallSiteScope call_site(site);
  return finish_factory(o::arange(start, end, step, opts.dtype, opts.device), opts);
}
Tensor rand(const Shape& s, TensorOptions opts, Generator* gen, CallSite site) {
  memory::CallSiteScope call_site(site);
  return finish_factory(o::rand(s, opts.dtype, opts.device, gen), opts);
}
Tensor randn(const Shape& s, TensorOptions opts, Generator* gen, CallSite site) {
  memory::CallSiteScope call_site(site);
  return finish_factory(o::randn(s, opts.dtype, opts.device, gen), opts);
}
Tensor randint(int64_t low, int64_t high, const Shape& s, TensorOptions opts, Generator* gen,
               CallSite site) {
  memory::CallSiteScope call_site(site);
  return o::randint(low, high, s, opts.dtype, opts.device, gen);
}
Tensor from_vector(const std::vector<double>& v, const Shape& s, TensorOptions opts,
                   CallSite site) {
  memory::CallSiteScope call_site(site);
  return finish_factory(o::from_vector(v, s, opts.dtype, opts.device), opts);
}
Tensor from_blob(void* data, const Shape& s, TensorOptions opts) {
  return finish_factory(o::from_blob(data, s, opts.dtype, opts.device), opts);
}
Tensor tensor(std::initializer_list<double> values, TensorOptions opts, CallSite site) {
  memory::CallSiteScope call_site(site);
  return from_vector(std::vector<double>(values), {static_cast<int64_t>(values.size())},
                     factory_opts(opts));
}
Tensor zeros_like(const Tensor& t, CallSite site) {
  memory::CallSiteScope call_site(site);
  return o::zeros_like(t);
}
Tensor ones_like(const Tensor& t, CallSite site) {
  memory::CallSiteScope call_site(site);
  return o::ones_like(t);
}

// ---------------------------------------------------------------- arithmetic

Tensor add(const Tensor& a, const Tensor& b, double alpha, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = alpha == 1.0 ? o::add(a, b) : o::add(a, o::mul(b, alpha));
  record("AddBackward", {a, b}, {out}, {},
         [sa = a.sizes(), sb = b.sizes(), da = a.dtype(), db = b.dtype(), alpha](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           Tensor ga, gb;
           if (ctx.needs_input_grad(0)) ga = reduce_like(g[0], sa, da);
           if (ctx.needs_input_grad(1))
             gb = reduce_like(alpha == 1.0 ? g[0] : o::mul(g[0], alpha), sb, db);
           return {ga, gb};
         });
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b, double alpha, CallSite site) {
  memory::CallSiteScope call_site(site);
  return add(a, b, -alpha);
}

Tensor mul(const Tensor& a, const Tensor& b, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::mul(a, b);
  const bool ga_needed = a.requires_grad(), gb_needed = b.requires_grad();
  record("MulBackward", {a, b}, {out}, {gb_needed ? a : Tensor(), ga_needed ? b : Tensor()},
         [sa = a.sizes(), sb = b.sizes(), da = a.dtype(), db = b.dtype()](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           Tensor ga, gb;
           if (ctx.needs_input_grad(0)) ga = reduce_like(o::mul(g[0], ctx.saved(1)), sa, da);
           if (ctx.needs_input_grad(1)) gb = reduce_like(o::mul(g[0], ctx.saved(0)), sb, db);
           return {ga, gb};
         });
  return out;
}

Tensor div(const Tensor& a, const Tensor& b, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::div(a, b);
  record("DivBackward", {a, b}, {out}, {a, b},
         [sa = a.sizes(), sb = b.sizes(), da = a.dtype(), db = b.dtype()](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           const Tensor b_ = ctx.saved(1);
           Tensor ga, gb;
           if (ctx.needs_input_grad(0)) ga = reduce_like(o::div(g[0], b_), sa, da);
           if (ctx.needs_input_grad(1)) {
             const Tensor a_ = ctx.saved(0);
             gb = reduce_like(o::neg(o::div(o::mul(g[0], a_), o::mul(b_, b_))), sb, db);
           }
           return {ga, gb};
         });
  return out;
}

Tensor add(const Tensor& a, double b, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::add(a, b);
  record("AddBackward", {a}, {out}, {},
         [](BackwardContext&, const TensorList& g) -> TensorList { return {g[0]}; });
  return out;
}

Tensor mul(const Tensor& a, double b, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::mul(a, b);
  record("MulBackward", {a}, {out}, {},
         [b](BackwardContext&, const TensorList& g) -> TensorList { return {o::mul(g[0], b)}; });
  return out;
}

Tensor div(const Tensor& a, double b, CallSite site) {
  memory::CallSiteScope call_site(site);
  return mul(a, 1.0 / b);
}

Tensor pow(const Tensor& a_, double e, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [a] = autocast::fp32("pow", a_);
  Tensor out = o::binary_scalar(o::BinaryOp::pow, a, e);
  record("PowBackward", {a}, {out}, {a},
         [e](BackwardContext& ctx, const TensorList& g) -> TensorList {
           if (e == 0.0) return {o::zeros_like(g[0])};
           const Tensor d = o::mul(o::binary_scalar(o::BinaryOp::pow, ctx.saved(0), e - 1.0), e);
           return {o::mul(g[0], d)};
         });
  return out;
}

Tensor pow(const Tensor& a_, const Tensor& e_, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [a, e] = autocast::fp32("pow", a_, e_);
  Tensor out = o::binary(o::BinaryOp::pow, a, e);
  record("PowBackward", {a, e}, {out}, {a, e, out},
         [sa = a.sizes(), se = e.sizes(), da = a.dtype(), de = e.dtype()](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           const Tensor a_ = ctx.saved(0), e_ = ctx.saved(1);
           Tensor ga, ge;
           if (ctx.needs_input_grad(0))
             ga = reduce_like(
                 o::mul(g[0], o::mul(e_, o::binary(o::BinaryOp::pow, a_, o::add(e_, -1.0)))), sa,
                 da);
           if (ctx.needs_input_grad(1))
             ge = reduce_like(o::mul(g[0], o::mul(ctx.saved(2), o::unary(o::UnaryOp::log, a_))), se,
                              de);
           return {ga, ge};
         });
  return out;
}

Tensor neg(const Tensor& a, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::neg(a);
  record("NegBackward", {a}, {out}, {},
         [](BackwardContext&, const TensorList& g) -> TensorList { return {o::neg(g[0])}; });
  return out;
}

Tensor exp(const Tensor& a_, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [a] = autocast::fp32("exp", a_);
  return unary_op(o::UnaryOp::exp, "ExpBackward", Saves::output, a,
                  [](const Tensor& g, const Tensor& y) -> Tensor { return o::mul(g, y); });
}

Tensor log(const Tensor& a_, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [a] = autocast::fp32("log", a_);
  return unary_op(o::UnaryOp::log, "LogBackward", Saves::input, a,
                  [](const Tensor& g, const Tensor& x) -> Tensor { return o::div(g, x); });
}

Tensor sqrt(const Tensor& a, CallSite site) {
  memory::CallSiteScope call_site(site);
  return unary_op(
      o::UnaryOp::sqrt, "SqrtBackward", Saves::output, a,
      [](const Tensor& g, const Tensor& y) -> Tensor { return o::div(g, o::mul(y, 2.0)); });
}

Tensor rsqrt(const Tensor& a_, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto [a] = autocast::fp32("rsqrt", a_);
  return unary_op(o::UnaryOp::rsqrt, "RsqrtBackward", Saves::output, a,
                  [](const Tensor& g, const Tensor& r) -> Tensor {
                    return o::mul(g, o::mul(o::mul(r, o::mul(r, r)), -0.5));
                  });
}

Tensor sin(const Tensor& a, CallSite site) {
  memory::CallSiteScope call_site(site);
  return unary_op(o::UnaryOp::sin, "SinBackward", Saves::input, a, &times_unary<o::UnaryOp::cos>);
}

Tensor cos(const Tensor& a, CallSite site) {
  memory::CallSiteScope call_site(site);
  return unary_op(o::UnaryOp::cos, "CosBackward", Saves::input, a,
                  [](const Tensor& g, const Tensor& x) -> Tensor {
                    return o::mul(g, o::mul(o::unary(o::UnaryOp::sin, x), -1.0));
                  });
}

Tensor erf(const Tensor& a, CallSite site) {
  memory::CallSiteScope call_site(site);
  // d/dx erf(x) = 2 / sqrt(pi) * exp(-x^2).
  return unary_op(o::UnaryOp::erf, "ErfBackward", Saves::input, a,
                  [](const Tensor& g, const Tensor& x) -> Tensor {
                    const Tensor e =
                        o::unary(o::UnaryOp::exp, o::mul(o::unary(o::UnaryOp::square, x), -1.0));
                    return o::mul(g, o::mul(e, 2.0 / std::sqrt(M_PI)));
                  });
}

Tensor lerp(const Tensor& input, const Tensor& end, const Tensor& weight, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::lerp(input, end, weight);
  // d/dinput = 1 - w, d/dend = w, d/dweight = end - input.
  const bool gw_needed = weight.requires_grad();
  const bool gie_needed = input.requires_grad() || end.requires_grad();
  record("LerpBackward", {input, end, weight}, {out},
         {gw_needed ? input : Tensor(), gw_needed ? end : Tensor(), gie_needed ? weight : Tensor()},
         [si = input.sizes(), se = end.sizes(), sw = weight.sizes(), dt = input.dtype()](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           const Tensor w = ctx.saved(2);
           Tensor gi, ge, gw;
           if (ctx.needs_input_grad(0))
             gi = reduce_like(o::mul(g[0], o::affine(w, -1.0, 1.0)), si, dt);
           if (ctx.needs_input_grad(1)) ge = reduce_like(o::mul(g[0], w), se, dt);
           if (ctx.needs_input_grad(2))
             gw = reduce_like(o::mul(g[0], o::sub(ctx.saved(1), ctx.saved(0))), sw, dt);
           return {gi, ge, gw};
         });
  return out;
}

Tensor lerp(const Tensor& input, const Tensor& end, double weight, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::lerp(input, end, weight);
  record("LerpBackward", {input, end}, {out}, {},
         [si = input.sizes(), se = end.sizes(), dt = input.dtype(), weight](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           Tensor gi, ge;
           if (ctx.needs_input_grad(0)) gi = reduce_like(o::mul(g[0], 1.0 - weight), si, dt);
           if (ctx.needs_input_grad(1)) ge = reduce_like(o::mul(g[0], weight), se, dt);
           return {gi, ge};
         });
  return out;
}

Tensor abs(const Tensor& a, CallSite site) {
  memory::CallSiteScope call_site(site);
  return unary_op(o::UnaryOp::abs, "AbsBackward", Saves::input, a, &times_unary<o::UnaryOp::sign>);
}

Tensor square(const Tensor& a, CallSite site) {
  memory::CallSiteScope call_site(site);
  return unary_op(
      o::UnaryOp::square, "SquareBackward", Saves::input, a,
      [](const Tensor& g, const Tensor& x) -> Tensor { return o::mul(g, o::mul(x, 2.0)); });
}

namespace {
Tensor max_min(const Tensor& a, const Tensor& b, bool is_max) {
  Tensor out = o::binary(is_max ? o::BinaryOp::maximum : o::BinaryOp::minimum, a, b);
  record(is_max ? "MaximumBackward" : "MinimumBackward", {a, b}, {out}, {a, b},
         [sa = a.sizes(), sb = b.sizes(), da = a.dtype(), db = b.dtype(), is_max](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           const Tensor a_ = ctx.saved(0), b_ = ctx.saved(1);
           const DType dt = g[0].dtype();
           // Ties split the gradient evenly, as PyTorch does.
           const Tensor win =
               as_dtype(o::binary(is_max ? o::BinaryOp::gt : o::BinaryOp::lt, a_, b_), dt);
           const Tensor tie = o::mul(as_dtype(o::binary(o::BinaryOp::eq, a_, b_), dt), 0.5);
           const Tensor wa = o::add(win, tie);
           Tensor ga, gb;
           if (ctx.needs_input_grad(0)) ga = reduce_like(o::mul(g[0], wa), sa, da);
           if (ctx.needs_input_grad(1))
             gb = reduce_like(o::mul(g[0], o::affine(wa, -1.0, 1.0)), sb, db);
           return {ga, gb};
         });
  return out;
}
}  // namespace

Tensor maximum(const Tensor& a, const Tensor& b, CallSite site) {
  memory::CallSiteScope call_site(site);
  return max_min(a, b, true);
}
Tensor minimum(const Tensor& a, const Tensor& b, CallSite site) {
  memory::CallSiteScope call_site(site);
  return max_min(a, b, false);
}

Tensor clamp(const Tensor& a, std::optional<double> lo, std::optional<double> hi, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::clamp(a, lo, hi);
  record("ClampBackward", {a}, {out}, {a},
         [lo, hi](BackwardContext& ctx, const TensorList& g) -> TensorList {
           const Tensor a_ = ctx.saved(0);
           Tensor keep = o::ones(a_.sizes(), DType::bool_, a_.device());
           if (lo)
             keep = o::binary(o::BinaryOp::mul, keep, o::binary_scalar(o::BinaryOp::ge, a_, *lo));
           if (hi)
             keep = o::binary(o::BinaryOp::mul, keep, o::binary_scalar(o::BinaryOp::le, a_, *hi));
           return {o::mul(g[0], as_dtype(keep, g[0].dtype()))};
         });
  return out;
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::where(cond, a, b);
  record("WhereBackward", {a, b}, {out}, {cond},
         [sa = a.sizes(), sb = b.sizes(), da = a.dtype(), db = b.dtype()](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           const Tensor c = ctx.saved(0);
           const Tensor zero = o::zeros({}, g[0].dtype(), g[0].device());
           Tensor ga, gb;
           if (ctx.needs_input_grad(0)) ga = reduce_like(o::where(c, g[0], zero), sa, da);
           if (ctx.needs_input_grad(1)) gb = reduce_like(o::where(c, zero, g[0]), sb, db);
           return {ga, gb};
         });
  return out;
}

Tensor masked_fill(const Tensor& a, const Tensor& mask, double value, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::masked_fill(a, mask, value);
  record("MaskedFillBackward", {a}, {out}, {mask},
         [](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {o::where(ctx.saved(0), o::zeros({}, g[0].dtype(), g[0].device()), g[0])};
         });
  return out;
}

// The comparisons: a bool output, no gradient, so no node.
#define TALLY_COMPARISON(NAME)                                   \
  Tensor NAME(const Tensor& a, const Tensor& b, CallSite site) { \
    memory::CallSiteScope call_site(site);                       \
    return o::binary(o::BinaryOp::NAME, a, b);                   \
  }
TALLY_COMPARISON(eq)
TALLY_COMPARISON(ne)
TALLY_COMPARISON(lt)
TALLY_COMPARISON(gt)
TALLY_COMPARISON(le)
TALLY_COMPARISON(ge)
#undef TALLY_COMPARISON

// ---------------------------------------------------------------- activations

Tensor relu(const Tensor& x, CallSite site) {
  memory::CallSiteScope call_site(site);
  return unary_op(o::UnaryOp::relu, "ReluBackward", Saves::output, x,
                  [](const Tensor& g, const Tensor& y) -> Tensor {
                    return o::binary(o::BinaryOp::relu_backward, g, y);  // one fused pass
                  });
}

namespace {
// add_relu's backward: out's mask routes the gradient to both inputs, reduced to their shapes.
void record_add_relu(const Tensor& a, const Tensor& b, const Tensor& out) {
  record("AddReluBackward", {a, b}, {out}, {out},
         [sa = a.sizes(), sb = b.sizes(), da = a.dtype(), db = b.dtype()](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           const Tensor gs = o::binary(o::BinaryOp::relu_backward, g[0], ctx.saved(0));
           Tensor ga, gb;
           if (ctx.needs_input_grad(0)) ga = reduce_like(gs, sa, da);
           if (ctx.needs_input_grad(1)) gb = reduce_like(gs, sb, db);
           return {ga, gb};
         });
}
}  // namespace

Tensor add_relu(const Tensor& a, const Tensor& b, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::add_relu(a, b);
  record_add_relu(a, b, out);
  return out;
}

Tensor add_relu(Tensor&& a, const Tensor& b, CallSite site) {
  if (&a == &b) return add_relu(std::as_const(a), b, site);  // b is a: nothing to give up
  memory::CallSiteScope call_site(site);
  Tensor given = std::move(a);  // the caller's handle is gone: only `given` holds it
  Tensor out = o::add_relu(std::move(given), b);
  record_add_relu(given, b, out);  // given's graph edge; its buffer may now be out's
  return out;
}

Tensor gelu(const Tensor& x, const std::string& approximate, CallSite site) {
  memory::CallSiteScope call_site(site);
  if (approximate != "none" && approximate != "tanh")
    throw std::invalid_argument("gelu: approximate must be 'none' or 'tanh', got '" + approximate +
                                "'");
  const bool tanh_approx = approximate == "tanh";
  Tensor out = o::unary(tanh_approx ? o::UnaryOp::gelu_tanh : o::UnaryOp::gelu, x);
  record("GeluBackward", {x}, {out}, {x},
         [tanh_approx](BackwardContext& ctx, const TensorList& g) -> TensorList {
           // g * gelu'(x) in one fused pass (the formulas: tensor/ops.h, BinaryOp).
           return {
               o::binary(tanh_approx ? o::BinaryOp::gelu_tanh_backward : o::BinaryOp::gelu_backward,
                         g[0], ctx.saved(0))};
         });
  return out;
}

Tensor silu(const Tensor& x, CallSite site) {
  memory::CallSiteScope call_site(site);
  return unary_op(o::UnaryOp::silu, "SiluBackward", Saves::input, x,
                  [](const Tensor& g, const Tensor& x_) -> Tensor {
                    return o::binary(o::BinaryOp::silu_backward, g, x_);  // one pass
                  });
}

Tensor silu_mul(const Tensor& a, const Tensor& b, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::binary(o::BinaryOp::silu_mul, a, b);
  // Saves the two inputs (silu(a) is neither written nor kept); the backward is
  //   d/da = g * b * silu'(a),  d/db = silu(a) * g.
  record("SiluMulBackward", {a, b}, {out}, {a, b},
         [sa = a.sizes(), sb = b.sizes(), da = a.dtype(), db = b.dtype()](
             BackwardContext& ctx, const TensorList& g) -> TensorList {
           Tensor ga, gb;
           if (ctx.needs_input_grad(0))
             ga = reduce_like(
                 o::binary(o::BinaryOp::silu_backward, o::mul(g[0], ctx.saved(1)), ctx.saved(0)),
                 sa, da);
           if (ctx.needs_input_grad(1))
             gb = reduce_like(o::binary(o::BinaryOp::silu_mul, ctx.saved(0), g[0]), sb, db);
           return {ga, gb};
         });
  return out;
}

Tensor sigmoid(const Tensor& x, CallSite site) {
  memory::CallSiteScope call_site(site);
  return unary_op(o::UnaryOp::sigmoid, "SigmoidBackward", Saves::output, x,
                  [](const Tensor& g, const Tensor& s) -> Tensor {
                    return o::binary(o::BinaryOp::sigmoid_backward, g, s);
                  });
}

Tensor tanh(const Tensor& x, CallSite site) {
  memory::CallSiteScope call_site(site);
  return unary_op(o::UnaryOp::tanh, "TanhBackward", Saves::output, x,
                  [](const Tensor& g, const Tensor& t) -> Tensor {
                    return o::binary(o::BinaryOp::tanh_backward, g, t);
                  });
}

Tensor dropout(const Tensor& x, double p, bool train, Generator* gen, CallSite site) {
  memory::CallSiteScope call_site(site);
  if (p < 0.0 || p > 1.0)
    throw std::invalid_argument("dropout: p must be in [0, 1], got " + std::to_string(p));
  if (!train || p == 0.0) return x;
  if (p == 1.0) return mul(x, 0.0);
  // keep = rand >= p, stored as a bool mask (what backward saves).
  const Tensor keep =
      o::binary_scalar(o::BinaryOp::ge, o::rand(x.sizes(), DType::float32, x.device(), gen), p);
  const double scale = 1.0 / (1.0 - p);
  Tensor out = o::mul(o::mul(x, as_dtype(keep, x.dtype())), scale);
  record("DropoutBackward", {x}, {out}, {keep},
         [scale](BackwardContext& ctx, const TensorList& g) -> TensorList {
           return {o::mul(o::mul(g[0], as_dtype(ctx.saved(0), g[0].dtype())), scale)};
         });
  return out;
}

// ---------------------------------------------------------------- reductions

namespace {
// Gradient of a reduction over `dims` (empty = all): g broadcast back to `shape`.
Tensor unreduce(const Tensor& g, const Shape& shape, const Shape& dims, bool keepdim) {
  Tensor r = g;
  if (!keepdim) {
    const auto rank = static_cast<int64_t>(shape.size());
    if (dims.empty() || rank == 0) {
      r = o::reshape(g, Shape(shape.size(), 1));
    } else {
      std::vector<int64_t> ds;
      for (int64_t d : dims) ds.push_back(o::wrap_dim(d, rank, "sum"));
      std::sort(ds.begin(), ds.end());
      for (int64_t d : ds) r = o::unsqueeze(r, d);
    }
  }
  return o::expand(r, shape);
}
}  // namespace

Tensor sum(const Tensor& x_, const Shape& dims, bool keepdim, std::optional<DType> dtype,
           CallSite site) {
  memory::CallSiteScope call_site(site);
  // Autocast's fp32_set_opt_dtype: without a dtype, a 16-bit input is summed into a float32
  // result, read widened by the kernel (no float32 copy of the input).
  const bool sixteen =
      x_.defined() && (x_.dtype() == DType::float16 || x_.dtype() == DType::bfloat16);
  if (!dtype && sixteen && autocast::is_active(x_.device())) dtype = DType::float32;
  const Tensor& x = x_;
  Tensor out = o::sum(x, dims, keepdim, dtype);
  record("SumBackward", {x}, {out}, {},
         [shape = x.sizes(), dims, keepdim, xdt = x.dtype()](BackwardContext&,
                                                             const TensorList& g) -> TensorList {
           const Tensor gx = o::contiguous(unreduce(g[0], shape, dims, keepdim));
           return {gx.dtype() == xdt ? gx : o::to(gx, xdt)};
         });
  return out;
}

Tensor mean(const Tensor& x, const Shape& dims, bool keepdim, CallSite site) {
  memory::CallSiteScope call_site(site);
  Tensor out = o::mean(x, dims, keepdim);
  int64_t count = 1;
  if (dims.empty()) {
    count = x.numel();
  } else {
    for (int64_t d : dims) count *= x.dim() == 0 ? 1 : x.size(d);
  }
  record("MeanBackward", {x}, {out}, {},
         [shape = x.sizes(), dims, keepdim, count](BackwardContext&,
                                                   const TensorList& g) -> TensorList {
           return {o::mul(unreduce(g[0], shape, dims, keepdim), 1.0 / static_cast<double>(count))};
         });
  return out;
}

// ---------------------------------------------------------------- operators

Tensor operator+(const Tensor& a, const Tensor& b) {
  return add(a, b);
}
Tensor operator-(const Tensor& a, const Tensor& b) {
  return sub(a, b);
}
Tensor operator*(const Tensor& a, const Tensor& b) {
  return mul(a, b);
}
Tensor operator/(const Tensor& a, const Tensor& b) {
  return div(a, b);
}
Tensor operator-(const Tensor& a) {
  return neg(a);
}
Tensor operator+(const Tensor& a, double b) {
  return add(a, b);
}
Tensor operator-(const Tensor& a, double b) {
  return add(a, -b);
}
Tensor operator*(const Tensor& a, double b) {
  return mul(a, b);
}
Tensor operator/(const Tensor& a, double b) {
  return div(a, b);
}
Tensor operator+(double a, const Tensor& b) {
  return add(b, a);
}
Tensor operator-(double a, const Tensor& b) {
  return add(neg(b), a);
}
Tensor operator*(double a, const Tensor& b) {
  return mul(b, a);
}
Tensor operator/(double a, const Tensor& b) {
  return mul(pow(b, -1.0), a);
}

}  // namespace tally
