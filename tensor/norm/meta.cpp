// Meta kernels of the norm family (tensor/meta/target.h). The CPU kernels allocate nothing;
// the CUDA kernels' partial sums are sized by tensor/norm/launch.h, which the CUDA launchers
// use too: layer_norm_backward's dweight/dbias partials, batch_norm's per-channel split sums
// and the training backward's coefficients, group_norm_backward's per-(sample, channel) sums.
#include "tensor/meta/target.h"
#include "tensor/norm/kernels.h"
#include "tensor/norm/launch.h"
#include "tensor/norm/ops.h"

namespace tally::meta {

namespace {

void layer_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                         const Tensor& weight, int64_t rows, int64_t cols, const Tensor& dx_add,
                         const Tensor& dx_low) {
  cost(x, 0, tensor_bytes(dx, dweight, dbias, dy, x, mean, rstd, weight, dx_add, dx_low));
  const bool params = dweight.defined() || dbias.defined();
  if (!replays_cuda(x) || (!dx.defined() && !params) || !params || cols <= 0 || rows <= 0) return;
  const int64_t parts = norm_launch::layer_norm_backward_parts(rows, cols, target(x).sm_count);
  alloc_scratch(parts * 2 * cols, ops::norm_stat_dtype(x.dtype()), x.device());
}

void batch_norm_stats(const Tensor& mean, const Tensor& var, const Tensor& invstd, const Tensor& x,
                      double /*eps*/, const Tensor& running_mean, const Tensor& running_var,
                      double /*momentum*/) {
  cost(x, 0,
       tensor_bytes(mean, var, invstd, x, running_mean, running_var, running_mean, running_var));
  const NCS d = ncs(x);
  if (!replays_cuda(x) || d.c == 0) return;
  const int splits = bn_channels_last(x)
                         ? norm_launch::bn_splits_nhwc(d.c, d.n * d.s, target(x).sm_count)
                         : norm_launch::bn_splits(d.c, d.n * d.s, target(x).sm_count);
  alloc_scratch(d.c * splits * 2, DType::float64, x.device());
}

void batch_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& mean,
                         const Tensor& invstd, const Tensor& weight, bool training) {
  // Two passes over dy and x (the sums, then dx).
  cost(dy, 0, tensor_bytes(dx, dweight, dbias, dy, x, mean, invstd, weight) + tensor_bytes(dy, x));
  const NCS d = ncs(dy);
  if (!replays_cuda(dy) || d.c == 0 || (!dx.defined() && !dweight.defined() && !dbias.defined()))
    return;
  const bool need_xhat = dweight.defined() || (dx.defined() && training);
  if (!dbias.defined() && !need_xhat) return;
  const int splits = bn_channels_last(dy)
                         ? norm_launch::bn_splits_nhwc(d.c, d.n * d.s, target(dy).sm_count)
                         : norm_launch::bn_splits(d.c, d.n * d.s, target(dy).sm_count);
  const Tensor part = alloc_scratch(d.c * splits * 2, DType::float64, dy.device());
  if (dx.defined() && training)
    alloc_scratch(d.c * 2, ops::norm_stat_dtype(dy.dtype()), dy.device());
}

void group_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                         const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                         const Tensor& weight, int64_t /*groups*/) {
  // The sums read dy and x, the dx pass reads them again (a row at a time, from the cache).
  cost(x, 0, tensor_bytes(dx, dweight, dbias, dy, x, mean, rstd, weight));
  if (!replays_cuda(x) || (!dweight.defined() && !dbias.defined())) return;
  const NCS d = ncs(x);
  if (d.n * d.c == 0) return;
  alloc_scratch(norm_launch::group_norm_backward_partials(d.n, d.c),
                ops::norm_stat_dtype(x.dtype()), x.device());
}

}  // namespace

const NormKernels norm_kernels{.layer_norm = nothing,
                               .layer_norm_backward = &layer_norm_backward,
                               .batch_norm_stats = &batch_norm_stats,
                               .batch_norm_elemt = nothing,
                               .batch_norm_backward = &batch_norm_backward,
                               .group_norm = nothing,
                               .group_norm_backward = &group_norm_backward};

}  // namespace tally::meta
