// Counter-based random numbers (Philox-4x32-10): the value of element i depends only on
// (seed, offset + i), so the same seed gives the same numbers on CPU and CUDA, and a
// generator's state is two integers (saved and restored by checkpointing for dropout).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace tally {

struct PhiloxState {
  uint64_t seed = 0;
  uint64_t offset = 0;  // counters consumed so far (in 4-value blocks)
};

#if defined(__CUDACC__)
#define TALLY_HOST_DEVICE __host__ __device__
#else
#define TALLY_HOST_DEVICE
#endif

struct Philox4 {
  uint32_t v[4];
  TALLY_HOST_DEVICE uint32_t operator[](size_t i) const { return v[i]; }
};

// Philox-4x32-10 on a 128-bit counter with a 64-bit key; the same code runs on the host
// and in CUDA kernels, so both produce the same stream.
TALLY_HOST_DEVICE inline Philox4 philox4x32(uint64_t counter_lo, uint64_t counter_hi,
                                            uint64_t key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n1 = static_cast<uint32_t>(p1);
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    const uint32_t n3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += kW0;
    k1 += kW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Uniform float in [0, 1) from 24 random bits.
TALLY_HOST_DEVICE inline float uniform_from_bits(uint32_t x) {
  return static_cast<float>(x >> 8) * (1.0f / 16777216.0f);
}

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
// torch.get_rng_state / set_rng_state for the default generator (it serves CPU and CUDA).
PhiloxState get_rng_state();
void set_rng_state(PhiloxState state);

}  // namespace tally
