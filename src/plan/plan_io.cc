#include "distca/plan/plan_io.h"

#include <fmt/format.h>

#include <algorithm>

#include "distca/plan/verify.h"

namespace distca::plan {

using nlohmann::json;

namespace {

json load_json(const LoadSummary& s) {
  return {{"max", s.max}, {"mean", s.mean}, {"imbalance", s.imbalance},
          {"pairs_imbalance", s.pairs_imbalance}};
}

json model_json(const ModelShape& m) {
  return {{"name", m.name},          {"layers", m.num_layers},  {"hidden", m.hidden},
          {"heads", m.num_q_heads},  {"kv_heads", m.num_kv_heads}, {"head_dim", m.head_dim},
          {"ffn_hidden", m.ffn_hidden}, {"dtype_bytes", m.dtype_bytes}, {"tp", m.tp}};
}

json rate_json(const std::vector<RatePoint>& rates) {
  json out = json::array();
  for (const RatePoint& r : rates) out.push_back({{"keys", r.keys}, {"flops_per_second", r.flops_per_second}});
  return out;
}

json profile_json(const ThroughputProfile& p) {
  return {{"source", p.source},
          {"flops_per_second", p.flops_per_second},
          {"tile_rows", p.tile_rows},
          {"task_overhead_seconds", p.task_overhead_seconds},
          {"rate_by_keys", rate_json(p.rate_by_keys)}};
}

std::string hex(uint64_t h) { return fmt::format("{:016x}", h); }

}  // namespace

json plan_report_json(const Plan& before, const Plan& after, const Batch& batch, const CostModel& cost,
                      double plan_ms, bool verified) {
  const CommSummary& c = after.traffic.forward;
  return {{"policy", after.policy},
          {"ranks", batch.num_ranks},
          {"tokens_per_rank", batch.tokens_per_rank},
          {"documents", batch.num_docs()},
          {"model", cost.model().name},
          {"tolerance", after.tolerance},
          {"tasks", after.tasks.size()},
          {"plan_ms", plan_ms},
          {"verified", verified},
          {"balanced", after.is_balanced},
          {"guaranteed", after.is_guaranteed},
          {"within_budget", after.is_within_budget},
          {"smallest_kept_budget_bytes", after.smallest_kept_budget > 0 ? json(after.smallest_kept_budget) : json(nullptr)},
          {"split_tasks", std::count_if(after.tasks.begin(), after.tasks.end(),
                                        [](const Task& t) { return t.k0 > 0 || !t.is_causal(); })},
          {"note", after.note},
          {"hash", hex(after.hash)},
          {"load_unit", "estimated seconds of core attention per step (all layers, fwd + bwd)"},
          {"load_before", load_json(before.load)},
          {"load_after", load_json(after.load)},
          {"comm",
           {{"scope", "forward dispatch + return, one layer"},
            {"total_bytes", c.total_bytes},
            {"max_send_bytes", c.max_send_bytes},
            {"max_recv_bytes", c.max_recv_bytes},
            {"q_bytes", c.q_bytes},
            {"kv_bytes", c.kv_bytes},
            {"out_bytes", c.out_bytes}}}};
}

json plan_to_json(const Plan& plan, const Batch& batch, const CostModel& cost) {
  json pieces = json::array();
  for (const Piece& p : batch.pieces) pieces.push_back({p.doc, p.begin, p.end, p.rank});
  json tasks = json::array();
  for (const Task& t : plan.tasks) tasks.push_back({t.doc, t.q0, t.q1, t.k0, t.k1, t.server});
  json phases = json::object();
  for (int p = 0; p < kNumPhases; ++p) {
    json flows = json::array();
    for (const Flow& f : plan.traffic.phases[p].flows) flows.push_back({f.src, f.dst, f.bytes});
    phases[phase_name(static_cast<Phase>(p))] = flows;
  }
  return {{"format", kPlanFormat},
          {"version", kPlanVersion},
          {"policy", plan.policy},
          {"tolerance", plan.tolerance},
          {"hash", hex(plan.hash)},
          {"model", model_json(cost.model())},
          {"profile", profile_json(cost.profile())},
          {"batch",
           {{"ranks", batch.num_ranks},
            {"tokens_per_rank", batch.tokens_per_rank},
            {"doc_lengths", batch.doc_lengths},
            {"pieces", pieces}}},
          {"task_fields", {"doc", "q0", "q1", "k0", "k1", "server"}},
          {"tasks", tasks},
          {"server_seconds", plan.server_seconds},
          {"flow_fields", {"src", "dst", "bytes"}},
          {"flows_per_layer", phases}};
}

Result<LoadedPlan> plan_from_json(const json& j) {
  try {
    if (!j.is_object() || j.value("format", "") != kPlanFormat) {
      return invalid_argument(fmt::format("not a plan file (expected \"format\": \"{}\"); "
                                          "write one with `distca plan --out FILE`", kPlanFormat));
    }
    if (j.value("version", -1) != kPlanVersion) {
      return invalid_argument(fmt::format("plan file version {} is not supported (this build reads "
                                          "version {}); regenerate it with `distca plan --out FILE`",
                                          j.value("version", -1), kPlanVersion));
    }
    LoadedPlan out;
    const json& m = j.at("model");
    out.model = ModelShape{m.at("name").get<std::string>(), m.at("layers").get<int>(),
                           m.at("hidden").get<int>(),      m.at("heads").get<int>(),
                           m.at("kv_heads").get<int>(),    m.at("head_dim").get<int>(),
                           m.at("ffn_hidden").get<int>(),  m.at("dtype_bytes").get<int>(),
                           m.at("tp").get<int>()};
    DISTCA_RETURN_IF_ERROR(out.model.validate());
    const json& p = j.at("profile");
    ThroughputProfile profile{p.at("source").get<std::string>(), p.at("flops_per_second").get<double>(),
                              p.at("tile_rows").get<int64_t>(), p.at("task_overhead_seconds").get<double>()};
    if (p.contains("rate_by_keys")) {
      for (const json& r : p.at("rate_by_keys")) {
        profile.rate_by_keys.push_back({r.at("keys").get<int64_t>(), r.at("flops_per_second").get<double>()});
      }
    }
    DISTCA_RETURN_IF_ERROR(profile.validate());
    const json& b = j.at("batch");
    out.batch.num_ranks = b.at("ranks").get<int32_t>();
    out.batch.tokens_per_rank = b.at("tokens_per_rank").get<int64_t>();
    out.batch.doc_lengths = b.at("doc_lengths").get<std::vector<int64_t>>();
    for (const json& piece : b.at("pieces")) {
      out.batch.pieces.push_back(Piece{piece.at(0).get<int32_t>(), piece.at(1).get<int64_t>(),
                                       piece.at(2).get<int64_t>(), piece.at(3).get<int32_t>()});
      const Piece& last = out.batch.pieces.back();
      if (last.doc < 0 || last.doc >= out.batch.num_docs()) {
        return invalid_argument(fmt::format("plan file: piece of unknown document {}", last.doc));
      }
    }
    out.batch.index();
    DISTCA_RETURN_IF_ERROR(out.batch.validate());
    std::vector<Task> tasks;
    for (const json& t : j.at("tasks")) {
      tasks.push_back(Task{t.at(0).get<int32_t>(), t.at(1).get<int64_t>(), t.at(2).get<int64_t>(),
                           t.at(3).get<int64_t>(), t.at(4).get<int64_t>(), t.at(5).get<int32_t>()});
    }
    Status verified = verify_tasks(out.batch, tasks);
    if (!verified.is_ok()) return invalid_argument("plan file: " + verified.message());
    const CostModel cost(out.model, profile);
    out.plan = finalize_plan(j.at("policy").get<std::string>(), j.at("tolerance").get<double>(),
                             out.batch, cost, std::move(tasks));
    if (hex(out.plan.hash) != j.at("hash").get<std::string>()) {
      return invalid_argument(fmt::format("plan file: hash {} does not match its contents ({}); "
                                          "the file was edited or truncated",
                                          j.at("hash").get<std::string>(), hex(out.plan.hash)));
    }
    return out;
  } catch (const json::exception& e) {
    return invalid_argument(fmt::format("plan file: malformed field: {}", e.what()));
  }
}

}  // namespace distca::plan
