// EmulatedLink: operations complete no earlier than latency + bytes / bandwidth after the link
// is free, one at a time; waiting sleeps instead of spinning; counters see every byte.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <time.h>

#include <chrono>
#include <cmath>
#include <vector>

#include "distca/comm/emulated_link.h"
#include "distca/comm/local_comm.h"

namespace distca::comm {
namespace {

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

TEST(EmulatedLink, DeliversAfterLatencyPlusBytesOverBandwidthWithoutSpinning) {
  auto statuses = LocalWorld::run(2, [](Communicator& base) -> Status {
    // 2 MB at 100 MB/s + 10 ms = 30 ms per operation; two back to back queue: 60 ms.
    EmulatedLink link(base, {0.010, 100e6});
    const int peer = 1 - base.rank();
    std::vector<std::byte> send(4'000'000), recv(4'000'000);
    std::vector<int64_t> counts(2, 0), offsets(2, 0);
    counts[peer] = 2'000'000;
    AllToAllV a{send.data(), counts, offsets, recv.data(), counts, offsets};
    const auto start = std::chrono::steady_clock::now();
    const double cpu0 = thread_cpu_seconds();
    DISTCA_ASSIGN_OR_RETURN(auto w1, link.all_to_all_v_async(a));
    AllToAllV b = a;
    std::vector<int64_t> offsets2(2, 0);
    offsets2[peer] = 2'000'000;
    b.send_offsets = offsets2, b.recv_offsets = offsets2;
    DISTCA_ASSIGN_OR_RETURN(auto w2, link.all_to_all_v_async(b));
    DISTCA_RETURN_IF_ERROR(w1->wait());
    const double first = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    DISTCA_ASSIGN_OR_RETURN(bool w2_done_early, w2->test());
    DISTCA_RETURN_IF_ERROR(w2->wait());
    const double both = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double cpu = thread_cpu_seconds() - cpu0;
    if (first < 0.030 || both < 0.060) return internal_error(fmt::format("delivered early: {} s, {} s", first, both));
    if (w2_done_early) return internal_error("the second operation finished while the first held the link");
    if (cpu > 0.5 * both) return internal_error(fmt::format("waiting burned {} s of CPU in {} s", cpu, both));
    const LinkCounters& c = link.counters();
    if (c.operations != 2 || c.bytes_sent != 4'000'000 || c.bytes_received != 4'000'000 || c.bytes_sent_to[peer] != 4'000'000 ||
        c.bytes_sent_to[base.rank()] != 0) {
      return internal_error("counters do not match the traffic");
    }
    return Status::ok();
  });
  for (const Status& st : statuses) EXPECT_TRUE(st.is_ok()) << st.to_string();
}

TEST(EmulatedLink, NewOptionsPriceTheOperationsPostedAfterThem) {
  auto statuses = LocalWorld::run(2, [](Communicator& base) -> Status {
    // 2 MB at 1 GB/s: 2 ms; then at 100 MB/s + 10 ms: 30 ms, on the link's own clock.
    EmulatedLink link(base, {0, 1e9});
    const int peer = 1 - base.rank();
    std::vector<std::byte> send(2'000'000), recv(2'000'000);
    std::vector<int64_t> counts(2, 0), offsets(2, 0);
    counts[peer] = 2'000'000;
    AllToAllV a{send.data(), counts, offsets, recv.data(), counts, offsets};
    DISTCA_RETURN_IF_ERROR(link.all_to_all_v(a));
    link.set_options({0.010, 100e6});
    const auto start = std::chrono::steady_clock::now();
    DISTCA_RETURN_IF_ERROR(link.all_to_all_v(a));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (seconds < 0.030) return internal_error(fmt::format("delivered after {} s, before the new link's 30 ms", seconds));
    const double busy = link.counters().busy_seconds;
    if (std::abs(busy - 0.032) > 1e-9) return internal_error(fmt::format("busy {} s; the two prices add up to 0.032 s", busy));
    if (link.options().bytes_per_second != 100e6 || link.options().latency_seconds != 0.010) {
      return internal_error("options() does not return the new options");
    }
    return Status::ok();
  });
  for (const Status& st : statuses) EXPECT_TRUE(st.is_ok()) << st.to_string();
}

TEST(EmulatedLink, PassesDataAndErrorsThrough) {
  auto statuses = LocalWorld::run(3, [](Communicator& base) -> Status {
    EmulatedLink link(base, {0.001, 0});
    float x = static_cast<float>(base.rank() + 1);
    DISTCA_RETURN_IF_ERROR(link.all_reduce_sum(&x, 1));
    if (x != 6.0f) return internal_error(fmt::format("all-reduce through the link gave {}", x));
    if (link.name().find("link") == std::string::npos) return internal_error("name: " + link.name());
    return Status::ok();
  });
  for (const Status& st : statuses) EXPECT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_FALSE((LinkOptions{-1, 0}.validate().is_ok()));
  EXPECT_FALSE((LinkOptions{0, -5}.validate().is_ok()));
}

}  // namespace
}  // namespace distca::comm
