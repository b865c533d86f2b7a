// Counter-based random numbers (Philox-4x32-10): the value of element i depends only on
// (seed, offset + i), so the same seed gives the same numbers on CPU and CUDA, and a
// generator's state is two integers (saved and restored by checkpointing for dropout).
#pragma once

#include <array>
#include <cstdint>

namespace tally {

struct PhiloxState {
  uint64_t seed = 0;
  uint64_t offset = 0;  // counters consumed so far (in 4-value blocks)
};

// Philox-4x32-10 on a 128-bit counter with a 64-bit key.
std::array<uint32_t, 4> philox4x32(uint64_t counter_lo, uint64_t counter_hi, uint64_t key);

// Uniform float in [0, 1) from 24 random bits; a standard normal from two uniforms.
inline float uniform_from_bits(uint32_t x) { return static_cast<float>(x >> 8) * (1.0f / 16777216.0f); }

class Generator {
 public:
  explicit Generator(uint64_t seed = 0x853c49e6748fea9bull) { state_.seed = seed; }
  void manual_seed(uint64_t seed) { state_ = PhiloxState{seed, 0}; }
  PhiloxState state() const { return state_; }
  void set_state(PhiloxState s) { state_ = s; }
  // Reserve `n` values: returns the state to generate them from, and advances.
  PhiloxState reserve(uint64_t n) {
    PhiloxState s = state_;
    state_.offset += (n + 3) / 4;
    return s;
  }

 private:
  PhiloxState state_;
};

// The default generator (torch.manual_seed).
Generator& default_generator();
void manual_seed(uint64_t seed);

}  // namespace tally
