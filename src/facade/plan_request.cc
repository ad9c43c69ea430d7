#include "distca/facade/plan_request.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>

#include "distca/core/check.h"
#include "distca/plan/plan_io.h"
#include "distca/plan/verify.h"
#include "distca/sim/auto_tolerance.h"

namespace distca::facade {

using namespace distca::plan;

// Why --granularity is a power of two from 16 to 4096: the planners accept any g >= 1, but the
// numbers plan prints assume kernels that run queries in tiles of power-of-two rows (the CPU
// kernel's 16-lane vectors and 64-row blocks, the GPU profile's 128-row tiles): a power-of-two g
// puts every cut on a tile boundary of every tile up to g, while g = 100 leaves part-filled tiles
// in each task that no cost estimate counts. 16 is the smallest tile; a shard below the tile costs
// as much as a whole one. Above 4096 rows a task's fixed overhead is already about 1% of the
// compute of its cheapest shard (a document's first), so larger shards buy nothing and only
// coarsen the balance.

namespace {

// A whole number of bytes >= 0 for `flag`, whose 0 means `zero`.
Result<int64_t> parse_bytes(const std::string& text, const char* flag, const char* zero) {
  int64_t bytes = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), bytes);
  if (error != std::errc() || end != text.data() + text.size() || bytes < 0) {
    return invalid_argument(fmt::format("{} must be a whole number of bytes >= 0 (0 = {}) or auto, got '{}'", flag, zero, text));
  }
  return bytes;
}

}  // namespace

Result<int64_t> parse_byte_budget(const std::string& text) { return parse_bytes(text, "--max-rank-bytes", "no budget"); }

Result<int64_t> parse_server_bytes(const std::string& text) {
  if (text == "auto") return plan::PlannerOptions::kAutoServerBytes;
  return parse_bytes(text, "--max-server-bytes", "no cap");
}

Result<std::optional<double>> parse_tolerance(const std::string& text) {
  if (text == "auto") return std::optional<double>();
  double eps = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), eps);
  if (error != std::errc() || end != text.data() + text.size() || !std::isfinite(eps)) {
    return invalid_argument(fmt::format("--tolerance must be a number in [0, 1] or auto, got '{}'", text));
  }
  return std::optional<double>(eps);
}

namespace {

constexpr const char* kShapeFlags[] = {"--layers", "--hidden", "--heads", "--kv-heads", "--head-dim", "--ffn-hidden"};

std::vector<int64_t> rank_tokens(const Batch& batch) {
  std::vector<int64_t> tokens(batch.num_ranks, 0);
  for (const Piece& p : batch.pieces) tokens[p.rank] += p.length();
  return tokens;
}

LinkChoice choose_link(const sim::Profile& profile, const Batch& batch, const ModelShape& model, int gpus_per_node) {
  LinkChoice c;
  c.gpus = int64_t{batch.num_ranks} * model.tp;
  c.nodes = (c.gpus + gpus_per_node - 1) / gpus_per_node;
  c.link = c.nodes > 1 ? profile.inter_node : profile.intra_node;
  c.name = c.nodes > 1 ? "inter-node" : "intra-node";
  return c;
}

// The ranks meet at every exchange, so a layer's compute lasts the fullest rank's linear layers
// plus the slowest server's core attention; communication longer than that cannot be hidden
// whatever the order. comm: the busiest rank's dispatch + return, each latency + max(send, recv)
// / bandwidth.
LayerTime layer_time(const Plan& plan, const Batch& batch, const ModelShape& model, const sim::Profile& profile,
                     const sim::Link& link) {
  const int32_t r = batch.num_ranks;
  LayerTime t;
  const PhaseTraffic& dispatch = plan.traffic.phases[static_cast<int>(Phase::kFwdDispatch)];
  const PhaseTraffic& ret = plan.traffic.phases[static_cast<int>(Phase::kFwdReturn)];
  auto seconds = [&](const PhaseTraffic& p, int32_t k) {
    const int64_t bytes = std::max(p.send_bytes[k], p.recv_bytes[k]);
    return bytes > 0 ? link.latency_seconds + static_cast<double>(bytes) / link.bytes_per_second : 0.0;
  };
  for (int32_t k = 0; k < r; ++k) t.comm = std::max(t.comm, seconds(dispatch, k) + seconds(ret, k));

  std::vector<double> attention(r, 0.0);
  const sim::AttentionPricer price(profile, model.q_heads_per_rank(), model.head_dim);  // once: not per task
  for (const Task& task : plan.tasks) {
    attention[task.server] += price.seconds(task.q_len(), task.k1, task.pairs(), /*is_backward=*/false);
  }
  t.attention = *std::max_element(attention.begin(), attention.end());
  const std::vector<int64_t> tokens = rank_tokens(batch);
  t.linear = static_cast<double>(*std::max_element(tokens.begin(), tokens.end())) *
             linear_seconds_per_token(model, profile);
  return t;
}

Result<AutoBudget> auto_byte_budget(const Batch& batch, const ModelShape& model, const sim::Profile& profile,
                                    const sim::Link& link) {
  const std::vector<int64_t> tokens = rank_tokens(batch);
  AutoBudget b;
  b.linear_seconds = static_cast<double>(*std::max_element(tokens.begin(), tokens.end())) *
                     linear_seconds_per_token(model, profile);
  const double bytes = (b.linear_seconds - 2 * link.latency_seconds) * link.bytes_per_second / 2;
  if (!(bytes >= 1)) {
    return invalid_argument(fmt::format(
        "--max-rank-bytes auto: the link's two latencies ({:.1f} us) exceed the layer's linear time ({:.1f} us), so no "
        "exchange can be hidden; give a budget in bytes",
        2e6 * link.latency_seconds, 1e6 * b.linear_seconds));
  }
  b.bytes = static_cast<int64_t>(bytes);
  return b;
}

}  // namespace

Status PlanRequest::validate() const {
  if (gpus_per_node < 1 || gpus_per_node > 1024) {
    return invalid_argument(fmt::format("--gpus-per-node must be in [1, 1024], got {}", gpus_per_node));
  }
  if (throughput) DISTCA_RETURN_IF_ERROR(throughput->validate());
  // The policy and what it uses.
  if (policy != "all") {
    if (auto found = find_planner(policy); !found.is_ok()) return found.status();
  }
  if (tolerance && !(*tolerance >= 0 && *tolerance <= 1)) {
    return invalid_argument(fmt::format(
        "--tolerance must be in [0, 1] (max load <= (1 + eps) x mean; above 1 a server may carry over twice the "
        "mean) or auto, got {}",
        *tolerance));
  }
  const int64_t g = granularity_or_default();
  if (g < kMinGranularity || g > kMaxGranularity || (g & (g - 1)) != 0) {
    return invalid_argument(fmt::format(
        "--granularity must be a power of two from {} to {} (16, 32, ..., 128, ..., 4096) so that every cut lands "
        "on a kernel tile boundary, got {}",
        kMinGranularity, kMaxGranularity, g));
  }
  if (max_rank_bytes && *max_rank_bytes != "auto") {
    DISTCA_RETURN_IF_ERROR(parse_byte_budget(*max_rank_bytes).status());
  }
  if (max_server_bytes) DISTCA_RETURN_IF_ERROR(parse_server_bytes(*max_server_bytes).status());
  if ((policy == "none" || policy == "distca") && max_server_bytes) {
    return invalid_argument(fmt::format("--policy {} has no memory cap ({}): --max-server-bytes is minmax's, minbytes' "
                                        "and minlink's; drop it, or pick one of those (or all)",
                                        policy, policy == "none" ? "it moves no work" : "the paper's planner"));
  }
  if (policy == "none" && (granularity || max_rank_bytes)) {
    return invalid_argument("--policy none cuts and moves no work, so --granularity and --max-rank-bytes would be "
                            "ignored: drop them, or pick --policy minmax, minbytes or all");
  }
  if (policy == "distca" && (granularity || max_rank_bytes)) {
    return invalid_argument("--policy distca cuts at token granularity and has no byte budget, as the paper's planner: "
                            "--granularity and --max-rank-bytes are minmax's and minbytes'; drop them, or pick --policy minmax "
                            "or minbytes (or all, where only those two use them)");
  }

  // The model: every shape flag within bounds that keep a step's byte counts in 64 bits.
  if (model == "custom") {
    const std::optional<int>* given[] = {&layers, &hidden, &heads, &kv_heads, &head_dim, &ffn_hidden};
    std::vector<std::string> missing;
    for (size_t i = 0; i < std::size(kShapeFlags); ++i) {
      if (!*given[i]) missing.emplace_back(kShapeFlags[i]);
    }
    if (!missing.empty()) {
      return invalid_argument(fmt::format("--model custom needs every shape flag: add {}", fmt::join(missing, ", ")));
    }
  }
  struct Bound {
    const char* flag;
    const std::optional<int>& value;
    int hi;
  };
  const Bound bounds[] = {{"--layers", layers, 1024},          {"--hidden", hidden, 1 << 20},
                          {"--heads", heads, 1024},            {"--kv-heads", kv_heads, 1024},
                          {"--head-dim", head_dim, 1024},      {"--ffn-hidden", ffn_hidden, 1 << 22},
                          {"--tp", tp, 1024}};
  for (const Bound& b : bounds) {
    if (b.value && (*b.value < 1 || *b.value > b.hi)) {
      return invalid_argument(fmt::format("{} must be in [1, {}], got {}", b.flag, b.hi, *b.value));
    }
  }
  if (dtype_bytes && *dtype_bytes != 1 && *dtype_bytes != 2 && *dtype_bytes != 4) {
    return invalid_argument(
        fmt::format("--dtype-bytes must be 1 (fp8), 2 (bf16) or 4 (fp32), got {}", *dtype_bytes));
  }
  if (grad_return) DISTCA_RETURN_IF_ERROR(parse_grad_return(*grad_return).status());
  return Status::ok();
}

Result<ModelShape> PlanRequest::model_shape() const {
  ModelShape m;
  if (model != "custom") {
    DISTCA_ASSIGN_OR_RETURN(m, model_preset(model));
  }
  auto set = [](int& field, const std::optional<int>& v) {
    if (v) field = *v;
  };
  set(m.num_layers, layers);
  set(m.hidden, hidden);
  set(m.num_q_heads, heads);
  set(m.num_kv_heads, kv_heads);
  set(m.head_dim, head_dim);
  set(m.ffn_hidden, ffn_hidden);
  set(m.dtype_bytes, dtype_bytes);
  set(m.tp, tp);
  if (grad_return) {
    DISTCA_ASSIGN_OR_RETURN(m.grad_return, parse_grad_return(*grad_return));
  }
  DISTCA_RETURN_IF_ERROR(m.validate());
  return m;
}

Result<PlanRun> prepare_plan_run(const PlanRequest& request, const Batch& batch, const sim::Profile& profile) {
  DISTCA_RETURN_IF_ERROR(request.validate());
  DISTCA_ASSIGN_OR_RETURN(const ModelShape model, request.model_shape());
  DISTCA_RETURN_IF_ERROR(batch.validate());
  PlanRun run(CostModel(model, request.throughput.value_or(ThroughputProfile{})));
  run.link = choose_link(profile, batch, model, request.gpus_per_node);
  if (request.max_rank_bytes == "auto") {
    DISTCA_ASSIGN_OR_RETURN(run.auto_budget, auto_byte_budget(batch, model, profile, run.link.link));
  }
  run.budget = run.auto_budget ? run.auto_budget->bytes : parse_byte_budget(request.max_rank_bytes.value_or("0")).value();
  run.max_server_bytes = parse_server_bytes(request.max_server_bytes.value_or("auto")).value();
  run.tolerance = request.tolerance;
  run.granularity = request.granularity_or_default();
  run.gpus_per_node = request.gpus_per_node;
  run.profile_name = profile.name;
  return run;
}

PolicyRun plan_policy(const PlanRun& run, const Batch& batch, PlanFn planner, const sim::Profile& profile,
                      Progress* progress) {
  // none moves nothing whatever eps is: auto has nothing to pick there.
  const bool is_auto = !run.tolerance && planner != plan_none;
  PlannerOptions options{run.tolerance.value_or(sim::kAutoToleranceStart), run.granularity, run.budget};
  options.max_server_bytes = run.max_server_bytes;
  PolicyRun p;
  if (progress != nullptr && !is_auto) {
    progress->stage(fmt::format("planning {} at eps {:g} ({} ranks, {} documents)", planner_name(planner),
                                options.tolerance, batch.num_ranks, batch.num_docs()));
  }
  const auto start = std::chrono::steady_clock::now();
  if (is_auto) {
    Result<sim::AutoPlan> chosen = plan_auto_tolerance(batch, run.cost, options, planner, profile, run.link.link,
                                                  /*stateless=*/planner == plan_distca, progress);
    DISTCA_CHECK(chosen.is_ok()) << chosen.status().to_string();  // inputs were validated
    p.plan = std::move(chosen.value().plan);
    p.auto_tolerance = std::move(chosen.value().auto_tolerance);
  } else {
    Result<Plan> plan = planner(batch, run.cost, options);
    DISTCA_CHECK(plan.is_ok()) << plan.status().to_string();
    p.plan = std::move(plan).value();
  }
  const auto stop = std::chrono::steady_clock::now();
  p.plan_ms = std::chrono::duration<double, std::milli>(stop - start).count();
  return p;
}

void complete_plan_run(PlanRun& run, const Batch& batch, const sim::Profile& profile, Progress* progress) {
  run.before = plan_policy(run, batch, plan_none, profile);
  std::vector<PolicyRun*> all = {&run.before};
  for (PolicyRun& p : run.runs) all.push_back(&p);
  for (PolicyRun* p : all) {
    if (progress != nullptr) progress->stage(fmt::format("verifying and pricing the {} plan", p->plan.policy));
    const Status verified = verify_tasks(batch, p->plan.tasks);
    p->is_verified = verified.is_ok();
    p->verify_error = verified.message();
    p->time = layer_time(p->plan, batch, run.cost.model(), profile, run.link.link);
  }
}

Result<PlanRun> run_plan_request(const PlanRequest& request, const Batch& batch, const sim::Profile& profile,
                                 Progress* progress) {
  DISTCA_ASSIGN_OR_RETURN(PlanRun run, prepare_plan_run(request, batch, profile));
  const std::vector<std::string> policies =
      request.policy == "all" ? planner_names() : std::vector<std::string>{request.policy};
  for (const std::string& name : policies) {
    run.runs.push_back(plan_policy(run, batch, find_planner(name).value(), profile, progress));
  }
  complete_plan_run(run, batch, profile, progress);
  return run;
}

nlohmann::json plan_run_json(const PlanRun& run, const Batch& batch) {
  auto report = [&](const PolicyRun& p) {
    nlohmann::json r = plan_report_json(run.before.plan, p.plan, batch, run.cost, p.plan_ms, p.is_verified);
    r.update({{"comm_seconds_per_layer", p.time.comm},
              {"linear_seconds_per_layer", p.time.linear},
              {"attention_seconds_per_layer", p.time.attention},
              {"comm_hidden", p.time.is_hidden()}});
    r["tolerance_auto"] = p.auto_tolerance ? p.auto_tolerance->to_json() : nlohmann::json(nullptr);
    return r;
  };
  nlohmann::json out;
  if (run.runs.size() == 1) {
    out = report(run.runs[0]);
  } else {
    out = nlohmann::json{{"policies", nlohmann::json::array()}};
    for (const PolicyRun& p : run.runs) out["policies"].push_back(report(p));
  }
  out["granularity"] = run.granularity;
  out["max_rank_bytes"] = run.budget;
  out["max_server_bytes"] = run.max_server_bytes == PlannerOptions::kAutoServerBytes ? nlohmann::json("auto")
                                                                                     : nlohmann::json(run.max_server_bytes);
  if (run.auto_budget) {
    out["max_rank_bytes_auto"] = {{"linear_seconds_per_layer", run.auto_budget->linear_seconds},
                                  {"rule", "(linear - 2 x latency) x bandwidth / 2: dispatch and return fit in the "
                                           "fullest rank's linear time"}};
  }
  out["profile"] = run.profile_name;
  out["link"] = {{"name", run.link.name},
                 {"bytes_per_second", run.link.link.bytes_per_second},
                 {"latency_seconds", run.link.link.latency_seconds},
                 {"gpus", run.link.gpus},
                 {"gpus_per_node", run.gpus_per_node},
                 {"nodes", run.link.nodes}};
  out["time_unit"] = "seconds of one layer's forward on the profile: comm = the busiest rank's dispatch + return "
                     "(latency + max(send, recv) / bandwidth each), linear = the fullest rank's, attention = the "
                     "slowest server's; comm_hidden = comm <= linear + attention";
  return out;
}

}  // namespace distca::facade
