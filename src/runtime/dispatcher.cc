#include "distca/runtime/dispatcher.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>

#include "distca/core/bf16.h"
#include "distca/kernels/attention.h"
#include "distca/kernels/registry.h"

namespace distca::runtime {

using layout::HeadShape;
using layout::Route;
using layout::Segment;
using plan::Phase;

// How the receiver of a part puts its rows where they go. Dispatches always copy; a return
// copies the rows of unsplit tasks and combines the partial results of the others.
enum class Combine {
  kCopy,
  kAdd,    // fp32 sum: dK/dV of a key row read by several tasks, dQ of a split query row
  kMerge,  // LSE merge of partial (O, LSE); the part's fields are exactly {O, LSE}
};

// One tensor of a message: fp32 rows of row_bytes bytes at base (linear or server layout). A
// bf16 field travels at half that: rounded when packed, widened to fp32 when unpacked.
struct Dispatcher::Field {
  std::byte* base = nullptr;
  int64_t row_bytes = 0;
  bool is_bf16 = false;
  int64_t wire_row_bytes() const { return is_bf16 ? row_bytes / 2 : row_bytes; }
};

// One part of every message (route.h): its segments, the fields it carries on the owner's side
// and on the server's (the same tensors, one to one), and how a return combines them.
struct Dispatcher::Part {
  const std::vector<std::vector<Segment>>* to_server = nullptr;   // the route's, as an owner
  const std::vector<std::vector<Segment>>* from_owner = nullptr;  // the route's, as a server
  std::vector<Field> owner, server;
  Combine combine = Combine::kCopy;
};

struct Dispatcher::Exchange {
  Phase phase = Phase::kFwdDispatch;
  std::vector<std::byte> send, recv;
  std::vector<int64_t> send_counts, send_offsets, recv_counts, recv_offsets;
  std::array<Part, 3> parts;  // unsplit Q rows, split Q rows, K/V rows: the message order
  std::unique_ptr<comm::Work> work;
};

namespace {

bool is_to_server(Phase phase) { return phase == Phase::kFwdDispatch || phase == Phase::kBwdDispatch; }

// Bytes a row of every field takes in a message.
template <typename F>
int64_t sum_wire_row_bytes(const std::vector<F>& fields) {
  int64_t b = 0;
  for (const F& f : fields) b += f.wire_row_bytes();
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

// n floats to bf16, rounded to nearest, ties to even (core/bf16.h).
void pack_bf16(const std::byte* src, int64_t n, std::byte* out) {
  for (int64_t i = 0; i < n; ++i) {
    float x;
    std::memcpy(&x, src + i * sizeof(float), sizeof(float));
    const uint16_t b = bf16::round_bits(x);
    std::memcpy(out + i * sizeof(uint16_t), &b, sizeof(uint16_t));
  }
}

// n bf16 values widened to fp32, added to dst (kAdd) or copied (kCopy).
void unpack_bf16(Combine how, const std::byte* src, int64_t n, std::byte* dst) {
  float* d = reinterpret_cast<float*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    bf16 b;
    std::memcpy(&b.bits, src + i * sizeof(uint16_t), sizeof(uint16_t));
    d[i] = how == Combine::kAdd ? d[i] + static_cast<float>(b) : static_cast<float>(b);
  }
}

// Sizes `v` to n floats holding exactly n (a buffer of another size is freed first, not kept):
// what a dispatcher's buffers hold is then what buffer_bytes() says.
void fit(std::vector<float>& v, size_t n) {
  if (v.capacity() != n) std::vector<float>().swap(v);
  v.resize(n);
}

// Grows `v` to n bytes exactly where it holds fewer (the exchange keeps its largest phase's).
void grow_exactly(std::vector<std::byte>& v, size_t n) {
  if (v.capacity() < n) {
    std::vector<std::byte>().swap(v);
    v.reserve(n);
  }
  v.resize(n);
}

// The wire bytes a row of each part (unsplit Q rows, split Q rows, K/V rows) carries in a phase:
// what fields() puts in them (post checks that the two agree).
std::array<int64_t, 3> part_row_bytes(Phase phase, plan::BackwardMode mode, const HeadShape& h, plan::GradReturn grad_return) {
  const int64_t qr = h.num_q_heads * h.head_dim * 4;
  const int64_t kr = h.num_kv_heads * h.head_dim * 4;
  const int64_t lr = h.num_q_heads * 4;
  switch (phase) {
    case Phase::kFwdDispatch: return {qr, qr, 2 * kr};
    case Phase::kFwdReturn: return {qr + lr, qr + lr, 0};
    case Phase::kBwdDispatch:
      if (mode == plan::BackwardMode::kStateful) return {qr, 2 * qr + lr, 0};
      return {3 * qr + lr, 3 * qr + lr, 2 * kr};
    case Phase::kBwdReturn: return {qr, qr, grad_return == plan::GradReturn::kBf16 ? kr : 2 * kr};
  }
  return {0, 0, 0};
}

// At most Q, O, dO and LSE travel in one part.
constexpr size_t kMaxFields = 4;

// Puts `rows` rows of every field, read from src[i] (rows contiguous), at row `row` of dst.
// `is_wire`: src is a received message, whose bf16 fields are half width; else fp32 rows.
template <typename F>
void combine_rows(Combine how, const std::vector<F>& dst, int64_t row, int64_t rows,
                  const std::array<const std::byte*, kMaxFields>& src, bool is_wire) {
  if (how == Combine::kMerge) {
    // dst = {O [rows, Hq, D], LSE [rows, Hq]}; the partial src are fp32 and 4-byte aligned.
    const int64_t heads = dst[1].row_bytes / static_cast<int64_t>(sizeof(float));
    const int64_t head_dim = dst[0].row_bytes / dst[1].row_bytes;
    kernels::lse_merge<float>(rows, heads, head_dim, reinterpret_cast<const float*>(src[0]),
                              reinterpret_cast<const float*>(src[1]),
                              reinterpret_cast<float*>(dst[0].base + row * dst[0].row_bytes),
                              reinterpret_cast<float*>(dst[1].base + row * dst[1].row_bytes));
    return;
  }
  for (size_t i = 0; i < dst.size(); ++i) {
    std::byte* to = dst[i].base + row * dst[i].row_bytes;
    if (is_wire && dst[i].is_bf16) {
      unpack_bf16(how, src[i], rows * dst[i].row_bytes / static_cast<int64_t>(sizeof(float)), to);
    } else if (how == Combine::kAdd) {
      add_floats(to, src[i], rows * dst[i].row_bytes);
    } else {
      std::memcpy(to, src[i], rows * dst[i].row_bytes);
    }
  }
}

// Readies the destination rows of a combining part before the first contribution arrives:
// zero for a sum, (O = 0, LSE = -inf) for a merge, so that the first one lands unchanged.
template <typename F>
void clear_rows(Combine how, const std::vector<F>& dst, const std::vector<Segment>& segments, bool is_local) {
  for (const Segment& s : segments) {
    for (size_t i = 0; i < dst.size(); ++i) {
      std::byte* to = dst[i].base + row_of(s, is_local) * dst[i].row_bytes;
      const int64_t n = s.rows * dst[i].row_bytes;
      if (how == Combine::kMerge && i == 1) {
        float* lse = reinterpret_cast<float*>(to);
        std::fill(lse, lse + n / static_cast<int64_t>(sizeof(float)), -std::numeric_limits<float>::infinity());
      } else {
        std::memset(to, 0, n);
      }
    }
  }
}

// Message layout: segment after segment, each as one block per field.
template <typename F>
std::byte* pack(const std::vector<Segment>& segments, bool is_local, const std::vector<F>& fields,
                std::byte* out) {
  for (const Segment& s : segments) {
    for (const F& f : fields) {
      const std::byte* from = f.base + row_of(s, is_local) * f.row_bytes;
      if (f.is_bf16) {
        pack_bf16(from, s.rows * f.row_bytes / static_cast<int64_t>(sizeof(float)), out);
      } else {
        std::memcpy(out, from, s.rows * f.row_bytes);
      }
      out += s.rows * f.wire_row_bytes();
    }
  }
  return out;
}

template <typename F>
const std::byte* unpack(const std::vector<Segment>& segments, bool is_local, const std::vector<F>& fields,
                        Combine how, const std::byte* in) {
  std::array<const std::byte*, kMaxFields> src{};
  for (const Segment& s : segments) {
    for (size_t i = 0; i < fields.size(); ++i) {
      src[i] = in;
      in += s.rows * fields[i].wire_row_bytes();
    }
    combine_rows(how, fields, row_of(s, is_local), s.rows, src, true);
  }
  return in;
}

// The rows a rank serves itself: straight from one layout to the other.
template <typename F>
void copy_own(const std::vector<Segment>& segments, bool from_local, const std::vector<F>& src,
              const std::vector<F>& dst, Combine how) {
  std::array<const std::byte*, kMaxFields> from{};
  for (const Segment& s : segments) {
    for (size_t i = 0; i < src.size(); ++i) from[i] = src[i].base + row_of(s, from_local) * src[i].row_bytes;
    combine_rows(how, dst, row_of(s, !from_local), s.rows, from, false);
  }
}

// The registry's "cpu" kernel on the server's fp32 rows.
class CpuKernel final : public ServerKernel {
 public:
  CpuKernel(int num_threads, std::function<void()> poll)
      : attention_(kernels::CpuAttentionOptions{.num_threads = num_threads, .poll = std::move(poll)}) {}
  Status forward(const kernels::AttnFwdParams<float>& p) override { return attention_.forward(p); }
  Status backward(const kernels::AttnBwdParams<float>& p) override { return attention_.backward(p); }
  Status supports(const kernels::AttnDims& dims) const override {
    return kernels::supports(kernels::kernel_info("cpu"), dims, {}, kernels::DType::kFloat32);
  }

 private:
  kernels::CpuAttention attention_;
};

std::byte* bytes(const float* p) { return reinterpret_cast<std::byte*>(const_cast<float*>(p)); }
std::byte* bytes(std::vector<float>& v) { return reinterpret_cast<std::byte*>(v.data()); }

}  // namespace

Dispatcher::Dispatcher(comm::Communicator& comm, Route route, HeadShape heads, DispatchOptions options)
    : comm_(comm), route_(std::move(route)), heads_(heads), options_(options),
      exchange_(std::make_unique<Exchange>()) {
  if (options_.kernel == nullptr) own_kernel_ = std::make_unique<CpuKernel>(options_.num_threads, options_.poll);
  kernel_ = options_.kernel ? options_.kernel : own_kernel_.get();
  const auto r = static_cast<size_t>(route_.num_ranks);
  std::array<Part, 3>& parts = exchange_->parts;
  parts[0].to_server = &route_.to_server_q, parts[0].from_owner = &route_.from_owner_q;
  parts[1].to_server = &route_.to_server_split_q, parts[1].from_owner = &route_.from_owner_split_q;
  parts[2].to_server = &route_.to_server_kv, parts[2].from_owner = &route_.from_owner_kv;
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
  if (options.grad_return != plan::GradReturn::kFp32 && options.grad_return != plan::GradReturn::kBf16) {
    return invalid_argument(fmt::format("DispatchOptions::grad_return {} is neither fp32 nor bf16",
                                        static_cast<int>(options.grad_return)));
  }
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
  if (!options.held_kv.empty() && (!options.is_part || options.backward_mode != plan::BackwardMode::kStateful)) {
    return invalid_argument("DispatchOptions::held_kv: only for a part of a plan (is_part) with the stateful backward "
                            "(the stateless one sends K/V again, in the other order)");
  }
  DISTCA_ASSIGN_OR_RETURN(Route route, options.is_part ? layout::build_partial_route(batch, plan.tasks, comm.rank(), options.held_kv)
                                                        : layout::build_route(batch, plan.tasks, comm.rank()));
  auto d = std::unique_ptr<Dispatcher>(new Dispatcher(comm, std::move(route), heads, options));
  DISTCA_RETURN_IF_ERROR(d->kernel_->supports({0, 0, heads.num_q_heads, heads.num_kv_heads, heads.head_dim}));
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
    fit(s.q, q), fit(s.k, kv), fit(s.v, kv), fit(s.o, q), fit(s.lse, lse);
  }
  if (is_backward) fit(s.d_o, q), fit(s.dq, q), fit(s.dk, kv), fit(s.dv, kv);
}

void Dispatcher::fields(Phase phase, std::array<Part, 3>& parts) const {
  const int64_t qr = heads_.num_q_heads * heads_.head_dim * 4;
  const int64_t kr = heads_.num_kv_heads * heads_.head_dim * 4;
  const int64_t lr = heads_.num_q_heads * 4;
  ServerBuffers& s = *server_;
  Part& q = parts[0];
  Part& split_q = parts[1];
  Part& kv = parts[2];
  for (Part& part : parts) part.owner.clear(), part.server.clear(), part.combine = Combine::kCopy;
  switch (phase) {
    case Phase::kFwdDispatch:
      q.owner = {{bytes(fwd_.q), qr}};
      q.server = {{bytes(s.q), qr}};
      split_q.owner = q.owner, split_q.server = q.server;
      kv.owner = {{bytes(fwd_.k), kr}, {bytes(fwd_.v), kr}};
      kv.server = {{bytes(s.k), kr}, {bytes(s.v), kr}};
      break;
    case Phase::kFwdReturn:
      // A split row's partial outputs are merged at the owner, in the order finish_comm meets
      // them (servers in rank order, segments in route order): the same bits on every run.
      q.owner = {{bytes(fwd_.o), qr}, {bytes(fwd_.lse), lr}};
      q.server = {{bytes(s.o), qr}, {bytes(s.lse), lr}};
      split_q.owner = q.owner, split_q.server = q.server;
      split_q.combine = Combine::kMerge;
      break;
    case Phase::kBwdDispatch:
      if (options_.backward_mode == plan::BackwardMode::kStateful) {
        // The server kept its forward's Q/K/V and O/LSE. The O/LSE of a split row there are its
        // partial ones, but the gradient needs the final (merged) ones: they travel with dO.
        q.owner = {{bytes(bwd_.d_o), qr}};
        q.server = {{bytes(s.d_o), qr}};
        split_q.owner = {{bytes(bwd_.d_o), qr}, {bytes(bwd_.o), qr}, {bytes(bwd_.lse), lr}};
        split_q.server = {{bytes(s.d_o), qr}, {bytes(s.o), qr}, {bytes(s.lse), lr}};
      } else {
        q.owner = {{bytes(bwd_.q), qr}, {bytes(bwd_.o), qr}, {bytes(bwd_.d_o), qr}, {bytes(bwd_.lse), lr}};
        q.server = {{bytes(s.q), qr}, {bytes(s.o), qr}, {bytes(s.d_o), qr}, {bytes(s.lse), lr}};
        split_q.owner = q.owner, split_q.server = q.server;
        kv.owner = {{bytes(bwd_.k), kr}, {bytes(bwd_.v), kr}};
        kv.server = {{bytes(s.k), kr}, {bytes(s.v), kr}};
      }
      break;
    case Phase::kBwdReturn: {
      // dK/dV partial sums may travel in bf16; dQ stays fp32 (see dispatcher.h).
      const bool is_bf16 = options_.grad_return == plan::GradReturn::kBf16;
      q.owner = {{bytes(bwd_.dq), qr}};
      q.server = {{bytes(s.dq), qr}};
      split_q.owner = q.owner, split_q.server = q.server;
      split_q.combine = Combine::kAdd;
      kv.owner = {{bytes(bwd_.dk), kr, is_bf16}, {bytes(bwd_.dv), kr, is_bf16}};
      kv.server = {{bytes(s.dk), kr, is_bf16}, {bytes(s.dv), kr, is_bf16}};
      kv.combine = Combine::kAdd;
      break;
    }
  }
}

Status Dispatcher::post(Phase phase) {
  Exchange& x = *exchange_;
  x.phase = phase;
  fields(phase, x.parts);
  const bool to_server = is_to_server(phase);
  // Sender: owners in a dispatch, servers in a return; the receiver is the other side.
  auto send_segments = [&](const Part& part) -> const auto& { return to_server ? *part.to_server : *part.from_owner; };
  auto recv_segments = [&](const Part& part) -> const auto& { return to_server ? *part.from_owner : *part.to_server; };
  auto send_fields = [&](const Part& part) -> const auto& { return to_server ? part.owner : part.server; };
  auto recv_fields = [&](const Part& part) -> const auto& { return to_server ? part.server : part.owner; };
  const int self = route_.rank;
  const std::array<int64_t, 3> widths = part_row_bytes(phase, options_.backward_mode, heads_, options_.grad_return);
  for (size_t i = 0; i < x.parts.size(); ++i) {
    DISTCA_CHECK(sum_wire_row_bytes(x.parts[i].owner) == widths[i] && sum_wire_row_bytes(x.parts[i].server) == widths[i])
        << "part_row_bytes disagrees with fields()";
  }
  int64_t send_total = 0;
  int64_t recv_total = 0;
  for (int p = 0; p < route_.num_ranks; ++p) {
    x.send_offsets[p] = send_total;
    x.recv_offsets[p] = recv_total;
    x.send_counts[p] = 0;
    x.recv_counts[p] = 0;
    if (p != self) {
      for (const Part& part : x.parts) {
        x.send_counts[p] += sum_rows(send_segments(part)[p]) * sum_wire_row_bytes(send_fields(part));
        x.recv_counts[p] += sum_rows(recv_segments(part)[p]) * sum_wire_row_bytes(recv_fields(part));
      }
    }
    send_total += x.send_counts[p];
    recv_total += x.recv_counts[p];
  }
  grow_exactly(x.send, static_cast<size_t>(send_total));
  grow_exactly(x.recv, static_cast<size_t>(recv_total));
  for (int p = 0; p < route_.num_ranks; ++p) {
    if (p == self) continue;
    std::byte* out = x.send.data() + x.send_offsets[p];
    for (const Part& part : x.parts) out = pack(send_segments(part)[p], to_server, send_fields(part), out);
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
  // Own rows go straight across while the messages travel (a return, which may sum or merge
  // into the owner's rows, copies them in finish_comm at this rank's place in rank order).
  if (to_server) {
    for (const Part& part : x.parts) copy_own((*part.to_server)[self], true, part.owner, part.server, Combine::kCopy);
  }
  return Status::ok();
}

BufferBytes buffer_bytes(const Route& route, const HeadShape& heads, plan::GradReturn grad_return) {
  const int64_t q = route.num_server_q_rows * heads.num_q_heads * heads.head_dim * 4;
  const int64_t kv = route.num_server_kv_rows * heads.num_kv_heads * heads.head_dim * 4;
  const int64_t lse = route.num_server_q_rows * heads.num_q_heads * 4;
  BufferBytes b;
  b.forward_set = 2 * q + 2 * kv + lse;
  b.backward_set = 2 * q + 2 * kv;
  b.kv = kv;
  const std::array<const std::vector<std::vector<Segment>>*, 3> to_server = {&route.to_server_q, &route.to_server_split_q,
                                                                            &route.to_server_kv};
  const std::array<const std::vector<std::vector<Segment>>*, 3> from_owner = {
      &route.from_owner_q, &route.from_owner_split_q, &route.from_owner_kv};
  for (const plan::BackwardMode mode : {plan::BackwardMode::kStateless, plan::BackwardMode::kStateful}) {
    int64_t send = 0, recv = 0;  // the largest phase's, each
    for (int p = 0; p < plan::kNumPhases; ++p) {
      const auto phase = static_cast<Phase>(p);
      const std::array<int64_t, 3> widths = part_row_bytes(phase, mode, heads, grad_return);
      int64_t s = 0, r = 0;
      for (int peer = 0; peer < route.num_ranks; ++peer) {
        if (peer == route.rank) continue;
        for (size_t i = 0; i < widths.size(); ++i) {
          const int64_t out = sum_rows((*to_server[i])[peer]) * widths[i], in = sum_rows((*from_owner[i])[peer]) * widths[i];
          s += is_to_server(phase) ? out : in;
          r += is_to_server(phase) ? in : out;
        }
      }
      send = std::max(send, s), recv = std::max(recv, r);
    }
    b.exchange[static_cast<int>(mode)] = send + recv;
  }
  return b;
}

int64_t Dispatcher::exchange_bytes() const {
  return static_cast<int64_t>(exchange_->send.capacity() + exchange_->recv.capacity());
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
  if (x.phase == Phase::kBwdReturn) {
    // Every key row's dK/dV is a sum (zero where no task reads the row).
    const auto n = static_cast<size_t>(route_.num_local_rows * heads_.num_kv_heads * heads_.head_dim);
    std::memset(bwd_.dk, 0, n * sizeof(float));
    std::memset(bwd_.dv, 0, n * sizeof(float));
  }
  if (!to_server) {
    const Part& split_q = x.parts[1];
    for (const std::vector<Segment>& segments : route_.to_server_split_q) {
      clear_rows(split_q.combine, split_q.owner, segments, true);
    }
  }
  // Servers in rank order, this rank's own rows at its place: a return sums and merges in an
  // order that does not depend on which message arrived first.
  for (int p = 0; p < route_.num_ranks; ++p) {
    if (p == route_.rank) {
      if (!to_server) {
        for (const Part& part : x.parts) copy_own((*part.to_server)[p], false, part.server, part.owner, part.combine);
      }
      continue;
    }
    const std::byte* in = x.recv.data() + x.recv_offsets[p];
    for (const Part& part : x.parts) {
      in = to_server ? unpack((*part.from_owner)[p], false, part.server, Combine::kCopy, in)
                     : unpack((*part.to_server)[p], true, part.owner, part.combine, in);
    }
    DISTCA_CHECK(in == x.recv.data() + x.recv_offsets[p] + x.recv_counts[p]) << "unpacked size";
  }
  if (x.phase == Phase::kFwdDispatch && !route_.held_kv.empty()) DISTCA_RETURN_IF_ERROR(copy_held_kv());
  stats_[static_cast<int>(x.phase)].wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  stage_ = stage_ == Stage::kDispatching ? Stage::kDispatched : Stage::kIdle;
  return Status::ok();
}

Status Dispatcher::copy_held_kv() {
  const ServerBuffers* held = server_->held;
  const int64_t row = heads_.num_kv_heads * heads_.head_dim;
  int64_t need = 0;
  for (const Segment& s : route_.held_kv) need = std::max(need, s.local_row + s.rows);
  if (held == nullptr || held->forward_of == nullptr || static_cast<int64_t>(held->k.size()) < need * row) {
    stage_ = Stage::kIdle;
    return invalid_argument("held K/V: the earlier dispatcher's forward of this layer must have run, its buffers in "
                            "ServerBuffers::held");
  }
  for (const Segment& s : route_.held_kv) {
    std::copy_n(held->k.begin() + s.local_row * row, s.rows * row, server_->k.begin() + s.server_row * row);
    std::copy_n(held->v.begin() + s.local_row * row, s.rows * row, server_->v.begin() + s.server_row * row);
  }
  return Status::ok();
}

Status Dispatcher::add_held_grads() {
  ServerBuffers& s = *server_;
  const int64_t row = heads_.num_kv_heads * heads_.head_dim;
  if (!route_.held_kv.empty()) {  // the later pass: its dK/dV of the held rows go to the earlier buffer
    ServerBuffers* held = s.held;
    if (held == nullptr || held->backward_computed) {
      return invalid_argument("held K/V: the later nano-batch's backward must compute before the earlier one's "
                              "(runtime::pingpong_schedule's b_leads_from)");
    }
    if (held->held_dk.size() != held->k.size()) {
      held->held_dk.assign(held->k.size(), 0.0f);
      held->held_dv.assign(held->k.size(), 0.0f);
    }
    for (const Segment& g : route_.held_kv) {
      for (int64_t i = 0; i < g.rows * row; ++i) {
        held->held_dk[g.local_row * row + i] += s.dk[g.server_row * row + i];
        held->held_dv[g.local_row * row + i] += s.dv[g.server_row * row + i];
      }
    }
  }
  if (!s.held_dk.empty()) {  // the earlier pass: a later one's dK/dV of its rows are pending
    if (s.held_dk.size() != s.dk.size()) return internal_error("held K/V: pending dK/dV of another layout");
    for (size_t i = 0; i < s.dk.size(); ++i) s.dk[i] += s.held_dk[i], s.dv[i] += s.held_dv[i];
    std::vector<float>().swap(s.held_dk);  // freed: a later layer's come with its pass
    std::vector<float>().swap(s.held_dv);
  }
  s.backward_computed = true;
  return Status::ok();
}

Status Dispatcher::start_forward(const ForwardArgs& args, ServerBuffers& server) {
  if (stage_ != Stage::kIdle) return invalid_argument("start_forward: the previous pass is not finished");
  if (!route_.held_kv.empty() && server.held == nullptr) {
    return invalid_argument("held K/V: ServerBuffers::held must point at the earlier dispatcher's buffers of the layer");
  }
  if (route_.num_local_rows > 0 && (!args.q || !args.k || !args.v || !args.o || !args.lse)) {
    return invalid_argument("forward: q, k, v, o and lse must all be given");
  }
  fwd_ = args;
  server_ = &server;
  is_backward_ = false;
  server.forward_of = nullptr;
  server.backward_computed = false;
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
  if (is_stateful && route_.owns_split_rows() && (!args.o || !args.lse)) {
    return invalid_argument("stateful backward of a plan that splits key ranges: o and lse (the forward's "
                            "merged outputs) must be given too");
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
  if (is_backward_) {
    if (!route_.tasks.empty()) {
      kernels::AttnBwdParams<float> p{dims, s.q.data(), s.k.data(), s.v.data(), s.o.data(), s.lse.data(),
                                      s.d_o.data(), route_.tasks, options_.scale, s.dq.data(),
                                      s.dk.data(), s.dv.data()};
      DISTCA_RETURN_IF_ERROR(kernel_->backward(p));
    }
    DISTCA_RETURN_IF_ERROR(add_held_grads());
  } else {
    if (!route_.tasks.empty()) {
      kernels::AttnFwdParams<float> p{dims, s.q.data(), s.k.data(), s.v.data(), route_.tasks,
                                      options_.scale, s.o.data(), s.lse.data()};
      DISTCA_RETURN_IF_ERROR(kernel_->forward(p));
    }
    s.forward_of = this;
  }
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
