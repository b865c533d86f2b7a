// Raw linear-algebra ops: argument checks, shape logic (1-D promotion, batch
// broadcasting, folding batches into one GEMM), output allocation and the dispatch into
// kernels. Operands reach the kernel in a BLAS-readable layout: transposed views go as
// they are (the kernel passes a transpose flag), other layouts are made contiguous here.
#include "tensor/linalg/ops.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>

#include "base/checked.h"
#include "tensor/dispatch.h"
#include "tensor/elementwise/kernels.h"
#include "tensor/linalg/kernels.h"
#include "tensor/op_alloc.h"

namespace tally::ops {

namespace {

Shape batch_of(const Tensor& t) {
  return Shape(t.sizes().begin(), t.sizes().end() - 2);
}

void check_pair(const char* op, const Tensor& a, const Tensor& b) {
  check_same_device(op, a.device(), b.device());
  if (a.dtype() != b.dtype())
    throw std::invalid_argument(fmt::format(
        "{}: expected both operands to have the same dtype, got "
        "{} {} and {} {}",
        op, dtype_name(a.dtype()), a.shape_string(), dtype_name(b.dtype()), b.shape_string()));
  if (!is_floating(a.dtype()))
    throw std::invalid_argument(
        fmt::format("{}: expected floating operands, got {} (shapes {} "
                    "and {})",
                    op, dtype_name(a.dtype()), a.shape_string(), b.shape_string()));
}

Tensor blas_ready(const Tensor& t) {
  return blas_layout(t) ? t : contiguous(t);
}

// a [batch_a..., M, K] @ b [batch_b..., K, N] -> [broadcast batch..., M, N] (contiguous).
// sa and sb are the user's shapes, for messages.
Tensor product(const OpInfo& info, const Tensor& a, const Tensor& b, const Shape& sa,
               const Shape& sb) {
  const int64_t M = a.size(-2), K = a.size(-1), K2 = b.size(-2), N = b.size(-1);
  if (K != K2)
    throw std::invalid_argument(
        fmt::format("{}: shapes {} and {} cannot be multiplied ({}x{} and "
                    "{}x{})",
                    info.name, shape_str(sa), shape_str(sb), M, K, K2, N));
  const Shape ba = batch_of(a), bb = batch_of(b);
  Shape batch(std::max(ba.size(), bb.size()));
  for (size_t i = 0; i < batch.size(); ++i) {
    const size_t n = batch.size();
    const int64_t x = i < n - ba.size() ? 1 : ba[i - (n - ba.size())];
    const int64_t y = i < n - bb.size() ? 1 : bb[i - (n - bb.size())];
    if (x != y && x != 1 && y != 1)
      throw std::invalid_argument(
          fmt::format("{}: batch dimensions of {} and {} cannot be "
                      "broadcast together ({} and {})",
                      info.name, shape_str(sa), shape_str(sb), shape_str(ba), shape_str(bb)));
    batch[i] = x == 1 ? y : x;
  }
  Shape out_shape = batch;
  out_shape.push_back(M);
  out_shape.push_back(N);
  if (bb.empty() && !ba.empty()) {
    // A batch of matrices times one matrix: fold the batch into the rows, one GEMM.
    const int64_t rows = base::checked_mul(shape_numel(ba), M, info.name);
    const Tensor a2 = reshape(a, {rows, K});  // a view unless a's layout forbids it
    Tensor out = alloc_output({rows, N}, a.dtype(), a.device());
    linalg_backends.get(info, a.device(), &LinalgKernels::matmul)(out, blas_ready(a2),
                                                                  blas_ready(b), false);
    return view(out, out_shape);
  }
  Tensor out = alloc_output(out_shape, a.dtype(), a.device());
  linalg_backends.get(info, a.device(), &LinalgKernels::matmul)(out, blas_ready(a), blas_ready(b),
                                                                false);
  return out;
}

}  // namespace

std::optional<MatrixLayout> blas_layout(const Tensor& t) {
  if (t.dim() < 2) return std::nullopt;
  const int64_t rows = t.size(-2), cols = t.size(-1), rs = t.stride(-2), cs = t.stride(-1);
  if (cols == 1 || cs == 1) {  // row-major: rows ld apart
    const int64_t ld = rows == 1 ? std::max<int64_t>(cols, 1) : rs;
    if (ld >= std::max<int64_t>(cols, 1) && ld <= INT_MAX) return MatrixLayout{false, ld};
  }
  if (rows == 1 || rs == 1) {  // the transpose of a row-major matrix: columns ld apart
    const int64_t ld = cols == 1 ? std::max<int64_t>(rows, 1) : cs;
    if (ld >= std::max<int64_t>(rows, 1) && ld <= INT_MAX) return MatrixLayout{true, ld};
  }
  return std::nullopt;
}

GemmOperand gemm_operand(const Tensor& t, const Shape& batch, const char* kernel,
                         const char* what) {
  const auto layout = blas_layout(t);
  if (!layout)
    throw std::logic_error(fmt::format("{}: operand {} of shape {} strides {} is not BLAS-readable",
                                       kernel, what, t.shape_string(), shape_str(t.strides())));
  GemmOperand op;
  static_cast<MatrixLayout&>(op) = *layout;
  const int64_t rank = static_cast<int64_t>(batch.size());
  const int64_t own = t.dim() - 2;
  op.batch_strides.assign(batch.size(), 0);
  for (int64_t i = 0; i < own; ++i) {
    const int64_t j = rank - own + i;
    if (j >= 0 && t.size(i) != 1) op.batch_strides[static_cast<size_t>(j)] = t.stride(i);
  }
  return op;
}

Tensor matmul(const Tensor& a, const Tensor& b) {
  static const OpInfo info("matmul");
  if (a.dim() == 0 || b.dim() == 0)
    throw std::invalid_argument(
        fmt::format("matmul: both arguments need to be at least 1-D, got "
                    "shapes {} and {}",
                    a.shape_string(), b.shape_string()));
  check_pair(info.name, a, b);
  DispatchScope scope(info, a, b);
  const Tensor ap = a.dim() == 1 ? unsqueeze(a, 0) : a;
  const Tensor bp = b.dim() == 1 ? unsqueeze(b, 1) : b;
  const Tensor out = product(info, ap, bp, a.sizes(), b.sizes());
  if (a.dim() > 1 && b.dim() > 1) return out;
  // Drop the dimensions the 1-D promotion added.
  Shape shape(out.sizes().begin(), out.sizes().end() - 2);
  if (a.dim() > 1) shape.push_back(out.size(-2));
  if (b.dim() > 1) shape.push_back(out.size(-1));
  return view(out, shape);
}

namespace {
// linear's and embedding's weight: 2-D, with the dims `dims` names.
void check_matrix(const char* op, const Tensor& weight, const char* dims) {
  if (weight.dim() != 2)
    throw std::invalid_argument(
        fmt::format("{}: weight must be 2-D {}, got shape {}", op, dims, weight.shape_string()));
}

// mm and bmm: two `dims`-D operands (bmm's with the same batch size), no promotion.
Tensor product_of_rank(const OpInfo& info, const Tensor& a, const Tensor& b, int64_t dims) {
  if (a.dim() != dims || b.dim() != dims)
    throw std::invalid_argument(fmt::format("{}: expected two {}-D tensors, got shapes {} and {}",
                                            info.name, dims, a.shape_string(), b.shape_string()));
  if (dims == 3 && a.size(0) != b.size(0))
    throw std::invalid_argument(
        fmt::format("{}: batch sizes differ: shapes {} and {} (bmm does "
                    "not broadcast; use matmul)",
                    info.name, a.shape_string(), b.shape_string()));
  check_pair(info.name, a, b);
  DispatchScope scope(info, a, b);
  return product(info, a, b, a.sizes(), b.sizes());
}
}  // namespace

Tensor mm(const Tensor& a, const Tensor& b) {
  static const OpInfo info("mm");
  return product_of_rank(info, a, b, 2);
}

Tensor bmm(const Tensor& a, const Tensor& b) {
  static const OpInfo info("bmm");
  return product_of_rank(info, a, b, 3);
}

void mm_out(const Tensor& out, const Tensor& a, const Tensor& b, bool accumulate) {
  static const OpInfo info("mm");
  const char* op = "mm_out";
  if (!out.defined() || !a.defined() || !b.defined())
    throw std::invalid_argument(fmt::format("{}: out, a and b must all be defined", op));
  if (a.dim() != 2 || b.dim() != 2)
    throw std::invalid_argument(fmt::format("{}: expected two 2-D tensors, got shapes {} and {}",
                                            op, a.shape_string(), b.shape_string()));
  check_pair(op, a, b);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  if (b.size(0) != K)
    throw std::invalid_argument(
        fmt::format("{}: shapes {} and {} cannot be multiplied ({}x{} and {}x{})", op,
                    a.shape_string(), b.shape_string(), M, K, b.size(0), N));
  const std::string shapes =
      fmt::format("out {} strides {}, a {}, b {}", out.shape_string(), shape_str(out.strides()),
                  a.shape_string(), b.shape_string());
  if (out.dim() != 2 || out.size(0) != M || out.size(1) != N)
    throw std::invalid_argument(
        fmt::format("{}: out must have shape [{}, {}] ({})", op, M, N, shapes));
  const bool widened = out.dtype() == DType::float32 &&
                       (a.dtype() == DType::float16 || a.dtype() == DType::bfloat16);
  if (out.dtype() != a.dtype() && !widened)
    throw std::invalid_argument(fmt::format(
        "{}: out must have the operands' dtype {}{}, got {} ({})", op, dtype_name(a.dtype()),
        a.dtype() == DType::float16 || a.dtype() == DType::bfloat16 ? " or float32" : "",
        dtype_name(out.dtype()), shapes));
  check_same_device(op, out.device(), a.device());
  if ((N > 1 && out.stride(1) != 1) || (M > 1 && (out.stride(0) < N || out.stride(0) > INT_MAX)))
    throw std::invalid_argument(fmt::format(
        "{}: out must have unit column stride and rows at least {} (and at most {}) elements "
        "apart ({})",
        op, N, INT_MAX, shapes));
  if (out.numel() > 0 && ((a.numel() > 0 && out.storage().data() == a.storage().data()) ||
                          (b.numel() > 0 && out.storage().data() == b.storage().data())))
    throw std::invalid_argument(
        fmt::format("{}: out must not share storage with a or b ({})", op, shapes));
  DispatchScope scope(info, a, b);
  linalg_backends.get(info, a.device(), &LinalgKernels::matmul)(out, blas_ready(a), blas_ready(b),
                                                                accumulate);
}

namespace {
// linear's (and linear_gelu's) argument checks, naming `op`.
void check_linear(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  check_matrix(op, weight, "[out_features, in_features]");
  if (x.dim() == 0 || x.size(-1) != weight.size(1))
    throw std::invalid_argument(fmt::format("{}: input {} has {} features but weight {} expects {}",
                                            op, x.shape_string(), x.dim() ? x.size(-1) : 0,
                                            weight.shape_string(), weight.size(1)));
  check_pair(op, x, weight);
  if (bias.defined()) {
    if (bias.dim() != 1 || bias.size(0) != weight.size(0))
      throw std::invalid_argument(fmt::format("{}: bias must have shape [{}] for weight {}, got {}",
                                              op, weight.size(0), weight.shape_string(),
                                              bias.shape_string()));
    check_pair(op, x, bias);
  }
}

// x as a matrix [rows, in_features] (a view unless x forbids it); `lead` gets x's leading dims.
Tensor as_rows(const Tensor& x, Shape& lead) {
  lead.assign(x.sizes().begin(), x.sizes().end() - 1);
  return x.dim() == 2 ? x : reshape(x, {shape_numel(lead), x.size(-1)});
}

// out = x2 @ wt (+ bias): the linear kernel with a bias, the plain product without.
void linear_product(const OpInfo& info, const Tensor& out, const Tensor& x2, const Tensor& wt,
                    const Tensor& bias) {
  if (bias.defined())
    linalg_backends.get(info, out.device(), &LinalgKernels::linear)(out, x2, wt, bias);
  else
    linalg_backends.get(info, out.device(), &LinalgKernels::matmul)(out, x2, wt, false);
}
}  // namespace

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  static const OpInfo info("linear");
  check_linear(info.name, x, weight, bias);
  DispatchScope scope(info, x, weight, bias);
  Shape shape;
  const Tensor x2 = as_rows(x, shape);
  Tensor out = alloc_output({x2.size(0), weight.size(0)}, x.dtype(), x.device());
  linear_product(info, out, blas_ready(x2), blas_ready(transpose(weight, 0, 1)), bias);
  shape.push_back(weight.size(0));
  return view(out, shape);
}

std::pair<Tensor, Tensor> linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  static const OpInfo info("linear_gelu");
  check_linear(info.name, x, weight, bias);
  const int64_t out_f = weight.size(0);
  DispatchScope scope(info, x, weight, bias);
  Shape shape;
  const Tensor x2 = blas_ready(as_rows(x, shape));
  const Tensor wt = blas_ready(transpose(weight, 0, 1));
  // The GELU's input first, then its output: the order linear and gelu allocate them in.
  Tensor pre = alloc_output({x2.size(0), out_f}, x.dtype(), x.device());
  Tensor out = alloc_output({x2.size(0), out_f}, x.dtype(), x.device());
  if (!linalg_backends.get(info, x.device(), &LinalgKernels::linear_gelu)(out, pre, x2, wt, bias)) {
    linear_product(info, pre, x2, wt, bias);
    elementwise_backends.get(info, x.device(), &ElementwiseKernels::unary)(UnaryOp::gelu_tanh, out,
                                                                           pre);
  }
  shape.push_back(out_f);
  return {view(out, shape), view(pre, shape)};
}

Tensor mm_dgelu(const Tensor& a, const Tensor& b, const Tensor& pre) {
  static const OpInfo info("mm_dgelu");
  if (!a.defined() || !b.defined() || !pre.defined())
    throw std::invalid_argument("mm_dgelu: a, b and pre must all be defined");
  if (a.dim() != 2 || b.dim() != 2 || pre.dim() != 2)
    throw std::invalid_argument(
        fmt::format("mm_dgelu: expected 2-D a, b and pre, got shapes {}, {} and {}",
                    a.shape_string(), b.shape_string(), pre.shape_string()));
  check_pair(info.name, a, b);
  check_pair(info.name, a, pre);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  if (b.size(0) != K || pre.size(0) != M || pre.size(1) != N)
    throw std::invalid_argument(
        fmt::format("mm_dgelu: a {} @ b {} does not fit pre {} (expected [{}, K] @ [K, {}] and "
                    "pre [{}, {}])",
                    a.shape_string(), b.shape_string(), pre.shape_string(), M, N, M, N));
  DispatchScope scope(info, a, b, pre);
  const Tensor pc = pre.is_contiguous() ? pre : contiguous(pre);
  const Tensor ar = blas_ready(a), br = blas_ready(b);
  Tensor out = alloc_output({M, N}, a.dtype(), a.device());
  if (!linalg_backends.get(info, a.device(), &LinalgKernels::matmul_dgelu)(out, ar, br, pc)) {
    linalg_backends.get(info, a.device(), &LinalgKernels::matmul)(out, ar, br, false);
    elementwise_backends.get(info, a.device(), &ElementwiseKernels::binary)(
        BinaryOp::gelu_tanh_backward, out, out, pc);
  }
  return out;
}

std::tuple<Tensor, Tensor, Tensor> linear_backward(const Tensor& input, const Tensor& grad_output,
                                                   const Tensor& weight,
                                                   std::array<bool, 3> output_mask,
                                                   std::optional<DType> weight_grad_dtype) {
  static const OpInfo info("linear_backward");
  if (!input.defined() || !grad_output.defined() || (output_mask[0] && !weight.defined()))
    throw std::invalid_argument(
        "linear_backward: input and grad_output must be defined, and weight too for "
        "grad_input");
  if (weight.defined()) check_matrix(info.name, weight, "[out_features, in_features]");
  if (input.dim() == 0 || grad_output.dim() == 0)
    throw std::invalid_argument(
        fmt::format("linear_backward: input {} and grad_output {} must have at least one dim",
                    input.shape_string(), grad_output.shape_string()));
  const int64_t out_f = grad_output.size(-1), in = input.size(-1);
  const bool fits =
      grad_output.dim() == input.dim() &&
      std::equal(input.sizes().begin(), input.sizes().end() - 1, grad_output.sizes().begin()) &&
      (!weight.defined() || (weight.size(0) == out_f && weight.size(1) == in));
  if (!fits)
    throw std::invalid_argument(
        fmt::format("linear_backward: input {} and grad_output {} do not fit weight {} (expected "
                    "[..., in_features] and [..., out_features] with the same leading dims)",
                    input.shape_string(), grad_output.shape_string(),
                    weight.defined() ? weight.shape_string() : std::string("(undefined)")));
  check_pair(info.name, input, grad_output);
  if (weight.defined()) check_pair(info.name, grad_output, weight);
  const DType gw_dtype = weight_grad_dtype.value_or(grad_output.dtype());
  const bool sixteen =
      grad_output.dtype() == DType::float16 || grad_output.dtype() == DType::bfloat16;
  if (gw_dtype != grad_output.dtype() && !(sixteen && gw_dtype == DType::float32))
    throw std::invalid_argument(fmt::format(
        "linear_backward: weight_grad_dtype {} must be grad_output's dtype {}{}",
        dtype_name(gw_dtype), dtype_name(grad_output.dtype()), sixteen ? " or float32" : ""));
  DispatchScope scope(info, input, grad_output, weight);
  const int64_t rows = shape_numel(Shape(input.sizes().begin(), input.sizes().end() - 1));
  const Tensor g2 = reshape(grad_output, {rows, out_f});  // a view unless g's layout forbids it
  Tensor gi, gw, gb;
  if (output_mask[0]) gi = reshape(mm(g2, weight), input.sizes());
  if (output_mask[1]) {
    gw = alloc_output({out_f, in}, gw_dtype, grad_output.device());
    linalg_backends.get(info, input.device(), &LinalgKernels::matmul)(
        gw, blas_ready(transpose(g2, 0, 1)), blas_ready(reshape(input, {rows, in})), false);
  }
  if (output_mask[2]) gb = sum(g2, {0});
  return {gi, gw, gb};
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  static const OpInfo info("embedding");
  check_matrix(info.name, weight, "[num_embeddings, embedding_dim]");
  if (indices.dtype() != DType::int64 && indices.dtype() != DType::int32)
    throw std::invalid_argument(
        fmt::format("embedding: indices must be int64 or int32, got {} "
                    "(shape {})",
                    dtype_name(indices.dtype()), indices.shape_string()));
  check_same_device(info.name, weight.device(), indices.device());
  DispatchScope scope(info, weight, indices);
  Shape shape = indices.sizes();
  shape.push_back(weight.size(1));
  Tensor out = alloc_output(shape, weight.dtype(), weight.device());
  linalg_backends.get(info, weight.device(), &LinalgKernels::embedding)(out, weight, indices);
  return out;
}

Tensor embedding_backward(const Tensor& grad, const Tensor& indices, int64_t num_weights,
                          int64_t padding_idx) {
  static const OpInfo info("embedding_backward");
  Shape expect = indices.sizes();
  expect.push_back(grad.dim() ? grad.size(-1) : 0);
  if (grad.dim() == 0 || grad.sizes() != expect)
    throw std::invalid_argument(
        fmt::format("embedding_backward: grad of shape {} does not match "
                    "indices {} + [embedding_dim]",
                    grad.shape_string(), indices.shape_string()));
  if (indices.dtype() != DType::int64 && indices.dtype() != DType::int32)
    throw std::invalid_argument(
        fmt::format("embedding_backward: indices must be int64 or int32, "
                    "got {}",
                    dtype_name(indices.dtype())));
  if (!is_floating(grad.dtype())) unsupported_dtype("embedding_backward", grad.dtype());
  if (padding_idx < -1 || padding_idx >= num_weights)
    throw std::invalid_argument(
        fmt::format("embedding_backward: padding_idx {} must be -1 (none) "
                    "or in [0, {})",
                    padding_idx, num_weights));
  check_same_device(info.name, grad.device(), indices.device());
  DispatchScope scope(info, grad, indices);
  const int64_t D = grad.size(-1);
  // 16-bit gradients accumulate in float32 (repeated indices sum many rows).
  const DType acc = grad.dtype() == DType::float64 ? DType::float64 : DType::float32;
  Tensor gw = alloc_output({num_weights, D}, acc, grad.device());
  fill_(gw, 0.0);
  const Tensor g2 = reshape(to(grad, acc), {indices.numel(), D});
  linalg_backends.get(info, grad.device(), &LinalgKernels::embedding_backward)(gw, g2, indices,
                                                                               padding_idx);
  return to(gw, grad.dtype());
}

}  // namespace tally::ops
