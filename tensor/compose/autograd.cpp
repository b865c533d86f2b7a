// Ops composed of other ops: tril/triu, repeat, pad, one_hot, norm, einsum.
#include "tensor/compose/autograd.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>

#include "autograd/node.h"
#include "base/checked.h"
#include "memory/context.h"

namespace tally {

using autograd::BackwardContext;
using autograd::record;
namespace o = ops;

namespace {

// Where the last two dims' column minus row compares with `diagonal` as `cmp`: the elements
// tril (gt) or triu (lt) zeroes, as a bool [rows, cols] mask.
Tensor triangle_mask(const Tensor& x, int64_t diagonal, o::BinaryOp cmp, const char* op) {
  if (x.dim() < 2)
    throw std::invalid_argument(
        fmt::format("{}: input must have at least 2 dims, got {}", op, x.shape_string()));
  const int64_t n = x.size(-2), m = x.size(-1);
  const Tensor rows =
      o::view(o::arange(0, static_cast<double>(n), 1, DType::int64, x.device()), {n, 1});
  const Tensor cols = o::arange(0, static_cast<double>(m), 1, DType::int64, x.device());
  return o::binary_scalar(cmp, o::sub(cols, rows), static_cast<double>(diagonal));
}

}  // namespace

Tensor tril(const Tensor& x, int64_t diagonal, CallSite site) {
  memory::CallSiteScope call_site(site);
  return masked_fill(x, triangle_mask(x, diagonal, o::BinaryOp::gt, "tril"), 0.0);
}

Tensor triu(const Tensor& x, int64_t diagonal, CallSite site) {
  memory::CallSiteScope call_site(site);
  return masked_fill(x, triangle_mask(x, diagonal, o::BinaryOp::lt, "triu"), 0.0);
}

Tensor repeat(const Tensor& x, const Shape& sizes, CallSite site) {
  memory::CallSiteScope call_site(site);
  const auto r = static_cast<int64_t>(sizes.size());
  if (r < x.dim())
    throw std::invalid_argument(
        fmt::format("repeat: the number of repeats {} can not be smaller than the input's dims {}",
                    shape_str(sizes), x.shape_string()));
  Shape padded(static_cast<size_t>(r - x.dim()), 1);
  padded.insert(padded.end(), x.sizes().begin(), x.sizes().end());
  Shape split, tiled, out;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] < 0)
      throw std::invalid_argument(
          fmt::format("repeat: repeats must be non-negative, got {}", shape_str(sizes)));
    split.insert(split.end(), {1, padded[d]});
    tiled.insert(tiled.end(), {sizes[d], padded[d]});
    out.push_back(base::checked_mul(sizes[d], padded[d], "repeat"));
  }
  return x.reshape(split).expand(tiled).reshape(out);
}

namespace {

// The constant pad of x (no autograd): a tensor filled with value, x's kept part copied in.
Tensor constant_pad(const Tensor& x, const Shape& pad, double value) {
  Shape sizes = x.sizes();
  Tensor src = x;
  Shape starts(sizes.size(), 0);
  for (size_t i = 0; i < pad.size() / 2; ++i) {
    const auto d = sizes.size() - 1 - i;
    const int64_t l = pad[2 * i], r = pad[2 * i + 1], n = x.sizes()[d];
    const int64_t size = base::checked_add(base::checked_add(n, l, "pad"), r, "pad");
    if (size < 0)
      throw std::invalid_argument(
          fmt::format("pad: the padded size of dim {} is negative ({} + {} + {}), input {}", d, n,
                      l, r, x.shape_string()));
    sizes[d] = size;
    const int64_t keep =
        std::max<int64_t>(0, n - std::max<int64_t>(0, -l) - std::max<int64_t>(0, -r));
    src = o::narrow(src, static_cast<int64_t>(d), std::min(std::max<int64_t>(0, -l), n), keep);
    starts[d] = std::max<int64_t>(0, l);
  }
  Tensor out = o::full(sizes, value, x.dtype(), x.device());
  if (src.numel() == 0) return out;
  Tensor dst = out;
  for (size_t d = 0; d < sizes.size(); ++d)
    dst = o::narrow(dst, static_cast<int64_t>(d), starts[d], src.sizes()[d]);
  o::copy_(dst, src);
  return out;
}

}  // namespace

Tensor pad(const Tensor& x, const Shape& pad, const std::string& mode, double value,
           CallSite site) {
  memory::CallSiteScope call_site(site);
  if (pad.size() % 2 != 0 || static_cast<int64_t>(pad.size() / 2) > x.dim())
    throw std::invalid_argument(
        fmt::format("pad: the pad {} must hold (left, right) pairs for at most the input's {} dims",
                    shape_str(pad), x.dim()));
  if (mode == "constant") {
    Tensor out = constant_pad(x, pad, value);
    Shape back;
    for (int64_t p : pad) back.push_back(-p);
    record("ConstantPadNdBackward", {x}, {out}, {},
           [back](BackwardContext&, const TensorList& g) -> TensorList {
             return {constant_pad(g[0], back, 0.0)};
           });
    return out;
  }
  if (mode != "reflect")
    throw std::invalid_argument(
        fmt::format("pad: mode '{}' is not supported (constant and reflect are)", mode));
  Tensor out = x;
  for (size_t i = 0; i < pad.size() / 2; ++i) {
    const int64_t d = x.dim() - 1 - static_cast<int64_t>(i);
    const int64_t l = pad[2 * i], r = pad[2 * i + 1], n = x.size(d);
    if (l < 0 || r < 0 || l >= n || r >= n)
      throw std::invalid_argument(
          fmt::format("pad: reflect padding ({}, {}) of dim {} must be in [0, {}) (input {})", l, r,
                      d, n, x.shape_string()));
    if (l == 0 && r == 0) continue;
    std::vector<double> idx;
    for (int64_t j = -l; j < n + r; ++j)
      idx.push_back(static_cast<double>(j < 0 ? -j : j >= n ? 2 * (n - 1) - j : j));
    const Tensor index =
        o::from_vector(idx, {static_cast<int64_t>(idx.size())}, DType::int64, x.device());
    out = index_select(out, d, index);
  }
  return out;
}

Tensor one_hot(const Tensor& x, int64_t num_classes, CallSite site) {
  memory::CallSiteScope call_site(site);
  if (x.dtype() != DType::int64)
    throw std::invalid_argument(
        fmt::format("one_hot: the input must be an int64 tensor, got {}", dtype_name(x.dtype())));
  if (num_classes < 0) {
    if (x.numel() == 0)
      throw std::invalid_argument("one_hot: cannot infer num_classes from an empty tensor");
    num_classes = static_cast<int64_t>(o::item(o::amax(x))) + 1;
  }
  if (x.device().type == DeviceType::cpu && x.numel() > 0) {
    const auto lo = static_cast<int64_t>(o::item(o::amin(x)));
    const auto hi = static_cast<int64_t>(o::item(o::amax(x)));
    if (lo < 0 || hi >= num_classes)
      throw std::invalid_argument(fmt::format(
          "one_hot: class values must be in [0, {}), got values in [{}, {}]", num_classes, lo, hi));
  }
  const Tensor classes =
      o::arange(0, static_cast<double>(num_classes), 1, DType::int64, x.device());
  return o::to(o::binary(o::BinaryOp::eq, o::unsqueeze(x, -1), classes), DType::int64);
}

namespace {

// A reduction's result over `dims` (wrapped, sorted; empty = all) broadcast back to `shape`.
Tensor unreduce(const Tensor& r, const Shape& shape, const Shape& dims, bool keepdim) {
  Tensor k = r;
  if (!keepdim) {
    if (dims.empty())
      k = o::reshape(r, Shape(shape.size(), 1));
    else
      for (int64_t d : dims) k = o::unsqueeze(k, d);
  }
  return o::expand(k, shape);
}

}  // namespace

Tensor norm(const Tensor& x, double p, const Shape& dims, bool keepdim, CallSite site) {
  memory::CallSiteScope call_site(site);
  if (!is_floating(x.dtype()))
    throw std::invalid_argument(fmt::format("norm: the input must be floating, got {} {}",
                                            dtype_name(x.dtype()), x.shape_string()));
  Shape ds;
  for (int64_t d : dims) ds.push_back(o::wrap_dim(d, std::max<int64_t>(x.dim(), 1), "norm"));
  std::sort(ds.begin(), ds.end());
  if (x.dim() == 0) ds.clear();
  if (std::isinf(p)) return p > 0 ? amax(abs(x), ds, keepdim) : amin(abs(x), ds, keepdim);
  if (p == 0) {
    NoGradGuard ng;
    return o::sum(o::to(o::binary_scalar(o::BinaryOp::ne, x, 0.0), x.dtype()), ds, keepdim);
  }
  if (p == 1) return sum(abs(x), ds, keepdim);
  const Tensor a = o::unary(o::UnaryOp::abs, x);
  Tensor out = p == 2 ? o::unary(o::UnaryOp::sqrt, o::sum(o::mul(x, x), ds, keepdim))
                      : o::binary_scalar(
                            o::BinaryOp::pow,
                            o::sum(o::binary_scalar(o::BinaryOp::pow, a, p), ds, keepdim), 1.0 / p);
  record("NormBackward", {x}, {out}, {x, out},
         [p, ds, keepdim](BackwardContext& ctx, const TensorList& g) -> TensorList {
           const Tensor& xs = ctx.saved(0);
           const Tensor n = unreduce(ctx.saved(1), xs.sizes(), ds, keepdim);
           const Tensor gx = unreduce(g[0], xs.sizes(), ds, keepdim);
           // d/dx (sum |x|^p)^(1/p) = sign(x) |x|^(p-1) / norm^(p-1); 0 where the norm is 0.
           Tensor num = p == 2 ? xs
                               : o::mul(o::unary(o::UnaryOp::sign, xs),
                                        o::binary_scalar(o::BinaryOp::pow,
                                                         o::unary(o::UnaryOp::abs, xs), p - 1));
           Tensor den = p == 2 ? n : o::binary_scalar(o::BinaryOp::pow, n, p - 1);
           Tensor scale = o::div(num, den);
           scale = o::masked_fill(scale, o::binary_scalar(o::BinaryOp::eq, n, 0.0), 0.0);
           return {o::mul(scale, gx)};
         });
  return out;
}

namespace {

[[noreturn]] void einsum_error(const std::string& eq, const std::string& why) {
  throw std::invalid_argument(fmt::format("einsum('{}'): {}", eq, why));
}

}  // namespace

Tensor einsum(const std::string& equation, const TensorList& operands, CallSite site) {
  memory::CallSiteScope call_site(site);
  std::string eq;
  for (char c : equation)
    if (c != ' ') eq += c;
  if (eq.find("...") != std::string::npos) einsum_error(equation, "'...' is not supported");
  const auto arrow = eq.find("->");
  const std::string lhs = eq.substr(0, arrow);
  std::vector<std::string> ins;
  for (size_t s = 0;;) {
    const auto c = lhs.find(',', s);
    ins.push_back(lhs.substr(s, c == std::string::npos ? std::string::npos : c - s));
    if (c == std::string::npos) break;
    s = c + 1;
  }
  if (ins.size() != operands.size())
    einsum_error(equation, fmt::format("{} operand(s) in the equation, {} given", ins.size(),
                                       operands.size()));
  if (ins.size() > 2)
    einsum_error(equation, "more than two operands are not supported (contract them pairwise)");
  std::map<char, int64_t> size, count;
  for (size_t k = 0; k < ins.size(); ++k) {
    const std::string& s = ins[k];
    if (static_cast<int64_t>(s.size()) != operands[k].dim())
      einsum_error(equation, fmt::format("operand {} has {} dims, the subscripts '{}' name {}", k,
                                         operands[k].dim(), s, s.size()));
    for (size_t i = 0; i < s.size(); ++i) {
      const char c = s[i];
      if (!std::isalpha(static_cast<unsigned char>(c)))
        einsum_error(equation, fmt::format("subscript '{}' is not a letter", c));
      if (s.find(c) != i)
        einsum_error(equation,
                     fmt::format("repeated subscript '{}' in one operand (a diagonal) is not "
                                 "supported",
                                 c));
      const int64_t n = operands[k].sizes()[i];
      if (size.count(c) && size[c] != n)
        einsum_error(equation, fmt::format("subscript '{}' has sizes {} and {}", c, size[c], n));
      size[c] = n;
      ++count[c];
    }
  }
  std::string out;
  if (arrow != std::string::npos) {
    out = eq.substr(arrow + 2);
    for (size_t i = 0; i < out.size(); ++i)
      if (!size.count(out[i]) || out.find(out[i]) != i)
        einsum_error(equation,
                     fmt::format("output subscript '{}' is not an input's, or repeats", out[i]));
  } else {
    for (auto [c, n] : count)
      if (n == 1) out += c;  // implicit: the letters used once, alphabetically
  }
  auto in_out = [&](char c) { return out.find(c) != std::string::npos; };
  // Sum away each operand's letters that neither the output nor the other operand has.
  std::vector<Tensor> ts(operands.begin(), operands.end());
  for (size_t k = 0; k < ins.size(); ++k) {
    std::string kept;
    Shape gone;
    for (size_t i = 0; i < ins[k].size(); ++i) {
      const char c = ins[k][i];
      if (!in_out(c) && count[c] == 1)
        gone.push_back(static_cast<int64_t>(i));
      else
        kept += c;
    }
    if (!gone.empty()) ts[k] = sum(ts[k], gone);
    ins[k] = kept;
  }
  auto permute_to = [&](const Tensor& t, const std::string& from, const std::string& to) {
    Shape perm;
    for (char c : to) perm.push_back(static_cast<int64_t>(from.find(c)));
    return t.permute(perm);
  };
  if (ins.size() == 1) return permute_to(ts[0], ins[0], out);
  // Two operands: batch (both, output), left (A, output), right (B, output), contracted.
  std::string batch, left, right, con;
  for (char c : ins[0]) {
    const bool in_b = ins[1].find(c) != std::string::npos;
    (in_b ? (in_out(c) ? batch : con) : left) += c;
  }
  for (char c : ins[1])
    if (ins[0].find(c) == std::string::npos) right += c;
  auto prod = [&](const std::string& s) {
    int64_t n = 1;
    for (char c : s) n *= size[c];
    return n;
  };
  const Tensor a =
      permute_to(ts[0], ins[0], batch + left + con).reshape({prod(batch), prod(left), prod(con)});
  const Tensor b =
      permute_to(ts[1], ins[1], batch + con + right).reshape({prod(batch), prod(con), prod(right)});
  Shape rs;
  for (char c : batch + left + right) rs.push_back(size[c]);
  return permute_to(bmm(a, b).reshape(rs), batch + left + right, out);
}

}  // namespace tally
