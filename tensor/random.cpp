#include "tensor/random.h"

namespace tally {

Generator& default_generator() {
  static Generator g;
  return g;
}

void manual_seed(uint64_t seed) {
  default_generator().manual_seed(seed);
}
PhiloxState get_rng_state() {
  return default_generator().state();
}
void set_rng_state(PhiloxState state) {
  default_generator().set_state(state);
}

}  // namespace tally
