#include "nn/offload.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <stdexcept>
#include <tuple>

#include "base/bytes.h"
#include "base/enum_table.h"
#include "memory/context.h"
#include "memory/memory.h"
#include "memory/meta.h"
#include "nn/module.h"
#include "tensor/host_link.h"

namespace tally::nn {

std::string OffloadSpec::str() const {
  if (kind == Kind::modules) return modules.str();
  if (kind == Kind::link) return "link";
  if (kind == Kind::blocks) return fmt::format("{}-blocks", blocks);
  static constexpr const char* kNames[] = {"none", "activations"};
  return base::enum_table<Kind::activations>(kind, kNames, "none");
}

OffloadSpec parse_offload_spec(const std::string& s) {
  OffloadSpec spec;
  if (s == "none" || s == "off" || s.empty()) return spec;
  if (s == "activations") {
    spec.kind = OffloadSpec::Kind::activations;
    return spec;
  }
  if (s == "link") {
    spec.kind = OffloadSpec::Kind::link;
    return spec;
  }
  if (is_module_selector(s)) {
    spec.kind = OffloadSpec::Kind::modules;
    spec.modules = parse_module_selector(s, "--offload");
    return spec;
  }
  const std::string suffix = "-blocks";
  if (s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0) {
    const std::string n = s.substr(0, s.size() - suffix.size());
    if (n.size() <= 6 && n.find_first_not_of("0123456789") == std::string::npos) {
      const int v = std::stoi(n);
      if (v >= 1) {
        spec.kind = OffloadSpec::Kind::blocks;
        spec.blocks = v;
        return spec;
      }
    }
  }
  throw std::invalid_argument(fmt::format(
      "--offload: expected none, activations, link, N-blocks (e.g. 6-blocks), type:TYPE or "
      "name:GLOB (optionally /K), got '{}'",
      s));
}

std::string LinkOffloadChoice::str() const {
  std::string names;
  for (size_t i = 0; i < modules.size() && i < 6; ++i) names += (i ? ", " : "") + modules[i];
  if (modules.size() > 6) names += ", ...";
  const double copy_ms =
      link_bytes_per_second > 0 ? 1e3 * static_cast<double>(bytes) / link_bytes_per_second : 0.0;
  return fmt::format(
      "offload link: {} of {} modules{}, {} of {} saved for backward; copies {:.1f} ms at "
      "{:.1f} GB/s, within {:.0f}% of the {:.1f} ms forward",
      modules.size(), candidates, names.empty() ? "" : " (" + names + ")",
      base::format_bytes(static_cast<double>(bytes)),
      base::format_bytes(static_cast<double>(candidate_bytes)), copy_ms,
      link_bytes_per_second / 1e9, margin * 100, forward_seconds * 1e3);
}

namespace {
// Undoes an earlier offload_activations: no module offloads or reports progress.
void clear_offload(Module& model) {
  for (auto& [name, m] : model.named_modules()) {
    m->set_offload(nullptr);
    m->set_offload_progress(nullptr);
  }
}

// Whether the dotted name `name` is inside the module `outer` (every name is inside "").
bool inside(const std::string& name, const std::string& outer) {
  return outer.empty() ||
         (name.size() > outer.size() && name.starts_with(outer) && name[outer.size()] == '.');
}
}  // namespace

LinkOffloadChoice choose_link_offload(const std::vector<LinkCandidate>& candidates,
                                      double link_bytes_per_second, double forward_seconds,
                                      double margin) {
  if (!(link_bytes_per_second > 0) || !(forward_seconds >= 0) || !(margin > 0 && margin <= 1))
    throw std::invalid_argument(
        fmt::format("choose_link_offload: expected a positive link speed, a forward time >= 0 "
                    "and a margin in (0, 1]; got {} B/s, {} s, {}",
                    link_bytes_per_second, forward_seconds, margin));
  LinkOffloadChoice c;
  c.link_bytes_per_second = link_bytes_per_second;
  c.forward_seconds = forward_seconds;
  c.margin = margin;
  c.candidates = static_cast<int>(candidates.size());
  std::vector<size_t> order(candidates.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const LinkCandidate& x = candidates[a];
    const LinkCandidate& y = candidates[b];
    if (x.checkpointed != y.checkpointed) return x.checkpointed;
    return x.saved_bytes > y.saved_bytes;
  });
  // Whether the copies of `taken` fit: in forward order, each starts at its module's end or
  // when the one before it ends, and all end within the share of the forward.
  const double window = margin * forward_seconds;
  auto fits = [&](const std::vector<size_t>& taken) {
    std::vector<size_t> by_end = taken;
    std::stable_sort(by_end.begin(), by_end.end(),
                     [&](size_t a, size_t b) { return candidates[a].after > candidates[b].after; });
    double t = 0;
    for (const size_t i : by_end) {
      const LinkCandidate& k = candidates[i];
      const double end = (1.0 - std::clamp(k.after, 0.0, 1.0)) * forward_seconds;
      t = std::max(t, end) + static_cast<double>(k.saved_bytes) / link_bytes_per_second;
      if (t > window * (1 + 1e-12)) return false;
    }
    return true;
  };
  for (const LinkCandidate& k : candidates) {
    bool outermost = true;  // a module inside another candidate is counted there
    for (const LinkCandidate& o : candidates) outermost = outermost && !inside(k.name, o.name);
    if (!outermost) continue;
    c.candidate_bytes += k.saved_bytes;
    c.blocks.push_back(k.name);
  }
  std::vector<size_t> taken;
  for (const size_t i : order) {
    const LinkCandidate& k = candidates[i];
    if (k.saved_bytes <= 0) continue;
    // Not a module inside one taken, nor one around it: its bytes are counted there.
    bool nested = false;
    for (const std::string& t : c.modules)
      nested = nested || inside(k.name, t) || inside(t, k.name);
    if (nested) continue;
    taken.push_back(i);
    if (!fits(taken)) {
      taken.pop_back();
      continue;
    }
    c.bytes += k.saved_bytes;
    c.modules.push_back(k.name);
  }
  return c;
}

std::vector<LinkCandidate> link_candidates(Module& model, const std::function<void()>& forward,
                                           double* forward_seconds, int64_t* forward_saved_bytes) {
  if (!forward) throw std::invalid_argument("offload link: no forward to measure");
  const auto modules = model.named_modules();
  std::vector<LinkCandidate> out;
  auto overlaps = [&](const std::string& name) {
    for (const LinkCandidate& c : out)
      if (c.name == name || inside(name, c.name) || inside(c.name, name)) return true;
    return false;
  };
  for (const auto& [name, m] : modules)
    if (!name.empty() && m->is_checkpointed() && !overlaps(name)) out.push_back({name, 0, true});
  const auto repeated = repeated_module_types(model);
  bool blocks = false;
  for (const auto& [name, m] : modules) blocks = blocks || m->is_checkpoint_block();
  for (const auto& [name, m] : modules) {
    const bool block = blocks ? m->is_checkpoint_block()
                              : !repeated.empty() && m->type_name() == repeated.front().first;
    if (block && !name.empty() && !overlaps(name)) out.push_back({name, 0, false});
  }
  // Then every module inside a block that is not checkpointed: what the link can carry may be
  // less than a block (GPT-2's blocks each save more than an H200's link moves in the forward).
  const size_t n_blocks = out.size();
  for (const auto& [name, m] : modules)
    for (size_t i = 0; i < n_blocks; ++i)
      if (!out[i].checkpointed && inside(name, out[i].name)) {
        out.push_back({name, 0, false});
        break;
      }
  if (out.empty())
    throw std::invalid_argument(fmt::format(
        "offload_activations(link): the model ({}) has no checkpointed, block or repeated "
        "module to offload",
        model.type_name()));
  // Each candidate's saves, counted once per tensor (as the offloader copies them: a view
  // through its whole block when that is at most 4x its size), nothing kept, and only where
  // every save of the tensor is inside the candidate: one that a module outside it saves too
  // (a ReLU's output the next convolution keeps) stays on the device when the candidate goes.
  // Keyed as the offloader does, while the block lives (a freed block's key may come back).
  struct Saved {
    int64_t bytes = 0;
    std::vector<size_t> within;  // the candidates around every save so far
    std::weak_ptr<const void> block;
  };
  std::vector<Saved> saves;
  std::map<SaveKey, size_t> seen;  // index into saves
  // The forward's saved bytes so far, and each candidate's count at its last save.
  int64_t total = 0;
  std::vector<int64_t> end(out.size(), 0);
  const std::string enclosing = memory::interned(memory::current_tag().module);
  SavedTensorHooks hooks;
  hooks.pack = [&](const Tensor& t) -> std::any {
    const Storage& s = t.storage();
    const memory::Category cat = s.category();
    if (!s.owned() || (cat != memory::Category::temporary && cat != memory::Category::activation))
      return {};
    const SaveKey key = save_key(t);
    if (key.offset < 0 && key.bytes / 4 > t.nbytes()) return {};  // the offloader keeps it
    if (key.bytes == 0) return {};
    // The module path, relative to the model (the path may carry modules around the model).
    std::string path = memory::interned(memory::current_tag().module);
    if (!enclosing.empty() && inside(path, enclosing)) path = path.substr(enclosing.size() + 1);
    auto around = [&](size_t i) { return path == out[i].name || inside(path, out[i].name); };
    if (auto it = seen.find(key); it != seen.end() && !saves[it->second].block.expired()) {
      std::vector<size_t>& within = saves[it->second].within;
      std::erase_if(within, [&](size_t i) { return !around(i); });
      return {};
    }
    seen[key] = saves.size();
    Saved& sv = saves.emplace_back();
    sv.bytes = static_cast<int64_t>(key.bytes);
    sv.block = s.watch();
    total += sv.bytes;
    for (size_t i = 0; i < out.size(); ++i)  // the module and every candidate around it
      if (around(i)) {
        sv.within.push_back(i);
        end[i] = total;
      }
    return {};
  };
  hooks.unpack = [](const std::any&) -> Tensor {
    throw std::logic_error("offload link: the measuring forward has no backward");
  };
  Device device = Device::cpu();
  for (const Tensor& p : model.parameters()) {
    device = p.device();
    break;
  }
  using Clock = std::chrono::steady_clock;
  double seconds = 0;
  {
    SavedTensorHooksScope scope(hooks);
    if (device.is_meta()) {
      // The cost model's time; then the clocks go back: a real run measures once, where a dry
      // run of a few steps would charge a large share of a forward to each.
      const double t0 = memory::meta_seconds(device);
      const double h0 = memory::meta_host_seconds(device);
      forward();
      seconds = memory::meta_seconds(device) - t0;
      memory::rewind_meta_clocks(device, t0, h0);
    } else {
      if (device.type == DeviceType::cuda) {
        forward();  // libraries' first calls, the allocator's first segments
        seen.clear();
        saves.clear();
        total = 0;
        std::fill(end.begin(), end.end(), 0);
        memory::synchronize(device);
      }
      const auto t0 = Clock::now();
      forward();
      memory::synchronize(device);
      seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    }
  }
  for (const Saved& sv : saves)
    for (const size_t i : sv.within) out[i].saved_bytes += sv.bytes;
  if (forward_seconds) *forward_seconds = seconds;
  if (forward_saved_bytes) *forward_saved_bytes = total;
  for (size_t i = 0; i < out.size(); ++i)
    out[i].after =
        total > 0 ? static_cast<double>(total - end[i]) / static_cast<double>(total) : 1.0;
  return out;
}

LinkOffloadChoice link_offload_choice(Module& model, const std::function<void()>& forward,
                                      double link_bytes_per_second, double margin) {
  double forward_seconds = 0;
  int64_t saved = 0;
  const std::vector<LinkCandidate> candidates =
      link_candidates(model, forward, &forward_seconds, &saved);
  if (link_bytes_per_second <= 0) {
    Device device = Device::cpu();
    for (const Tensor& p : model.parameters()) {
      device = p.device();
      break;
    }
    link_bytes_per_second = ops::host_link_bandwidth(device);
  }
  LinkOffloadChoice c =
      choose_link_offload(candidates, link_bytes_per_second, forward_seconds, margin);
  c.forward_saved_bytes = saved;
  // Backward takes at least the forward's time for the same saves; 1.5x more lead than that
  // covers the host's wait for the fence and a block whose saves are few for its time.
  if (forward_seconds > 0)
    c.prefetch_lead = kLinkPrefetchSafety * static_cast<double>(saved) /
                      (forward_seconds * link_bytes_per_second);
  return c;
}

std::shared_ptr<ActivationOffloader> offload_activations(Module& model, const OffloadSpec& spec,
                                                         OffloadOptions options,
                                                         const std::function<void()>& forward,
                                                         LinkOffloadChoice* choice) {
  if (spec.kind != OffloadSpec::Kind::link) return offload_activations(model, spec, options);
  clear_offload(model);
  if (!forward)
    throw std::invalid_argument(fmt::format(
        "offload_activations(link): the model ({}) needs its forward to measure what each "
        "block saves (nn::offload_activations(model, spec, options, forward))",
        model.type_name()));
  const LinkOffloadChoice c = link_offload_choice(model, forward);
  if (choice) *choice = c;
  if (c.modules.empty()) return nullptr;
  if (options.prefetch && options.prefetch_lead <= 0) options.prefetch_lead = c.prefetch_lead;
  OffloadSpec chosen;
  chosen.kind = OffloadSpec::Kind::modules;
  const std::set<std::string> names(c.modules.begin(), c.modules.end());
  chosen.modules.predicate = [names](const std::string& name, const Module&) {
    return names.count(name) > 0;
  };
  chosen.modules.label = "link";
  // Each save is copied at once: the modules chosen may be few (a block's attention and MLP),
  // and a copy deferred two groups (the default) would never be issued for the last two.
  if (options.defer_groups < 0) options.defer_groups = 0;
  std::shared_ptr<ActivationOffloader> offloader = offload_activations(model, chosen, options);
  if (options.prefetch_lead > 0) {
    // The blocks (the outermost candidates) not offloaded report backward's progress.
    const std::set<std::string> blocks(c.blocks.begin(), c.blocks.end());
    for (auto& [name, m] : model.named_modules())
      if (!m->offloader() && blocks.count(name)) m->set_offload_progress(offloader);
  }
  return offloader;
}

std::shared_ptr<ActivationOffloader> offload_activations(Module& model, const OffloadSpec& spec,
                                                         OffloadOptions options) {
  const auto modules = model.named_modules();
  clear_offload(model);
  if (!spec.enabled()) return nullptr;
  if (spec.kind == OffloadSpec::Kind::link)
    return offload_activations(model, spec, options, nullptr);
  // Each block's saves are copied as the next block opens; the head's (the logits, which
  // backward needs first) stay on the device rather than going out and straight back.
  if (options.defer_groups < 0) options.defer_groups = 2;
  if (spec.kind == OffloadSpec::Kind::modules) {
    const auto selected = spec.modules.select(model);
    if (selected.empty())
      throw std::invalid_argument(
          fmt::format("offload_activations({}): no module of the model "
                      "({}) matches",
                      spec.str(), model.type_name()));
    auto offloader = ActivationOffloader::create(options);
    for (auto& [name, m] : selected) m->set_offload(offloader);
    return offloader;
  }
  int blocks = 0;
  for (auto& [name, m] : modules)
    if (m->is_checkpoint_block()) ++blocks;
  if (blocks == 0)
    throw std::invalid_argument(
        fmt::format("offload_activations({}): the model ({}) has no residual or transformer blocks",
                    spec.str(), model.type_name()));
  if (spec.kind == OffloadSpec::Kind::blocks && spec.blocks > blocks)
    throw std::invalid_argument(fmt::format("offload_activations({}): the model ({}) has {} blocks",
                                            spec.str(), model.type_name(), blocks));
  auto offloader = ActivationOffloader::create(options);
  if (spec.kind == OffloadSpec::Kind::activations) model.set_offload(offloader);
  int n = 0;
  for (auto& [name, m] : modules)
    if (m->is_checkpoint_block()) {
      if (spec.kind == OffloadSpec::Kind::activations || n < spec.blocks) m->set_offload(offloader);
      ++n;
    }
  return offloader;
}

}  // namespace tally::nn
