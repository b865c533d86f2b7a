// The TCP exchange of rank 0's bytes (NCCL's unique id) on loopback, torchrun's
// environment variables, and per-rank file names.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <future>
#include <optional>
#include <thread>

#include "base/rank_path.h"
#include "distributed/rendezvous.h"
#include "memory/memory.h"
#include "memory/timeline.h"

namespace tally::distributed {
namespace {

// A port that is free right now (bind to 0, read it back, close).
int free_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(s);
  return ntohs(a.sin_port);
}

std::vector<uint8_t> unique_id_like() {
  std::vector<uint8_t> b(128);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(i * 7 + 3);
  return b;
}

TEST(Rendezvous, TwoRanksGetRankZerosBytes) {
  const int port = free_port();
  const auto payload = unique_id_like();
  // Rank 1 starts first: it must retry until rank 0 listens.
  auto client = std::async(std::launch::async, [&] {
    return exchange_bytes({.host = "127.0.0.1",
                           .port = port,
                           .rank = 1,
                           .world_size = 2,
                           .timeout = std::chrono::seconds(20)},
                          {});
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto served = exchange_bytes({.host = "127.0.0.1",
                                      .port = port,
                                      .rank = 0,
                                      .world_size = 2,
                                      .timeout = std::chrono::seconds(20)},
                                     payload);
  EXPECT_EQ(served, payload);
  EXPECT_EQ(client.get(), payload);
}

TEST(Rendezvous, FourRanksByHostName) {
  const int port = free_port();
  const auto payload = unique_id_like();
  std::vector<std::future<std::vector<uint8_t>>> clients;
  for (int r = 1; r < 4; ++r)
    clients.push_back(std::async(std::launch::async, [&, r] {
      return exchange_bytes({.host = "localhost",
                             .port = port,
                             .rank = r,
                             .world_size = 4,
                             .timeout = std::chrono::seconds(20)},
                            {});
    }));
  exchange_bytes({.host = "localhost",
                  .port = port,
                  .rank = 0,
                  .world_size = 4,
                  .timeout = std::chrono::seconds(20)},
                 payload);
  for (auto& c : clients) EXPECT_EQ(c.get(), payload);
}

// exchange_bytes with `o` on 127.0.0.1 at a free port (nobody listens there) times out with
// an error naming the address and `says`.
void expect_timeout(RendezvousOptions o, const std::vector<uint8_t>& payload,
                    const std::string& says) {
  o.host = "127.0.0.1";
  o.port = free_port();
  try {
    exchange_bytes(o, payload);
    FAIL() << "expected a timeout";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(o.port)), std::string::npos) << msg;
    EXPECT_NE(msg.find(says), std::string::npos) << msg;
  }
}

TEST(Rendezvous, WrongPortTimesOutNamingHostAndPort) {
  expect_timeout({.rank = 1, .world_size = 2, .timeout = std::chrono::milliseconds(300)}, {},
                 "timed out");
}

TEST(Rendezvous, RankZeroTimesOutWhenNobodyComes) {
  expect_timeout({.rank = 0, .world_size = 3, .timeout = std::chrono::milliseconds(200)},
                 unique_id_like(), "0 of 2 arrived");
}

TEST(Rendezvous, WorldSizeOneNeedsNoSocket) {
  EXPECT_EQ(exchange_bytes({.port = 1, .rank = 0, .world_size = 1}, {1, 2, 3}),
            (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_THROW(exchange_bytes({.rank = 2, .world_size = 2}, {}), std::invalid_argument);
}

// Sets environment variables for the scope and restores them after.
class EnvGuard {
 public:
  EnvGuard(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (auto [k, v] : vars) {
      const char* old = std::getenv(k);
      saved_.push_back({k, old ? std::optional<std::string>(old) : std::nullopt});
      if (v)
        ::setenv(k, v, 1);
      else
        ::unsetenv(k);
    }
  }
  ~EnvGuard() {
    for (auto& [k, v] : saved_) {
      if (v)
        ::setenv(k.c_str(), v->c_str(), 1);
      else
        ::unsetenv(k.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST(DistEnv, FromTorchrunVariables) {
  {
    EnvGuard g({{"RANK", "3"},
                {"WORLD_SIZE", "4"},
                {"LOCAL_RANK", "1"},
                {"MASTER_ADDR", "10.0.0.7"},
                {"MASTER_PORT", "29555"}});
    const DistEnv e = DistEnv::from_env();
    EXPECT_EQ(e.rank, 3);
    EXPECT_EQ(e.world_size, 4);
    EXPECT_EQ(e.local_rank, 1);
    EXPECT_EQ(e.master_addr, "10.0.0.7");
    EXPECT_EQ(e.master_port, 29555);
    EXPECT_TRUE(e.distributed());
  }
  {
    EnvGuard g({{"RANK", nullptr},
                {"WORLD_SIZE", nullptr},
                {"LOCAL_RANK", nullptr},
                {"MASTER_ADDR", nullptr},
                {"MASTER_PORT", nullptr}});
    const DistEnv e = DistEnv::from_env();
    EXPECT_EQ(e.rank, 0);
    EXPECT_EQ(e.world_size, 1);
    EXPECT_FALSE(e.distributed());
  }
  {
    EnvGuard g({{"RANK", "2"}, {"WORLD_SIZE", "2"}});
    EXPECT_THROW(DistEnv::from_env(), std::invalid_argument);
  }
  {
    EnvGuard g({{"RANK", "x"}, {"WORLD_SIZE", "2"}});
    EXPECT_THROW(DistEnv::from_env(), std::invalid_argument);
  }
  {
    EnvGuard g({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}});
    EXPECT_THROW(DistEnv::from_env(), std::invalid_argument);
  }
}

TEST(RankPath, RankGoesBeforeTheExtension) {
  using base::per_rank_path;
  EXPECT_EQ(base::per_rank_path("x.pickle", 1, 2), "x.rank1.pickle");
  EXPECT_EQ(base::per_rank_path("out/run.timeline.json", 0, 4), "out/run.timeline.rank0.json");
  EXPECT_EQ(base::per_rank_path("dir.d/snap", 3, 4), "dir.d/snap.rank3");
  EXPECT_EQ(base::per_rank_path("x.pickle", 0, 1), "x.pickle");              // single process
  EXPECT_EQ(base::per_rank_path("x.rank1.pickle", 1, 2), "x.rank1.pickle");  // already there
  {
    EnvGuard g({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
    EXPECT_EQ(base::per_rank_path("a.pickle"), "a.rank1.pickle");
  }
  {
    EnvGuard g({{"RANK", nullptr}, {"WORLD_SIZE", nullptr}});
    EXPECT_EQ(base::per_rank_path("a.pickle"), "a.pickle");
  }
}

TEST(RankPath, SnapshotsAndTimelinesCarryTheRank) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("tally_rank_path_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  {
    EnvGuard g({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
    memory::get_allocator(memory::Device::cpu()).dump_snapshot((dir / "s.pickle").string());
    memory::write_timeline_json(memory::MemoryTimeline{}, (dir / "t.json").string());
  }
  EXPECT_TRUE(fs::exists(dir / "s.rank1.pickle"));
  EXPECT_FALSE(fs::exists(dir / "s.pickle"));
  EXPECT_TRUE(fs::exists(dir / "t.rank1.json"));
  memory::get_allocator(memory::Device::cpu()).dump_snapshot((dir / "single.pickle").string());
  EXPECT_TRUE(fs::exists(dir / "single.pickle"));  // no WORLD_SIZE: the name as given
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tally::distributed
