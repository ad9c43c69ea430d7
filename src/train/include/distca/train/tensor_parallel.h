// The rank map of a (tp, pp, dp) run and the tensor-parallel pieces the trainers share.
//
// World rank w = (stage * dp + replica) * tp + tp_index: the tensor-parallel group is innermost
// (adjacent ranks, one node in a real cluster), then the data-parallel replicas of a stage, then
// the stages. A rank joins four groups:
//   tp   the same stage and replica: the model's heads and FFN columns split over it
//   dp   the same stage and TP index: gradients all-reduced over it
//   pp   the same replica and TP index: activations and their gradients pass along it
//   cad  the same TP index: the attention servers of CAD; TP index i's head slice is dispatched
//        only to ranks of TP index i (the paper's CAD with TP)
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "distca/comm/communicator.h"
#include "distca/model/model.h"

namespace distca::train {

struct RankCoords {
  int tp = 0, pp = 0, dp = 0;  // this rank's TP index, stage and replica
};

struct RankMap {
  int tp = 1, pp = 1, dp = 1;  // group sizes; world = tp * pp * dp
  // REQUIRES: tp, pp >= 1, and tp * pp divides world.
  static RankMap of(int world, int tp, int pp) { return {tp, pp, world / (tp * pp)}; }
  int world() const { return tp * pp * dp; }
  RankCoords coords(int world_rank) const { return {world_rank % tp, world_rank / (tp * dp), (world_rank / tp) % dp}; }
  int rank(RankCoords c) const { return (c.pp * dp + c.dp) * tp + c.tp; }
  // The world ranks of each group `world_rank` joins, in group-rank order.
  std::vector<int> tp_group(int world_rank) const;
  std::vector<int> dp_group(int world_rank) const;
  std::vector<int> pp_group(int world_rank) const;
  std::vector<int> cad_group(int world_rank) const;
  // One line per rank: "rank 3: tp 1, pp 0, dp 1; tp [2 3], dp [1 3], pp [3], cad [1 3]".
  std::vector<std::string> describe() const;
  nlohmann::json to_json() const;
};

// The communicators of one rank (split collectively from the world). A group of one is still a
// communicator (its collectives are copies).
struct RankGroups {
  RankMap map;
  RankCoords me;
  int kv_replicas = 1;  // TP ranks that share each key/value head (kv_head_replicas)
  std::unique_ptr<comm::Communicator> tp, dp, pp, cad;
  std::unique_ptr<comm::Communicator> kv;  // the TP ranks sharing this rank's key/value heads (kv_replicas > 1)
  // `model`: the whole model (for how its key/value heads spread over the TP ranks).
  static Result<RankGroups> split(comm::Communicator& world, int tp, int pp, const model::ModelConfig& model);
};

// The Model's all-reduces over the groups' tp and kv communicators (none for a TP group of one).
model::TensorParallel<float> tensor_parallel(const RankGroups& groups);

// The sum of squares of the gradients in arena elements [begin, end), over the whole model's
// parameters: the sharded blocks' squares summed over the TP group (shared key/value heads
// counted once), the replicated blocks (the same on every TP rank) once. Collective over the TP
// group.
Result<double> gradient_square_sum(const model::ModelState<float>& state, int64_t begin, int64_t end, const RankGroups& groups);

// Checks that every rank of `group` holds a plan with this hash (CAD with TP makes the plan
// from document lengths alone, once per TP rank: they must agree). Collective; every rank gets
// the same verdict.
Status check_same_plan(comm::Communicator& group, uint64_t hash, const std::string& what);

}  // namespace distca::train
