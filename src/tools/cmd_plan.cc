#include "cmd_plan.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <memory>
#include <charconv>
#include <optional>

#include "distca/core/file.h"
#include "distca/plan/plan_io.h"
#include "distca/plan/planner.h"
#include "distca/plan/verify.h"
#include "distca/plan/workload.h"
#include "distca/sim/profile.h"

namespace distca::tools {
namespace {

using namespace distca::plan;

// --granularity: a power of two from 16 to 4096. The planners accept any g >= 1, but the
// numbers plan prints assume kernels that run queries in tiles of power-of-two rows (the CPU
// kernel's 16-lane vectors and 64-row blocks, the GPU profile's 128-row tiles): a power-of-two g
// puts every cut on a tile boundary of every tile up to g, while g = 100 leaves part-filled tiles
// in each task that no cost estimate counts. 16 is the smallest tile; a shard below the tile costs
// as much as a whole one. Above 4096 rows a task's fixed overhead is already about 1% of the
// compute of its cheapest shard (a document's first), so larger shards buy nothing and only
// coarsen the balance.
constexpr int64_t kMinGranularity = 16;
constexpr int64_t kMaxGranularity = 4096;

// Flags that only shape a sampled batch: --batch gives every rank's documents instead.
constexpr const char* kSamplingFlags[] = {"--workload",   "--seed",     "--long-threshold",
                                          "--keep-short", "--upsample", "--elongation"};
// Flags that must all be given with --model custom (dtype bytes and tp default to 2 and 1).
constexpr const char* kShapeFlags[] = {"--layers", "--hidden", "--heads", "--kv-heads", "--head-dim", "--ffn-hidden"};

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
  std::string max_rank_bytes = "0";  // bytes, or "auto" (from the profile: see auto_byte_budget)
  int64_t seed = 0;
  SamplingOptions sampling;
  std::string profile_path;
  int gpus_per_node = 8;
  bool is_json = false;
  std::string out_path;
  // Which flags the user gave: a flag the run would ignore is refused.
  const CLI::App* cmd = nullptr;
  bool given(const char* flag) const { return cmd->count(flag) > 0; }
};

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

std::string join_flags(const std::vector<std::string>& flags) { return fmt::format("{}", fmt::join(flags, ", ")); }

// Everything about the command line that can be wrong without reading a file, checked before
// any work: a failure here is bad input (exit 2).
// --max-rank-bytes as a number of bytes, 0 = no budget.
Result<int64_t> parse_byte_budget(const std::string& text) {
  int64_t bytes = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), bytes);
  if (error != std::errc() || end != text.data() + text.size() || bytes < 0) {
    return invalid_argument(fmt::format(
        "--max-rank-bytes must be a whole number of bytes >= 0 (0 = no budget) or auto, got '{}'", text));
  }
  return bytes;
}

Status check_args(const PlanArgs& a) {
  // 1. Where the documents come from: one of --batch, --doc-lengths, --workload (the default).
  if (!a.batch_path.empty() && !a.doc_lengths_path.empty()) {
    return invalid_argument("give at most one of --doc-lengths and --batch");
  }
  if (!a.batch_path.empty()) {
    std::vector<std::string> ignored;
    for (const char* flag : kSamplingFlags) {
      if (a.given(flag)) ignored.emplace_back(flag);
    }
    if (!ignored.empty()) {
      return invalid_argument(fmt::format(
          "--batch lists every rank's documents, so {} (which only shape sampled batches) would be ignored: drop {}, "
          "or drop --batch to sample a batch",
          join_flags(ignored), ignored.size() == 1 ? "it" : "them"));
    }
  }
  if (!a.doc_lengths_path.empty() && a.given("--workload")) {
    return invalid_argument("--doc-lengths and --workload both say where document lengths come from: give one");
  }

  // 2. Sizes.
  if (a.ranks && (*a.ranks < 1 || *a.ranks > 1'000'000)) {
    return invalid_argument(fmt::format("--ranks must be in [1, 1000000], got {}", *a.ranks));
  }
  if (a.tokens_per_rank && (*a.tokens_per_rank < 1 || *a.tokens_per_rank > kMaxTokens)) {
    return invalid_argument(
        fmt::format("--tokens-per-rank must be in [1, {}], got {}", kMaxTokens, *a.tokens_per_rank));
  }
  if (a.seed < 0) return invalid_argument(fmt::format("--seed must be >= 0, got {}", a.seed));
  if (a.gpus_per_node < 1 || a.gpus_per_node > 1024) {
    return invalid_argument(fmt::format("--gpus-per-node must be in [1, 1024], got {}", a.gpus_per_node));
  }

  // 3. The policy and what it uses.
  if (a.policy != "all") {
    if (auto found = find_planner(a.policy); !found.is_ok()) return found.status();
  }
  if (!(a.tolerance >= 0 && a.tolerance <= 1)) {
    return invalid_argument(fmt::format(
        "--tolerance must be in [0, 1] (max load <= (1 + eps) x mean; above 1 a server may carry over twice the "
        "mean), got {}",
        a.tolerance));
  }
  const int64_t g = a.granularity;
  if (g < kMinGranularity || g > kMaxGranularity || (g & (g - 1)) != 0) {
    return invalid_argument(fmt::format(
        "--granularity must be a power of two from {} to {} (16, 32, ..., 128, ..., 4096) so that every cut lands "
        "on a kernel tile boundary, got {}",
        kMinGranularity, kMaxGranularity, g));
  }
  if (a.max_rank_bytes != "auto") {
    DISTCA_RETURN_IF_ERROR(parse_byte_budget(a.max_rank_bytes).status());
  }
  if (a.policy == "none" && (a.given("--granularity") || a.given("--max-rank-bytes"))) {
    return invalid_argument("--policy none cuts and moves no work, so --granularity and --max-rank-bytes would be "
                            "ignored: drop them, or pick --policy minmax, minbytes or all");
  }
  if (a.policy == "distca" && (a.given("--granularity") || a.given("--max-rank-bytes"))) {
    return invalid_argument("--policy distca cuts at token granularity and has no byte budget, as the paper's planner: "
                            "--granularity and --max-rank-bytes are minmax's and minbytes'; drop them, or pick --policy minmax "
                            "or minbytes (or all, where only those two use them)");
  }

  // 4. The model: every shape flag within bounds that keep a step's byte counts in 64 bits.
  if (a.model == "custom") {
    std::vector<std::string> missing;
    for (const char* flag : kShapeFlags) {
      if (!a.given(flag)) missing.emplace_back(flag);
    }
    if (!missing.empty()) {
      return invalid_argument(fmt::format("--model custom needs every shape flag: add {}", join_flags(missing)));
    }
  }
  struct Bound {
    const char* flag;
    const std::optional<int>& value;
    int hi;
  };
  const Bound bounds[] = {{"--layers", a.layers, 1024},          {"--hidden", a.hidden, 1 << 20},
                          {"--heads", a.heads, 1024},            {"--kv-heads", a.kv_heads, 1024},
                          {"--head-dim", a.head_dim, 1024},      {"--ffn-hidden", a.ffn_hidden, 1 << 22},
                          {"--tp", a.tp, 1024}};
  for (const Bound& b : bounds) {
    if (b.value && (*b.value < 1 || *b.value > b.hi)) {
      return invalid_argument(fmt::format("{} must be in [1, {}], got {}", b.flag, b.hi, *b.value));
    }
  }
  if (a.dtype_bytes && *a.dtype_bytes != 1 && *a.dtype_bytes != 2 && *a.dtype_bytes != 4) {
    return invalid_argument(
        fmt::format("--dtype-bytes must be 1 (fp8), 2 (bf16) or 4 (fp32), got {}", *a.dtype_bytes));
  }

  // 5. Sampling (also checked by sample_batch; here so that it fails before any file is read).
  SamplingOptions sampling = a.sampling;
  DISTCA_RETURN_IF_ERROR(sampling.validate());

  // 6. Where the plan goes.
  if (a.given("--out")) {
    if (a.out_path == "-") {
      return invalid_argument("--out writes the plan to a file: give a file name, not '-' (the report goes to "
                              "stdout; add --json for it as JSON)");
    }
    if (a.policy == "all") return invalid_argument("--out writes one plan: pick one --policy, not all");
    DISTCA_RETURN_IF_ERROR(check_output_path("--out", a.out_path));
  }
  return Status::ok();
}

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
  sampling.seed = static_cast<uint64_t>(a.seed);
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

// (R) tokens each rank holds in the linear layout: at most T, fewer on a batch file's short ranks.
std::vector<int64_t> rank_tokens(const Batch& batch) {
  std::vector<int64_t> tokens(batch.num_ranks, 0);
  for (const Piece& p : batch.pieces) tokens[p.rank] += p.length();
  return tokens;
}

// The link one layer's all-to-all runs on: the R ranks are R x tp GPUs, gpus_per_node to a node.
// Once they span two nodes the inter-node link (the slower one) bounds the exchange, as the
// simulator prices it.
struct LinkChoice {
  sim::Link link;
  std::string name;  // "intra-node" or "inter-node"
  int64_t gpus = 0;
  int64_t nodes = 0;
};

LinkChoice choose_link(const sim::Profile& profile, const Batch& batch, const ModelShape& model, int gpus_per_node) {
  LinkChoice c;
  c.gpus = int64_t{batch.num_ranks} * model.tp;
  c.nodes = (c.gpus + gpus_per_node - 1) / gpus_per_node;
  c.link = c.nodes > 1 ? profile.inter_node : profile.intra_node;
  c.name = c.nodes > 1 ? "inter-node" : "intra-node";
  return c;
}

// Forward seconds of one linear layer per token on one GPU: the FLOPs of the QKV and output
// projections and the gated MLP, 2 per multiply-add, split over tp, at the profile's linear rate.
// The same figure src/sim/simulate.cc prices the linear layers with.
double linear_seconds_per_token(const ModelShape& m, const sim::Profile& profile) {
  const double h = m.hidden, hq = m.num_q_heads, hkv = m.num_kv_heads, d = m.head_dim;
  const double flops = 2.0 * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * m.ffn_hidden) / m.tp;
  return flops / profile.linear_flops_per_second;
}

// The forward of one layer on the profile: the busiest rank's link time against the compute
// ping-pong can overlap it with. The ranks meet at every exchange, so a layer's compute lasts
// the fullest rank's linear layers plus the slowest server's core attention; communication longer
// than that cannot be hidden whatever the order.
struct LayerTime {
  double comm = 0;       // max over ranks: dispatch + return, each latency + max(send, recv) / bandwidth
  double linear = 0;     // the fullest rank's linear layers
  double attention = 0;  // the slowest server's core attention
  bool is_hidden() const { return comm <= linear + attention; }
};

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
  for (const Task& task : plan.tasks) {
    attention[task.server] += profile.attention_seconds(task.q_len(), task.k1, task.pairs(), model.q_heads_per_rank(),
                                                        model.head_dim, /*is_backward=*/false);
  }
  t.attention = *std::max_element(attention.begin(), attention.end());

  const std::vector<int64_t> tokens = rank_tokens(batch);
  const int64_t fullest = *std::max_element(tokens.begin(), tokens.end());
  t.linear = static_cast<double>(fullest) * linear_seconds_per_token(model, profile);
  return t;
}

// --max-rank-bytes auto: the most a rank may send and receive in one layer's forward (dispatch +
// return) so that the exchange fits in the fullest rank's linear time on the profile's link, the
// compute ping-pong hides it behind. A rank's dispatch send and its return receive run one after
// the other (as do its dispatch receive and return send), each paying one latency, so the time
// is at most 2 x latency + 2 x budget / bandwidth: the budget is half of what the link moves in
// the linear time less two latencies. Not positive: the link cannot hide any exchange.
struct AutoBudget {
  int64_t bytes = 0;
  double linear_seconds = 0;
};

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

nlohmann::json layer_time_json(const LayerTime& t) {
  return {{"comm_seconds_per_layer", t.comm},
          {"linear_seconds_per_layer", t.linear},
          {"attention_seconds_per_layer", t.attention},
          {"comm_hidden", t.is_hidden()}};
}

// Exit codes: 2 for bad input found before any work, 1 for a run that failed.
int fail(const Status& status, int exit_code = 2) {
  fmt::print(stderr, "distca plan: error: {}\n", status.message());
  return exit_code;
}

int run_plan(const PlanArgs& a) {
  if (Status s = check_args(a); !s.is_ok()) return fail(s);
  sim::Profile profile = sim::default_h200_profile();
  if (!a.profile_path.empty()) {
    auto loaded = sim::load_profile(a.profile_path);
    if (!loaded.is_ok()) return fail(loaded.status());
    profile = loaded.value();
  }
  auto model = make_model(a);
  if (!model.is_ok()) return fail(model.status());
  std::string workload_name;
  auto batch_or = make_batch(a, workload_name);
  if (!batch_or.is_ok()) return fail(batch_or.status());
  const Batch& batch = batch_or.value();
  if (Status s = batch.validate(); !s.is_ok()) return fail(s);

  const std::vector<std::string> policies = a.policy == "all" ? planner_names() : std::vector<std::string>{a.policy};
  const CostModel cost(model.value(), ThroughputProfile{});
  const LinkChoice link = choose_link(profile, batch, model.value(), a.gpus_per_node);
  std::optional<AutoBudget> auto_budget;
  if (a.max_rank_bytes == "auto") {
    auto b = auto_byte_budget(batch, model.value(), profile, link.link);
    if (!b.is_ok()) return fail(b.status());
    auto_budget = b.value();
  }
  const int64_t budget = auto_budget ? auto_budget->bytes : parse_byte_budget(a.max_rank_bytes).value();
  const PlannerOptions options{a.tolerance, a.granularity, budget};

  const PolicyRun before = run_policy(plan_none, batch, cost, options);
  std::vector<PolicyRun> runs;
  for (const std::string& name : policies) runs.push_back(run_policy(find_planner(name).value(), batch, cost, options));
  // The rows the report shows: with one policy other than none, none first as the baseline.
  std::vector<const PolicyRun*> rows;
  if (a.policy != "all" && a.policy != "none") rows.push_back(&before);
  for (const PolicyRun& run : runs) rows.push_back(&run);
  std::vector<LayerTime> times;
  for (const PolicyRun* run : rows) times.push_back(layer_time(run->plan, batch, model.value(), profile, link.link));

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
    if (Status s = write_file_atomic(a.out_path, text); !s.is_ok()) return fail(s, 1);
  }

  // One warning line naming every policy whose communication cannot hide behind its compute.
  std::vector<std::string> exposed;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (times[i].is_hidden()) continue;
    exposed.push_back(fmt::format("{}: {:.1f} ms of communication vs {:.1f} ms of compute", rows[i]->plan.policy,
                                  1e3 * times[i].comm, 1e3 * (times[i].linear + times[i].attention)));
  }
  if (!exposed.empty()) {
    fmt::print(stderr,
               "distca plan: warning: communication cannot be hidden: the busiest rank's forward send or receive "
               "time per layer on the {} link exceeds the layer's linear + attention compute ({})\n",
               link.name, fmt::join(exposed, "; "));
  }

  const nlohmann::json link_json = {{"name", link.name},
                                    {"bytes_per_second", link.link.bytes_per_second},
                                    {"latency_seconds", link.link.latency_seconds},
                                    {"gpus", link.gpus},
                                    {"gpus_per_node", a.gpus_per_node},
                                    {"nodes", link.nodes}};
  if (a.is_json) {
    auto report = [&](size_t i) {
      nlohmann::json r = plan_report_json(before.plan, rows[i]->plan, batch, cost, rows[i]->plan_ms,
                                          rows[i]->is_verified);
      r.update(layer_time_json(times[i]));
      return r;
    };
    const size_t first = rows.size() - runs.size();  // skip the baseline row: load_before holds it
    nlohmann::json out;
    if (runs.size() == 1) {
      out = report(first);
    } else {
      out = nlohmann::json{{"policies", nlohmann::json::array()}};
      for (size_t i = first; i < rows.size(); ++i) out["policies"].push_back(report(i));
    }
    out["workload"] = workload_name;
    out["seed"] = a.seed;
    out["granularity"] = a.granularity;
    out["max_rank_bytes"] = budget;
    if (auto_budget) {
      out["max_rank_bytes_auto"] = {{"linear_seconds_per_layer", auto_budget->linear_seconds},
                                    {"rule", "(linear - 2 x latency) x bandwidth / 2: dispatch and return fit in the "
                                             "fullest rank's linear time"}};
    }
    out["profile"] = profile.name;
    out["link"] = link_json;
    out["time_unit"] = "seconds of one layer's forward on the profile: comm = the busiest rank's dispatch + return "
                       "(latency + max(send, recv) / bandwidth each), linear = the fullest rank's, attention = the "
                       "slowest server's; comm_hidden = comm <= linear + attention";
    fmt::print("{}\n", out.dump(2));
    return exit_code;
  }

  const std::vector<int64_t> tokens = rank_tokens(batch);
  const int64_t fewest = *std::min_element(tokens.begin(), tokens.end());
  const int64_t most = *std::max_element(tokens.begin(), tokens.end());
  const std::string sizes = fewest == batch.tokens_per_rank
                                ? fmt::format("{} ranks x {} tokens", batch.num_ranks, batch.tokens_per_rank)
                                : fmt::format("{} ranks x up to {} tokens ({}..{} held)", batch.num_ranks,
                                              batch.tokens_per_rank, fewest, most);
  const ModelShape& m = cost.model();
  fmt::print("distca plan: {}, {} ({} documents), {} (tp {}), eps {}{}\n\n", sizes, workload_name, batch.num_docs(),
             m.name, m.tp, a.tolerance,
             a.policy == "none" ? "" : a.policy == "distca" ? ", distca cuts at token granularity"
                                                           : fmt::format(", g {} (minmax, minbytes; distca cuts at token granularity)", a.granularity));

  if (auto_budget) {
    fmt::print("byte budget (--max-rank-bytes auto): {:.1f} MiB per rank per layer = ({:.2f} ms linear - 2 x {:.0f} us) x "
               "{:.1f} GB/s / 2, so that the forward exchange fits in the linear time ({} link)\n\n",
               mib(budget), 1e3 * auto_budget->linear_seconds, 1e6 * link.link.latency_seconds,
               link.link.bytes_per_second / 1e9, link.name);
  }
  fmt::print("Balance and bytes\n");
  fmt::print("{:<8} {:>7} {:>8} {:>10} {:>10} {:>13} {:>12} {:>10} {:>15} {:>15} {:>9}\n", "policy", "tasks",
             "plan ms", "imbalance", "pairs imb", "max load (s)", "total (MiB)", "KV (MiB)", "max send (MiB)",
             "max recv (MiB)", "verified");
  for (const PolicyRun* run : rows) {
    const Plan& p = run->plan;
    const CommSummary& c = p.traffic.forward;
    fmt::print("{:<8} {:>7} {:>8.2f} {:>10.4f} {:>10.4f} {:>13.4f} {:>12.1f} {:>10.1f} {:>15.1f} {:>15.1f} {:>9}\n",
               p.policy, p.tasks.size(), run->plan_ms, p.load.imbalance, p.load.pairs_imbalance, p.load.max,
               mib(c.total_bytes), mib(c.kv_bytes), mib(c.max_send_bytes), mib(c.max_recv_bytes),
               run->is_verified ? "yes" : "NO");
  }
  fmt::print("  load: a server's estimated core-attention seconds per step ({} layers, fwd + bwd; planner cost model, "
             "{:.0f} TFLOP/s)\n",
             m.num_layers, cost.profile().flops_per_second / 1e12);
  fmt::print("  imbalance: max / mean of the servers' loads; pairs imb: the same of causal (query, key) pairs\n");
  fmt::print("  bytes: one layer's forward dispatch + return (1 MiB = 2^20 bytes); max send / recv: the busiest "
             "rank's\n\n");

  fmt::print("Forward time of one layer (profile {}; {} link: {:.1f} GB/s, {:.0f} us per message; {} ranks x tp {} = "
             "{} GPUs on {} node{} of {})\n",
             profile.name, link.name, link.link.bytes_per_second / 1e9, link.link.latency_seconds * 1e6,
             batch.num_ranks, m.tp, link.gpus, link.nodes, link.nodes == 1 ? "" : "s", a.gpus_per_node);
  fmt::print("{:<8} {:>10} {:>12} {:>15} {:>15} {:>7}\n", "policy", "comm (ms)", "linear (ms)", "attention (ms)",
             "comm / compute", "hidden");
  for (size_t i = 0; i < rows.size(); ++i) {
    const LayerTime& t = times[i];
    fmt::print("{:<8} {:>10.2f} {:>12.2f} {:>15.2f} {:>14.2f}x {:>7}\n", rows[i]->plan.policy, 1e3 * t.comm,
               1e3 * t.linear, 1e3 * t.attention, t.comm / (t.linear + t.attention), t.is_hidden() ? "yes" : "NO");
  }
  fmt::print("  comm: the busiest rank's dispatch + return, each latency + max(send, recv) / bandwidth; linear: the "
             "fullest rank's; attention: the slowest server's\n");
  fmt::print("  compute = linear + attention, all that ping-pong can overlap the communication with; hidden: comm <= "
             "compute\n");
  fmt::print("\n");
  for (const PolicyRun& run : runs) {
    fmt::print("{}: {} (max {:.4f} s vs mean {:.4f} s per step; hash {:016x})\n", run.plan.policy, run.plan.note,
               run.plan.load.max, run.plan.load.mean, run.plan.hash);
  }
  if (!a.out_path.empty() && exit_code == 0) fmt::print("wrote {}\n", a.out_path);
  return exit_code;
}

}  // namespace

std::function<int()> add_plan_command(CLI::App& app) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand("plan", "plan core-attention tasks for one step and report balance, bytes and "
                                              "whether the communication can hide behind compute");
  args->cmd = cmd;
  cmd->add_option("--ranks", args->ranks, "R: ranks (attention servers), 1..1000000; default 8, or the batch file's count");
  cmd->add_option("--tokens-per-rank", args->tokens_per_rank,
                  "T: tokens per rank; default 131072 (with --batch: the largest rank's, or a capacity every rank must fit in)");
  cmd->add_option("--workload", args->workload, "built-in document-length distribution to sample: pretrain or prolong")
      ->capture_default_str();
  cmd->add_option("--doc-lengths", args->doc_lengths_path, "JSON array of document lengths to sample from");
  cmd->add_option("--batch", args->batch_path,
                  "explicit batch, {\"ranks\": [[len, ...], ...]}: every rank lists at least one document (no sampling "
                  "flags with it)");
  cmd->add_option("--model", args->model, "llama-8b, llama-34b or custom (then give every shape flag)")
      ->capture_default_str();
  cmd->add_option("--layers", args->layers, "override: transformer layers, 1..1024");
  cmd->add_option("--hidden", args->hidden, "override: hidden size, 1..2^20");
  cmd->add_option("--heads", args->heads, "override: query heads Hq, 1..1024");
  cmd->add_option("--kv-heads", args->kv_heads, "override: key/value heads Hkv, 1..1024, dividing Hq");
  cmd->add_option("--head-dim", args->head_dim, "override: head dim D, 1..1024");
  cmd->add_option("--ffn-hidden", args->ffn_hidden, "override: FFN hidden size, 1..2^22");
  cmd->add_option("--dtype-bytes", args->dtype_bytes, "override: bytes per activation element: 1, 2 (bf16) or 4");
  cmd->add_option("--tp", args->tp, "override: tensor-parallel degree, dividing Hq");
  cmd->add_option("--policy", args->policy, "none, distca, minmax, minbytes or all")->capture_default_str();
  cmd->add_option("--tolerance", args->tolerance, "eps in [0, 1]: target max load <= (1 + eps) x mean")
      ->capture_default_str();
  cmd->add_option("--granularity", args->granularity,
                  "g: shard size in tokens, a power of two from 16 to 4096 (cuts on kernel tile boundaries)")
      ->capture_default_str();
  cmd->add_option("--max-rank-bytes", args->max_rank_bytes,
                  "minmax and minbytes: per-rank forward send and receive byte budget per layer (0 = none), or auto: what the "
                  "profile's link moves while the layer's linear work runs (the exchange ping-pong can hide)")
      ->capture_default_str();
  cmd->add_option("--seed", args->seed, "sampling seed, >= 0")->capture_default_str();
  cmd->add_option("--long-threshold", args->sampling.long_threshold, "sampling: documents above this are long")
      ->capture_default_str();
  cmd->add_option("--keep-short", args->sampling.keep_short, "sampling: fraction of short documents kept, 0..1")
      ->capture_default_str();
  cmd->add_option("--upsample", args->sampling.upsample,
                  "sampling: how much more often long documents are drawn, 1..1e6")
      ->capture_default_str();
  cmd->add_option("--elongation", args->sampling.elongation,
                  "sampling: length multiplier, 1..1024 (0 = auto: tokens-per-rank / 65536, at least 1)")
      ->capture_default_str();
  cmd->add_option("--profile", args->profile_path,
                  "profile JSON (distca-profile, version 1) pricing the per-layer times; default: the built-in H200 one");
  cmd->add_option("--gpus-per-node", args->gpus_per_node,
                  "GPUs per node, 1..1024: R x tp GPUs on more than one node use the inter-node link")
      ->capture_default_str();
  cmd->add_flag("--json", args->is_json, "print one JSON object instead of the tables");
  cmd->add_option("--out", args->out_path, "write the full plan (format distca-plan, version 1) to this file");
  return [args] { return run_plan(*args); };
}

}  // namespace distca::tools
