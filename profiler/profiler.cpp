// The profiler's collector (observers of dispatch, context scopes and the allocator,
// writing into per-thread buffers), the schedule state machine and record_function.
#include "profiler/profiler.h"

#include <fmt/format.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <x86intrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

#include "base/enum_table.h"
#include "memory/context.h"
#include "profiler/gpu_tracer.h"
#include "tensor/dispatch.h"

namespace tally::profiler {

const char* span_kind_name(SpanKind k) {
  static constexpr const char* kNames[] = {"cpu_op", "module", "user_annotation", "phase"};
  return base::enum_table<SpanKind::phase>(k, kNames, "?");
}

const char* gpu_kind_name(GpuKind k) {
  static constexpr const char* kNames[] = {"kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime",
                                           "cuda_driver"};
  return base::enum_table<GpuKind::driver>(k, kNames, "?");
}

const char* action_name(ProfilerAction a) {
  static constexpr const char* kNames[] = {"NONE", "WARMUP", "RECORD", "RECORD_AND_SAVE"};
  return base::enum_table<ProfilerAction::record_and_save>(a, kNames, "?");
}

Schedule schedule(int wait, int warmup, int active, int repeat, int skip_first) {
  if (active <= 0 || wait < 0 || warmup < 0 || repeat < 0 || skip_first < 0)
    throw std::invalid_argument(fmt::format(
        "profiler::schedule(wait={}, warmup={}, active={}, repeat={}, skip_first={}): active "
        "must be > 0 and the others >= 0",
        wait, warmup, active, repeat, skip_first));
  return [=](int step) {
    if (step < skip_first) return ProfilerAction::none;
    step -= skip_first;
    const int cycle = wait + warmup + active;
    if (repeat > 0 && step / cycle >= repeat) return ProfilerAction::none;
    const int m = step % cycle;
    if (m < wait) return ProfilerAction::none;
    if (m < wait + warmup) return ProfilerAction::warmup;
    return m < cycle - 1 ? ProfilerAction::record : ProfilerAction::record_and_save;
  };
}

namespace {

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The events' timestamps. The recording threads read ticks: the CPU's time-stamp counter where
// it runs at a constant rate (x86-64 with CPUID's invariant-TSC bit: one instruction, half the
// cost of a clock_gettime, as PyTorch's profiler's approximate clock), else the steady clock's
// nanoseconds. A window turns its ticks into nanoseconds since its start at its end (TickMap),
// linearly between the (ticks, ns) pairs read at its start and its end.
bool use_tsc() {
#if defined(__x86_64__)
  static const bool invariant = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid(0x80000007, &a, &b, &c, &d) != 0 && ((d >> 8) & 1) != 0;
  }();
  return invariant;
#else
  return false;
#endif
}

int64_t now_ticks() {
#if defined(__x86_64__)
  if (use_tsc()) return static_cast<int64_t>(__rdtsc());
#endif
  return steady_ns();
}

// Ticks -> nanoseconds since the window's start (its origin).
struct TickMap {
  int64_t origin_ticks = 0;
  double ns_per_tick = 1;
  int64_t ns(int64_t ticks) const {
    return static_cast<int64_t>(
        std::llround(static_cast<double>(ticks - origin_ticks) * ns_per_tick));
  }
};

// A (steady-clock ns, ticks) pair for the tick map: the ticks read between two steady-clock
// reads, the tightest of four tries, its ns the middle of the two. Read one after the other
// once, a thread preempted between the reads skews the map by the pause (a TSan CI run: a 30 ms
// span 54 us longer than the steady clock around it).
struct ClockPair {
  int64_t ns, ticks;
};
ClockPair read_clocks() {
  if (!use_tsc()) {
    const int64_t t = steady_ns();
    return {t, t};
  }
  ClockPair best{};
  int64_t best_gap = std::numeric_limits<int64_t>::max();
  for (int i = 0; i < 4; ++i) {
    const int64_t before = steady_ns();
    const int64_t ticks = now_ticks();
    const int64_t after = steady_ns();
    if (after - before < best_gap) {
      best_gap = after - before;
      best = {before + (after - before) / 2, ticks};
    }
  }
  return best;
}

// The map of a window that started at (origin_ns, origin_ticks) and ended at (end_ns,
// end_ticks): exact (1 ns a tick from the origin) when the ticks are the steady clock's.
TickMap tick_map(int64_t origin_ns, int64_t origin_ticks, int64_t end_ns, int64_t end_ticks) {
  if (!use_tsc()) return {origin_ns, 1.0};
  const int64_t ticks = end_ticks - origin_ticks;
  return {origin_ticks,
          ticks > 0 ? static_cast<double>(end_ns - origin_ns) / static_cast<double>(ticks) : 0.0};
}

uint64_t os_tid() {
  return static_cast<uint64_t>(::syscall(SYS_gettid));
}

// A span as recorded on the hot path: interned ids and a slice of the thread's shape pool.
struct RawSpan {
  SpanKind kind;
  memory::StrId name;
  memory::StrId module;
  memory::StrId phase;
  int depth;
  int64_t start;  // ticks (now_ticks)
  int64_t end;    // ticks; -1 while open
  uint64_t id;
  uint64_t parent;
  uint64_t parent_op;
  memory::Device device;
  int32_t shapes_at;  // index into shape_pool, -1: none
  const char* file;
  uint32_t line;
};

struct RawMem {
  int64_t time;  // ticks (now_ticks)
  uint64_t seq;
  uint64_t op_id;
  memory::StrId scope_module;
  memory::AllocationEvent e;
};

// Room reserved per thread and window (address space only: pages are touched as events
// come; a closed window's storage, touched pages included, goes to the next window's threads
// as a SpareStorage). Past it a vector grows by copying megabytes inside an op: at 1 << 15 a
// window of 16 ResNet-50 steps (2,700 allocator events and 1,700 spans a step) cost 0.33 ms of
// host time a step against 0.21 at 8 steps; at 1 << 17 both cost 0.21 (profile_models
// --device meta:h200).
constexpr size_t kReserveSpans = 1 << 17;
constexpr size_t kReserveMem = 1 << 17;

// One thread's events in one window. The thread writes under `mu`; end_window takes `mu` to
// close the buffer, after which late events (a thread that loaded an observer before the
// window closed) are dropped. Shared with the thread, so that it outlives the window for a
// thread still inside a callback.
struct ThreadBuffer {
  std::mutex mu;
  bool closed = false;
  uint64_t generation = 0;  // the window it belongs to
  uint64_t tid = 0;
  uint64_t index = 0;
  uint64_t next = 1;  // per-thread id counter
  std::vector<RawSpan> spans;
  std::vector<RawMem> mem;
  // Shapes: [n_inputs, then per input: dtype, ndim, dims...]
  std::vector<int64_t> shape_pool;
  std::vector<uint32_t> open;  // indices into spans, innermost last
};

// A closed window's vectors, emptied with their capacity and touched pages kept, for the next
// window's threads: on a fresh vector every event that reaches a new page takes a page fault
// inside an op (a ResNet-50 step writes about 0.5 MB of events).
struct SpareStorage {
  std::vector<RawSpan> spans;
  std::vector<RawMem> mem;
  std::vector<int64_t> shape_pool;
};
// At most this many are kept (one per thread that recorded; each the size its window needed).
constexpr size_t kMaxSpare = 4;

class Collector final : public DispatchObserver,
                        public memory::ContextObserver,
                        public memory::AllocationObserver {
 public:
  std::atomic<uint64_t> generation{0};
  std::atomic<bool> active{false};
  std::atomic<uint64_t> mem_seq{0};
  // Set by begin_window, read by the recording threads (atomics: a thread from the previous
  // window may still be in a callback).
  std::atomic<bool> record_shapes{false}, profile_memory{false}, with_stack{false}, cuda{false};
  std::mutex mu;  // guards `buffers` and `spare`
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  std::vector<SpareStorage> spare;

  // The calling thread's buffer for the current window (made on its first event).
  ThreadBuffer& buffer() {
    thread_local uint64_t gen = 0;
    thread_local std::shared_ptr<ThreadBuffer> buf;
    const uint64_t g = generation.load(std::memory_order_acquire);
    if (gen != g || !buf) {
      auto b = std::make_shared<ThreadBuffer>();
      b->generation = g;
      b->tid = os_tid();
      {
        std::lock_guard lock(mu);
        if (!spare.empty()) {
          b->spans = std::move(spare.back().spans);
          b->mem = std::move(spare.back().mem);
          b->shape_pool = std::move(spare.back().shape_pool);
          spare.pop_back();
        }
        b->index = buffers.size() + 1;
        buffers.push_back(b);
      }
      b->spans.reserve(kReserveSpans);  // no-ops on a spare's vectors
      b->mem.reserve(kReserveMem);
      b->shape_pool.reserve(kReserveSpans * 4);
      b->open.reserve(64);
      buf = std::move(b);
      gen = g;
    }
    return *buf;
  }
  // Runs f(buffer) on the calling thread's buffer, locked; does nothing once its window has
  // closed.
  template <class F>
  void write(F&& f) {
    ThreadBuffer& b = buffer();
    std::lock_guard lock(b.mu);
    if (!b.closed) f(b);
  }

  // Closes the buffers of window `g` (no thread writes to them afterwards) and returns them.
  std::vector<std::shared_ptr<ThreadBuffer>> close(uint64_t g) {
    std::vector<std::shared_ptr<ThreadBuffer>> out;
    {
      std::lock_guard lock(mu);
      for (const auto& b : buffers)
        if (b->generation == g) out.push_back(b);
    }
    for (const auto& b : out) {
      std::lock_guard lock(b->mu);
      b->closed = true;
    }
    return out;
  }
  void drop_buffers() {
    std::lock_guard lock(mu);
    buffers.clear();
  }
  // Empties a closed buffer (the caller holds b.mu), keeping its vectors' storage as a spare
  // while there is room for one; otherwise it is freed now, not at the thread's exit.
  void recycle(ThreadBuffer& b) {
    SpareStorage s{std::exchange(b.spans, {}), std::exchange(b.mem, {}),
                   std::exchange(b.shape_pool, {})};
    std::vector<uint32_t>().swap(b.open);
    s.spans.clear();
    s.mem.clear();
    s.shape_pool.clear();
    std::lock_guard lock(mu);
    if (spare.size() < kMaxSpare && s.mem.capacity() > 0) spare.push_back(std::move(s));
  }

  uint64_t innermost_op(const ThreadBuffer& b) const {
    for (auto it = b.open.rbegin(); it != b.open.rend(); ++it) {
      const RawSpan& s = b.spans[*it];
      if (s.kind == SpanKind::op || s.kind == SpanKind::user) return s.id;
    }
    return 0;
  }

  RawSpan& push(ThreadBuffer& b, SpanKind kind, memory::StrId name, memory::Device device) {
    const memory::AllocTag tag = memory::current_tag();
    RawSpan s{};
    s.kind = kind;
    s.name = name;
    s.module = tag.module;
    s.phase = tag.phase;
    s.depth = static_cast<int>(b.open.size());
    s.end = -1;
    s.id = (b.index << 40) | b.next++;
    s.parent = b.open.empty() ? 0 : b.spans[b.open.back()].id;
    s.parent_op = innermost_op(b);
    s.device = device;
    s.shapes_at = -1;
    s.file = nullptr;
    s.line = 0;
    b.open.push_back(static_cast<uint32_t>(b.spans.size()));
    b.spans.push_back(s);
    b.spans.back().start = now_ticks();
    return b.spans.back();
  }
  void push(SpanKind kind, memory::StrId name, memory::Device device) {
    write([&](ThreadBuffer& b) { push(b, kind, name, device); });
  }

  // Close the innermost open span of `kind` (with `name` unless 0) and anything opened
  // inside it. Returns false when there is none (its start preceded the window).
  bool pop(SpanKind kind, memory::StrId name) {
    const int64_t t = now_ticks();
    bool found = false;
    write([&](ThreadBuffer& b) {
      for (size_t i = b.open.size(); i-- > 0;) {
        RawSpan& s = b.spans[b.open[i]];
        if (s.kind != kind || (name != 0 && s.name != name)) continue;
        for (size_t j = i; j < b.open.size(); ++j) b.spans[b.open[j]].end = t;
        b.open.resize(i);
        found = true;
        return;
      }
    });
    return found;
  }

  void on_enter(const OpInfo& op, Device device, const OpInputs* inputs) override {
    uint64_t id = 0;
    write([&](ThreadBuffer& b) {
      RawSpan& s = push(b, SpanKind::op, op.id, device);
      id = s.id;
      if (record_shapes.load(std::memory_order_relaxed) && inputs) {
        s.shapes_at = static_cast<int32_t>(b.shape_pool.size());
        b.shape_pool.push_back(inputs->count);
        for (int i = 0; i < inputs->count; ++i) {
          b.shape_pool.push_back(static_cast<int64_t>(inputs->dtypes[i]));
          b.shape_pool.push_back(static_cast<int64_t>(inputs->sizes[i]->size()));
          b.shape_pool.insert(b.shape_pool.end(), inputs->sizes[i]->begin(),
                              inputs->sizes[i]->end());
        }
      }
    });
    if (id && cuda.load(std::memory_order_relaxed) && device.type == DeviceType::cuda)
      gpu_tracer::push_external_id(id);
  }
  void on_exit(const OpInfo& op, Device device) override {
    if (pop(SpanKind::op, op.id) && cuda.load(std::memory_order_relaxed) &&
        device.type == DeviceType::cuda)
      gpu_tracer::pop_external_id();
  }
  void on_module_enter(memory::StrId path) override {
    push(SpanKind::module, path, memory::Device::cpu());
  }
  void on_module_exit(memory::StrId path) override { pop(SpanKind::module, path); }
  void on_phase_enter(memory::StrId phase) override {
    push(SpanKind::phase, phase, memory::Device::cpu());
  }
  void on_phase_exit(memory::StrId phase) override { pop(SpanKind::phase, phase); }

  void on_allocation_event(const memory::AllocationEvent& e) override {
    write([&](ThreadBuffer& b) {
      RawMem m;
      m.time = now_ticks();
      m.seq = mem_seq.fetch_add(1, std::memory_order_relaxed);
      m.op_id = innermost_op(b);
      m.scope_module = memory::current_tag().module;
      m.e = e;
      b.mem.push_back(m);
    });
  }

  void install() {
    active.store(true);
    set_dispatch_observer(this);
    memory::set_context_observer(this);
    if (profile_memory.load()) memory::set_allocation_observer(this);
  }
  void uninstall() {
    set_dispatch_observer(nullptr);
    memory::set_context_observer(nullptr);
    memory::set_allocation_observer(nullptr);
    active.store(false);
  }
};

Collector& collector() {
  static Collector* c = new Collector();  // never destroyed: observers outlive statics
  return *c;
}

std::atomic<Profiler*> g_running{nullptr};

std::vector<memory::Device> allocator_devices() {
  std::vector<memory::Device> d{memory::Device::cpu()};
  for (int i = 0; i < memory::cuda_device_count(); ++i) d.push_back(memory::Device::cuda(i));
  return d;
}

}  // namespace

struct Profiler::Session {
  int64_t origin = 0;        // steady_ns() at the window's start
  int64_t origin_ticks = 0;  // now_ticks() then
  int64_t base_epoch_ns = 0;
  bool warmup = false;
  bool gpu = false;
  std::vector<memory::Device> history_turned_on;
  std::vector<InitialMemory> initial;
  std::vector<int> steps;
  memory::StrId step_span = 0;  // the open "ProfilerStep#N"
};

Profiler::Profiler(ProfilerOptions options) : options_(std::move(options)) {}

Profiler::~Profiler() {
  if (!running_) return;
  try {
    stop();
  } catch (...) {
  }
}

void Profiler::start() {
  if (running_) throw std::logic_error("Profiler::start: already started");
  Profiler* expected = nullptr;
  if (!g_running.compare_exchange_strong(expected, this))
    throw std::logic_error("Profiler::start: another profiler is running (one at a time)");
  running_ = true;
  step_num_ = 0;
  action_ = options_.schedule ? options_.schedule(0) : ProfilerAction::record;
  transition(ProfilerAction::none, action_);
}

void Profiler::stop() {
  if (!running_) return;
  const ProfilerAction a = action_;
  action_ = ProfilerAction::none;
  running_ = false;
  g_running.store(nullptr);
  if (collecting_) end_window(a == ProfilerAction::record || a == ProfilerAction::record_and_save);
}

void Profiler::step() {
  if (!running_) throw std::logic_error("Profiler::step: the profiler is not running");
  const ProfilerAction prev = action_;
  ++step_num_;
  action_ = options_.schedule ? options_.schedule(step_num_) : ProfilerAction::record;
  transition(prev, action_);
}

void Profiler::transition(ProfilerAction from, ProfilerAction to) {
  using A = ProfilerAction;
  const bool rec_to = to == A::record || to == A::record_and_save;
  const bool reopen = rec_to || to == A::warmup;  // a window opens right after this one
  Collector& c = collector();
  if (from == A::record) {
    if (rec_to) {  // continue: next step span
      c.pop(SpanKind::user, session_->step_span);
      session_->step_span = memory::intern(fmt::format("ProfilerStep#{}", step_num_));
      c.push(SpanKind::user, session_->step_span, memory::Device::cpu());
      session_->steps.push_back(step_num_);
      return;
    }
    end_window(true, reopen);
  } else if (from == A::record_and_save) {
    end_window(true, reopen);
  } else if (from == A::warmup) {
    end_window(false, reopen);
  }
  if (to == A::warmup) begin_window(true);
  if (rec_to) begin_window(false);
}

void Profiler::begin_window(bool warmup) {
  Collector& c = collector();
  session_ = std::make_unique<Session>();
  session_->warmup = warmup;
  c.record_shapes = options_.record_shapes;
  c.profile_memory = options_.profile_memory;
  c.with_stack = options_.with_stack;
  c.cuda = options_.activities.count(ProfilerActivity::cuda) > 0 && gpu_tracer::available();
  c.drop_buffers();
  c.mem_seq.store(0);
  c.generation.fetch_add(1, std::memory_order_acq_rel);
  // This thread's buffers now, before the window's origin: reserving them (megabytes of
  // address space; longer under ASan, which poisons what it hands out) is not the window's.
  (void)c.buffer();
  if (options_.profile_memory) {
    for (memory::Device d : allocator_devices()) {
      memory::CachingAllocator& a = memory::get_allocator(d);
      if (!warmup && !a.history_enabled()) {
        a.record_memory_history(true);
        session_->history_turned_on.push_back(d);
      }
      const memory::DeviceStats st = a.stats();
      InitialMemory im;
      im.device = d;
      for (memory::Category cat : memory::kAllCategories)
        im.category_bytes[static_cast<int>(cat)] = st.cat_bytes(cat).current;
      im.total_allocated = a.memory_allocated();
      im.total_reserved = a.memory_reserved();
      session_->initial.push_back(im);
    }
  }
  session_->base_epoch_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count();
  const ClockPair origin = read_clocks();
  session_->origin = origin.ns;
  session_->origin_ticks = origin.ticks;
  if (c.cuda.load()) {
    gpu_tracer::start(session_->origin);
    session_->gpu = true;
  }
  collecting_ = true;
  c.install();
  if (!warmup) {
    session_->step_span = memory::intern(fmt::format("ProfilerStep#{}", step_num_));
    c.push(SpanKind::user, session_->step_span, memory::Device::cpu());
    session_->steps.push_back(step_num_);
  }
}

namespace {

using Buffers = std::vector<std::shared_ptr<ThreadBuffer>>;

std::vector<CpuSpan> merge_spans(const Buffers& buffers, const TickMap& map, int64_t end,
                                 bool with_stack) {
  std::vector<CpuSpan> out;
  for (auto& bp : buffers) {
    ThreadBuffer& b = *bp;
    for (const RawSpan& r : b.spans) {
      CpuSpan s;
      s.kind = r.kind;
      s.name = memory::interned(r.name);
      s.module = memory::interned(r.module);
      s.phase = memory::interned(r.phase);
      s.start_ns = map.ns(r.start);
      s.end_ns = r.end < 0 ? end : map.ns(r.end);
      s.id = r.id;
      s.parent = r.parent;
      s.parent_op = r.parent_op;
      s.depth = r.depth;
      s.tid = b.tid;
      s.device = r.device;
      if (with_stack && r.file) {
        s.file = memory::display_source_path(r.file);
        s.line = r.line;
      }
      if (r.shapes_at >= 0) {
        size_t i = static_cast<size_t>(r.shapes_at);
        const int64_t n = b.shape_pool[i++];
        for (int64_t k = 0; k < n; ++k) {
          const auto dt = static_cast<DType>(b.shape_pool[i++]);
          const int64_t nd = b.shape_pool[i++];
          s.input_shapes.emplace_back(b.shape_pool.begin() + static_cast<std::ptrdiff_t>(i),
                                      b.shape_pool.begin() + static_cast<std::ptrdiff_t>(i + nd));
          s.input_types.emplace_back(dtype_name(dt));
          i += static_cast<size_t>(nd);
        }
      }
      out.push_back(std::move(s));
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const CpuSpan& a, const CpuSpan& b) {
    if (a.start_ns != b.start_ns) return a.start_ns < b.start_ns;
    if (a.tid != b.tid) return a.tid < b.tid;
    return a.depth < b.depth;
  });
  return out;
}

std::vector<MemoryEvent> merge_memory(const Buffers& buffers, const TickMap& map, bool with_stack) {
  std::vector<MemoryEvent> out;
  for (auto& bp : buffers) {
    for (const RawMem& r : bp->mem) {
      MemoryEvent m;
      m.time_ns = map.ns(r.time);
      m.seq = r.seq;
      m.addr = r.e.addr;
      m.bytes = r.e.bytes;
      m.total_allocated = r.e.total_allocated;
      m.total_reserved = r.e.total_reserved;
      m.category = r.e.tag.category;
      m.old_category = r.e.old_category;
      m.retag = r.e.retag;
      m.device = memory::Device{r.e.device_type, r.e.device_index};
      m.module = memory::interned(r.e.tag.module);
      m.op = memory::interned(r.e.tag.op);
      m.phase = memory::interned(r.e.tag.phase);
      m.scope_module = memory::interned(r.scope_module);
      if (with_stack && r.e.tag.loc.file) {  // the user's line (memory::CallSiteScope)
        m.file = memory::display_source_path(r.e.tag.loc.file);
        m.line = r.e.tag.loc.line;
      }
      m.tid = bp->tid;
      m.op_id = r.op_id;
      out.push_back(std::move(m));
    }
  }
  std::sort(out.begin(), out.end(),
            [](const MemoryEvent& a, const MemoryEvent& b) { return a.seq < b.seq; });
  // Times follow the allocator's order (a later event never has an earlier time).
  for (size_t i = 1; i < out.size(); ++i)
    out[i].time_ns = std::max(out[i].time_ns, out[i - 1].time_ns);
  return out;
}

}  // namespace

void Profiler::end_window(bool save, bool reopen) {
  Collector& c = collector();
  c.uninstall();
  // Threads still inside a callback finish their event; later ones are dropped. The window
  // ends after the last event it holds.
  const Buffers buffers = c.close(c.generation.load());
  const ClockPair last = read_clocks();
  const int64_t end = last.ns - session_->origin;
  const TickMap map = tick_map(session_->origin, session_->origin_ticks, last.ns, last.ticks);
  collecting_ = false;
  std::vector<GpuEvent> gpu;
  if (session_->gpu) gpu_tracer::stop(gpu, /*detach=*/!reopen);
  auto data = std::make_unique<ProfileData>();
  if (save && !session_->warmup) {
    data->base_time_ns = session_->base_epoch_ns;
    data->duration_ns = end;
    data->pid = static_cast<int64_t>(::getpid());
    data->profile_memory = options_.profile_memory;
    data->record_shapes = options_.record_shapes;
    data->with_stack = options_.with_stack;
    data->spans = merge_spans(buffers, map, end, options_.with_stack);
    data->memory = merge_memory(buffers, map, options_.with_stack);
    std::sort(gpu.begin(), gpu.end(),
              [](const GpuEvent& a, const GpuEvent& b) { return a.start_ns < b.start_ns; });
    data->gpu = std::move(gpu);
    data->initial = session_->initial;
    data->steps = session_->steps;
    if (options_.profile_memory)
      for (memory::Device d : allocator_devices())
        data->snapshots.emplace_back(d, memory::get_allocator(d).snapshot());
  }
  for (memory::Device d : session_->history_turned_on)
    memory::get_allocator(d).record_memory_history(false);
  for (const auto& b : buffers) {  // closed: their storage goes to the next window's threads
    std::lock_guard lock(b->mu);
    c.recycle(*b);
  }
  c.drop_buffers();
  session_.reset();
  if (save && data->base_time_ns != 0) {
    last_ = std::move(data);
    if (options_.on_trace_ready) options_.on_trace_ready(*this);
  }
}

const ProfileData& Profiler::data() const {
  if (!last_)
    throw std::logic_error(
        "Profiler: no recorded window yet (call stop(), or read results in on_trace_ready)");
  return *last_;
}

EventList Profiler::key_averages(bool group_by_input_shape) const {
  return build_key_averages(data(), group_by_input_shape);
}

EventList Profiler::key_averages_by_module() const {
  return build_module_averages(data());
}

memory::Device Profiler::timeline_device() const {
  const ProfileData& d = data();
  for (const InitialMemory& im : d.initial)
    if (im.device.type == memory::DeviceType::cuda) {
      // Prefer the GPU when it saw traffic in the window.
      for (const MemoryEvent& m : d.memory)
        if (m.device == im.device) return im.device;
    }
  return memory::Device::cpu();
}

void Profiler::export_memory_timeline(const std::string& path) const {
  export_memory_timeline(path, timeline_device());
}

void Profiler::export_memory_snapshot(const std::string& path) const {
  export_memory_snapshot(path, timeline_device());
}

void Profiler::export_memory_snapshot(const std::string& path, memory::Device device) const {
  const ProfileData& d = data();
  for (const auto& [dev, snap] : d.snapshots)
    if (dev == device) return memory::write_snapshot_file(snap, path);
  throw std::logic_error(fmt::format(
      "Profiler::export_memory_snapshot({}): no snapshot for {} (profile_memory was {})", path,
      device.str(), d.profile_memory ? "on" : "off"));
}

record_function::record_function(std::string_view name, std::source_location loc) {
  Collector& c = collector();
  if (!c.active.load(std::memory_order_relaxed)) return;
  name_ = memory::intern(name);
  c.write([&](ThreadBuffer& b) {
    RawSpan& s = c.push(b, SpanKind::user, name_, memory::Device::cpu());
    s.file = loc.file_name();
    s.line = static_cast<uint32_t>(loc.line());
  });
  generation_ = c.generation.load(std::memory_order_relaxed);
  active_ = true;
}

record_function::~record_function() {
  if (!active_) return;
  Collector& c = collector();
  // Only in the window that opened it (a schedule may have moved on since).
  if (c.active.load(std::memory_order_relaxed) &&
      c.generation.load(std::memory_order_relaxed) == generation_)
    c.pop(SpanKind::user, name_);
}

}  // namespace tally::profiler
