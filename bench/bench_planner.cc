#include "distca/bench/bench_planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>

#include "distca/core/file.h"
#include "distca/core/knobs.h"
#include "distca/plan/bounds.h"
#include "distca/plan/model_shape.h"
#include "distca/plan/planner.h"
#include "distca/plan/verify.h"
#include "distca/plan/workload.h"
#include "distca/sim/auto_tolerance.h"
#include "distca/facade/plan_request.h"

namespace distca::bench {

using nlohmann::json;
using namespace distca::plan;

Status validate(const PlannerBenchOptions& o) {
  DISTCA_ASSIGN_OR_RETURN(const std::optional<double> eps, facade::parse_tolerance(o.tolerance));
  if (eps && !(*eps >= 0 && *eps <= 1)) return invalid_argument(fmt::format("--tolerance must be in [0, 1] or auto, got {}", *eps));
  if (o.repeats < 1 || o.repeats > 1000) return invalid_argument(fmt::format("--repeats must be 1..1000, got {}", o.repeats));
  if (o.fresh_seeds < 0 || o.fresh_seeds > 100) {
    return invalid_argument(fmt::format("--fresh must be 0..100, got {}", o.fresh_seeds));
  }
  if (o.policies.empty()) return invalid_argument("--policies names no planner");
  for (const std::string& p : o.policies) {
    if (!find_planner(p).is_ok()) {
      return invalid_argument(fmt::format("--policies: unknown planner '{}' (the planners are {})", p,
                                          fmt::join(planner_names(), ", ")));
    }
  }
  return Status::ok();
}

std::string reference_dir(const PlannerBenchOptions& o) {
  if (!o.reference_dir.empty()) return o.reference_dir;
  const char* shared = knob("DISTCA_SHARED_DATA");
  return std::string(shared != nullptr ? shared : "../shared/data") + "/reference";
}

constexpr const char* kFreshSamples[] = {"dist_wlbllm.json", "dist_prolong.json"};

std::vector<PlannerBenchInput> planner_bench_inputs(const PlannerBenchOptions& o) {
  const std::string dir = reference_dir(o);
  const std::string flag = o.reference_dir.empty() ? "the default --reference-dir" : "--reference-dir";
  std::vector<PlannerBenchInput> inputs{{flag, dir}};
  if (o.fresh_seeds > 0) {
    for (const char* sample : kFreshSamples) {
      inputs.push_back({"--fresh (a sample beside the --reference-dir folder)", (std::filesystem::path(dir).parent_path() / sample).string()});
    }
  }
  return inputs;
}

namespace {

double max_of(const std::vector<int64_t>& v) { return static_cast<double>(*std::max_element(v.begin(), v.end())); }

// ours / the reference's, or null where the reference has no figures at this eps.
json over(double ours, const json& ref, const char* key) {
  if (ref.is_null()) return nullptr;
  return ours / ref.at(key).get<double>();
}

json plan_json(const Batch& batch, const CostModel& cost, const Plan& plan, double plan_ms, const json& ref) {
  const auto& d = plan.traffic.phases[static_cast<int>(Phase::kFwdDispatch)];
  const double q = static_cast<double>(plan.traffic.forward.q_bytes);
  const double kv = static_cast<double>(plan.traffic.forward.kv_bytes);
  const double send = max_of(d.send_bytes), recv = max_of(d.recv_bytes);
  const int64_t max_pairs = *std::max_element(plan.server_pairs.begin(), plan.server_pairs.end());
  const DispatchBounds bound = dispatch_lower_bounds(batch, cost.token_bytes(), max_pairs);
  // What the runtime sends in all four phases with the stateful backward: a key-split row pays
  // its partial O/LSE back, and its merged O/LSE again with dO.
  const Traffic all = count_traffic(batch, cost.token_bytes(), plan.tasks, BackwardMode::kStateful);
  double all_bytes = 0;
  for (const auto& ph : all.phases) all_bytes += static_cast<double>(ph.total_bytes);
  json j{{"policy", plan.policy},
         {"tolerance", plan.tolerance},
         {"all_phases_bytes_stateful", all_bytes},
         {"verified", verify_tasks(batch, plan.tasks).is_ok()},
         {"imbalance", plan.load.pairs_imbalance},
         {"seconds_imbalance", plan.load.imbalance},  // what the planners balance: estimated seconds
         {"q_bytes", q},
         {"kv_bytes", kv},
         {"dispatch_bytes", q + kv},
         {"max_send_bytes", send},
         {"max_recv_bytes", recv},
         {"tasks", plan.tasks.size()},
         {"split_tasks", std::count_if(plan.tasks.begin(), plan.tasks.end(),
                                       [](const Task& t) { return t.k0 > 0 || !t.is_causal(); })},
         {"plan_ms", plan_ms},
         {"dispatch_over_reference",
          ref.is_null() ? json(nullptr)
                        : json((q + kv) / (ref.at("q_bytes").get<double>() + ref.at("kv_bytes").get<double>()))},
         {"max_send_over_reference", over(send, ref, "max_send_bytes")},
         {"max_recv_over_reference", over(recv, ref, "max_recv_bytes")}};
  // The busiest link of each phase (the most bytes a rank sends or receives in it), stateful.
  const LinkSummary links = busiest_links(all);
  j["links"] = {{"fwd_dispatch", links.busiest[0]}, {"fwd_return", links.busiest[1]}, {"bwd_dispatch", links.busiest[2]},
                {"bwd_return", links.busiest[3]}, {"step", links.step}};
  const LinkBounds lb = link_lower_bounds(batch, cost.token_bytes(), max_pairs);
  if (lb.is_computed && !(lb.step > 0 && lb.fwd_dispatch > 0)) {
    // A plan whose largest load is above every rank's own: the bounds ask nothing to move.
    j["link_bound"] = {{"not_computed", "no rank holds more than this plan's largest load, so the bounds are 0"}};
  } else if (lb.is_computed) {
    j["link_bound"] = {{"fwd_dispatch", lb.fwd_dispatch}, {"step", lb.step}};
    j["fwd_dispatch_link_over_bound"] = static_cast<double>(links.fwd_dispatch) / lb.fwd_dispatch;
    j["step_link_over_bound"] = static_cast<double>(links.step) / lb.step;
  } else {
    j["link_bound"] = {{"not_computed", lb.why_not}};
  }
  if (bound.is_computed) {
    j["bound"] = {{"max_pairs", bound.max_pairs},
                  {"dispatch_bytes", bound.total},
                  {"dispatch_bytes_by_senders", bound.total_by_senders},
                  {"dispatch_bytes_by_rooms", bound.total_by_rooms},
                  {"max_send_bytes", bound.max_send},
                  {"max_recv_bytes", bound.max_recv}};
  } else {
    j["bound"] = {{"not_computed", bound.why_not}};
  }
  return j;
}

}  // namespace

Result<json> run_planner_bench(const PlannerBenchOptions& o) {
  const std::string dir = reference_dir(o);
  const std::string results_path = dir + "/reference_planner.json";
  DISTCA_ASSIGN_OR_RETURN(std::string text, read_text_file(results_path));
  json reference;
  try {
    reference = json::parse(text);
  } catch (const json::exception& e) {
    return invalid_argument(fmt::format("{}: not JSON: {}", results_path, e.what()));
  }
  if (!reference.is_object() || reference.value("format", "") != "distca-reference-planner-results") {
    return invalid_argument(fmt::format("{}: not a distca-reference-planner-results file", results_path));
  }
  // The reference ran Llama-8B in bf16 at TP 1; our byte counts must be its.
  const CostModel cost(model_preset("llama-8b").value(), ThroughputProfile{});
  const sim::Profile profile = sim::default_h200_profile();
  const json& model = reference.at("model");
  const int64_t q_row = model.at("hidden").get<int64_t>() * model.at("dtype_bytes").get<int64_t>();
  if (cost.token_bytes().q != q_row) {
    return invalid_argument(fmt::format("{}: the reference's model moves {} bytes per Q row, llama-8b {}", results_path,
                                        q_row, cost.token_bytes().q));
  }
  DISTCA_RETURN_IF_ERROR(validate(o));
  const std::optional<double> eps = facade::parse_tolerance(o.tolerance).value();  // unset: auto
  json report{{"tolerance", eps ? json(*eps) : json("auto")}, {"reference_dir", dir}, {"repeats", o.repeats}, {"batches", json::array()}};
  // Every batch the reference ran, once; its figures where it ran at this eps (0.02 and 0.1).
  std::vector<std::string> names;
  for (const json& r : reference.at("results")) {
    if (std::find(names.begin(), names.end(), r.at("batch").get<std::string>()) == names.end()) names.push_back(r.at("batch"));
  }
  struct Case {
    std::string name;
    Batch batch;
    json ref;
  };
  std::vector<Case> cases;
  for (const std::string& name : names) {
    json ref = nullptr;
    for (const json& r : reference.at("results")) {
      if (r.at("batch") == name && eps && std::abs(r.at("tolerance").get<double>() - *eps) <= 1e-12) ref = r;
    }
    const std::string path = dir + "/" + name;
    DISTCA_ASSIGN_OR_RETURN(std::string batch_text, read_text_file(path));
    DISTCA_ASSIGN_OR_RETURN(Batch batch, parse_batch_json(batch_text, 0, path));
    cases.push_back({name, std::move(batch), ref});
  }
  // Fresh batches from the shipped samples, drawn as `distca plan --doc-lengths F --seed S` draws.
  for (const char* sample : kFreshSamples) {
    if (o.fresh_seeds == 0) break;
    const std::string path = (std::filesystem::path(dir).parent_path() / sample).string();
    DISTCA_ASSIGN_OR_RETURN(LengthDistribution dist, load_doc_lengths(path));
    for (const int32_t ranks : {64, 512}) {
      for (int seed = 1; seed <= o.fresh_seeds; ++seed) {
        SamplingOptions so;
        so.seed = static_cast<uint64_t>(seed);
        DISTCA_ASSIGN_OR_RETURN(Batch sampled, sample_batch(dist, so, ranks, 131072));
        // In the reference batches' form: each rank's pieces as its own documents (a document
        // packed across a rank boundary becomes two), so every document lies on one rank.
        json per_rank = json::array();
        for (int32_t k = 0; k < ranks; ++k) per_rank.push_back(json::array());
        for (const Piece& p : sampled.pieces) per_rank[p.rank].push_back(p.length());
        const std::string name = fmt::format("{} r{} seed {}", sample, ranks, seed);
        DISTCA_ASSIGN_OR_RETURN(Batch batch, parse_batch_json(json{{"ranks", per_rank}}.dump(), 0, name));
        cases.push_back({name, std::move(batch), nullptr});
      }
    }
  }
  for (Case& c : cases) {
    const std::string& name = c.name;
    const Batch& batch = c.batch;
    const json& ref = c.ref;
    json entry{{"batch", name}, {"ranks", batch.num_ranks}, {"reference", ref}, {"plans", json::array()}};
    const PlannerOptions options{eps.value_or(sim::kAutoToleranceStart), 128, 0};
    // auto prices each plan's step on the built-in H200 profile, 8 GPUs to a node (distca plan's
    // defaults): inter-node beyond 8 ranks.
    const sim::Link link = batch.num_ranks > 8 ? profile.inter_node : profile.intra_node;
    // Interleaved repeats, so every policy's time is taken under the same machine load.
    std::vector<PlanFn> fns;
    for (const std::string& p : o.policies) fns.push_back(find_planner(p).value());
    std::vector<std::vector<double>> ms(fns.size());
    std::vector<Plan> plans(fns.size());
    std::vector<json> autos(fns.size());
    for (int rep = 0; rep < o.repeats; ++rep) {
      for (size_t i = 0; i < fns.size(); ++i) {
        const auto start = std::chrono::steady_clock::now();
        Plan plan;
        if (eps) {
          DISTCA_ASSIGN_OR_RETURN(plan, fns[i](batch, cost, options));
        } else {
          DISTCA_ASSIGN_OR_RETURN(sim::AutoPlan chosen, sim::plan_auto_tolerance(batch, cost, options, fns[i], profile, link,
                                                                                /*stateless=*/fns[i] == plan_distca));
          plan = std::move(chosen.plan);
          if (rep == 0) autos[i] = chosen.auto_tolerance.to_json();
        }
        ms[i].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
        if (rep == 0) plans[i] = std::move(plan);
      }
    }
    for (size_t i = 0; i < fns.size(); ++i) {
      std::sort(ms[i].begin(), ms[i].end());
      entry["plans"].push_back(plan_json(batch, cost, plans[i], ms[i][ms[i].size() / 2], ref));
      entry["plans"].back()["tolerance_auto"] = autos[i];
    }
    report["batches"].push_back(entry);
  }
  if (report["batches"].empty()) return invalid_argument(fmt::format("{} names no batch", results_path));
  // Per policy, over every batch: the worst ratio to each bound, the worst imbalance, the slowest
  // median planning time at 512 ranks, and in how many batches its step's links are the least busy
  // of the policies run (ties count).
  json summary = json::object();
  for (const json& b : report["batches"]) {
    double least = 0;
    bool first = true;
    for (const json& p : b["plans"]) {
      const double step = p["links"]["step"].get<double>();
      if (first || step < least) least = step;
      first = false;
    }
    for (const json& p : b["plans"]) {
      json& s = summary[p["policy"].get<std::string>()];
      if (s.is_null()) s = json::object();
      auto worst = [&](const char* key, double v) { s[key] = std::max(s.value(key, v), v); };
      if (p.contains("step_link_over_bound")) {
        worst("worst_step_link_over_bound", p["step_link_over_bound"].get<double>());
        worst("worst_fwd_dispatch_link_over_bound", p["fwd_dispatch_link_over_bound"].get<double>());
        worst("worst_dispatch_bytes_over_bound", p["dispatch_bytes"].get<double>() / p["bound"]["dispatch_bytes"].get<double>());
      }
      worst("worst_imbalance", p["seconds_imbalance"].get<double>());
      // Whether max load <= (1 + eps) mean held at the eps the plan was made at (auto: the one picked).
      const bool within = p["seconds_imbalance"].get<double>() <= (1 + p["tolerance"].get<double>()) * (1 + 1e-9);
      s["imbalance_within_eps_in"] = s.value("imbalance_within_eps_in", 0) + (within ? 1 : 0);
      worst("largest_tolerance", p["tolerance"].get<double>());
      s["smallest_tolerance"] = std::min(s.value("smallest_tolerance", 1.0), p["tolerance"].get<double>());
      if (b["ranks"].get<int>() >= 512) worst("slowest_plan_ms_512", p["plan_ms"].get<double>());
      s["least_busy_step_in"] = s.value("least_busy_step_in", 0) + (p["links"]["step"].get<double>() <= least ? 1 : 0);
      s["batches"] = s.value("batches", 0) + 1;
    }
  }
  report["summary"] = summary;
  return report;
}

void print_planner_report(const json& report) {
  constexpr double kGB = 1e9;
  const std::string eps =
      report["tolerance"].is_string() ? "auto (each plan's own: eps column)" : fmt::format("{}", report["tolerance"].get<double>());
  fmt::print("Forward dispatch (Q + K/V) of one layer, Llama-8B bf16 TP 1, eps {}; 1 GB = 1e9 bytes; (x ref) = ours / "
             "the reference planner's\n", eps);
  if (report["tolerance"].is_string()) {
    fmt::print("auto: each plan's step predicted on the built-in H200 profile (8 GPUs a node); plan ms: the whole "
               "search, every plan it made\n");
  }
  fmt::print("plan ms: median of {} runs, the policies interleaved in this run; all phases: GB of the forward and the "
             "stateful backward, both directions\n\n", report["repeats"].get<int>());
  for (const json& b : report["batches"]) {
    const json& ref = b["reference"];
    fmt::print("{} ({} ranks)\n", b["batch"].get<std::string>(), b["ranks"].get<int>());
    fmt::print("  {:<22} {:>9} {:>8} {:>16} {:>16} {:>16} {:>8} {:>8} {:>8} {:>12}\n", "", "imbalance", "eps",
               "Q+K/V GB (x ref)", "max send GB", "max recv GB", "tasks", "split", "plan ms", "all phases");
    if (ref.is_null()) {
      fmt::print("  {:<22} (no figures at this eps: the reference ran at 0.02 and 0.1 only)\n", "reference planner");
    } else {
      fmt::print("  {:<22} {:>9.4f} {:>8g} {:>16.2f} {:>16.3f} {:>16.3f} {:>8} {:>8} {:>8} {:>12}\n", "reference planner",
                 ref["imbalance_after"].get<double>(), ref["tolerance"].get<double>(),
                 (ref["q_bytes"].get<double>() + ref["kv_bytes"].get<double>()) / kGB,
                 ref["max_send_bytes"].get<double>() / kGB, ref["max_recv_bytes"].get<double>() / kGB,
                 ref["chunks"].get<int64_t>(), "-", "-", "-");
    }
    auto x = [](const json& v) { return v.is_null() ? std::string("  -  ") : fmt::format("{:.2f}x", v.get<double>()); };
    for (const json& p : b["plans"]) {
      fmt::print("  {:<22} {:>9.4f} {:>8g} {:>8.2f} ({}) {:>8.3f} ({}) {:>8.3f} ({}) {:>8} {:>8} {:>8.2f} {:>12.1f}{}\n",
                 p["policy"].get<std::string>(), p["imbalance"].get<double>(), p["tolerance"].get<double>(),
                 p["dispatch_bytes"].get<double>() / kGB,
                 x(p["dispatch_over_reference"]), p["max_send_bytes"].get<double>() / kGB,
                 x(p["max_send_over_reference"]), p["max_recv_bytes"].get<double>() / kGB,
                 x(p["max_recv_over_reference"]), p["tasks"].get<int64_t>(), p["split_tasks"].get<int64_t>(),
                 p["plan_ms"].get<double>(), p["all_phases_bytes_stateful"].get<double>() / kGB,
                 p["verified"].get<bool>() ? "" : "  NOT VERIFIED");
    }
    for (const json& p : b["plans"]) {
      const json& bound = p["bound"];
      if (bound.contains("not_computed")) {
        fmt::print("  lower bound for {}: not computed: {}\n", p["policy"].get<std::string>(),
                   bound["not_computed"].get<std::string>());
        continue;
      }
      if (p["policy"] != "minbytes") continue;
      fmt::print("  {:<22} {:>9} {:>8} {:>16.2f} {:>16.3f} {:>16.3f}   (plans as balanced as minbytes', rows not relayed)\n",
                 "lower bound", "", "", bound["dispatch_bytes"].get<double>() / kGB, bound["max_send_bytes"].get<double>() / kGB,
                 bound["max_recv_bytes"].get<double>() / kGB);
    }
    // The busiest link per phase of a stateful step, beside its lower bound.
    fmt::print("  busiest link, GB (the most a rank sends or receives), stateful step; (x bound)\n");
    fmt::print("  {:<22} {:>16} {:>11} {:>12} {:>11} {:>16}\n", "", "fwd dispatch", "fwd return", "bwd dispatch",
               "bwd return", "step (sum)");
    for (const json& p : b["plans"]) {
      const json& l = p["links"];
      const bool has = p.contains("step_link_over_bound");
      fmt::print("  {:<22} {:>8.3f} ({}) {:>11.3f} {:>12.3f} {:>11.3f} {:>8.3f} ({})\n", p["policy"].get<std::string>(),
                 l["fwd_dispatch"].get<double>() / kGB, has ? x(p["fwd_dispatch_link_over_bound"]) : "  -  ",
                 l["fwd_return"].get<double>() / kGB, l["bwd_dispatch"].get<double>() / kGB,
                 l["bwd_return"].get<double>() / kGB, l["step"].get<double>() / kGB,
                 has ? x(p["step_link_over_bound"]) : "  -  ");
    }
    for (const json& p : b["plans"]) {
      if (!p["link_bound"].contains("step")) continue;
      fmt::print("  {:<22} {:>8.3f} {:>55.3f}   (plans as balanced as {}'s)\n", "link lower bound",
                 p["link_bound"]["fwd_dispatch"].get<double>() / kGB, p["link_bound"]["step"].get<double>() / kGB,
                 p["policy"].get<std::string>());
      break;
    }
    fmt::print("\n");
  }
  fmt::print("Over all {} batches (the worst of each; least busy: batches where its step's links are the least busy "
             "of the policies run)\n", report["batches"].size());
  fmt::print("  {:<12} {:>16} {:>20} {:>18} {:>10} {:>15} {:>10} {:>16} {:>12}\n", "policy", "step link/bound",
             "fwd dispatch/bound", "Q+K/V bytes/bound", "imbalance", "eps", "<= 1+eps", "plan ms at 512", "least busy");
  fmt::print("  (imbalance here: max / mean of estimated seconds, what the planners balance; above: of pairs)\n");
  for (const auto& [name, s] : report["summary"].items()) {
    auto v = [&](const char* key, const char* f) {
      return s.contains(key) ? fmt::format(fmt::runtime(f), s[key].get<double>()) : std::string("-");
    };
    const double lo = s["smallest_tolerance"].get<double>(), hi = s["largest_tolerance"].get<double>();
    const std::string eps = lo == hi ? fmt::format("{:g}", lo) : fmt::format("{:g}..{:g}", lo, hi);
    fmt::print("  {:<12} {:>16} {:>20} {:>18} {:>10} {:>15} {:>10} {:>16} {:>12}\n", name,
               v("worst_step_link_over_bound", "{:.3f}"), v("worst_fwd_dispatch_link_over_bound", "{:.3f}"),
               v("worst_dispatch_bytes_over_bound", "{:.3f}"), v("worst_imbalance", "{:.4f}"), eps,
               fmt::format("{}/{}", s["imbalance_within_eps_in"].get<int>(), s["batches"].get<int>()),
               v("slowest_plan_ms_512", "{:.2f}"),
               fmt::format("{}/{}", s["least_busy_step_in"].get<int>(), s["batches"].get<int>()));
  }
}

}  // namespace distca::bench
