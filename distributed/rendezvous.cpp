#include "distributed/rendezvous.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace tally::distributed {
namespace {

using Clock = std::chrono::steady_clock;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno != 0 || *end != '\0' || x < 0 || x > 1000000)
    throw std::invalid_argument(
        fmt::format("environment variable {}='{}': expected a non-negative integer", name, v));
  return static_cast<int>(x);
}

// Closes the socket on scope exit.
struct Fd {
  int fd = -1;
  explicit Fd(int f = -1) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

std::string where(const RendezvousOptions& o) {
  return fmt::format("{}:{}", o.host, o.port);
}

int remaining_ms(Clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(left);
}

// Resolves host:port (IPv4 or a name) to a socket address.
sockaddr_in resolve(const RendezvousOptions& o) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(o.host.c_str(), std::to_string(o.port).c_str(), &hints, &res);
  if (rc != 0 || !res)
    throw std::runtime_error(fmt::format("rendezvous {}: cannot resolve MASTER_ADDR '{}': {}",
                                         where(o), o.host, ::gai_strerror(rc)));
  sockaddr_in addr{};
  std::memcpy(&addr, res->ai_addr, sizeof(addr));
  ::freeaddrinfo(res);
  return addr;
}

// Waits until `fd` is readable/writable or the deadline passes.
void wait_fd(int fd, short events, Clock::time_point deadline, const RendezvousOptions& o,
             const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc > 0) return;
    if (rc == 0)
      throw std::runtime_error(
          fmt::format("rendezvous {} (rank {} of {}): timed out after {} ms {}", where(o), o.rank,
                      o.world_size, o.timeout.count(), what));
    if (errno != EINTR)
      throw std::runtime_error(
          fmt::format("rendezvous {}: poll failed {}: {}", where(o), what, std::strerror(errno)));
  }
}

void send_all(int fd, const void* data, size_t n, Clock::time_point deadline,
              const RendezvousOptions& o) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    wait_fd(fd, POLLOUT, deadline, o, "sending");
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw std::runtime_error(
          fmt::format("rendezvous {}: send failed: {}", where(o), std::strerror(errno)));
    }
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void recv_all(int fd, void* data, size_t n, Clock::time_point deadline,
              const RendezvousOptions& o) {
  char* p = static_cast<char*>(data);
  size_t got = 0;
  while (got < n) {
    wait_fd(fd, POLLIN, deadline, o, "waiting for rank 0's bytes");
    const ssize_t k = ::recv(fd, p + got, n - got, 0);
    if (k == 0)
      throw std::runtime_error(
          fmt::format("rendezvous {}: connection closed after {} of {} bytes", where(o), got, n));
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw std::runtime_error(
          fmt::format("rendezvous {}: recv failed: {}", where(o), std::strerror(errno)));
    }
    got += static_cast<size_t>(k);
  }
}

// Message: 8-byte magic, 8-byte little-endian length, payload.
constexpr uint64_t kMagic = 0x54414c4c59525a31ull;  // "TALLYRZ1"

std::vector<uint8_t> serve(const RendezvousOptions& o, const std::vector<uint8_t>& payload) {
  const auto deadline = Clock::now() + o.timeout;
  Fd listener(::socket(AF_INET, SOCK_STREAM, 0));
  if (listener.fd < 0)
    throw std::runtime_error(
        fmt::format("rendezvous {}: socket: {}", where(o), std::strerror(errno)));
  const int one = 1;
  ::setsockopt(listener.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr = resolve(o);
  if (::bind(listener.fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
    throw std::runtime_error(
        fmt::format("rendezvous {}: rank 0 cannot listen there (bind: {}); is MASTER_PORT in use?",
                    where(o), std::strerror(errno)));
  if (::listen(listener.fd, 128) != 0)
    throw std::runtime_error(
        fmt::format("rendezvous {}: listen: {}", where(o), std::strerror(errno)));
  const uint64_t header[2] = {kMagic, static_cast<uint64_t>(payload.size())};
  for (int served = 1; served < o.world_size; ++served) {
    wait_fd(
        listener.fd, POLLIN, deadline, o,
        fmt::format("waiting for ranks to connect ({} of {} arrived)", served - 1, o.world_size - 1)
            .c_str());
    Fd conn(::accept(listener.fd, nullptr, nullptr));
    if (conn.fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) {
        --served;
        continue;
      }
      throw std::runtime_error(
          fmt::format("rendezvous {}: accept: {}", where(o), std::strerror(errno)));
    }
    send_all(conn.fd, header, sizeof(header), deadline, o);
    send_all(conn.fd, payload.data(), payload.size(), deadline, o);
    // Wait for the client's one-byte acknowledgement so the bytes are delivered before close.
    uint8_t ack = 0;
    recv_all(conn.fd, &ack, 1, deadline, o);
  }
  return payload;
}

std::vector<uint8_t> connect_and_receive(const RendezvousOptions& o) {
  const auto deadline = Clock::now() + o.timeout;
  const sockaddr_in addr = resolve(o);
  std::string last_error = "no attempt";
  auto backoff = std::chrono::milliseconds(10);
  while (true) {
    Fd s(::socket(AF_INET, SOCK_STREAM, 0));
    if (s.fd < 0)
      throw std::runtime_error(
          fmt::format("rendezvous {}: socket: {}", where(o), std::strerror(errno)));
    if (::connect(s.fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) {
      uint64_t header[2] = {0, 0};
      recv_all(s.fd, header, sizeof(header), deadline, o);
      if (header[0] != kMagic)
        throw std::runtime_error(
            fmt::format("rendezvous {}: the peer is not a Tally rank 0 (bad magic)", where(o)));
      if (header[1] > (1u << 20))
        throw std::runtime_error(
            fmt::format("rendezvous {}: implausible payload of {} bytes", where(o), header[1]));
      std::vector<uint8_t> bytes(header[1]);
      recv_all(s.fd, bytes.data(), bytes.size(), deadline, o);
      const uint8_t ack = 1;
      send_all(s.fd, &ack, 1, deadline, o);
      return bytes;
    }
    last_error = std::strerror(errno);
    if (Clock::now() >= deadline)
      throw std::runtime_error(
          fmt::format("rendezvous {} (rank {} of {}): timed out after {} ms connecting to rank 0 "
                      "(last error: {}); "
                      "check MASTER_ADDR/MASTER_PORT and that rank 0 is running",
                      where(o), o.rank, o.world_size, o.timeout.count(), last_error));
    std::this_thread::sleep_for(
        std::min(backoff, std::chrono::milliseconds(remaining_ms(deadline) + 1)));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
}

}  // namespace

DistEnv DistEnv::from_env() {
  DistEnv e;
  e.world_size = env_int("WORLD_SIZE", 1);
  e.rank = env_int("RANK", 0);
  e.local_rank = env_int("LOCAL_RANK", e.rank);
  if (const char* a = std::getenv("MASTER_ADDR"); a && *a) e.master_addr = a;
  e.master_port = env_int("MASTER_PORT", e.master_port);
  if (e.world_size < 1)
    throw std::invalid_argument("environment variable WORLD_SIZE=0: expected >= 1");
  if (e.rank >= e.world_size)
    throw std::invalid_argument(
        fmt::format("environment: RANK={} is not below WORLD_SIZE={}", e.rank, e.world_size));
  if (e.master_port < 1 || e.master_port > 65535)
    throw std::invalid_argument(
        fmt::format("environment variable MASTER_PORT={}: expected 1..65535", e.master_port));
  return e;
}

std::vector<uint8_t> exchange_bytes(const RendezvousOptions& options,
                                    const std::vector<uint8_t>& payload) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size)
    throw std::invalid_argument(fmt::format("exchange_bytes: rank {} of world size {} is invalid",
                                            options.rank, options.world_size));
  if (options.world_size == 1) return payload;
  return options.rank == 0 ? serve(options, payload) : connect_and_receive(options);
}

}  // namespace tally::distributed
