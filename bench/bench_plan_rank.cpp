// Does the planner's cost model rank plans as the CPU runs them? (issue 51: Spearman rho >= 0.9
// over the tiny models' candidates, and the chosen plan within 10% of the fastest measured plan
// that fits.) For a user-defined residual MLP (its own module types, no blocks declared) the
// planner (optim/plan_training.h) dry-runs every candidate of its grid; each is then trained
// for real on the CPU in interleaved rounds (A B C ... A B C ...) and its median step time
// compared with the prediction.
//
//   ./build/bench/bench_plan_rank [--rounds 3] [--steps 3] [--batch 256] [--width 256]
//
// Prints one row per candidate (predicted and measured ms per step, predicted peak reserved),
// Spearman's rho, and for budgets at the quartiles of the peaks the chosen plan against the
// fastest measured one that fits. Quiet machines only: the ranking is of milliseconds.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "autograd/ops.h"
#include "memory/estimate.h"
#include "memory/memory.h"
#include "optim/plan_training.h"
#include "testing/residual_mlp.h"  // tests/testing: the planner tests' user model

using namespace tally;

namespace {

// Ranks (1-based, ties averaged).
std::vector<double> ranks(const std::vector<double>& v) {
  std::vector<size_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return v[a] < v[b]; });
  std::vector<double> r(v.size());
  for (size_t i = 0; i < idx.size();) {
    size_t j = i;
    while (j + 1 < idx.size() && v[idx[j + 1]] == v[idx[i]]) ++j;
    for (size_t k = i; k <= j; ++k) r[idx[k]] = (static_cast<double>(i + j) / 2.0) + 1.0;
    i = j + 1;
  }
  return r;
}

double spearman(const std::vector<double>& a, const std::vector<double>& b) {
  const std::vector<double> x = ranks(a), y = ranks(b);
  const double n = static_cast<double>(x.size());
  const double mx = std::accumulate(x.begin(), x.end(), 0.0) / n;
  const double my = std::accumulate(y.begin(), y.end(), 0.0) / n;
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (x[i] - mx) * (y[i] - my);
    sxx += (x[i] - mx) * (x[i] - mx);
    syy += (y[i] - my) * (y[i] - my);
  }
  return sxy / std::sqrt(sxx * syy);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t rounds = 3, steps = 3, batch = 256, width = 256;
  const std::pair<std::string_view, int64_t*> flags[] = {
      {"--rounds", &rounds}, {"--steps", &steps}, {"--batch", &batch}, {"--width", &width}};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int64_t v = std::atoll(argv[i + 1]);
    if (v < 1) {
      fmt::print(stderr, "bench_plan_rank: {} {}: expected a positive number\n", flag, argv[i + 1]);
      return 2;
    }
    const auto* known = std::find_if(std::begin(flags), std::end(flags),
                                     [&](const auto& f) { return f.first == flag; });
    if (known == std::end(flags)) {
      fmt::print(stderr, "bench_plan_rank: unknown flag {}\n", flag);
      return 2;
    }
    *known->second = v;
  }
  constexpr int64_t kIn = 64, kBlocks = 4, kClasses = 10;
  auto factory = [&](const nn::PlanCandidate&) {
    manual_seed(0);
    return std::make_shared<testing::MyNet>(kIn, width, kBlocks, kClasses);
  };
  const nn::LossFn loss = [](nn::Module& m, const std::vector<Tensor>& b) {
    return cross_entropy(m(b[0]), b[1]);
  };
  std::vector<Tensor> data;
  {
    memory::CategoryScope input(memory::Category::input);
    data = {randn({batch, kIn}), randint(0, kClasses, {batch})};
  }
  nn::TrainingPlanOptions o;
  o.budget = memory::meta_target(o.target).capacity;  // everything fits: the peaks and times
  o.steps = steps;
  const nn::MemoryPlan all = nn::plan_memory(factory, loss, data, o);

  // Each candidate trained for real, `rounds` times in interleaved order: the median step.
  std::vector<std::vector<double>> times(all.candidates.size());
  for (int64_t r = 0; r < rounds; ++r)
    for (size_t i = 0; i < all.candidates.size(); ++i) {
      auto model = factory(all.candidates[i].candidate);
      const auto t0 = std::chrono::steady_clock::now();
      (void)nn::train_candidate(*model, all.candidates[i].candidate, loss, data, steps, o);
      times[i].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e3 /
          static_cast<double>(steps));
    }
  std::vector<double> predicted, measured;
  fmt::print("{:<64} {:>12} {:>12} {:>12}\n", "candidate", "pred ms", "meas ms", "peak MiB");
  for (size_t i = 0; i < all.candidates.size(); ++i) {
    const nn::PlannedCandidate& c = all.candidates[i];
    predicted.push_back(c.step_seconds * 1e3);
    measured.push_back(median(times[i]));
    fmt::print("{:<64} {:>12.2f} {:>12.2f} {:>12.1f}\n", c.candidate.str(), predicted.back(),
               measured.back(), static_cast<double>(c.estimate.peak_reserved) / 1048576.0);
  }
  fmt::print("Spearman rho (predicted vs measured step time, {} candidates): {:.3f}\n",
             predicted.size(), spearman(predicted, measured));

  // At budgets across the peaks: the chosen plan against the fastest measured one that fits.
  std::vector<int64_t> peaks;
  for (const auto& c : all.candidates) peaks.push_back(c.estimate.peak_reserved);
  std::sort(peaks.begin(), peaks.end());
  const memory::MetaTarget target = memory::meta_target(o.target);
  for (const double q : {0.25, 0.5, 0.75, 1.0}) {
    const int64_t budget = peaks[std::min(
        peaks.size() - 1, static_cast<size_t>(q * static_cast<double>(peaks.size() - 1)))];
    const nn::MemoryPlan plan =
        nn::choose_plan(all.candidates, static_cast<size_t>(budget), target);
    double chosen = 0, fastest = 1e300;
    for (size_t i = 0; i < all.candidates.size(); ++i) {
      if (!all.candidates[i].fits || all.candidates[i].estimate.peak_reserved > budget) continue;
      fastest = std::min(fastest, measured[i]);
      if (all.candidates[i].candidate.str() == plan.chosen.candidate.str()) chosen = measured[i];
    }
    fmt::print(
        "budget {:.1f} MiB: chosen {} measured {:.2f} ms, fastest fitting {:.2f} ms ({:+.1f}%)\n",
        static_cast<double>(budget) / 1048576.0, plan.chosen.candidate.str(), chosen, fastest,
        (chosen / fastest - 1) * 100);
  }
  return 0;
}
