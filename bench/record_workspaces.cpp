// record_workspaces: the cuDNN workspace of every convolution call that ResNet-50 and ResNet-34
// training makes on this GPU (224x224 images, batch 32, 64 and 128, float32 with TF32 allowed,
// float16 and bfloat16, NCHW and channels_last), written as a CUDA target's table for the dry runs
// (tensor/conv/workspaces_<target>.inc, read by tensor/conv/meta.cpp).
//
//   record_workspaces tensor/conv/workspaces_h200.inc h200
#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "autograd/autocast.h"
#include "autograd/ops.h"
#include "base/atomic_file.h"
#include "memory/memory.h"
#include "nn/models/resnet.h"
#include "optim/sgd.h"
#include "tensor/conv/cuda.h"

using namespace tally;

int main(int argc, char** argv) {
  if (argc != 3) {
    fmt::print(stderr, "usage: record_workspaces OUT.inc TARGET_NAME\n");
    return 2;
  }
  const std::string out = argv[1], name = argv[2];
  if (!memory::cuda_available()) {
    fmt::print(stderr, "record_workspaces: no GPU\n");
    return 2;
  }
  const Device dev = Device::cuda(0);
  // ResNet-34's convolutions are ResNet-18's too (same stages, more blocks).
  for (const char* arch : {"resnet50", "resnet34"})
    for (const int64_t batch : {32, 64, 128}) {
      for (const auto amp : {std::optional<DType>{}, std::optional<DType>{DType::float16},
                             std::optional<DType>{DType::bfloat16}})
        for (const MemoryFormat format : {MemoryFormat::contiguous, MemoryFormat::channels_last}) {
          auto model = nn::resnet_by_name(arch, {.num_classes = 10});
          model->to(dev);
          model->to(format);
          optim::SGD opt(model->parameters(), {.lr = 0.01, .momentum = 0.9});
          const Tensor x =
              ops::contiguous(ops::randn({batch, 3, 224, 224}, DType::float32, dev), format);
          const Tensor y = ops::randint(0, 10, {batch}, DType::int64, dev);
          Tensor loss;
          {
            AutocastGuard autocast(DeviceType::cuda, amp.value_or(DType::float16), amp.has_value());
            loss = cross_entropy((*model)(x), y);
          }
          loss.backward();
          opt.step();
          memory::synchronize(dev);
          fmt::print("{} batch {} {} {}: {} planned calls so far\n", arch, batch,
                     amp ? dtype_name(*amp) : "float32", memory_format_name(format),
                     cuda::conv_planned_workspaces().size());
        }
    }
  std::vector<ConvWorkspace> rows = cuda::conv_planned_workspaces();
  std::sort(rows.begin(), rows.end(), [](const ConvWorkspace& a, const ConvWorkspace& b) {
    return std::tie(a.nhwc, a.dtype, a.x[0], a.kind, a.w[0], a.w[1], a.w[2], a.x[2], a.stride[0],
                    a.accumulate, a.tf32) < std::tie(b.nhwc, b.dtype, b.x[0], b.kind, b.w[0],
                                                     b.w[1], b.w[2], b.x[2], b.stride[0],
                                                     b.accumulate, b.tf32);
  });
  std::string body;
  for (const ConvWorkspace& r : rows)
    body += fmt::format(
        "    ConvWorkspace{{{}, {}, {}, {{{}, {}, {}, {}}}, {{{}, {}, {}, {}}}, {{{}, {}, {}, "
        "{}}}, "
        "{{{}, {}}}, {{{}, {}}}, {{{}, {}}}, {}, {}, {}, {}}},\n",
        r.kind, r.dtype, r.tf32, r.x[0], r.x[1], r.x[2], r.x[3], r.w[0], r.w[1], r.w[2], r.w[3],
        r.y[0], r.y[1], r.y[2], r.y[3], r.pad[0], r.pad[1], r.stride[0], r.stride[1], r.dilation[0],
        r.dilation[1], r.groups, r.accumulate, r.bytes, r.nhwc);
  std::string upper = name;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (!upper.empty()) upper = upper.substr(0, 1) + std::string(name.begin() + 1, name.end());
  const std::string text = fmt::format(
      "// The cuDNN workspace of each convolution call planned on the {} ({}), written by\n"
      "// bench/record_workspaces: ResNet-50 and ResNet-34 training steps, 224x224, at batch 32, "
      "64\n"
      "// and 128 in float32 (TF32 allowed), float16 and bfloat16, NCHW and channels_last.\n"
      "// Fields: kind (0 forward, 1 backward data, 2 backward filter), dtype, tf32, x, w, y,\n"
      "// padding, stride, dilation, groups, accumulate, workspace bytes, nhwc (channels_last).\n"
      "// Read by tensor/conv/meta.cpp for dry runs of the \"{}\" target.\n"
      "// clang-format off\n"
      "#pragma once\n#include <array>\n#include \"tensor/conv/kernels.h\"\n"
      "namespace tally::meta {{\n"
      "inline constexpr std::array<ConvWorkspace, {}> kConvWorkspaces{}{{{{\n{}}}}};\n"
      "}}  // namespace tally::meta\n// clang-format on\n",
      name, memory::get_allocator(dev).provider().device_name(), name, rows.size(),
      name == "h200" ? std::string("H200") : upper, body);
  base::write_file_atomic(out, text, "record_workspaces");
  fmt::print("{} rows written to {}\n", rows.size(), out);
  return 0;
}
