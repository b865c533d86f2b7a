#include "tensor/cuda/cudnn_graph.h"

#include <fmt/format.h>

#include <algorithm>

namespace tally::cuda::cudnn_graph {

namespace {

std::string last_error() {
  char buf[2048] = {0};
  cudnnGetLastErrorString(buf, sizeof(buf));
  return buf;
}

[[noreturn]] void fail(cudnnStatus_t st, const std::string& what) {
  const std::string msg = last_error();
  throw CudnnGraphError(fmt::format("{}: cuDNN error {} ({}){}{}", what, static_cast<int>(st),
                                    cudnnGetErrorString(st), msg.empty() ? "" : ": ", msg),
                        static_cast<int>(st) / 1000 == 3);  // CUDNN_STATUS_NOT_SUPPORTED*
}

void check(cudnnStatus_t st, const std::string& what) {
  if (st != CUDNN_STATUS_SUCCESS) fail(st, what);
}

}  // namespace

Descriptor::Descriptor(cudnnBackendDescriptorType_t type, const char* what) : what_(what) {
  check(cudnnBackendCreateDescriptor(type, &desc_),
        fmt::format("cudnnBackendCreateDescriptor ({})", what));
}

Descriptor::~Descriptor() {
  if (desc_) cudnnBackendDestroyDescriptor(desc_);
}

void Descriptor::set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
                     int64_t count, const void* values) {
  check(cudnnBackendSetAttribute(desc_, name, type, count, values),
        fmt::format("cudnnBackendSetAttribute ({}, attribute {})", what_, static_cast<int>(name)));
}

void Descriptor::set_desc(cudnnBackendAttributeName_t name, const Descriptor& d) {
  cudnnBackendDescriptor_t raw = d.get();
  set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw);
}

void Descriptor::set_int(cudnnBackendAttributeName_t name, int64_t v) {
  set(name, CUDNN_TYPE_INT64, 1, &v);
}

void Descriptor::set_dtype(cudnnBackendAttributeName_t name, cudnnDataType_t dt) {
  set(name, CUDNN_TYPE_DATA_TYPE, 1, &dt);
}

cudnnStatus_t Descriptor::finalize(bool may_fail) {
  const cudnnStatus_t st = cudnnBackendFinalize(desc_);
  if (st != CUDNN_STATUS_SUCCESS && !may_fail)
    fail(st, fmt::format("cudnnBackendFinalize ({})", what_));
  return st;
}

int64_t Graph::tensor(cudnnDataType_t dtype, std::vector<int64_t> dims,
                      std::vector<int64_t> strides, bool is_virtual) {
  if (dims.size() != strides.size())
    throw std::invalid_argument(
        fmt::format("{}: tensor with {} dims but {} strides", name_, dims.size(), strides.size()));
  const int64_t uid = static_cast<int64_t>(tensors_.size()) + 1;
  auto d = std::make_unique<Descriptor>(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor");
  d->set_dtype(CUDNN_ATTR_TENSOR_DATA_TYPE, dtype);
  d->set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, static_cast<int64_t>(dims.size()),
         dims.data());
  d->set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, static_cast<int64_t>(strides.size()),
         strides.data());
  d->set_int(CUDNN_ATTR_TENSOR_UNIQUE_ID, uid);
  d->set_int(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16);
  const bool virt = is_virtual;
  d->set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt);
  d->finalize();
  tensors_.push_back(std::move(d));
  return uid;
}

int64_t Graph::virt(cudnnDataType_t dtype, const std::vector<int64_t>& dims) {
  std::vector<int64_t> strides(dims.size(), 1);
  for (size_t i = dims.size(); i-- > 1;) strides[i - 1] = strides[i] * dims[i];
  return tensor(dtype, dims, strides, true);
}

int64_t Graph::scalar(float value) {
  const int64_t uid = static_cast<int64_t>(tensors_.size()) + 1;
  const std::vector<int64_t> ones{1, 1, 1, 1};
  auto d = std::make_unique<Descriptor>(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "scalar tensor");
  d->set_dtype(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_DATA_FLOAT);
  d->set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, ones.data());
  d->set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, ones.data());
  d->set_int(CUDNN_ATTR_TENSOR_UNIQUE_ID, uid);
  d->set_int(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16);
  const bool f = false, t = true;
  d->set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &f);
  d->set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &t);
  d->finalize();
  tensors_.push_back(std::move(d));
  scalars_.emplace_back(uid, std::make_unique<float>(value));
  return uid;
}

const Descriptor& Graph::desc(int64_t uid) const {
  if (uid < 1 || uid > static_cast<int64_t>(tensors_.size()))
    throw std::invalid_argument(fmt::format("{}: no tensor with uid {}", name_, uid));
  return *tensors_[static_cast<size_t>(uid - 1)];
}

void Graph::pointwise(cudnnPointwiseMode_t mode, int64_t x, int64_t b, int64_t t, int64_t y,
                      cudnnDataType_t math, int64_t axis) {
  auto pw = std::make_unique<Descriptor>(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise");
  pw->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
  pw->set_dtype(CUDNN_ATTR_POINTWISE_MATH_PREC, math);
  if (axis >= 0) pw->set_int(CUDNN_ATTR_POINTWISE_AXIS, axis);
  pw->finalize();
  TensorAttrs tensors{{CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x}};
  if (b > 0) tensors.emplace_back(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
  if (t > 0) tensors.emplace_back(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
  tensors.emplace_back(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
  add_operation(std::make_unique<Descriptor>(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR,
                                             "pointwise operation"),
                tensors, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, std::move(pw));
}

void Graph::matmul(int64_t a, int64_t b, int64_t c) {
  auto mm = std::make_unique<Descriptor>(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul");
  mm->set_dtype(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_DATA_FLOAT);
  mm->finalize();
  add_operation(
      std::make_unique<Descriptor>(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation"),
      {{CUDNN_ATTR_OPERATION_MATMUL_ADESC, a},
       {CUDNN_ATTR_OPERATION_MATMUL_BDESC, b},
       {CUDNN_ATTR_OPERATION_MATMUL_CDESC, c}},
      CUDNN_ATTR_OPERATION_MATMUL_DESC, std::move(mm));
}

void Graph::reduction(cudnnReduceTensorOp_t rop, int64_t x, int64_t y) {
  auto r = std::make_unique<Descriptor>(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction");
  r->set_dtype(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_DATA_FLOAT);
  r->set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &rop);
  r->finalize();
  add_operation(
      std::make_unique<Descriptor>(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR,
                                   "reduction operation"),
      {{CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x}, {CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y}},
      CUDNN_ATTR_OPERATION_REDUCTION_DESC, std::move(r));
}

void Graph::reshape(int64_t x, int64_t y) {
  add_operation(
      std::make_unique<Descriptor>(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation"),
      {{CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x}, {CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y}});
}

void Graph::add_operation(std::unique_ptr<Descriptor> op, const TensorAttrs& tensors,
                          cudnnBackendAttributeName_t inner_attr,
                          std::unique_ptr<Descriptor> inner) {
  if (inner) op->set_desc(inner_attr, *inner);
  for (const auto& [attr, uid] : tensors) op->set_desc(attr, desc(uid));
  op->finalize();
  if (inner) keep_.push_back(std::move(inner));
  ops_.push_back(std::move(op));
}

void Graph::convolution(ConvKind kind, int64_t x, int64_t w, int64_t y,
                        const std::vector<int64_t>& pad, const std::vector<int64_t>& stride,
                        const std::vector<int64_t>& dilation, cudnnDataType_t compute, double alpha,
                        double beta) {
  auto conv = std::make_unique<Descriptor>(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, "convolution");
  const int64_t dims = static_cast<int64_t>(pad.size());
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  conv->set_dtype(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, compute);
  conv->set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode);
  conv->set_int(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, dims);
  conv->set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, dims, dilation.data());
  conv->set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, dims, stride.data());
  conv->set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, dims, pad.data());
  conv->set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, dims, pad.data());
  conv->finalize();

  struct Names {
    cudnnBackendDescriptorType_t op;
    cudnnBackendAttributeName_t alpha, beta, desc, x, w, y;
  };
  const Names n = kind == ConvKind::forward
                      ? Names{CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y}
                  : kind == ConvKind::backward_data
                      ? Names{CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY}
                      : Names{CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW,
                              CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY};
  auto op = std::make_unique<Descriptor>(n.op, "convolution operation");
  if (compute == CUDNN_DATA_DOUBLE) {
    op->set(n.alpha, CUDNN_TYPE_DOUBLE, 1, &alpha);
    op->set(n.beta, CUDNN_TYPE_DOUBLE, 1, &beta);
  } else {
    const float a = static_cast<float>(alpha), b = static_cast<float>(beta);
    op->set(n.alpha, CUDNN_TYPE_FLOAT, 1, &a);
    op->set(n.beta, CUDNN_TYPE_FLOAT, 1, &b);
  }
  add_operation(std::move(op), {{n.x, x}, {n.w, w}, {n.y, y}}, n.desc, std::move(conv));
}

// The handle attributes are marked deprecated in cuDNN 9 headers but are still how a graph
// and a plan are bound to a device (cuDNN's own frontend sets them the same way).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
void Graph::build(cudnnHandle_t handle, const std::vector<cudnnBackendHeurMode_t>& modes,
                  const NoteFilter& reject, int skip) {
  op_graph_ =
      std::make_unique<Descriptor>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
  std::vector<cudnnBackendDescriptor_t> raw;
  raw.reserve(ops_.size());
  for (const auto& o : ops_) raw.push_back(o->get());
  op_graph_->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                 static_cast<int64_t>(raw.size()), raw.data());
  op_graph_->set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
  const cudnnStatus_t gst = op_graph_->finalize(true);
  if (gst != CUDNN_STATUS_SUCCESS)
    fail(gst, fmt::format("{}: finalizing the operation graph", name_));

  std::string tried;
  for (cudnnBackendHeurMode_t mode : modes) {
    Descriptor heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
    heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, *op_graph_);
    heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    if (heur.finalize(true) != CUDNN_STATUS_SUCCESS) {
      tried += fmt::format(" heuristics mode {}: {};", static_cast<int>(mode), last_error());
      continue;
    }
    int64_t count = 0;
    check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
          name_ + ": counting the heuristics' results");
    if (count <= 0) {
      tried += fmt::format(" heuristics mode {}: no engine;", static_cast<int>(mode));
      continue;
    }
    std::vector<std::unique_ptr<Descriptor>> cfgs;
    std::vector<cudnnBackendDescriptor_t> raw_cfgs;
    for (int64_t i = 0; i < count; ++i) {
      cfgs.push_back(
          std::make_unique<Descriptor>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config"));
      raw_cfgs.push_back(cfgs.back()->get());
    }
    int64_t got = 0;
    check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw_cfgs.data()),
          name_ + ": reading the heuristics' results");
    for (int64_t i = 0; i < got; ++i) {
      const Descriptor& cfg = *cfgs[static_cast<size_t>(i)];
      // The engine behind the configuration: its global index and numerical notes.
      int64_t engine_id = -1;
      std::vector<cudnnBackendNumericalNote_t> notes(CUDNN_NUMERICAL_NOTE_TYPE_COUNT);
      {
        Descriptor engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR, "engine");
        cudnnBackendDescriptor_t raw_engine = engine.get();
        int64_t n = 0;
        check(cudnnBackendGetAttribute(cfg.get(), CUDNN_ATTR_ENGINECFG_ENGINE,
                                       CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &raw_engine),
              name_ + ": reading a configuration's engine");
        cudnnBackendGetAttribute(engine.get(), CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1,
                                 &n, &engine_id);
        int64_t count_notes = 0;
        if (cudnnBackendGetAttribute(engine.get(), CUDNN_ATTR_ENGINE_NUMERICAL_NOTE,
                                     CUDNN_TYPE_NUMERICAL_NOTE, CUDNN_NUMERICAL_NOTE_TYPE_COUNT,
                                     &count_notes, notes.data()) != CUDNN_STATUS_SUCCESS)
          count_notes = 0;
        notes.resize(static_cast<size_t>(std::max<int64_t>(0, count_notes)));
      }
      if (reject && reject(notes)) {
        tried += fmt::format(" engine {}: numerical notes refused;", engine_id);
        continue;
      }
      auto plan =
          std::make_unique<Descriptor>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
      plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
      plan->set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfg);
      const cudnnStatus_t st = plan->finalize(true);
      if (st != CUDNN_STATUS_SUCCESS) {
        tried +=
            fmt::format(" engine {}: {} {};", engine_id, cudnnGetErrorString(st), last_error());
        continue;
      }
      if (skip > 0) {
        --skip;
        tried += fmt::format(" engine {}: skipped;", engine_id);
        continue;
      }
      int64_t n = 0;
      check(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                     CUDNN_TYPE_INT64, 1, &n, &workspace_),
            name_ + ": reading the plan's workspace size");
      engine_id_ = engine_id;
      plan_ = std::move(plan);
      configs_ = std::move(cfgs);
      return;
    }
  }
  throw CudnnGraphError(fmt::format("{}: no cuDNN engine runs this graph:{}", name_, tried), true);
}
#pragma GCC diagnostic pop

void Graph::execute(cudnnHandle_t handle, const std::vector<std::pair<int64_t, void*>>& pointers,
                    void* workspace) const {
  if (!plan_) throw std::logic_error(fmt::format("{}: execute() before build()", name_));
  std::lock_guard<std::mutex> lock(exec_mu_);
  bool same = pack_ && pack_key_.size() == pointers.size() + 1 && pack_key_.back() == workspace;
  for (size_t i = 0; same && i < pointers.size(); ++i) same = pack_key_[i] == pointers[i].second;
  if (!same) {
    std::vector<int64_t> uids;
    std::vector<void*> ptrs;
    uids.reserve(pointers.size() + scalars_.size());
    ptrs.reserve(pointers.size() + scalars_.size());
    for (const auto& [uid, p] : pointers) {
      uids.push_back(uid);
      ptrs.push_back(p);
    }
    for (const auto& [uid, v] : scalars_) {
      uids.push_back(uid);
      ptrs.push_back(v.get());
    }
    pack_.reset();
    auto pack = std::make_unique<Descriptor>(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack");
    pack->set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
              static_cast<int64_t>(uids.size()), uids.data());
    pack->set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
              static_cast<int64_t>(ptrs.size()), ptrs.data());
    pack->set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
    pack->finalize();
    pack_ = std::move(pack);
    pack_key_.clear();
    for (const auto& pr : pointers) pack_key_.push_back(pr.second);
    pack_key_.push_back(workspace);
  }
  check(cudnnBackendExecute(handle, plan_->get(), pack_->get()), name_ + ": cudnnBackendExecute");
}

}  // namespace tally::cuda::cudnn_graph
