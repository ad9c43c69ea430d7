#include "distca/train/nano_chain.h"

#include <algorithm>

#include <fmt/format.h>

#include "distca/core/trace.h"

namespace distca::train {

namespace {

// The attention stage of layer l (posting its return) and the linear stage's communication.
runtime::Stage attention_stage(StagedAttention* att, int64_t layer, const char* dir) {
  return {[att] { return att->compute(); }, [att] { return att->start_return(); },
          [att] { return att->finish_return(); }, fmt::format("L{} {} attention", layer, dir),
          fmt::format("L{} {} return", layer, dir)};
}

// The layer's attention tensors as the nano-batch's dispatcher sees them: B's begin `rows`
// rows before its slice (in A's rows of the one workspace), its dK/dV in the context buffers.
model::Model<float>::AttentionIo dispatch_io(NanoPass& p, int64_t l) {
  model::Model<float>::AttentionIo io = p.model->attention_io(l);
  if (p.context && p.context_reader) {
    const ContextRows& c = *p.context;
    for (float** t : {&io.q, &io.o, &io.d_o, &io.dq}) *t -= c.rows * c.q_row;
    for (float** t : {&io.k, &io.v}) *t -= c.rows * c.kv_row;
    io.lse -= c.rows * c.lse_row;
    io.dk = p.context->dk.data();
    io.dv = p.context->dv.data();
  }
  return io;
}

// After the backward return of a positional split: B copies its own rows' dK/dV into its slice
// (the context rows' stay for A); A adds the context rows' to its last rows.
Status finish_backward_return(StagedAttention* att, NanoPass& p, int64_t l) {
  DISTCA_RETURN_IF_ERROR(att->finish_return());
  if (!p.context) return Status::ok();
  const trace::Scope span("context rows' dK/dV", "linear", static_cast<int>(l));
  ContextRows& c = *p.context;
  const model::Model<float>::AttentionIo io = p.model->attention_io(l);
  const int64_t own = p.model->rows() * c.kv_row, ctx = c.rows * c.kv_row;
  std::vector<float>& layer_dk = c.layer_dk.at(static_cast<size_t>(l));
  std::vector<float>& layer_dv = c.layer_dv.at(static_cast<size_t>(l));
  if (p.context_reader) {
    std::copy(c.dk.begin() + ctx, c.dk.begin() + ctx + own, io.dk);
    std::copy(c.dv.begin() + ctx, c.dv.begin() + ctx + own, io.dv);
    layer_dk.assign(c.dk.begin(), c.dk.begin() + ctx);
    layer_dv.assign(c.dv.begin(), c.dv.begin() + ctx);
    c.pending_bytes += static_cast<int64_t>((layer_dk.capacity() + layer_dv.capacity()) * sizeof(float));
    c.pending_peak_bytes = std::max(c.pending_peak_bytes, c.pending_bytes);
  } else {
    if (static_cast<int64_t>(layer_dk.size()) != ctx) return internal_error("ping-pong: A's backward return came before B's");
    float* dk = io.dk + own - ctx;
    float* dv = io.dv + own - ctx;
    for (int64_t i = 0; i < ctx; ++i) dk[i] += layer_dk[i], dv[i] += layer_dv[i];
    c.pending_bytes -= static_cast<int64_t>((layer_dk.capacity() + layer_dv.capacity()) * sizeof(float));
    std::vector<float>().swap(layer_dk);  // freed: at most the layers between B's return and A's are held
    std::vector<float>().swap(layer_dv);
  }
  return Status::ok();
}

}  // namespace

std::vector<runtime::Stage> forward_stages(NanoPass& p) {
  model::Model<float>& m = *p.model;
  const int64_t layers = m.num_stage_layers(), first = m.first_layer();
  std::vector<runtime::Stage> out;
  for (int64_t l = 0; l < layers; ++l) {
    auto compute = [&p, l]() -> Status {
      model::Model<float>& m = *p.model;
      if (l == 0) {
        DISTCA_RETURN_IF_ERROR(m.begin_forward(*p.state, p.in, p.x_in));
      } else {
        DISTCA_RETURN_IF_ERROR(m.forward_post_attention(*p.state, l - 1));
      }
      m.forward_pre_attention(*p.state, l);
      return Status::ok();
    };
    auto start = [&p, l, first] {
      const auto io = dispatch_io(p, l);
      return p.attention->start_forward(static_cast<int>(first + l), {io.q, io.k, io.v, io.o, io.lse});
    };
    StagedAttention* att = p.attention;
    out.push_back({compute, start, [att] { return att->finish_dispatch(); }, fmt::format("L{} fwd linear", first + l),
                   fmt::format("L{} fwd dispatch", first + l)});
    out.push_back(attention_stage(att, first + l, "fwd"));
  }
  out.push_back({[&p, layers]() -> Status {
                   DISTCA_RETURN_IF_ERROR(p.model->forward_post_attention(*p.state, layers - 1));
                   p.loss = p.model->finish_forward(*p.state, p.loss_scale);
                   return Status::ok();
                 },
                 nullptr, nullptr, fmt::format("L{} fwd post-attention, head", first + layers - 1), ""});
  return out;
}

std::vector<runtime::Stage> backward_stages(NanoPass& p) {
  model::Model<float>& m = *p.model;
  const int64_t layers = m.num_stage_layers(), first = m.first_layer();
  std::vector<runtime::Stage> out;
  for (int64_t l = layers - 1; l >= 0; --l) {
    auto compute = [&p, l, layers]() -> Status {
      model::Model<float>& m = *p.model;
      if (l == layers - 1) {
        DISTCA_RETURN_IF_ERROR(m.begin_backward(*p.state, p.dx_in, /*zero_grads=*/false));
      } else {
        DISTCA_RETURN_IF_ERROR(m.backward_pre_attention(*p.state, l + 1));
      }
      return m.backward_post_attention(*p.state, l);
    };
    auto start = [&p, l, first] {
      const auto io = dispatch_io(p, l);
      return p.attention->start_backward(static_cast<int>(first + l),
                                         {io.q, io.k, io.v, io.o, io.lse, io.d_o, io.dq, io.dk, io.dv});
    };
    StagedAttention* att = p.attention;
    out.push_back({compute, start, [att] { return att->finish_dispatch(); }, fmt::format("L{} bwd linear", first + l),
                   fmt::format("L{} bwd dispatch", first + l)});
    out.push_back(attention_stage(att, first + l, "bwd"));
    out.back().finish_comm = [att, &p, l] { return finish_backward_return(att, p, l); };
  }
  out.push_back({[&p]() -> Status {
                   DISTCA_RETURN_IF_ERROR(p.model->backward_pre_attention(*p.state, 0));
                   p.model->finish_backward(*p.state);
                   return Status::ok();
                 },
                 nullptr, nullptr, fmt::format("L{} bwd pre-attention, embedding", first), ""});
  return out;
}

std::vector<runtime::Stage> serve_stages(StagedAttention& attention, int64_t first, int64_t layers, bool is_backward) {
  StagedAttention* att = &attention;
  const char* dir = is_backward ? "bwd" : "fwd";
  std::vector<runtime::Stage> out;
  for (int64_t i = 0; i < layers; ++i) {
    const int layer = static_cast<int>(is_backward ? first + layers - 1 - i : first + i);
    auto start = [att, layer, is_backward] {
      return is_backward ? att->start_backward(layer, {}) : att->start_forward(layer, {});
    };
    out.push_back({[] { return Status::ok(); }, start, [att] { return att->finish_dispatch(); },
                   fmt::format("L{} {} serve", layer, dir), fmt::format("L{} {} dispatch", layer, dir)});
    out.push_back(attention_stage(att, layer, dir));
  }
  out.push_back({[] { return Status::ok(); }, nullptr, nullptr, fmt::format("{} serve end", dir), ""});
  return out;
}

std::vector<runtime::Stage> joined(std::vector<runtime::Stage> a, std::vector<runtime::Stage> b) {
  if (!a.empty() && !b.empty() && !a.back().start_comm) {
    runtime::Stage& last = a.back();
    runtime::Stage next = std::move(b.front());
    last.compute = [first = std::move(last.compute), second = std::move(next.compute)]() -> Status {
      DISTCA_RETURN_IF_ERROR(first());
      return second();
    };
    last.start_comm = std::move(next.start_comm);
    last.finish_comm = std::move(next.finish_comm);
    last.name = fmt::format("{}; {}", last.name, next.name);
    last.comm_name = std::move(next.comm_name);
    b.erase(b.begin());
  }
  for (runtime::Stage& s : b) a.push_back(std::move(s));
  return a;
}

}  // namespace distca::train
