#include "cmd_plan.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <memory>
#include <optional>

#include "distca/core/file.h"
#include "distca/plan/plan_io.h"
#include "distca/plan/planner.h"
#include "distca/plan/verify.h"
#include "distca/plan/workload.h"

namespace distca::tools {
namespace {

using namespace distca::plan;

struct PlanArgs {
  std::optional<int64_t> ranks;            // default: the batch file's count, else 8
  std::optional<int64_t> tokens_per_rank;  // default: the batch's largest rank, else 131072
  std::string workload = "pretrain";
  std::string doc_lengths_path;
  std::string batch_path;
  std::string model = "llama-8b";
  std::optional<int> layers, hidden, heads, kv_heads, head_dim, ffn_hidden, dtype_bytes, tp;
  std::string policy = std::string(kDefaultPlanner);
  double tolerance = 0.05;
  int64_t granularity = 128;
  int64_t max_rank_bytes = 0;
  uint64_t seed = 0;
  SamplingOptions sampling;
  bool is_json = false;
  std::string out_path;
};

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

Result<ModelShape> make_model(const PlanArgs& a) {
  ModelShape m;
  if (a.model != "custom") {
    DISTCA_ASSIGN_OR_RETURN(m, model_preset(a.model));
  }
  auto set = [](int& field, const std::optional<int>& v) {
    if (v) field = *v;
  };
  set(m.num_layers, a.layers);
  set(m.hidden, a.hidden);
  set(m.num_q_heads, a.heads);
  set(m.num_kv_heads, a.kv_heads);
  set(m.head_dim, a.head_dim);
  set(m.ffn_hidden, a.ffn_hidden);
  set(m.dtype_bytes, a.dtype_bytes);
  set(m.tp, a.tp);
  DISTCA_RETURN_IF_ERROR(m.validate());
  return m;
}

Result<Batch> make_batch(const PlanArgs& a, std::string& workload_name) {
  const int sources = (a.batch_path.empty() ? 0 : 1) + (a.doc_lengths_path.empty() ? 0 : 1);
  if (sources > 1) return invalid_argument("give at most one of --doc-lengths and --batch");
  if (a.ranks && (*a.ranks < 1 || *a.ranks > 1'000'000)) {
    return invalid_argument(fmt::format("--ranks must be in [1, 1000000], got {}", *a.ranks));
  }
  if (a.tokens_per_rank && *a.tokens_per_rank < 1) {
    return invalid_argument(fmt::format("--tokens-per-rank must be positive, got {}", *a.tokens_per_rank));
  }
  if (!a.batch_path.empty()) {
    workload_name = a.batch_path;
    DISTCA_ASSIGN_OR_RETURN(const std::string text, read_text_file(a.batch_path));
    DISTCA_ASSIGN_OR_RETURN(Batch batch, parse_batch_json(text, a.tokens_per_rank.value_or(0), a.batch_path));
    if (a.ranks && batch.num_ranks != *a.ranks) {
      return invalid_argument(fmt::format("{} holds {} ranks but --ranks is {}", a.batch_path,
                                          batch.num_ranks, *a.ranks));
    }
    return batch;
  }
  const auto ranks = static_cast<int32_t>(a.ranks.value_or(8));
  const int64_t tokens = a.tokens_per_rank.value_or(131072);
  std::optional<LengthDistribution> dist;
  if (!a.doc_lengths_path.empty()) {
    DISTCA_ASSIGN_OR_RETURN(dist, load_doc_lengths(a.doc_lengths_path));
    workload_name = a.doc_lengths_path;
  } else {
    DISTCA_ASSIGN_OR_RETURN(dist, builtin_distribution(a.workload));
    workload_name = a.workload;
  }
  SamplingOptions sampling = a.sampling;
  sampling.seed = a.seed;
  return sample_batch(*dist, sampling, ranks, tokens);
}

struct PolicyRun {
  Plan plan;
  double plan_ms = 0;
  bool is_verified = false;
  std::string verify_error;
};

PolicyRun run_policy(PlanFn fn, const Batch& batch, const CostModel& cost, const PlannerOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  Result<Plan> plan = fn(batch, cost, options);
  const auto stop = std::chrono::steady_clock::now();
  DISTCA_CHECK(plan.is_ok()) << plan.status().to_string();  // inputs were validated
  PolicyRun run;
  run.plan = std::move(plan).value();
  run.plan_ms = std::chrono::duration<double, std::milli>(stop - start).count();
  Status verified = verify_tasks(batch, run.plan.tasks);
  run.is_verified = verified.is_ok();
  run.verify_error = verified.message();
  return run;
}

int fail(const Status& status) {
  fmt::print(stderr, "distca plan: error: {}\n", status.message());
  return 2;
}

int run_plan(const PlanArgs& a) {
  if (a.is_json && a.out_path == "-") return fail(invalid_argument("--out - conflicts with --json"));
  PlannerOptions options{a.tolerance, a.granularity, a.max_rank_bytes};
  if (Status s = options.validate(); !s.is_ok()) return fail(s);
  std::vector<std::string> policies;
  if (a.policy == "all") {
    policies = planner_names();
    if (!a.out_path.empty()) return fail(invalid_argument("--out writes one plan: pick one --policy, not all"));
  } else {
    if (auto found = find_planner(a.policy); !found.is_ok()) return fail(found.status());
    policies = {a.policy};
  }
  auto model = make_model(a);
  if (!model.is_ok()) return fail(model.status());
  std::string workload_name;
  auto batch_or = make_batch(a, workload_name);
  if (!batch_or.is_ok()) return fail(batch_or.status());
  const Batch& batch = batch_or.value();
  if (Status s = batch.validate(); !s.is_ok()) return fail(s);
  const CostModel cost(model.value(), ThroughputProfile{});

  const PolicyRun before = run_policy(plan_none, batch, cost, options);
  std::vector<PolicyRun> runs;
  for (const std::string& name : policies) runs.push_back(run_policy(find_planner(name).value(), batch, cost, options));

  int exit_code = 0;
  for (const PolicyRun& run : runs) {
    if (!run.is_verified) {
      fmt::print(stderr, "distca plan: internal error: {} plan fails verification: {}\n", run.plan.policy,
                 run.verify_error);
      exit_code = 1;
    }
  }
  if (!a.out_path.empty() && exit_code == 0) {
    const std::string text = plan_to_json(runs[0].plan, batch, cost).dump() + "\n";
    if (Status s = write_file_atomic(a.out_path, text); !s.is_ok()) return fail(s);
  }

  if (a.is_json) {
    nlohmann::json out;
    if (runs.size() == 1) {
      out = plan_report_json(before.plan, runs[0].plan, batch, cost, runs[0].plan_ms, runs[0].is_verified);
    } else {
      out = nlohmann::json{{"policies", nlohmann::json::array()}};
      for (const PolicyRun& run : runs) {
        out["policies"].push_back(plan_report_json(before.plan, run.plan, batch, cost, run.plan_ms, run.is_verified));
      }
    }
    out["workload"] = workload_name;
    out["seed"] = a.seed;
    fmt::print("{}\n", out.dump(2));
    return exit_code;
  }

  fmt::print("distca plan: {} ranks x {} tokens, {} ({} documents), {}, eps {}, g {}\n", batch.num_ranks,
             batch.tokens_per_rank, workload_name, batch.num_docs(), cost.model().name, a.tolerance,
             a.granularity);
  fmt::print("load = estimated core-attention seconds per step; bytes = forward dispatch + return, one layer\n\n");
  fmt::print("{:<8} {:>7} {:>9} {:>11} {:>11} {:>10} {:>11} {:>10} {:>12} {:>8}\n", "policy", "tasks",
             "plan ms", "imbalance", "pairs imb", "max load", "total MiB", "KV MiB", "max send MiB",
             "verified");
  auto row = [&](const PolicyRun& run) {
    const Plan& p = run.plan;
    const CommSummary& c = p.traffic.forward;
    fmt::print("{:<8} {:>7} {:>9.2f} {:>11.4f} {:>11.4f} {:>9.4f}s {:>11.1f} {:>10.1f} {:>12.1f} {:>8}\n",
               p.policy, p.tasks.size(), run.plan_ms, p.load.imbalance, p.load.pairs_imbalance, p.load.max,
               mib(c.total_bytes), mib(c.kv_bytes), mib(c.max_send_bytes), run.is_verified ? "yes" : "NO");
  };
  if (a.policy != "all" && a.policy != "none") row(before);
  for (const PolicyRun& run : runs) row(run);
  fmt::print("\n");
  for (const PolicyRun& run : runs) {
    fmt::print("{}: {} (max {:.4f}s vs mean {:.4f}s; hash {:016x})\n", run.plan.policy, run.plan.note,
               run.plan.load.max, run.plan.load.mean, run.plan.hash);
  }
  if (!a.out_path.empty() && exit_code == 0) fmt::print("wrote {}\n", a.out_path);
  return exit_code;
}

}  // namespace

std::function<int()> add_plan_command(CLI::App& app) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand("plan", "plan core-attention tasks for one step and report balance and bytes");
  cmd->add_option("--ranks", args->ranks, "R: ranks (attention servers); default 8, or the batch file's count");
  cmd->add_option("--tokens-per-rank", args->tokens_per_rank, "T: tokens per rank; default 131072");
  cmd->add_option("--workload", args->workload, "built-in document-length distribution: pretrain or prolong")
      ->capture_default_str();
  cmd->add_option("--doc-lengths", args->doc_lengths_path, "JSON array of document lengths to sample from");
  cmd->add_option("--batch", args->batch_path, "explicit batch: {\"ranks\": [[len, ...], ...]}");
  cmd->add_option("--model", args->model, "llama-8b, llama-34b or custom (then give every shape flag)")
      ->capture_default_str();
  cmd->add_option("--layers", args->layers, "override: transformer layers");
  cmd->add_option("--hidden", args->hidden, "override: hidden size");
  cmd->add_option("--heads", args->heads, "override: query heads Hq");
  cmd->add_option("--kv-heads", args->kv_heads, "override: key/value heads Hkv");
  cmd->add_option("--head-dim", args->head_dim, "override: head dim D");
  cmd->add_option("--ffn-hidden", args->ffn_hidden, "override: FFN hidden size");
  cmd->add_option("--dtype-bytes", args->dtype_bytes, "override: bytes per activation element (2 = bf16)");
  cmd->add_option("--tp", args->tp, "override: tensor-parallel degree");
  cmd->add_option("--policy", args->policy, "none, distca, minmax or all")->capture_default_str();
  cmd->add_option("--tolerance", args->tolerance, "eps: target max load <= (1 + eps) x mean")->capture_default_str();
  cmd->add_option("--granularity", args->granularity, "g: shard size in tokens")->capture_default_str();
  cmd->add_option("--max-rank-bytes", args->max_rank_bytes,
                  "minmax: per-rank forward send and receive byte budget per layer (0 = none)")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "sampling seed")->capture_default_str();
  cmd->add_option("--long-threshold", args->sampling.long_threshold, "sampling: documents above this are long")
      ->capture_default_str();
  cmd->add_option("--keep-short", args->sampling.keep_short, "sampling: fraction of short documents kept")
      ->capture_default_str();
  cmd->add_option("--upsample", args->sampling.upsample, "sampling: how much more often long documents are drawn")
      ->capture_default_str();
  cmd->add_option("--elongation", args->sampling.elongation,
                  "sampling: length multiplier (0 = auto: tokens-per-rank / 65536, at least 1)")
      ->capture_default_str();
  cmd->add_flag("--json", args->is_json, "print one JSON object instead of the table");
  cmd->add_option("--out", args->out_path, "write the full plan (format distca-plan, version 1) to this file");
  return [args] { return run_plan(*args); };
}

}  // namespace distca::tools
