#include "distca/runtime/dispatcher.h"

#include <fmt/format.h>

#include <chrono>
#include <cstring>

namespace distca::runtime {

using plan::Phase;

// One tensor of a message: rows of row_bytes bytes at base (linear or server layout). A field
// that accumulates receives fp32 sums instead of copies.
struct Dispatcher::Field {
  std::byte* base = nullptr;
  int64_t row_bytes = 0;
  bool accumulate = false;
};

struct Dispatcher::Exchange {
  Phase phase = Phase::kFwdDispatch;
  std::vector<std::byte> send, recv;
  std::vector<int64_t> send_counts, send_offsets, recv_counts, recv_offsets;
  std::vector<Field> owner_q, owner_kv, server_q, server_kv;
  std::unique_ptr<comm::Work> work;
};

namespace {

bool is_to_server(Phase phase) { return phase == Phase::kFwdDispatch || phase == Phase::kBwdDispatch; }

template <typename F>
int64_t sum_row_bytes(const std::vector<F>& fields) {
  int64_t b = 0;
  for (const F& f : fields) b += f.row_bytes;
  return b;
}

int64_t sum_rows(const std::vector<Segment>& segments) {
  int64_t rows = 0;
  for (const Segment& s : segments) rows += s.rows;
  return rows;
}

int64_t row_of(const Segment& s, bool is_local) { return is_local ? s.local_row : s.server_row; }

void add_floats(std::byte* dst, const std::byte* src, int64_t bytes) {
  float* d = reinterpret_cast<float*>(dst);
  const int64_t n = bytes / static_cast<int64_t>(sizeof(float));
  for (int64_t i = 0; i < n; ++i) {
    float x;
    std::memcpy(&x, src + i * sizeof(float), sizeof(float));
    d[i] += x;
  }
}

// Message layout: segment after segment, each as one block per field.
template <typename F>
std::byte* pack(const std::vector<Segment>& segments, bool is_local, const std::vector<F>& fields,
                std::byte* out) {
  for (const Segment& s : segments) {
    for (const F& f : fields) {
      const int64_t n = s.rows * f.row_bytes;
      std::memcpy(out, f.base + row_of(s, is_local) * f.row_bytes, n);
      out += n;
    }
  }
  return out;
}

template <typename F>
const std::byte* unpack(const std::vector<Segment>& segments, bool is_local,
                        const std::vector<F>& fields, const std::byte* in) {
  for (const Segment& s : segments) {
    for (const F& f : fields) {
      const int64_t n = s.rows * f.row_bytes;
      std::byte* dst = f.base + row_of(s, is_local) * f.row_bytes;
      if (f.accumulate) {
        add_floats(dst, in, n);
      } else {
        std::memcpy(dst, in, n);
      }
      in += n;
    }
  }
  return in;
}

// The rows a rank serves itself: straight from one layout to the other.
template <typename F>
void copy_own(const std::vector<Segment>& segments, bool from_local, const std::vector<F>& src,
              const std::vector<F>& dst) {
  for (const Segment& s : segments) {
    for (size_t i = 0; i < src.size(); ++i) {
      const int64_t n = s.rows * src[i].row_bytes;
      const std::byte* from = src[i].base + row_of(s, from_local) * src[i].row_bytes;
      std::byte* to = dst[i].base + row_of(s, !from_local) * dst[i].row_bytes;
      if (dst[i].accumulate) {
        add_floats(to, from, n);
      } else {
        std::memcpy(to, from, n);
      }
    }
  }
}

class CpuKernel final : public ServerKernel {
 public:
  explicit CpuKernel(int num_threads) : attention_(kernels::CpuAttentionOptions{num_threads, false}) {}
  Status forward(const kernels::AttnFwdParams<float>& p) override { return attention_.forward(p); }
  Status backward(const kernels::AttnBwdParams<float>& p) override { return attention_.backward(p); }

 private:
  kernels::CpuAttention attention_;
};

std::byte* bytes(const float* p) { return reinterpret_cast<std::byte*>(const_cast<float*>(p)); }
std::byte* bytes(std::vector<float>& v) { return reinterpret_cast<std::byte*>(v.data()); }

}  // namespace

Dispatcher::Dispatcher(comm::Communicator& comm, Route route, HeadShape heads, DispatchOptions options)
    : comm_(comm), route_(std::move(route)), heads_(heads), options_(options),
      exchange_(std::make_unique<Exchange>()) {
  if (options_.kernel == nullptr) own_kernel_ = std::make_unique<CpuKernel>(options_.num_threads);
  kernel_ = options_.kernel ? options_.kernel : own_kernel_.get();
  const auto r = static_cast<size_t>(route_.num_ranks);
  exchange_->send_counts.assign(r, 0);
  exchange_->send_offsets.assign(r, 0);
  exchange_->recv_counts.assign(r, 0);
  exchange_->recv_offsets.assign(r, 0);
}

Dispatcher::~Dispatcher() = default;

Result<std::unique_ptr<Dispatcher>> Dispatcher::create(comm::Communicator& comm, const plan::Batch& batch,
                                                       const plan::Plan& plan, HeadShape heads,
                                                       DispatchOptions options) {
  DISTCA_RETURN_IF_ERROR(heads.validate());
  if (batch.num_ranks != comm.size()) {
    return invalid_argument(fmt::format("the plan is for {} ranks but the communicator has {}",
                                        batch.num_ranks, comm.size()));
  }
  const uint64_t mine = plan.hash;
  if (plan::plan_hash(batch, plan.tasks) != mine) {
    return invalid_argument(fmt::format(
        "rank {}: the plan's hash {:016x} does not match its batch and tasks (a modified plan?)",
        comm.rank(), mine));
  }
  // Same plan everywhere, before any other byte moves: rank 0's hash against each rank's, and
  // a count of mismatches that every rank sees.
  uint64_t root = mine;
  DISTCA_RETURN_IF_ERROR(comm.broadcast(&root, sizeof(root), 0));
  float mismatches = root == mine ? 0.0f : 1.0f;
  DISTCA_RETURN_IF_ERROR(comm.all_reduce_sum(&mismatches, 1));
  if (mismatches > 0) {
    if (root != mine) {
      return invalid_argument(fmt::format("rank {}: plan hash {:016x} differs from rank 0's {:016x}; "
                                          "every rank must run the same plan",
                                          comm.rank(), mine, root));
    }
    return invalid_argument(fmt::format("{} rank(s) hold a plan whose hash differs from rank 0's "
                                        "{:016x}; every rank must run the same plan",
                                        static_cast<int>(mismatches), root));
  }
  DISTCA_ASSIGN_OR_RETURN(Route route, build_route(batch, plan.tasks, comm.rank()));
  auto d = std::unique_ptr<Dispatcher>(new Dispatcher(comm, std::move(route), heads, options));
  // A plan whose every task is served where all of its rows live moves nothing in any phase;
  // every rank sees the same plan, so all of them skip the exchanges together (no all-to-all
  // of empty messages, which would make the ranks wait for each other at every layer).
  d->is_silent_ = true;
  for (const plan::Task& t : plan.tasks) {
    auto remote = [&](int32_t owner, int64_t) { d->is_silent_ = d->is_silent_ && owner == t.server; };
    plan::for_each_owner(batch, t.doc, t.q0, t.q1, remote);
    plan::for_each_owner(batch, t.doc, t.k0, t.k1, remote);
  }
  return d;
}

void Dispatcher::size_server_buffers(bool is_backward) {
  ServerBuffers& s = *server_;
  const auto q = static_cast<size_t>(route_.num_server_q_rows * heads_.num_q_heads * heads_.head_dim);
  const auto kv = static_cast<size_t>(route_.num_server_kv_rows * heads_.num_kv_heads * heads_.head_dim);
  const auto lse = static_cast<size_t>(route_.num_server_q_rows * heads_.num_q_heads);
  if (!is_backward || options_.backward_mode == plan::BackwardMode::kStateless) {
    s.q.resize(q), s.k.resize(kv), s.v.resize(kv), s.o.resize(q), s.lse.resize(lse);
  }
  if (is_backward) s.d_o.resize(q), s.dq.resize(q), s.dk.resize(kv), s.dv.resize(kv);
}

void Dispatcher::fields(Phase phase, std::vector<Field>& owner_q, std::vector<Field>& owner_kv,
                        std::vector<Field>& server_q, std::vector<Field>& server_kv) const {
  const int64_t qr = heads_.num_q_heads * heads_.head_dim * 4;
  const int64_t kr = heads_.num_kv_heads * heads_.head_dim * 4;
  const int64_t lr = heads_.num_q_heads * 4;
  ServerBuffers& s = *server_;
  owner_q.clear(), owner_kv.clear(), server_q.clear(), server_kv.clear();
  switch (phase) {
    case Phase::kFwdDispatch:
      owner_q = {{bytes(fwd_.q), qr}};
      owner_kv = {{bytes(fwd_.k), kr}, {bytes(fwd_.v), kr}};
      server_q = {{bytes(s.q), qr}};
      server_kv = {{bytes(s.k), kr}, {bytes(s.v), kr}};
      break;
    case Phase::kFwdReturn:
      owner_q = {{bytes(fwd_.o), qr}, {bytes(fwd_.lse), lr}};
      server_q = {{bytes(s.o), qr}, {bytes(s.lse), lr}};
      break;
    case Phase::kBwdDispatch:
      if (options_.backward_mode == plan::BackwardMode::kStateful) {
        owner_q = {{bytes(bwd_.d_o), qr}};
        server_q = {{bytes(s.d_o), qr}};
      } else {
        owner_q = {{bytes(bwd_.q), qr}, {bytes(bwd_.o), qr}, {bytes(bwd_.d_o), qr}, {bytes(bwd_.lse), lr}};
        owner_kv = {{bytes(bwd_.k), kr}, {bytes(bwd_.v), kr}};
        server_q = {{bytes(s.q), qr}, {bytes(s.o), qr}, {bytes(s.d_o), qr}, {bytes(s.lse), lr}};
        server_kv = {{bytes(s.k), kr}, {bytes(s.v), kr}};
      }
      break;
    case Phase::kBwdReturn:
      owner_q = {{bytes(bwd_.dq), qr}};
      owner_kv = {{bytes(bwd_.dk), kr, true}, {bytes(bwd_.dv), kr, true}};
      server_q = {{bytes(s.dq), qr}};
      server_kv = {{bytes(s.dk), kr}, {bytes(s.dv), kr}};
      break;
  }
}

Status Dispatcher::post(Phase phase) {
  Exchange& x = *exchange_;
  x.phase = phase;
  fields(phase, x.owner_q, x.owner_kv, x.server_q, x.server_kv);
  const bool to_server = is_to_server(phase);
  // Sender: owners in a dispatch, servers in a return; the receiver is the other side.
  const auto& send_q = to_server ? route_.to_server_q : route_.from_owner_q;
  const auto& send_kv = to_server ? route_.to_server_kv : route_.from_owner_kv;
  const auto& recv_q = to_server ? route_.from_owner_q : route_.to_server_q;
  const auto& recv_kv = to_server ? route_.from_owner_kv : route_.to_server_kv;
  const auto& send_fq = to_server ? x.owner_q : x.server_q;
  const auto& send_fkv = to_server ? x.owner_kv : x.server_kv;
  const auto& recv_fq = to_server ? x.server_q : x.owner_q;
  const auto& recv_fkv = to_server ? x.server_kv : x.owner_kv;
  const int self = route_.rank;
  int64_t send_total = 0;
  int64_t recv_total = 0;
  for (int p = 0; p < route_.num_ranks; ++p) {
    x.send_offsets[p] = send_total;
    x.recv_offsets[p] = recv_total;
    x.send_counts[p] = p == self ? 0
                                 : sum_rows(send_q[p]) * sum_row_bytes(send_fq) +
                                       sum_rows(send_kv[p]) * sum_row_bytes(send_fkv);
    x.recv_counts[p] = p == self ? 0
                                 : sum_rows(recv_q[p]) * sum_row_bytes(recv_fq) +
                                       sum_rows(recv_kv[p]) * sum_row_bytes(recv_fkv);
    send_total += x.send_counts[p];
    recv_total += x.recv_counts[p];
  }
  x.send.resize(static_cast<size_t>(send_total));
  x.recv.resize(static_cast<size_t>(recv_total));
  for (int p = 0; p < route_.num_ranks; ++p) {
    if (p == self) continue;
    std::byte* out = x.send.data() + x.send_offsets[p];
    out = pack(send_q[p], to_server, send_fq, out);
    if (!send_fkv.empty()) out = pack(send_kv[p], to_server, send_fkv, out);
    DISTCA_CHECK(out == x.send.data() + x.send_offsets[p] + x.send_counts[p]) << "packed size";
  }
  comm::AllToAllV a{x.send.data(), x.send_counts, x.send_offsets, x.recv.data(), x.recv_counts, x.recv_offsets};
  if (!is_silent_) {
    DISTCA_ASSIGN_OR_RETURN(x.work, comm_.all_to_all_v_async(a));
  }
  PhaseStats& st = stats_[static_cast<int>(phase)];
  ++st.calls;
  st.bytes_sent += send_total;
  st.bytes_received += recv_total;
  // Own rows go straight across while the messages travel (a return's wait, which may sum into
  // the owner's dK/dV, keeps rank order instead).
  if (to_server) {
    copy_own(route_.to_server_q[self], true, x.owner_q, x.server_q);
    if (!x.owner_kv.empty()) copy_own(route_.to_server_kv[self], true, x.owner_kv, x.server_kv);
  }
  return Status::ok();
}

Status Dispatcher::finish_comm() {
  if (stage_ != Stage::kDispatching && stage_ != Stage::kReturning) {
    return invalid_argument("finish_comm: no exchange in flight (call start_* or start_return first)");
  }
  Exchange& x = *exchange_;
  const auto begin = std::chrono::steady_clock::now();
  Status waited = x.work ? x.work->wait() : Status::ok();
  x.work.reset();
  if (!waited.is_ok()) {
    stage_ = Stage::kIdle;
    return waited;
  }
  const bool to_server = is_to_server(x.phase);
  const auto& recv_q = to_server ? route_.from_owner_q : route_.to_server_q;
  const auto& recv_kv = to_server ? route_.from_owner_kv : route_.to_server_kv;
  const auto& recv_fq = to_server ? x.server_q : x.owner_q;
  const auto& recv_fkv = to_server ? x.server_kv : x.owner_kv;
  if (x.phase == Phase::kBwdReturn) {
    const auto n = static_cast<size_t>(route_.num_local_rows * heads_.num_kv_heads * heads_.head_dim);
    std::memset(bwd_.dk, 0, n * sizeof(float));
    std::memset(bwd_.dv, 0, n * sizeof(float));
  }
  for (int p = 0; p < route_.num_ranks; ++p) {
    if (p == route_.rank) {
      if (!to_server) {
        copy_own(route_.to_server_q[p], false, x.server_q, x.owner_q);
        if (!x.owner_kv.empty()) copy_own(route_.to_server_kv[p], false, x.server_kv, x.owner_kv);
      }
      continue;
    }
    const std::byte* in = x.recv.data() + x.recv_offsets[p];
    in = unpack(recv_q[p], !to_server, recv_fq, in);
    if (!recv_fkv.empty()) in = unpack(recv_kv[p], !to_server, recv_fkv, in);
    DISTCA_CHECK(in == x.recv.data() + x.recv_offsets[p] + x.recv_counts[p]) << "unpacked size";
  }
  stats_[static_cast<int>(x.phase)].wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  stage_ = stage_ == Stage::kDispatching ? Stage::kDispatched : Stage::kIdle;
  return Status::ok();
}

Status Dispatcher::start_forward(const ForwardArgs& args, ServerBuffers& server) {
  if (stage_ != Stage::kIdle) return invalid_argument("start_forward: the previous pass is not finished");
  if (route_.num_local_rows > 0 && (!args.q || !args.k || !args.v || !args.o || !args.lse)) {
    return invalid_argument("forward: q, k, v, o and lse must all be given");
  }
  fwd_ = args;
  server_ = &server;
  is_backward_ = false;
  server.forward_of = nullptr;
  size_server_buffers(false);
  DISTCA_RETURN_IF_ERROR(post(Phase::kFwdDispatch));
  stage_ = Stage::kDispatching;
  return Status::ok();
}

Status Dispatcher::start_backward(const BackwardArgs& args, ServerBuffers& server) {
  if (stage_ != Stage::kIdle) return invalid_argument("start_backward: the previous pass is not finished");
  const bool is_stateful = options_.backward_mode == plan::BackwardMode::kStateful;
  if (is_stateful && server.forward_of != this) {
    return invalid_argument("stateful backward: pass the ServerBuffers this dispatcher's forward filled");
  }
  if (route_.num_local_rows > 0 &&
      (!args.d_o || !args.dq || !args.dk || !args.dv ||
       (!is_stateful && (!args.q || !args.k || !args.v || !args.o || !args.lse)))) {
    return invalid_argument(is_stateful ? "backward: d_o, dq, dk and dv must all be given"
                                        : "backward: q, k, v, o, lse, d_o, dq, dk and dv must all be given");
  }
  bwd_ = args;
  server_ = &server;
  is_backward_ = true;
  size_server_buffers(true);
  DISTCA_RETURN_IF_ERROR(post(Phase::kBwdDispatch));
  stage_ = Stage::kDispatching;
  return Status::ok();
}

Status Dispatcher::compute() {
  if (stage_ != Stage::kDispatched) return invalid_argument("compute: the dispatch has not finished");
  ServerBuffers& s = *server_;
  const kernels::AttnDims dims{route_.num_server_q_rows, route_.num_server_kv_rows, heads_.num_q_heads,
                               heads_.num_kv_heads, heads_.head_dim};
  if (!route_.tasks.empty()) {
    if (is_backward_) {
      kernels::AttnBwdParams<float> p{dims, s.q.data(), s.k.data(), s.v.data(), s.o.data(), s.lse.data(),
                                      s.d_o.data(), route_.tasks, options_.scale, s.dq.data(),
                                      s.dk.data(), s.dv.data()};
      DISTCA_RETURN_IF_ERROR(kernel_->backward(p));
    } else {
      kernels::AttnFwdParams<float> p{dims, s.q.data(), s.k.data(), s.v.data(), route_.tasks,
                                      options_.scale, s.o.data(), s.lse.data()};
      DISTCA_RETURN_IF_ERROR(kernel_->forward(p));
    }
  }
  if (!is_backward_) s.forward_of = this;
  stage_ = Stage::kComputed;
  return Status::ok();
}

Status Dispatcher::start_return() {
  if (stage_ != Stage::kComputed) return invalid_argument("start_return: compute has not run");
  DISTCA_RETURN_IF_ERROR(post(is_backward_ ? Phase::kBwdReturn : Phase::kFwdReturn));
  stage_ = Stage::kReturning;
  return Status::ok();
}

Status Dispatcher::forward(const ForwardArgs& args, ServerBuffers& server) {
  DISTCA_RETURN_IF_ERROR(start_forward(args, server));
  DISTCA_RETURN_IF_ERROR(finish_comm());
  DISTCA_RETURN_IF_ERROR(compute());
  DISTCA_RETURN_IF_ERROR(start_return());
  return finish_comm();
}

Status Dispatcher::backward(const BackwardArgs& args, ServerBuffers& server) {
  DISTCA_RETURN_IF_ERROR(start_backward(args, server));
  DISTCA_RETURN_IF_ERROR(finish_comm());
  DISTCA_RETURN_IF_ERROR(compute());
  DISTCA_RETURN_IF_ERROR(start_return());
  return finish_comm();
}

}  // namespace distca::runtime
