#include "distca/train/tensor_parallel.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace distca::train {

namespace {

// The world ranks whose coordinates differ from `world_rank`'s only where `vary` says, ordered
// by the varying coordinate(s) (the group's rank order).
template <typename Vary>
std::vector<int> members(const RankMap& m, int world_rank, Vary vary) {
  std::vector<int> out;
  for (int w = 0; w < m.world(); ++w) {
    if (vary(m.coords(w), m.coords(world_rank))) out.push_back(w);
  }
  return out;
}

}  // namespace

std::vector<int> RankMap::tp_group(int w) const {
  return members(*this, w, [](RankCoords a, RankCoords b) { return a.pp == b.pp && a.dp == b.dp; });
}
std::vector<int> RankMap::dp_group(int w) const {
  return members(*this, w, [](RankCoords a, RankCoords b) { return a.pp == b.pp && a.tp == b.tp; });
}
std::vector<int> RankMap::pp_group(int w) const {
  return members(*this, w, [](RankCoords a, RankCoords b) { return a.dp == b.dp && a.tp == b.tp; });
}
std::vector<int> RankMap::cad_group(int w) const {
  return members(*this, w, [](RankCoords a, RankCoords b) { return a.tp == b.tp; });
}

std::vector<std::string> RankMap::describe() const {
  std::vector<std::string> lines;
  for (int w = 0; w < world(); ++w) {
    const RankCoords c = coords(w);
    lines.push_back(fmt::format("rank {}: tp {}, pp {}, dp {}; groups tp [{}], dp [{}], pp [{}], cad servers [{}]", w,
                                c.tp, c.pp, c.dp, fmt::join(tp_group(w), " "), fmt::join(dp_group(w), " "),
                                fmt::join(pp_group(w), " "), fmt::join(cad_group(w), " ")));
  }
  return lines;
}

nlohmann::json RankMap::to_json() const {
  nlohmann::json ranks = nlohmann::json::array();
  for (int w = 0; w < world(); ++w) {
    const RankCoords c = coords(w);
    ranks.push_back({{"rank", w}, {"tp", c.tp}, {"pp", c.pp}, {"dp", c.dp}, {"tp_group", tp_group(w)},
                     {"dp_group", dp_group(w)}, {"pp_group", pp_group(w)}, {"cad_group", cad_group(w)}});
  }
  return {{"tp", tp}, {"pp", pp}, {"dp", dp}, {"ranks", ranks}};
}

Result<RankGroups> RankGroups::split(comm::Communicator& world, int tp, int pp, const model::ModelConfig& model) {
  if (tp < 1 || pp < 1 || world.size() % (tp * pp) != 0) {
    return invalid_argument(fmt::format("--tp {} x --pp {} must divide the {} ranks (the rest is data parallelism)", tp,
                                        pp, world.size()));
  }
  RankGroups g;
  g.map = RankMap::of(world.size(), tp, pp);
  g.me = g.map.coords(world.rank());
  const RankCoords c = g.me;
  const int D = g.map.dp;
  DISTCA_ASSIGN_OR_RETURN(g.tp, world.split(c.pp * D + c.dp, c.tp, "tp"));
  DISTCA_ASSIGN_OR_RETURN(g.dp, world.split(c.pp * tp + c.tp, c.dp, "dp"));
  DISTCA_ASSIGN_OR_RETURN(g.pp, world.split(c.dp * tp + c.tp, c.pp, "pp"));
  DISTCA_ASSIGN_OR_RETURN(g.cad, world.split(c.tp, c.pp * D + c.dp, "cad"));
  DISTCA_RETURN_IF_ERROR(model::tensor_parallel_shard(model, tp).status());
  g.kv_replicas = model::kv_head_replicas(model, tp);
  if (g.kv_replicas > 1) {
    DISTCA_ASSIGN_OR_RETURN(g.kv, g.tp->split(c.tp / g.kv_replicas, c.tp, "tp-kv"));
  }
  return g;
}

model::TensorParallel<float> tensor_parallel(const RankGroups& g) {
  model::TensorParallel<float> out;
  comm::Communicator* tp = g.tp.get();
  if (tp == nullptr || tp->size() == 1) return out;
  out.size = tp->size();
  out.all_reduce = [tp](float* data, int64_t count) { return tp->all_reduce_sum(data, count); };
  if (comm::Communicator* kv = g.kv.get()) {
    out.kv_all_reduce = [kv](float* data, int64_t count) { return kv->all_reduce_sum(data, count); };
  }
  return out;
}

Result<double> gradient_square_sum(const model::ModelState<float>& state, int64_t begin, int64_t end, const RankGroups& groups) {
  double sharded = 0, replicated = 0;
  for (const auto& b : state.grads.blocks()) {
    if (b.offset < begin || b.offset + b.count > end) continue;
    const float* g = state.grads.at(b.offset);
    double ss = 0;
    for (int64_t i = 0; i < b.count; ++i) ss += static_cast<double>(g[i]) * g[i];
    const bool is_kv = b.name.ends_with(".wk") || b.name.ends_with(".wv");
    if (is_kv) ss /= groups.kv_replicas;  // each of kv_replicas ranks holds the same summed gradient
    (model::ModelState<float>::is_tp_sharded(b.name) ? sharded : replicated) += ss;
  }
  comm::Communicator* tp = groups.tp.get();
  if (tp == nullptr || tp->size() == 1) return sharded + replicated;
  // One slot per TP rank, summed in a fixed order: every rank gets the same total.
  std::vector<float> slots(static_cast<size_t>(tp->size()), 0.0f);
  slots[tp->rank()] = static_cast<float>(sharded);
  DISTCA_RETURN_IF_ERROR(tp->all_reduce_sum(slots.data(), tp->size()));
  double total = replicated;
  for (float s : slots) total += s;
  return total;
}

Status check_same_plan(comm::Communicator& group, uint64_t hash, const std::string& what) {
  if (group.size() == 1) return Status::ok();
  // Four 16-bit pieces per rank travel exactly as floats.
  std::vector<float> all(static_cast<size_t>(4 * group.size()), 0.0f);
  for (int i = 0; i < 4; ++i) all[4 * group.rank() + i] = static_cast<float>((hash >> (16 * i)) & 0xffff);
  DISTCA_RETURN_IF_ERROR(group.all_reduce_sum(all.data(), static_cast<int64_t>(all.size())));
  for (int r = 1; r < group.size(); ++r) {
    for (int i = 0; i < 4; ++i) {
      if (all[4 * r + i] != all[i]) {
        return internal_error(fmt::format("{}: rank {} of the group made another plan than rank 0 (the plan must come "
                                          "from document lengths alone, the same on every rank)",
                                          what, r));
      }
    }
  }
  return Status::ok();
}

}  // namespace distca::train
