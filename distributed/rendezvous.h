// Rendezvous: who this process is in a data-parallel job (torchrun's environment variables
// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and the one-shot TCP exchange
// that hands rank 0's bytes (NCCL's ncclUniqueId) to every other rank: rank 0 listens on
// MASTER_ADDR:MASTER_PORT, the others connect with retries until a timeout.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace tally::distributed {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;

  // From the environment; absent variables keep the defaults above (a single process).
  // Throws std::invalid_argument naming the variable when one is malformed or
  // inconsistent (RANK >= WORLD_SIZE, a port outside 1..65535).
  static DistEnv from_env();
  bool distributed() const { return world_size > 1; }
};

struct RendezvousOptions {
  std::string host = "127.0.0.1";
  int port = 29500;
  int rank = 0;
  int world_size = 1;
  // Rank 0: how long to wait for all others to connect; others: how long to keep retrying
  // the connection and waiting for the bytes.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
};

// Rank 0 sends `payload` to each of the world_size - 1 other ranks and returns it; every
// other rank ignores its `payload` and returns the bytes it received from rank 0. Throws
// std::runtime_error naming host:port on a timeout, a refused bind, or a short read.
std::vector<uint8_t> exchange_bytes(const RendezvousOptions& options,
                                    const std::vector<uint8_t>& payload);

}  // namespace tally::distributed
