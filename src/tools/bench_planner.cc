#include "bench_planner.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>

#include "distca/core/file.h"
#include "distca/plan/bounds.h"
#include "distca/plan/model.h"
#include "distca/plan/planner.h"
#include "distca/plan/verify.h"

namespace distca::tools {

using nlohmann::json;
using namespace distca::plan;

Status validate(const PlannerBenchOptions& o) {
  if (!(o.tolerance >= 0 && o.tolerance <= 1)) {
    return invalid_argument(fmt::format("--tolerance must be in [0, 1], got {}", o.tolerance));
  }
  if (o.repeats < 1 || o.repeats > 1000) return invalid_argument(fmt::format("--repeats must be 1..1000, got {}", o.repeats));
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
  const char* shared = std::getenv("DISTCA_SHARED_DATA");
  return std::string(shared != nullptr ? shared : "../shared/data") + "/reference";
}

namespace {

double max_of(const std::vector<int64_t>& v) { return static_cast<double>(*std::max_element(v.begin(), v.end())); }

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
         {"all_phases_bytes_stateful", all_bytes},
         {"verified", verify_tasks(batch, plan.tasks).is_ok()},
         {"imbalance", plan.load.pairs_imbalance},
         {"q_bytes", q},
         {"kv_bytes", kv},
         {"dispatch_bytes", q + kv},
         {"max_send_bytes", send},
         {"max_recv_bytes", recv},
         {"tasks", plan.tasks.size()},
         {"split_tasks", std::count_if(plan.tasks.begin(), plan.tasks.end(),
                                       [](const Task& t) { return t.k0 > 0 || !t.is_causal(); })},
         {"plan_ms", plan_ms},
         {"dispatch_over_reference", (q + kv) / (ref.at("q_bytes").get<double>() + ref.at("kv_bytes").get<double>())},
         {"max_send_over_reference", send / ref.at("max_send_bytes").get<double>()},
         {"max_recv_over_reference", recv / ref.at("max_recv_bytes").get<double>()}};
  if (bound.is_computed) {
    j["bound"] = {{"max_pairs", bound.max_pairs}, {"dispatch_bytes", bound.total}, {"max_send_bytes", bound.max_send},
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
  const json& model = reference.at("model");
  const int64_t q_row = model.at("hidden").get<int64_t>() * model.at("dtype_bytes").get<int64_t>();
  if (cost.token_bytes().q != q_row) {
    return invalid_argument(fmt::format("{}: the reference's model moves {} bytes per Q row, llama-8b {}", results_path,
                                        q_row, cost.token_bytes().q));
  }
  json report{{"tolerance", o.tolerance}, {"reference_dir", dir}, {"repeats", o.repeats}, {"batches", json::array()}};
  for (const json& ref : reference.at("results")) {
    if (std::abs(ref.at("tolerance").get<double>() - o.tolerance) > 1e-12) continue;
    const std::string name = ref.at("batch");
    const std::string path = dir + "/" + name;
    DISTCA_ASSIGN_OR_RETURN(std::string batch_text, read_text_file(path));
    DISTCA_ASSIGN_OR_RETURN(Batch batch, parse_batch_json(batch_text, 0, path));
    json entry{{"batch", name}, {"ranks", batch.num_ranks}, {"reference", ref}, {"plans", json::array()}};
    const PlannerOptions options{o.tolerance, 128, 0};
    // Interleaved repeats, so every policy's time is taken under the same machine load.
    std::vector<PlanFn> fns;
    for (const std::string& p : o.policies) fns.push_back(find_planner(p).value());
    std::vector<std::vector<double>> ms(fns.size());
    std::vector<Plan> plans(fns.size());
    for (int rep = 0; rep < o.repeats; ++rep) {
      for (size_t i = 0; i < fns.size(); ++i) {
        const auto start = std::chrono::steady_clock::now();
        DISTCA_ASSIGN_OR_RETURN(Plan plan, fns[i](batch, cost, options));
        ms[i].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
        if (rep == 0) plans[i] = std::move(plan);
      }
    }
    for (size_t i = 0; i < fns.size(); ++i) {
      std::sort(ms[i].begin(), ms[i].end());
      entry["plans"].push_back(plan_json(batch, cost, plans[i], ms[i][ms[i].size() / 2], ref));
    }
    report["batches"].push_back(entry);
  }
  if (report["batches"].empty()) {
    return invalid_argument(fmt::format("{} holds no result at --tolerance {} (it has 0.02 and 0.1)", results_path, o.tolerance));
  }
  return report;
}

void print_planner_report(const json& report) {
  constexpr double kGB = 1e9;
  fmt::print("Forward dispatch (Q + K/V) of one layer, Llama-8B bf16 TP 1, eps {}; 1 GB = 1e9 bytes; (x ref) = ours / "
             "the reference planner's\n", report["tolerance"].get<double>());
  fmt::print("plan ms: median of {} runs, the policies interleaved in this run; all phases: GB of the forward and the "
             "stateful backward, both directions\n\n", report["repeats"].get<int>());
  for (const json& b : report["batches"]) {
    const json& ref = b["reference"];
    fmt::print("{} ({} ranks)\n", b["batch"].get<std::string>(), b["ranks"].get<int>());
    fmt::print("  {:<22} {:>9} {:>16} {:>16} {:>16} {:>8} {:>8} {:>8} {:>12}\n", "", "imbalance", "Q+K/V GB (x ref)",
               "max send GB", "max recv GB", "tasks", "split", "plan ms", "all phases");
    fmt::print("  {:<22} {:>9.4f} {:>16.2f} {:>16.3f} {:>16.3f} {:>8} {:>8} {:>8} {:>12}\n", "reference planner",
               ref["imbalance_after"].get<double>(),
               (ref["q_bytes"].get<double>() + ref["kv_bytes"].get<double>()) / kGB,
               ref["max_send_bytes"].get<double>() / kGB, ref["max_recv_bytes"].get<double>() / kGB,
               ref["chunks"].get<int64_t>(), "-", "-", "-");
    for (const json& p : b["plans"]) {
      fmt::print("  {:<22} {:>9.4f} {:>8.2f} ({:.2f}x) {:>8.3f} ({:.2f}x) {:>8.3f} ({:.2f}x) {:>8} {:>8} {:>8.2f} {:>12.1f}{}\n",
                 p["policy"].get<std::string>(), p["imbalance"].get<double>(), p["dispatch_bytes"].get<double>() / kGB,
                 p["dispatch_over_reference"].get<double>(), p["max_send_bytes"].get<double>() / kGB,
                 p["max_send_over_reference"].get<double>(), p["max_recv_bytes"].get<double>() / kGB,
                 p["max_recv_over_reference"].get<double>(), p["tasks"].get<int64_t>(), p["split_tasks"].get<int64_t>(),
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
      fmt::print("  {:<22} {:>9} {:>16.2f} {:>16.3f} {:>16.3f}   (plans as balanced as minbytes', rows not relayed)\n",
                 "lower bound", "", bound["dispatch_bytes"].get<double>() / kGB, bound["max_send_bytes"].get<double>() / kGB,
                 bound["max_recv_bytes"].get<double>() / kGB);
    }
    fmt::print("\n");
  }
}

}  // namespace distca::tools
