// A nano-batch's passes as chains of ping-pong stages (runtime/pingpong.h): the model's phases
// (on a row slice of the micro-batch's workspace) and its attention backend's staged passes, so
// that runtime::run_pingpong can interleave two nano-batches layer by layer.
//
// Forward, per layer l: a linear stage (the previous layer's post-attention work, then this
// layer's norm, Q/K/V and RoPE) that ends by posting the dispatch, and an attention stage (the
// server kernel) that ends by posting the return; then a last stage (the last layer's
// post-attention work and the head's loss). Backward mirrors it: per layer from the last, a
// linear stage (the layer above's pre-attention backward, then this layer's MLP and Wo backward)
// ending with the dispatch of dO, and an attention stage ending with the return of dQ/dK/dV; then
// a last stage (layer 0's pre-attention backward and the embedding). The backward adds to the
// state's gradients: the caller zeroes them once and calls reduce_shared_grads after both
// nano-batches.
#pragma once
#include <vector>

#include "distca/train/dispatch_attention.h"
#include "distca/model/model.h"
#include "distca/runtime/pingpong.h"

namespace distca::train {

// A positional split (layout::split_step): nano-batch B's attention layout begins with `rows`
// rows that are A's last (the prefixes of the documents the two share): B's passes read their
// K/V from A's rows just before B's slice, and B's backward return leaves their dK/dV here,
// which A adds to its own once its return is in (B's backward runs first).
struct ContextRows {
  int64_t rows = 0;      // this rank's context rows
  int64_t q_row = 0;     // floats per row of Q/O/dO/dQ, K/V/dK/dV and LSE on this rank
  int64_t kv_row = 0;
  int64_t lse_row = 0;
  std::vector<float> dk, dv;  // B's backward return: [rows + B's own rows, kv_row]
  // [stage layer] the context rows' dK/dV B returned, until A adds them (the sequential
  // schedule runs all of B's backward before A's).
  std::vector<std::vector<float>> layer_dk, layer_dv;
  int64_t pending_bytes = 0, pending_peak_bytes = 0;  // layer_dk + layer_dv held now, and at most
  // The bytes these buffers hold at their peak.
  int64_t peak_bytes() const { return static_cast<int64_t>((dk.capacity() + dv.capacity()) * sizeof(float)) + pending_peak_bytes; }
};

// What a nano-batch's chain works on. The stages capture this object: it must outlive them.
struct NanoPass {
  model::Model<float>* model = nullptr;  // a row slice holding this nano-batch's rows
  model::ModelState<float>* state = nullptr;
  StagedAttention* attention = nullptr;  // begin_step done with the nano-batch's layout
  model::StepTokens in;
  const float* x_in = nullptr;   // a stage without the embedding: its input activations
  const float* dx_in = nullptr;  // a stage without the head: the gradient of its output
  double loss_scale = 0;
  double loss = 0;  // out: the forward's summed loss (0 without the head)
  // A positional split: B reads the context rows (context_reader), A adds their dK/dV.
  ContextRows* context = nullptr;
  bool context_reader = false;
};

std::vector<runtime::Stage> forward_stages(NanoPass& pass);
std::vector<runtime::Stage> backward_stages(NanoPass& pass);
// The chain of a rank that serves a nano-batch's attention without rows of its own in it (an
// idle pipeline stage, or a micro-batch with nothing in this nano-batch): every exchange of the
// layers [first_layer, first_layer + layers), no linear work, in the shape of forward_stages
// (backward_stages), so that its collectives pair with the other ranks'.
std::vector<runtime::Stage> serve_stages(StagedAttention& attention, int64_t first_layer, int64_t layers, bool is_backward);
// a then b as one chain: when a's last stage posts nothing, b's first compute joins it (so the
// turn from the forward to the backward is one stage, overlapped like the others).
std::vector<runtime::Stage> joined(std::vector<runtime::Stage> a, std::vector<runtime::Stage> b);

}  // namespace distca::train
