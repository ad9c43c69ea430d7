// Dispatcher: runs core attention of one plan through the attention servers (docs/design.md §4).
// Forward: Q/K/V rows go from their owners to the servers the plan names (one all-to-all-v;
// K/V once per (document, server)), each server runs the fused kernel over its tasks, and O
// and LSE come back into the linear layout. Backward is the mirror: dO (and, stateless, Q, O,
// LSE, K, V again) to the servers, dQ and dK/dV back; dK/dV of a row used by several tasks are
// summed in fp32 on the server, then at the owner in rank order of the servers. dK/dV travel in
// DispatchOptions::grad_return: fp32, or bf16 (each server's partial sum rounded to nearest
// even, the paper's choice: half the bytes), widened and summed in fp32 at the owner. dQ keeps
// the activation dtype (fp32): the paper rounds only the dK/dV partial sums.
//
// Key-range splits (route.h): a query row in several tasks gets one partial (O, LSE) from each;
// the owner folds them by the LSE merge (kernels::lse_merge) and sums their dQ in fp32, in a
// fixed order (servers in rank order, this rank's own at its place, segments in route order),
// so a run's results do not depend on message timing. The backward of such a row needs its
// final O and LSE: stateless sends them anyway; stateful sends them with dO for split rows
// (the server's own are partial). Rows in one task only are copied, as without splits.
//
// Every call is collective: all ranks make the same calls in the same order. A pass runs whole
// (forward / backward) or in stages for ping-pong: start_* (pack, post the dispatch, copy the
// rows this rank serves itself), finish_comm (wait, unpack), compute (the server's kernel),
// start_return (pack, post the return), finish_comm (wait, unpack into the linear layout).
// One exchange is in flight per dispatcher; two nano-batches use two dispatchers.
//
// Bytes sent per phase are exactly plan::count_traffic's (less the held K/V rows' K/V and dK/dV,
// DispatchOptions::held_kv) with plan::token_bytes(Hq, Hkv, D, 4,
// grad_return). fp32 throughout but on the wire of a bf16 return. Thread safety: one call at a
// time per object.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "distca/comm/communicator.h"
#include "distca/core/status.h"
#include "distca/kernels/cpu.h"
#include "distca/plan/batch.h"
#include "distca/plan/plan.h"
#include "distca/layout/route.h"

namespace distca::runtime {

// What a server holds for one pass: the rows it received (server layout, see route.h) and its
// outputs. A stateful backward needs the buffers its forward filled: keep one per (layer,
// nano-batch). A stateless run can share one across layers.
struct ServerBuffers {
  std::vector<float> q, k, v, o, lse, d_o, dq, dk, dv;
  const void* forward_of = nullptr;  // the dispatcher whose last forward filled q, k, v, o, lse
  // Held K/V (DispatchOptions::held_kv): the earlier dispatcher's buffers of the same layer,
  // whose K/V rows this pass copies instead of receiving them again, and into whose held_dk /
  // held_dv it adds its dK/dV of those rows; the earlier one's backward compute adds them to
  // its own before its return. So the later dispatcher's backward must compute first.
  ServerBuffers* held = nullptr;
  std::vector<float> held_dk, held_dv;  // [K/V rows, Hkv, D] while a later pass's are pending
  bool backward_computed = false;       // this layer's backward compute ran since its forward
};

// Linear-layout tensors of this rank, num_local_rows() rows each: Q/O/dO/dQ [T, Hq, D],
// K/V/dK/dV [T, Hkv, D], LSE [T, Hq].
struct ForwardArgs {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  float* o = nullptr;    // out
  float* lse = nullptr;  // out
};
struct BackwardArgs {
  // q, k, v, o, lse: the forward's inputs and (merged) outputs, read in stateless mode; o and
  // lse also in stateful mode when the plan splits key ranges (for the split rows).
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* o = nullptr;
  const float* lse = nullptr;
  const float* d_o = nullptr;
  float* dq = nullptr;  // out
  float* dk = nullptr;  // out (overwritten: the sum of every server's contribution)
  float* dv = nullptr;  // out
};

// The attention server's compute over the rows it received (server layout, tasks from the
// route). The default is the kernel registry's "cpu" entry (kernels::CpuAttention); a GPU backend
// (CudaServerKernel) or a test plugs in here.
class ServerKernel {
 public:
  virtual ~ServerKernel() = default;
  virtual Status forward(const kernels::AttnFwdParams<float>& p) = 0;
  virtual Status backward(const kernels::AttnBwdParams<float>& p) = 0;
  // Whether the kernel runs heads of this shape (dims' row counts are 0), as its registry entry
  // says (kernels::supports); Dispatcher::create asks it before any byte moves. The default, for
  // a kernel the registry does not describe (a test's), accepts.
  virtual Status supports(const kernels::AttnDims& dims) const {
    (void)dims;
    return Status::ok();
  }
};

struct DispatchOptions {
  plan::BackwardMode backward_mode = plan::BackwardMode::kStateless;
  int num_threads = 0;          // CpuAttention threads; <= 0: one per hardware thread
  std::optional<float> scale;   // softmax scale; default 1 / sqrt(D)
  ServerKernel* kernel = nullptr;  // not owned; nullptr: a CpuAttention of num_threads
  // With kernel == nullptr: called by the CpuAttention between its work items (kernels::
  // CpuAttentionOptions::poll), so that an exchange in flight moves while this rank computes its
  // tasks (ping-pong over MPI, which moves a message only inside MPI calls).
  std::function<void()> poll;
  // The dtype dK/dV partial sums cross ranks in on the backward return. Rows a rank serves
  // itself never travel and are summed unrounded.
  plan::GradReturn grad_return = plan::GradReturn::kFp32;
  // The plan's tasks cover part of the batch's queries (a nano-batch of layout::split_step,
  // whose layout also holds rows it reads only as K/V): checked for shape, not coverage.
  bool is_part = false;
  // With is_part: the K/V layout (route.h's kv_layout, in this plan's document numbering) of an
  // earlier dispatcher's forward of the same layer, kept on the servers: rows a server holds
  // there are not sent again (ServerBuffers::held). Stateful backward only.
  std::vector<layout::KvInterval> held_kv;
};

// What a dispatcher's buffers hold on one rank for a route, in bytes: exact, for the dispatcher
// sizes its vectors to these (capacity included), so that a caller can price a plan before it
// runs it (train::DispatchAttention::predict_bytes).
struct BufferBytes {
  int64_t forward_set = 0;   // a server's Q, K, V, O and LSE of one pass (ServerBuffers q..lse)
  int64_t backward_set = 0;  // its dO, dQ, dK and dV
  int64_t kv = 0;            // its K (held_dk and held_dv are each this large while pending)
  // [BackwardMode] the exchange's send and receive buffers, each as large as its largest phase's
  // (they are reused phase after phase).
  std::array<int64_t, 2> exchange{};
};
BufferBytes buffer_bytes(const layout::Route& route, const layout::HeadShape& heads, plan::GradReturn grad_return);

struct PhaseStats {
  int64_t calls = 0;
  int64_t bytes_sent = 0;      // to other ranks (rows a rank serves itself are copied)
  int64_t bytes_received = 0;
  double wait_seconds = 0;     // blocked in finish_comm (unpacking included)
};

class Dispatcher {
 public:
  // Collective. Checks that the plan's hash matches its tasks and is the same on every rank
  // before anything else moves; a mismatch is an error on every rank.
  static Result<std::unique_ptr<Dispatcher>> create(comm::Communicator& comm, const plan::Batch& batch,
                                                    const plan::Plan& plan, layout::HeadShape heads,
                                                    DispatchOptions options = {});
  ~Dispatcher();

  Status forward(const ForwardArgs& args, ServerBuffers& server);
  Status backward(const BackwardArgs& args, ServerBuffers& server);

  // The stages (see above). The args and buffers must stay valid until the pass's last
  // finish_comm.
  Status start_forward(const ForwardArgs& args, ServerBuffers& server);
  Status start_backward(const BackwardArgs& args, ServerBuffers& server);
  Status finish_comm();
  Status compute();
  Status start_return();

  const layout::Route& route() const { return route_; }
  int64_t num_local_rows() const { return route_.num_local_rows; }
  const layout::HeadShape& heads() const { return heads_; }
  // True when every task is served on the rank that holds all of its rows: no phase moves a
  // byte, and no exchange is posted (the ranks do not synchronize).
  bool is_silent() const { return is_silent_; }
  plan::BackwardMode backward_mode() const { return options_.backward_mode; }
  const PhaseStats& stats(plan::Phase phase) const { return stats_[static_cast<int>(phase)]; }
  // Bytes the exchange's send and receive buffers hold: the largest phase's so far (they are
  // reused, phase after phase).
  int64_t exchange_bytes() const;
  void reset_stats() { stats_ = {}; }

 private:
  struct Field;
  struct Part;
  struct Exchange;
  enum class Stage { kIdle, kDispatching, kDispatched, kComputed, kReturning };

  Dispatcher(comm::Communicator& comm, layout::Route route, layout::HeadShape heads, DispatchOptions options);
  // Packs and posts one phase; copies this rank's own rows at once unless they accumulate.
  Status post(plan::Phase phase);
  void size_server_buffers(bool is_backward);
  Status copy_held_kv();    // forward, after the dispatch: the held rows from the earlier buffer
  Status add_held_grads();  // backward, after the kernel: the held rows' dK/dV (both sides)
  // The tensors each part of the phase's messages carries, and how a return combines them.
  void fields(plan::Phase phase, std::array<Part, 3>& parts) const;

  comm::Communicator& comm_;
  layout::Route route_;
  layout::HeadShape heads_;
  DispatchOptions options_;
  std::unique_ptr<ServerKernel> own_kernel_;
  ServerKernel* kernel_ = nullptr;
  std::unique_ptr<Exchange> exchange_;
  std::array<PhaseStats, plan::kNumPhases> stats_{};

  Stage stage_ = Stage::kIdle;
  bool is_backward_ = false;
  bool is_silent_ = false;  // no task reads a row held by another rank: no exchange is posted
  ForwardArgs fwd_;
  BackwardArgs bwd_;
  ServerBuffers* server_ = nullptr;
};

}  // namespace distca::runtime
