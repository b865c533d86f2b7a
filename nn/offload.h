// Activation offload for a model (--offload): the blocks the spec names run under SaveOnCpu
// (autograd/offload.h) with one shared ActivationOffloader, so each block is a group and
// backward prefetches the block it needs next while the current one runs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "autograd/offload.h"
#include "nn/module_select.h"

namespace tally::nn {

class Module;

// "none" | "activations" (every residual or transformer block, and what the model saves
// outside them: the stem, the head, the classifier) | "N-blocks" (the first N blocks in
// forward order, nothing outside them: the partial plans the memory planner searches) | a
// module policy for any model: "type:Block", "name:blocks.*", each optionally "/K"
// (nn/module_select.h) | "link": the bandwidth-aware policy below (what the host link can carry
// while the forward computes).
struct OffloadSpec {
  enum class Kind { none, activations, blocks, modules, link };
  Kind kind = Kind::none;
  int blocks = 0;               // Kind::blocks
  ModuleSelector modules = {};  // Kind::modules
  std::string str() const;
  bool enabled() const { return kind != Kind::none; }
};
// Throws std::invalid_argument naming the accepted spellings.
OffloadSpec parse_offload_spec(const std::string& s);

// ---- `--offload link`: offload that the host link hides ----
// One module the link policy may offload: its dotted name, the bytes its forward saves for
// backward that no module outside it saves too (what offloading it frees), whether it is
// checkpointed (then those bytes are the input its checkpoint keeps), and the share of the
// forward's saved bytes saved after its last save: where it sits in the forward (1: first, or
// not known).
struct LinkCandidate {
  std::string name;
  int64_t saved_bytes = 0;
  bool checkpointed = false;
  double after = 1.0;
};
// What the link policy chose, and why.
struct LinkOffloadChoice {
  std::vector<std::string> modules;  // chosen, in the order taken
  int64_t bytes = 0;                 // the bytes they save (copied each step)
  int64_t candidate_bytes = 0;       // the outermost candidates' (inner ones are inside them)
  std::vector<std::string> blocks;   // the outermost candidates, in the given order
  int candidates = 0;
  double link_bytes_per_second = 0;
  double forward_seconds = 0;
  double margin = 0;  // the share of the forward the copies may take
  // What the whole forward saves (the measuring forward's count; 0 when not measured), and the
  // restores' lead in backward that follows from it (OffloadOptions::prefetch_lead): 1.5 x
  // the forward's saved bytes a second over the link's bytes a second.
  int64_t forward_saved_bytes = 0;
  double prefetch_lead = 0;
  // "offload link: 3 of 12 modules (blocks.0, ...), 1.5 GiB of 4.0 GiB saved for backward;
  // copies 27.0 ms at 50.0 GB/s, within 80% of the 36.7 ms forward"
  std::string str() const;
};
// The share of the forward's time the link policy lets the copies take.
inline constexpr double kLinkOffloadMargin = 0.8;
// How much earlier than the forward's pace a restore starts in backward (prefetch_lead).
inline constexpr double kLinkPrefetchSafety = 1.5;
// The link policy, a pure function: checkpointed candidates first, then the others, each group
// largest first (ties: the given order), each taken when the copies of everything taken, in
// forward order, each starting no earlier than its module's end (1 - after of the forward, its
// saved bytes standing in for its time) and after the one before it, all end within margin x
// forward_seconds at link_bytes_per_second (first fit: one too large, or too late, is passed
// over for others), and no module around it or inside it (dotted names) is taken. Candidates
// that save nothing are left out.
LinkOffloadChoice choose_link_offload(const std::vector<LinkCandidate>& candidates,
                                      double link_bytes_per_second, double forward_seconds,
                                      double margin = kLinkOffloadMargin);
// What the link policy chooses from in `model`: its checkpointed modules (the outermost), then
// its blocks (Module::is_checkpoint_block; for any other model the modules of its most repeated
// composite type, nn::repeated_module_types) that neither hold nor sit inside one of those,
// then every module inside those blocks (a block may save more than the link carries); a
// candidate's bytes include those of the candidates inside it, and its `after` is the share of
// the forward's saved bytes saved after its last save (`forward_saved_bytes`: the whole count).
// Runs `forward` (one forward of the step, under its autocast) once with pack hooks that count
// what each candidate saves and keep nothing, so it holds no more than a no_grad forward, and
// returns the forward's time in `forward_seconds`: on a meta device (a dry run) the cost
// model's (and the dry run's clocks are set back: not charged to its steps); on the CPU the
// clock's; on a GPU the clock's over a second forward between two device synchronisations (the
// first one warms the libraries up): once, before training. Throws std::invalid_argument when the
// model has no candidate.
std::vector<LinkCandidate> link_candidates(Module& model, const std::function<void()>& forward,
                                           double* forward_seconds,
                                           int64_t* forward_saved_bytes = nullptr);
// link_candidates, then choose_link_offload at `link_bytes_per_second` (0: the measured speed of
// the link of the model's device, ops::host_link_bandwidth): what offload_activations(model,
// "link", ...) would offload, without applying it.
LinkOffloadChoice link_offload_choice(Module& model, const std::function<void()>& forward,
                                      double link_bytes_per_second = 0,
                                      double margin = kLinkOffloadMargin);

// Applies `spec` to a ResNet, ResNetTiny or GPT (any model whose blocks declare
// Module::is_checkpoint_block) or the modules a module policy selects in any model, replacing
// what an earlier call set, and returns the
// offloader (null for "none"; its stats() say what moved). Combines with checkpointing: a
// checkpointed block then offloads the input it keeps.
std::shared_ptr<ActivationOffloader> offload_activations(Module& model, const OffloadSpec& spec,
                                                         OffloadOptions options = {});
// The same, for any spec including "link", which needs `forward` (link_candidates) and the
// link's speed (ops::host_link_bandwidth of the model's device): it offloads the modules
// choose_link_offload picks, the other blocks report backward's progress
// (Module::set_offload_progress) so that each restore starts the choice's prefetch_lead ahead
// (unless options.prefetch_lead is set, or prefetch is off), and, when `choice` is given, says
// what it chose there. Other specs ignore `forward`. "link" without a forward is a
// std::invalid_argument.
std::shared_ptr<ActivationOffloader> offload_activations(Module& model, const OffloadSpec& spec,
                                                         OffloadOptions options,
                                                         const std::function<void()>& forward,
                                                         LinkOffloadChoice* choice = nullptr);

}  // namespace tally::nn
