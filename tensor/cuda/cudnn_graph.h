// A small builder over cuDNN 9's backend ("graph") API: tensors, convolution / pointwise /
// matmul / reduction / reshape operations, an operation graph, the first engine
// configuration from cuDNN's heuristics (the given modes in order) whose numerical notes are
// acceptable and whose execution plan finalises, and execution with a variant pack. It is
// what cuDNN's fused kernels (its flash attention: tensor/attention/cuda_cudnn_sdpa.cpp) and its
// convolution engines with cached plans (tensor/conv/cuda_conv.cpp) are reached through.
//
// Depends only on cuDNN and fmt (no Tally types), so a graph can be built and run from a
// standalone program while it is being brought up on a GPU. Errors throw CudnnGraphError
// with cuDNN's own message (cudnnGetLastErrorString), naming the call and the operation.
#pragma once

#include <cudnn.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace tally::cuda::cudnn_graph {

// Thrown for a graph cuDNN rejects; `not_supported` when no engine can run it (the caller
// may then fall back to another kernel), otherwise a malformed graph or a failed call.
class CudnnGraphError : public std::runtime_error {
 public:
  CudnnGraphError(const std::string& what, bool not_supported)
      : std::runtime_error(what), not_supported_(not_supported) {}
  bool not_supported() const { return not_supported_; }

 private:
  bool not_supported_;
};

// Owner of one cudnnBackendDescriptor_t.
class Descriptor {
 public:
  Descriptor(cudnnBackendDescriptorType_t type, const char* what);
  ~Descriptor();
  Descriptor(Descriptor&& o) noexcept : desc_(std::exchange(o.desc_, nullptr)), what_(o.what_) {}
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  Descriptor& operator=(Descriptor&&) = delete;

  cudnnBackendDescriptor_t get() const { return desc_; }
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
           const void* values);
  void set_desc(cudnnBackendAttributeName_t name, const Descriptor& d);
  void set_int(cudnnBackendAttributeName_t name, int64_t v);
  void set_dtype(cudnnBackendAttributeName_t name, cudnnDataType_t dt);
  // Returns the status; throws unless it is success or (when `may_fail`) not-supported.
  cudnnStatus_t finalize(bool may_fail = false);

 private:
  cudnnBackendDescriptor_t desc_ = nullptr;
  const char* what_;
};

enum class ConvKind { forward, backward_data, backward_filter };

// Whether an engine with these numerical notes must not run the graph.
using NoteFilter = std::function<bool(const std::vector<cudnnBackendNumericalNote_t>&)>;

class Graph {
 public:
  explicit Graph(std::string name) : name_(std::move(name)) {}

  // A tensor; returns its unique id. Virtual tensors live only inside the fused kernel;
  // the others get a data pointer at execute().
  int64_t tensor(cudnnDataType_t dtype, std::vector<int64_t> dims, std::vector<int64_t> strides,
                 bool is_virtual);
  // A virtual tensor with row-major strides.
  int64_t virt(cudnnDataType_t dtype, const std::vector<int64_t>& dims);
  // A scalar passed by value (the value lives in the graph).
  int64_t scalar(float value);

  // y = op(x[, b[, t]]) elementwise with broadcasting; `axis` for GEN_INDEX.
  void pointwise(cudnnPointwiseMode_t mode, int64_t x, int64_t b, int64_t t, int64_t y,
                 cudnnDataType_t math = CUDNN_DATA_FLOAT, int64_t axis = -1);
  // c = a @ b over the last two dims (batched over the others), float accumulation.
  void matmul(int64_t a, int64_t b, int64_t c);
  // y = reduce(x) over the dims where y has extent 1.
  void reduction(cudnnReduceTensorOp_t op, int64_t x, int64_t y);
  // y = x seen with y's dims and strides (no data movement).
  void reshape(int64_t x, int64_t y);
  // A 2-D cross-correlation (PyTorch's conv2d) over x [N, C, H, W], w [O, C / groups, kH, kW]
  // (groups follow from C / w's dim 1), y [N, O, OH, OW]: forward writes y, backward_data
  // writes x (dx from dy = y), backward_filter writes w (dw); out = alpha * result + beta * out.
  void convolution(ConvKind kind, int64_t x, int64_t w, int64_t y, const std::vector<int64_t>& pad,
                   const std::vector<int64_t>& stride, const std::vector<int64_t>& dilation,
                   cudnnDataType_t compute, double alpha, double beta);

  // Builds the operation graph and the execution plan for `handle`'s device from the
  // heuristics' configurations (each mode's list in turn), skipping engines `reject` refuses
  // and the first `skip` configurations that finalise (a tuner's later candidates). Throws
  // CudnnGraphError (not_supported() when no configuration, or no more than `skip`, finalise).
  void build(cudnnHandle_t handle,
             const std::vector<cudnnBackendHeurMode_t>& modes = {CUDNN_HEUR_MODE_A,
                                                                 CUDNN_HEUR_MODE_FALLBACK},
             const NoteFilter& reject = {}, int skip = 0);
  int64_t workspace_size() const { return workspace_; }
  // Runs on `handle`'s stream. `pointers` maps every non-virtual, non-scalar uid to its
  // device pointer; `workspace` has workspace_size() bytes (may be null when 0). The variant
  // pack of the last call is kept and reused while the pointers stay the same (a training
  // loop's caching allocator hands back the same blocks step after step).
  void execute(cudnnHandle_t handle, const std::vector<std::pair<int64_t, void*>>& pointers,
               void* workspace) const;
  const std::string& name() const { return name_; }
  // The global index of the engine the plan runs (for logs and tests).
  int64_t engine_id() const { return engine_id_; }

 private:
  using TensorAttrs = std::vector<std::pair<cudnnBackendAttributeName_t, int64_t>>;

  const Descriptor& desc(int64_t uid) const;
  // Adds the operation `op` to the graph: binds its inner descriptor (pointwise, matmul,
  // reduction, convolution; kept alive with the graph) under `inner_attr` and each tensor uid
  // under its attribute, then finalises it.
  void add_operation(std::unique_ptr<Descriptor> op, const TensorAttrs& tensors,
                     cudnnBackendAttributeName_t inner_attr = {},
                     std::unique_ptr<Descriptor> inner = nullptr);

  std::string name_;
  std::vector<std::unique_ptr<Descriptor>> tensors_;  // index = uid - 1
  std::vector<std::unique_ptr<Descriptor>> ops_;
  std::vector<std::unique_ptr<Descriptor>> keep_;  // operations' inner descriptors
  std::vector<std::pair<int64_t, std::unique_ptr<float>>> scalars_;
  std::unique_ptr<Descriptor> op_graph_, plan_;
  std::vector<std::unique_ptr<Descriptor>> configs_;
  int64_t workspace_ = 0;
  int64_t engine_id_ = -1;
  mutable std::mutex exec_mu_;
  mutable std::vector<void*> pack_key_;
  mutable std::unique_ptr<Descriptor> pack_;
};

}  // namespace tally::cuda::cudnn_graph
