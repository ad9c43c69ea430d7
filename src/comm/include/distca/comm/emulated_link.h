// EmulatedLink: a Communicator decorator that gives this rank a network link of a chosen
// latency and bandwidth, so that overlap of communication with compute can be measured
// honestly on one CPU machine, where shared-memory copies compete with compute for the same
// cores. The wrapped communicator moves the data; the operation is reported complete only
// once the link would have delivered it: it starts when posted or when the link's previous
// operation is done (one operation on the wire at a time, full duplex), and takes
// latency + max(bytes out, bytes in) / bandwidth, bytes to and from this rank itself excluded.
// Waiting sleeps; nothing spins.
//
// It also counts what crosses the link (operations, bytes out and in, bytes per peer), which
// tests use to check the runtime's traffic against the plan.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "distca/comm/communicator.h"

namespace distca::comm {

struct LinkOptions {
  double latency_seconds = 0;   // per operation
  double bytes_per_second = 0;  // per direction; 0: unlimited (counting only)
  Status validate() const;
};

struct LinkCounters {
  int64_t operations = 0;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t wire_bytes = 0;              // sum over operations of max(bytes out, bytes in)
  std::vector<int64_t> bytes_sent_to;  // (R) all-to-all-v bytes per destination
  double busy_seconds = 0;             // emulated time the link was occupied
};

class EmulatedLink final : public Communicator {
 public:
  // `inner` must outlive this object.
  EmulatedLink(Communicator& inner, LinkOptions options);

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string name() const override;

  Result<std::unique_ptr<Work>> all_to_all_v_async(const AllToAllV& a) override;
  // Collectives are priced as a ring: 2 (R - 1) / R of the data each way for the all-reduce,
  // (R - 1) / R for the broadcast, and latency alone for the barrier.
  Result<std::unique_ptr<Work>> all_reduce_sum_async(float* data, int64_t count) override;
  Result<std::unique_ptr<Work>> broadcast_async(void* data, int64_t bytes, int root) override;
  Result<std::unique_ptr<Work>> barrier_async() override;
  // Point to point and sub-groups go to the inner communicator undelayed (the link models the
  // attention exchange only).
  Result<std::unique_ptr<Work>> send_async(const void* data, int64_t bytes, int peer, int tag) override {
    return inner_.send_async(data, bytes, peer, tag);
  }
  Result<std::unique_ptr<Work>> recv_async(void* data, int64_t bytes, int peer, int tag) override {
    return inner_.recv_async(data, bytes, peer, tag);
  }
  Result<std::unique_ptr<Communicator>> split(int color, int key, const std::string& label) override {
    return inner_.split(color, key, label);
  }
  int world_rank() const override { return inner_.world_rank(); }
  Status progress() override { return inner_.progress(); }
  void abort(const std::string& reason) override { inner_.abort(reason); }

  const LinkCounters& counters() const { return counters_; }
  void reset_counters();
  const LinkOptions& options() const { return options_; }
  // A new latency and bandwidth for the operations posted from now on (those in flight keep
  // theirs): a benchmark tunes the link between runs without rebuilding what holds it.
  // REQUIRES: options.validate() is ok.
  void set_options(const LinkOptions& options);

 private:
  Result<std::unique_ptr<Work>> delay(Result<std::unique_ptr<Work>> inner, int64_t bytes_out,
                                      int64_t bytes_in);

  Communicator& inner_;
  LinkOptions options_;
  LinkCounters counters_;
  std::chrono::steady_clock::time_point link_free_{};
};

}  // namespace distca::comm
