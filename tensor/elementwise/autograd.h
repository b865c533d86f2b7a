// Differentiable elementwise ops and the core of the differentiable API (namespace tally):
// factories (requires_grad from options), elementwise maps, activations, sum/mean and the
// operators. Each computes its result with ops:: kernels and, when grad is needed, records
// its backward and what it saves (tensor/elementwise/autograd.cpp). Users include the
// umbrella autograd/ops.h.
#pragma once

#include <optional>
#include <source_location>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "tensor/elementwise/ops.h"

namespace tally {

// ---- factories (requires_grad from options) ----
// `site`, defaulted at the caller, names the user's line in snapshots and traces
// (memory::CallSiteScope).
using CallSite = std::source_location;
Tensor empty(const Shape& shape, TensorOptions opts = {}, CallSite site = CallSite::current());
Tensor zeros(const Shape& shape, TensorOptions opts = {}, CallSite site = CallSite::current());
Tensor ones(const Shape& shape, TensorOptions opts = {}, CallSite site = CallSite::current());
Tensor full(const Shape& shape, double value, TensorOptions opts = {},
            CallSite site = CallSite::current());
Tensor arange(double end, TensorOptions opts = TensorOptions{}.with_dtype(DType::int64),
              CallSite site = CallSite::current());
Tensor arange(double start, double end, double step = 1.0,
              TensorOptions opts = TensorOptions{}.with_dtype(DType::int64),
              CallSite site = CallSite::current());
Tensor rand(const Shape& shape, TensorOptions opts = {}, Generator* gen = nullptr,
            CallSite site = CallSite::current());
Tensor randn(const Shape& shape, TensorOptions opts = {}, Generator* gen = nullptr,
             CallSite site = CallSite::current());
Tensor randint(int64_t low, int64_t high, const Shape& shape,
               TensorOptions opts = TensorOptions{}.with_dtype(DType::int64),
               Generator* gen = nullptr, CallSite site = CallSite::current());
Tensor from_vector(const std::vector<double>& values, const Shape& shape, TensorOptions opts = {},
                   CallSite site = CallSite::current());
Tensor from_blob(void* data, const Shape& shape, TensorOptions opts = {});
Tensor tensor(std::initializer_list<double> values, TensorOptions opts = {},
              CallSite site = CallSite::current());  // 1-D
Tensor zeros_like(const Tensor& t, CallSite site = CallSite::current());
Tensor ones_like(const Tensor& t, CallSite site = CallSite::current());

// ---- elementwise ----
Tensor add(const Tensor& a, const Tensor& b, double alpha = 1.0,
           CallSite site = CallSite::current());
Tensor sub(const Tensor& a, const Tensor& b, double alpha = 1.0,
           CallSite site = CallSite::current());
Tensor mul(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());
Tensor div(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());
Tensor add(const Tensor& a, double b, CallSite site = CallSite::current());
Tensor mul(const Tensor& a, double b, CallSite site = CallSite::current());
Tensor div(const Tensor& a, double b, CallSite site = CallSite::current());
Tensor pow(const Tensor& a, double exponent, CallSite site = CallSite::current());
Tensor pow(const Tensor& a, const Tensor& exponent, CallSite site = CallSite::current());
Tensor neg(const Tensor& a, CallSite site = CallSite::current());
Tensor exp(const Tensor& a, CallSite site = CallSite::current());
Tensor log(const Tensor& a, CallSite site = CallSite::current());
Tensor sqrt(const Tensor& a, CallSite site = CallSite::current());
Tensor rsqrt(const Tensor& a, CallSite site = CallSite::current());
Tensor abs(const Tensor& a, CallSite site = CallSite::current());
Tensor square(const Tensor& a, CallSite site = CallSite::current());
Tensor sin(const Tensor& a, CallSite site = CallSite::current());
Tensor cos(const Tensor& a, CallSite site = CallSite::current());
Tensor erf(const Tensor& a, CallSite site = CallSite::current());
// torch.lerp: input + weight * (end - input), broadcasting; gradients flow to all three.
Tensor lerp(const Tensor& input, const Tensor& end, const Tensor& weight,
            CallSite site = CallSite::current());
Tensor lerp(const Tensor& input, const Tensor& end, double weight,
            CallSite site = CallSite::current());
Tensor maximum(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());
Tensor minimum(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());
Tensor clamp(const Tensor& a, std::optional<double> min, std::optional<double> max,
             CallSite site = CallSite::current());
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b,
             CallSite site = CallSite::current());
Tensor masked_fill(const Tensor& a, const Tensor& mask, double value,
                   CallSite site = CallSite::current());
// comparisons (bool results, no gradient)
Tensor eq(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());
Tensor ne(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());
Tensor lt(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());
Tensor gt(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());
Tensor le(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());
Tensor ge(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());

// ---- activations ----
Tensor relu(const Tensor& x, CallSite site = CallSite::current());
// relu(a + b) in one pass (broadcasting; PyTorch's aten::_add_relu), saving only its output:
// a residual block's sum and activation. The sum never exists on its own, so the block holds
// one buffer fewer than add then relu at its peak, and reads and writes its output once.
Tensor add_relu(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());
// The same, written over a's buffer when the caller gives `a` up (std::move) and nothing else
// holds it: no handle, view or saved reference (PyTorch's torchvision block writes
// `out += identity; relu_(out)` in place). The block then holds one buffer where the sum and
// its input were two. `a` is left empty.
Tensor add_relu(Tensor&& a, const Tensor& b, CallSite site = CallSite::current());
Tensor gelu(const Tensor& x, const std::string& approximate = "none",
            CallSite site = CallSite::current());  // "none" | "tanh"
Tensor silu(const Tensor& x, CallSite site = CallSite::current());
// silu(a) * b in one pass (broadcasting): a SwiGLU's gate and up projection. Saves a and b
// only, where silu then mul would also keep silu(a); the backward is three passes.
Tensor silu_mul(const Tensor& a, const Tensor& b, CallSite site = CallSite::current());
Tensor sigmoid(const Tensor& x, CallSite site = CallSite::current());
Tensor tanh(const Tensor& x, CallSite site = CallSite::current());
// Inverted dropout: zero with probability p, scale the rest by 1/(1-p); identity if !train.
Tensor dropout(const Tensor& x, double p, bool train = true, Generator* gen = nullptr,
               CallSite site = CallSite::current());

// ---- reductions ----
// dtype: the result's dtype, as torch.sum's (the gradient comes back in x's dtype).
Tensor sum(const Tensor& x, const Shape& dims = {}, bool keepdim = false,
           std::optional<DType> dtype = std::nullopt, CallSite site = CallSite::current());
Tensor mean(const Tensor& x, const Shape& dims = {}, bool keepdim = false,
            CallSite site = CallSite::current());

// ---- operators ----
Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator/(double a, const Tensor& b);

}  // namespace tally
