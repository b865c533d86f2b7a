// Meta kernels of the conv family (tensor/meta/target.h). CPU: each call's im2col column
// matrix of one plane (cpu::conv_col_scratch_numel), in the dtype the CPU kernel computes in.
// CUDA: the workspace of the call's cuDNN execution plan, which depends on the engine cuDNN's
// heuristics pick on the device: looked up in the target's table, recorded on that GPU
// (tensor/conv/workspaces_h200.inc and workspaces_h100.inc, written by bench/record_workspaces). A
// call the table has no row for counts no workspace and is noted (memory::note_unreplayed), so the
// report says what the prediction could not replay; a channels_last call without a channels_last
// row counts the NCHW call's workspace, noted too.
#include <fmt/format.h>

#include <algorithm>
#include <span>

#include "tensor/conv/kernels.h"
#include "tensor/conv/workspaces_h100.inc"
#include "tensor/conv/workspaces_h200.inc"
#include "tensor/meta/target.h"

namespace tally::meta {

namespace {

enum Kind : int { kForward = 0, kBackwardData = 1, kBackwardFilter = 2 };

std::span<const ConvWorkspace> table_of(const memory::MetaTarget& t) {
  if (t.workspace_tables == "h200") return kConvWorkspacesH200;
  if (t.workspace_tables == "h100") return kConvWorkspacesH100;
  return {};
}

// x [N, C, H, W], w [O, C/g, kH, kW], y [N, O, OH, OW] of the call, as the CUDA kernels see
// them (tensor/conv/cuda_conv.cpp, one call for the whole batch).
void cuda_workspace(int kind, const Tensor& x, const Tensor& w, const Tensor& y,
                    const ops::Conv2dParams& p) {
  if (x.numel() == 0 || y.numel() == 0) return;
  ConvWorkspace c{};
  c.kind = kind;
  c.dtype = static_cast<int>(x.dtype());
  c.tf32 = x.dtype() == DType::float32 ? 1 : 0;  // cudnn_allow_tf32()'s default
  for (int i = 0; i < 4; ++i) {
    c.x[i] = static_cast<int>(x.size(i));
    c.w[i] = static_cast<int>(w.size(i));
    c.y[i] = static_cast<int>(y.size(i));
  }
  c.pad[0] = static_cast<int>(p.padding.h), c.pad[1] = static_cast<int>(p.padding.w);
  c.stride[0] = static_cast<int>(p.stride.h), c.stride[1] = static_cast<int>(p.stride.w);
  c.dilation[0] = static_cast<int>(p.dilation.h), c.dilation[1] = static_cast<int>(p.dilation.w);
  c.groups = static_cast<int>(p.groups);
  c.nhwc = conv_memory_format({&x, &w, &y}) == MemoryFormat::channels_last ? 1 : 0;
  const memory::MetaTarget& t = target(x);
  const auto table = table_of(t);
  auto find = [&](const ConvWorkspace& call) {
    return std::find_if(table.begin(), table.end(),
                        [&](const ConvWorkspace& r) { return r.same_call(call); });
  };
  auto row = find(c);
  if (row == table.end() && c.nhwc) {
    ConvWorkspace nchw = c;
    nchw.nhwc = 0;
    row = find(nchw);
    if (row != table.end())
      memory::note_unreplayed(
          x.device(), fmt::format("cuDNN convolution workspace of a channels_last call (no "
                                  "channels_last row in the {} table; counted as the NCHW call's)",
                                  t.workspace_tables));
  }
  if (row == table.end()) {
    memory::note_unreplayed(
        x.device(),
        t.workspace_tables.empty()
            ? fmt::format("cuDNN convolution workspace (no table recorded for {}; counted as 0 B)",
                          t.name)
            : fmt::format("cuDNN convolution workspace (no row in the {} table for these shapes; "
                          "counted as 0 B)",
                          t.workspace_tables));
    return;
  }
  if (row->bytes > 0) alloc_scratch_bytes(static_cast<size_t>(row->bytes), x.device());
}

// 2 N O OH OW (C/g) kH kW FLOPs, the same for each of the three kernels.
void conv_cost(const Tensor& x, const Tensor& w, const Tensor& y) {
  const double flops = 2.0 * static_cast<double>(y.numel()) * static_cast<double>(w.size(1)) *
                       static_cast<double>(w.size(2)) * static_cast<double>(w.size(3));
  cost(x, flops, tensor_bytes(x, w, y), /*tf32=*/true);
}

// One kernel call of x [N, C, H, W], w and y [N, O, OH, OW]: its FLOPs, then the scratch of the
// kernel that `like` (the operand whose dtype the kernel computes in) runs on: cuDNN's
// workspace where the target replays CUDA, the CPU kernel's im2col columns otherwise.
void conv_call(Kind kind, const Tensor& x, const Tensor& w, const Tensor& y,
               const ops::Conv2dParams& p, const Tensor& like) {
  conv_cost(x, w, y);
  if (replays_cuda(like)) return cuda_workspace(kind, x, w, y, p);
  const int64_t n = cpu::conv_col_scratch_numel(x.sizes(), w.sizes(), y.sizes(), p);
  if (n > 0) alloc_scratch(n, like.dtype(), like.device());
}

void conv2d_forward(const Tensor& out, const Tensor& input, const Tensor& weight,
                    const Tensor& /*bias*/, const ops::Conv2dParams& p) {
  conv_call(kForward, input, weight, out, p, input);
}

void conv2d_backward_input(const Tensor& grad_input, const Tensor& grad_output,
                           const Tensor& weight, const ops::Conv2dParams& p) {
  conv_call(kBackwardData, grad_input, weight, grad_output, p, weight);
}

void conv2d_backward_weight(const Tensor& grad_weight, const Tensor& grad_output,
                            const Tensor& input, const ops::Conv2dParams& p) {
  conv_call(kBackwardFilter, input, grad_weight, grad_output, p, input);
}

}  // namespace

const ConvKernels conv_kernels{TALLY_CONV_KERNELS};

}  // namespace tally::meta
