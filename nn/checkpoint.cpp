// checkpoint / checkpoint_sequential: the segment frame, its pack/unpack hooks and the
// recompute.
#include "nn/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <stdexcept>

#include "autograd/autocast.h"
#include "autograd/saved_tensor.h"
#include "memory/context.h"
#include "memory/memory.h"
#include "nn/container.h"
#include "tensor/random.h"

namespace tally::nn {
namespace {

thread_local CheckpointStats tls_stats;

struct Holder;

// One checkpointed segment: what is needed to run it again, and what the recompute found.
struct Frame {
  std::function<Tensor(const TensorList&)> fn;
  std::vector<SavedTensor> inputs;
  std::vector<bool> input_requires_grad;
  bool preserve_rng = true;
  bool early_stop = true;
  PhiloxState rng;
  autocast::State autocast_state;
  memory::StrId module = 0;  // the module path the segment ran under in forward
  CheckpointPolicy policy;

  // By order of saving in forward: shape/dtype (to check the recompute), whether a
  // handle still waits for the tensor, and the recomputed tensor.
  struct Slot {
    Shape shape;
    DType dtype = DType::float32;
    bool waiting = false;
    std::unique_ptr<SavedTensor> recomputed;
  };
  std::vector<Slot> slots;
  // With a policy: the products run in forward, in order (SavedTensorHooks::product), with
  // their output's identity (storage data, offset, shape, strides, version: compared, never
  // dereferenced) and the holder of the kept tensor that is that output, if the policy kept it
  // unchanged. The recompute's n-th product hands that tensor back instead of multiplying.
  struct Product {
    const void* data = nullptr;
    int64_t offset = 0;
    Shape sizes, strides;
    uint64_t version = 0;
    bool requires_grad = false;
    std::weak_ptr<Holder> kept;
  };
  std::vector<Product> products;
  bool recomputed = false;
  bool recomputing = false;

  void recompute();
};

// Thrown by the recompute's pack hook once every tensor backward still waits for is back: the
// rest of the segment is not run again (PyTorch's _StopRecomputationError). Caught by
// Frame::recompute; a what() in case something between the two catches it first.
struct StopRecompute : std::exception {
  const char* what() const noexcept override {
    return "checkpoint: recompute stopped early (every tensor backward needs was recomputed)";
  }
};

// What a saved tensor's handle holds: the frame and its index, or the kept tensor.
struct Holder {
  std::shared_ptr<Frame> frame;
  size_t index = 0;
  std::unique_ptr<SavedTensor> kept;

  ~Holder() {
    if (frame && index < frame->slots.size()) {
      frame->slots[index].waiting = false;
      frame->slots[index].recomputed.reset();
    }
  }
};

std::string_view producing_op(const Tensor& t) {
  const Storage& s = t.storage();
  if (!s.owned() || s.data() == nullptr) return {};
  return memory::interned(memory::get_allocator(t.device()).block_tag(s.data()).op);
}

// RAII: the default generator's state put back on exit.
class RngRestore {
 public:
  RngRestore() : state_(get_rng_state()) {}
  ~RngRestore() { set_rng_state(state_); }

 private:
  PhiloxState state_;
};

void Frame::recompute() {
  if (recomputing)
    throw std::logic_error(
        "checkpoint: a saved tensor of a segment was unpacked while that segment was being "
        "recomputed");
  recomputing = true;
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{recomputing};

  memory::PhaseScope phase("recompute");
  // The segment runs again under the module path it had in forward (backward runs outside
  // any module), so a recomputed block's allocations carry "layer1.0.conv1", not "conv1".
  memory::AllocContextScope context(memory::current_tag().category, memory::interned(module));
  EnableGradGuard grad;
  autocast::StateScope autocast_scope(autocast_state);
  RngRestore rng_restore;
  if (preserve_rng) set_rng_state(rng);

  TensorList args;
  args.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    Tensor t = inputs[i].unpack();
    if (t.defined()) {
      t = t.detach();
      if (input_requires_grad[i]) t.requires_grad_(true);
    }
    args.push_back(t);
  }

  // Early stop: the last slot a handle still waits for; once it is recomputed, the rest of
  // the segment (what follows the last save, e.g. a block's last matrix product, whose inputs
  // autograd::save_inputs saves before computing) is skipped.
  size_t last_needed = 0;
  for (size_t i = 0; i < slots.size(); ++i)
    if (slots[i].waiting && !slots[i].recomputed) last_needed = i;
  size_t next = 0;
  bool stopped = false;  // this recompute stopped early (StopRecompute)
  SavedTensorHooks hooks;
  hooks.pack = [this, &next, &stopped, last_needed](const Tensor& t) -> std::any {
    const size_t i = next++;
    if (i >= slots.size())
      throw std::runtime_error(
          fmt::format("checkpoint: the recomputed segment saves more tensors for backward than its "
                      "forward did ({}); the function must compute the same ops when run again",
                      slots.size()));
    Slot& slot = slots[i];
    if (t.sizes() != slot.shape || t.dtype() != slot.dtype)
      throw std::runtime_error(fmt::format(
          "checkpoint: recomputed tensor {} is {} {} but the forward saved {} {}; the function "
          "must compute the same ops when run again",
          i, dtype_name(t.dtype()), t.shape_string(), dtype_name(slot.dtype),
          shape_str(slot.shape)));
    if (slot.waiting && !slot.recomputed) {
      slot.recomputed = std::make_unique<SavedTensor>(t, "checkpoint (recomputed)", false);
      ++tls_stats.tensors_recomputed;
    }
    if (early_stop && i == last_needed) {
      stopped = true;
      throw StopRecompute();
    }
    return {};
  };
  hooks.unpack = [](const std::any&) -> Tensor {
    throw std::logic_error("checkpoint: a tensor saved during a recompute was unpacked");
  };
  size_t next_product = 0;
  if (!products.empty())
    hooks.product = [this, &next_product](const std::function<Tensor()>& compute) -> Tensor {
      const size_t c = next_product++;
      if (c < products.size()) {
        const Product& p = products[c];
        const std::shared_ptr<Holder> h = p.kept.lock();
        if (h && h->kept) {
          const Tensor kept = h->kept->unpack();  // checks that nothing modified it
          if (kept.sizes() == p.sizes && kept.strides() == p.strides) {
            Tensor out = kept.detach();
            if (p.requires_grad) out.requires_grad_(true);
            ++tls_stats.products_replayed;
            return out;
          }
        }
      }
      return compute();
    };
  try {
    SavedTensorHooksScope scope(std::move(hooks));
    fn(args);
  } catch (...) {
    // The stop, however it arrives: a function written in Python hands it back as a Python
    // error. Anything else is the function's own error.
    if (!stopped) throw;
  }
  if (stopped) ++tls_stats.early_stops;
  if (!stopped && next != slots.size())
    throw std::runtime_error(fmt::format(
        "checkpoint: the recomputed segment saved {} tensors for backward, its forward saved "
        "{}; the function must compute the same ops when run again",
        next, slots.size()));
  recomputed = true;
  ++tls_stats.recomputations;
}

Tensor unpack_holder(const std::any& packed) {
  const auto& holder = std::any_cast<const std::shared_ptr<Holder>&>(packed);
  if (holder->kept) return holder->kept->unpack();
  Frame& frame = *holder->frame;
  Frame::Slot& slot = frame.slots.at(holder->index);
  if (!slot.recomputed) {
    if (frame.recomputed)
      throw std::runtime_error(fmt::format(
          "checkpoint: saved tensor {} of the segment is no longer available (its recompute "
          "already ran and released it)",
          holder->index));
    frame.recompute();
  }
  return slot.recomputed->unpack();
}

}  // namespace

CheckpointPolicy save_ops(std::vector<std::string> ops) {
  return [ops = std::move(ops)](const SavedTensorInfo& info) {
    return std::find(ops.begin(), ops.end(), info.op) != ops.end();
  };
}

Tensor checkpoint(std::function<Tensor(const TensorList&)> fn, const TensorList& inputs,
                  CheckpointOptions options) {
  if (!fn) throw std::invalid_argument("checkpoint: fn is empty");
  if (!GradMode::is_enabled()) return fn(inputs);

  auto frame = std::make_shared<Frame>();
  frame->fn = fn;
  frame->preserve_rng = options.preserve_rng_state;
  frame->early_stop = options.early_stop;
  frame->rng = get_rng_state();
  frame->autocast_state = autocast::current_state();
  frame->module = memory::current_tag().module;
  frame->policy = std::move(options.policy);
  // Saved under the hooks of an enclosing checkpoint, if any: nested segments drop their
  // inputs too.
  frame->inputs.reserve(inputs.size());
  for (const Tensor& t : inputs) {
    frame->inputs.emplace_back(t, "checkpoint (input)");
    frame->input_requires_grad.push_back(t.defined() && t.requires_grad());
  }
  ++tls_stats.segments;

  std::weak_ptr<Frame> weak = frame;
  SavedTensorHooks hooks;
  hooks.pack = [weak](const Tensor& t) -> std::any {
    std::shared_ptr<Frame> f = weak.lock();
    auto holder = std::make_shared<Holder>();
    holder->index = f->slots.size();
    Frame::Slot slot;
    slot.shape = t.sizes();
    slot.dtype = t.dtype();
    if (f->policy) {
      // The op whose allocation context made the storage: the op that produced it.
      SavedTensorInfo info{producing_op(t), t.sizes(), t.dtype(), t.nbytes()};
      if (f->policy(info)) {
        holder->kept = std::make_unique<SavedTensor>(t, "checkpoint (kept)", false);
        ++tls_stats.tensors_kept;
        // The product this tensor is the output of, unchanged since (the latest first: an
        // address freed and reused names the live tensor).
        for (auto p = f->products.rbegin(); p != f->products.rend(); ++p)
          if (p->data == t.storage().data() && p->offset == t.storage_offset() &&
              p->sizes == t.sizes() && p->strides == t.strides()) {
            if (p->version == t.storage().version() && p->kept.expired()) p->kept = holder;
            break;
          }
        f->slots.push_back(std::move(slot));
        return holder;  // no frame: a kept tensor never triggers a recompute
      }
    }
    slot.waiting = true;
    f->slots.push_back(std::move(slot));
    holder->frame = f;
    ++tls_stats.tensors_dropped;
    return holder;
  };
  hooks.unpack = unpack_holder;
  if (frame->policy)
    hooks.product = [weak](const std::function<Tensor()>& compute) -> Tensor {
      Tensor out = compute();
      if (std::shared_ptr<Frame> f = weak.lock(); f && out.defined())
        f->products.push_back({out.storage().data(),
                               out.storage_offset(),
                               out.sizes(),
                               out.strides(),
                               out.storage().version(),
                               out.requires_grad(),
                               {}});
      return out;
    };
  SavedTensorHooksScope scope(std::move(hooks));
  return fn(inputs);
}

Tensor checkpoint(std::function<Tensor(const Tensor&)> fn, const Tensor& input,
                  CheckpointOptions options) {
  if (!fn) throw std::invalid_argument("checkpoint: fn is empty");
  return checkpoint([fn = std::move(fn)](const TensorList& in) { return fn(in[0]); },
                    TensorList{input}, std::move(options));
}

Tensor checkpoint_sequential(std::vector<std::function<Tensor(const Tensor&)>> stages, int segments,
                             Tensor input, CheckpointOptions options) {
  const int n = static_cast<int>(stages.size());
  if (segments < 1 || segments > n)
    throw std::invalid_argument(fmt::format(
        "checkpoint_sequential: segments must be in [1, {}] (the number of stages), got {}", n,
        segments));
  // The runs outlive this call (a recompute runs them again in backward): share the stages.
  auto shared =
      std::make_shared<std::vector<std::function<Tensor(const Tensor&)>>>(std::move(stages));
  auto run = [shared](int start, int end) {  // stages [start, end]
    return std::function<Tensor(const Tensor&)>([shared, start, end](const Tensor& x) {
      Tensor y = x;
      for (int i = start; i <= end; ++i) y = (*shared)[static_cast<size_t>(i)](y);
      return y;
    });
  };
  const int size = n / segments;
  int end = -1;
  for (int start = 0; start < size * (segments - 1); start += size) {
    end = start + size - 1;
    input = checkpoint(run(start, end), input, options);
  }
  return run(end + 1, n - 1)(input);
}

Tensor checkpoint_sequential(const Sequential& functions, int segments, Tensor input,
                             CheckpointOptions options) {
  std::vector<std::function<Tensor(const Tensor&)>> stages;
  for (const auto& named : functions.named_children())
    stages.push_back([child = named.second](const Tensor& x) { return (*child)(x); });
  return checkpoint_sequential(std::move(stages), segments, std::move(input), std::move(options));
}

Tensor checkpoint_sequential(ModuleList& list, int segments, Tensor input) {
  std::vector<std::function<Tensor(const Tensor&)>> stages;
  for (const auto& m : list)
    stages.push_back([&list, m](const Tensor& x) { return list.call([&] { return (*m)(x); }); });
  const int n = std::min<int>(segments, static_cast<int>(stages.size()));
  return checkpoint_sequential(std::move(stages), n, std::move(input));
}

CheckpointStats checkpoint_stats() {
  return tls_stats;
}
void reset_checkpoint_stats() {
  tls_stats = CheckpointStats{};
}

}  // namespace tally::nn
