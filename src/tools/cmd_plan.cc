#include "cmd_plan.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <memory>
#include <charconv>
#include <optional>

#include "distca/core/file.h"
#include "distca/core/progress.h"
#include "distca/plan/plan_io.h"
#include "distca/plan/planner.h"
#include "distca/plan/verify.h"
#include "distca/plan/workload.h"
#include "distca/facade/plan_request.h"
#include "distca/sim/profile.h"
#include "distca/core/memory.h"

namespace distca::tools {
namespace {

using namespace distca::plan;

// Flags that only shape a sampled batch: --batch gives every rank's documents instead.
constexpr const char* kSamplingFlags[] = {"--workload",   "--seed",     "--long-threshold",
                                          "--keep-short", "--upsample", "--elongation"};
struct PlanArgs {
  std::optional<int64_t> ranks;            // default: the batch file's count, else 8
  std::optional<int64_t> tokens_per_rank;  // default: the batch's largest rank, else 131072
  std::string workload = "pretrain";
  std::string doc_lengths_path;
  std::string batch_path;
  facade::PlanRequest request;  // policy, tolerance, granularity, budget, model, gpus per node
  std::string tolerance = "auto";  // --tolerance as given: auto or a number
  int64_t seed = 0;
  SamplingOptions sampling;
  std::string profile_path;
  bool is_json = false;
  std::string json_out;  // --json-out: the JSON report also to this file
  std::string out_path;
  // Which flags the user gave: a flag the run would ignore is refused.
  const CLI::App* cmd = nullptr;
  bool given(const char* flag) const { return cmd->count(flag) > 0; }
};

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

std::string join_flags(const std::vector<std::string>& flags) { return fmt::format("{}", fmt::join(flags, ", ")); }

// Everything about the command line that can be wrong without reading a file, checked before
// any work: a failure here is bad input (exit 2).
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
  if (a.ranks && (*a.ranks < 1 || *a.ranks > kMaxRanks)) {
    return invalid_argument(fmt::format("--ranks must be in [1, {}], got {}", kMaxRanks, *a.ranks));
  }
  if (a.tokens_per_rank && (*a.tokens_per_rank < 1 || *a.tokens_per_rank > kMaxTokens)) {
    return invalid_argument(
        fmt::format("--tokens-per-rank must be in [1, {}], got {}", kMaxTokens, *a.tokens_per_rank));
  }
  if (a.seed < 0) return invalid_argument(fmt::format("--seed must be >= 0, got {}", a.seed));

  // 3. The policy, what it uses, the model (shared with the Python package).
  DISTCA_RETURN_IF_ERROR(a.request.validate());

  // 4. Sampling (also checked by sample_batch; here so that it fails before any file is read).
  SamplingOptions sampling = a.sampling;
  DISTCA_RETURN_IF_ERROR(sampling.validate());

  // 5. Where the plan goes.
  if (a.given("--out")) {
    if (a.out_path == "-") {
      return invalid_argument("--out writes the plan to a file: give a file name, not '-' (the report goes to "
                              "stdout; add --json for it as JSON)");
    }
    if (a.request.policy == "all") return invalid_argument("--out writes one plan: pick one --policy, not all");
    DISTCA_RETURN_IF_ERROR(check_output_path("--out", a.out_path));  // refuses an empty name
  }
  if (a.given("--json-out")) DISTCA_RETURN_IF_ERROR(check_output_path("--json-out", a.json_out));
  return check_output_paths({{"--out", a.out_path}, {"--json-out", a.json_out}},
                            {{"--batch", a.batch_path}, {"--doc-lengths", a.doc_lengths_path}, {"--profile", a.profile_path}});
}

// Planning's memory beyond what the process holds when it starts, from the batch's size: per
// document and two per rank (a batch's pieces are its documents and at most one cut per rank,
// and a plan's tasks about as many as the pieces and ranks), 0.9-1.5 KiB measured with one policy
// and 1.7 KiB with --policy all (reports/cpu/2026-12-01-plan-memory), counted at 2 KiB and 3 KiB.
// The flows --out writes are not counted: they are known only once the plan is (its file holds
// them; writing it holds one phase's, about 50 bytes each).
constexpr int64_t kPlanBytesPerUnit = 2048;

Status check_plan_memory(const PlanArgs& a, int64_t docs, int64_t ranks, bool is_expected) {
  const double per_unit = (a.request.policy == "all" ? 1.5 : 1.0) * kPlanBytesPerUnit;
  const auto bytes = static_cast<int64_t>(per_unit * static_cast<double>(docs + 2 * ranks));
  return check_memory(
      "plan", bytes,
      fmt::format("{} ranks and {}{} documents, at {:.0f} KiB per document and two per rank{}", ranks,
                  is_expected ? "about " : "", docs, per_unit / 1024, a.request.policy == "all" ? " for --policy all" : ""),
      1.0, a.batch_path.empty() ? "lower --ranks or --tokens-per-rank" : "plan a smaller batch");
}

// The documents a sampled batch of R x T tokens holds, expected from the distribution before
// drawing them: R x T over the mean length as the sampling weights and stretches it, taken at
// 1024 quantiles (a long tail above the last one makes the mean larger, so fewer documents).
int64_t expected_documents(const LengthDistribution& dist, const SamplingOptions& sampling, int64_t ranks,
                           int64_t tokens) {
  const double elongation =
      sampling.elongation > 0 ? sampling.elongation : std::max(1.0, static_cast<double>(tokens) / 65536.0);
  double weights = 0, weighted_length = 0;
  constexpr int kPoints = 1024;
  for (int i = 0; i < kPoints; ++i) {
    const int64_t length = dist.quantile((i + 0.5) / kPoints);
    const double w = length > sampling.long_threshold ? sampling.upsample : sampling.keep_short;
    weights += w;
    weighted_length += w * std::max(1.0, static_cast<double>(length) * elongation);
  }
  const double mean = weights > 0 ? weighted_length / weights : 1.0;
  return static_cast<int64_t>(std::ceil(static_cast<double>(ranks) * static_cast<double>(tokens) / mean));
}

// The batch to plan, refused (exit 2) before it is planned, or for a sampled one before it is
// drawn, when planning it would not fit in memory.
Result<Batch> make_batch(const PlanArgs& a, std::string& workload_name) {
  if (!a.batch_path.empty()) {
    workload_name = a.batch_path;
    DISTCA_ASSIGN_OR_RETURN(const std::string text, read_text_file(a.batch_path));
    DISTCA_ASSIGN_OR_RETURN(Batch batch, parse_batch_json(text, a.tokens_per_rank.value_or(0), a.batch_path));
    if (a.ranks && batch.num_ranks != *a.ranks) {
      return invalid_argument(fmt::format("{} holds {} ranks but --ranks is {}", a.batch_path,
                                          batch.num_ranks, *a.ranks));
    }
    DISTCA_RETURN_IF_ERROR(check_plan_memory(a, batch.num_docs(), batch.num_ranks, false));
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
  if (int64_t{ranks} * tokens <= kMaxTokens) {  // else sample_batch refuses the size itself
    DISTCA_RETURN_IF_ERROR(check_plan_memory(a, expected_documents(*dist, sampling, ranks, tokens), ranks, true));
  }
  return sample_batch(*dist, sampling, ranks, tokens);
}

// (R) tokens each rank holds in the linear layout: at most T, fewer on a batch file's short ranks.
std::vector<int64_t> rank_tokens(const Batch& batch) {
  std::vector<int64_t> tokens(batch.num_ranks, 0);
  for (const Piece& p : batch.pieces) tokens[p.rank] += p.length();
  return tokens;
}

// Exit codes: 2 for bad input found before any work, 1 for a run that failed.
int fail(const Status& status, int exit_code = 2) {
  fmt::print(stderr, "distca plan: error: {}\n", status.message());
  return exit_code;
}

int run_plan(PlanArgs& a) {
  if (auto eps = facade::parse_tolerance(a.tolerance); eps.is_ok()) {
    a.request.tolerance = eps.value();
  } else {
    return fail(eps.status());
  }
  if (Status s = check_args(a); !s.is_ok()) return fail(s);
  sim::Profile profile = sim::default_h200_profile();
  if (!a.profile_path.empty()) {
    auto loaded = sim::load_profile(a.profile_path);
    if (!loaded.is_ok()) return fail(loaded.status());
    profile = loaded.value();
  }
  if (auto model = a.request.model_shape(); !model.is_ok()) return fail(model.status());
  std::string workload_name;
  // Lines on stderr once the run lasts (core/progress.h), from the planning on: reading the batch
  // says nothing, so that a batch refused after a long read is refused in one line.
  Progress progress("distca plan");
  auto batch_or = make_batch(a, workload_name);
  if (!batch_or.is_ok()) return fail(batch_or.status());
  const Batch& batch = batch_or.value();
  auto run_or = facade::run_plan_request(a.request, batch, profile, &progress);
  if (!run_or.is_ok()) return fail(run_or.status());
  progress.stage("writing the report");
  const facade::PlanRun& run = run_or.value();
  const facade::LinkChoice& link = run.link;
  const int64_t budget = run.budget;

  // The rows the report shows: with one policy other than none, none first as the baseline.
  const std::string& policy = a.request.policy;
  std::vector<const facade::PolicyRun*> rows;
  if (policy != "all" && policy != "none") rows.push_back(&run.before);
  for (const facade::PolicyRun& r : run.runs) rows.push_back(&r);

  int exit_code = 0;
  for (const facade::PolicyRun& r : run.runs) {
    if (!r.is_verified) {
      fmt::print(stderr, "distca plan: internal error: {} plan fails verification: {}\n", r.plan.policy,
                 r.verify_error);
      exit_code = 1;
    }
  }
  if (!a.out_path.empty() && exit_code == 0) {
    Status s = write_file_atomic_streamed(
        a.out_path, [&](const WriteFn& write) { return write_plan_text(run.runs[0].plan, batch, run.cost, write); });
    if (!s.is_ok()) return fail(s, 1);
  }

  // One warning line naming every policy whose communication cannot hide behind its compute.
  std::vector<std::string> exposed;
  for (const facade::PolicyRun* r : rows) {
    if (r->time.is_hidden()) continue;
    exposed.push_back(fmt::format("{}: {:.1f} ms of communication vs {:.1f} ms of compute", r->plan.policy,
                                  1e3 * r->time.comm, 1e3 * (r->time.linear + r->time.attention)));
  }
  if (!exposed.empty()) {
    fmt::print(stderr,
               "distca plan: warning: communication cannot be hidden: the busiest rank's forward send or receive "
               "time per layer on the {} link exceeds the layer's linear + attention compute ({})\n",
               link.name, fmt::join(exposed, "; "));
  }

  if (a.is_json || !a.json_out.empty()) {
    nlohmann::json out = facade::plan_run_json(run, batch);
    out["workload"] = workload_name;
    out["seed"] = a.seed;
    if (!a.json_out.empty()) {
      if (Status s = write_file_atomic(a.json_out, out.dump(2) + "\n"); !s.is_ok()) return fail(s, 1);
    }
    if (a.is_json) {
      fmt::print("{}\n", out.dump(2));
      return exit_code;
    }
  }

  const std::vector<int64_t> tokens = rank_tokens(batch);
  const int64_t fewest = *std::min_element(tokens.begin(), tokens.end());
  const int64_t most = *std::max_element(tokens.begin(), tokens.end());
  const std::string sizes = fewest == batch.tokens_per_rank
                                ? fmt::format("{} ranks x {} tokens", batch.num_ranks, batch.tokens_per_rank)
                                : fmt::format("{} ranks x up to {} tokens ({}..{} held)", batch.num_ranks,
                                              batch.tokens_per_rank, fewest, most);
  const ModelShape& m = run.cost.model();
  fmt::print("distca plan: {}, {} ({} documents), {} (tp {}), eps {}{}\n\n", sizes, workload_name, batch.num_docs(),
             m.name, m.tp, a.request.tolerance ? fmt::format("{}", *a.request.tolerance) : "auto",
             policy == "none" ? "" : policy == "distca" ? ", distca cuts at token granularity"
                                                       : fmt::format(", g {} (minmax, minbytes; distca cuts at token granularity)", run.granularity));

  if (run.auto_budget) {
    fmt::print("byte budget (--max-rank-bytes auto): {:.1f} MiB per rank per layer = ({:.2f} ms linear - 2 x {:.0f} us) x "
               "{:.1f} GB/s / 2, so that the forward exchange fits in the linear time ({} link)\n\n",
               mib(budget), 1e3 * run.auto_budget->linear_seconds, 1e6 * link.link.latency_seconds,
               link.link.bytes_per_second / 1e9, link.name);
  }
  fmt::print("Balance and bytes\n");
  fmt::print("{:<8} {:>7} {:>8} {:>10} {:>10} {:>13} {:>12} {:>10} {:>15} {:>15} {:>14} {:>9}\n", "policy", "tasks",
             "plan ms", "imbalance", "pairs imb", "max load (s)", "total (MiB)", "KV (MiB)", "max send (MiB)",
             "max recv (MiB)", "held (x coloc)", "verified");
  const auto fullest = [](const Plan& p) {
    return p.server_bytes.empty() ? int64_t{0} : *std::max_element(p.server_bytes.begin(), p.server_bytes.end());
  };
  const double colocated_held = static_cast<double>(fullest(run.before.plan));
  for (const facade::PolicyRun* r : rows) {
    const Plan& p = r->plan;
    const CommSummary& c = p.traffic.forward;
    fmt::print("{:<8} {:>7} {:>8.2f} {:>10.4f} {:>10.4f} {:>13.4f} {:>12.1f} {:>10.1f} {:>15.1f} {:>15.1f} {:>14.3f} {:>9}\n",
               p.policy, p.tasks.size(), r->plan_ms, p.load.imbalance, p.load.pairs_imbalance, p.load.max,
               mib(c.total_bytes), mib(c.kv_bytes), mib(c.max_send_bytes), mib(c.max_recv_bytes),
               colocated_held > 0 ? static_cast<double>(fullest(p)) / colocated_held : 0.0, r->is_verified ? "yes" : "NO");
  }
  fmt::print("  load: a server's estimated core-attention seconds per step ({} layers, fwd + bwd; planner cost model, "
             "{:.0f} TFLOP/s)\n",
             m.num_layers, run.cost.profile().flops_per_second / 1e12);
  fmt::print("  imbalance: max / mean of the servers' loads; pairs imb: the same of causal (query, key) pairs\n");
  fmt::print("  bytes: one layer's forward dispatch + return (1 MiB = 2^20 bytes); max send / recv: the busiest "
             "rank's\n");
  fmt::print("  held: the fullest server's attention rows of one layer (Q, O, LSE, K, V: what a stateful server keeps per "
             "layer), over colocated's fullest ({:.1f} MiB)\n\n", colocated_held / (1 << 20));

  fmt::print("Forward time of one layer (profile {}; {} link: {:.1f} GB/s, {:.0f} us per message; {} ranks x tp {} = "
             "{} GPUs on {} node{} of {})\n",
             profile.name, link.name, link.link.bytes_per_second / 1e9, link.link.latency_seconds * 1e6,
             batch.num_ranks, m.tp, link.gpus, link.nodes, link.nodes == 1 ? "" : "s", a.request.gpus_per_node);
  fmt::print("{:<8} {:>10} {:>12} {:>15} {:>15} {:>7}\n", "policy", "comm (ms)", "linear (ms)", "attention (ms)",
             "comm / compute", "hidden");
  for (const facade::PolicyRun* r : rows) {
    const facade::LayerTime& t = r->time;
    fmt::print("{:<8} {:>10.2f} {:>12.2f} {:>15.2f} {:>14.2f}x {:>7}\n", r->plan.policy, 1e3 * t.comm,
               1e3 * t.linear, 1e3 * t.attention, t.comm / (t.linear + t.attention), t.is_hidden() ? "yes" : "NO");
  }
  fmt::print("  comm: the busiest rank's dispatch + return, each latency + max(send, recv) / bandwidth; linear: the "
             "fullest rank's; attention: the slowest server's\n");
  fmt::print("  compute = linear + attention, all that ping-pong can overlap the communication with; hidden: comm <= "
             "compute\n");
  fmt::print("\n");
  for (const facade::PolicyRun& r : run.runs) {
    fmt::print("{}: {} (max {:.4f} s vs mean {:.4f} s per step; hash {:016x})\n", r.plan.policy, r.plan.note,
               r.plan.load.max, r.plan.load.mean, r.plan.hash);
    if (!r.auto_tolerance) continue;
    std::vector<std::string> tried;
    bool any_moved = false;
    for (const sim::ToleranceTry& t : r.auto_tolerance->tried) {
      tried.push_back(fmt::format("{:g}: {:.3f}{}{}", t.tolerance, 1e3 * t.step.seconds, t.is_balanced ? "" : " (not balanced)",
                                  t.moves_work ? "" : " (moves no work)"));
      any_moved = any_moved || t.moves_work;
    }
    fmt::print("  eps auto: {:g}, the fastest predicted step of those planned (ms per layer, forward + backward, on "
               "the profile's {} link; of 8 eps predicted, {} planned in {:.1f} ms): {}{}\n",
               r.auto_tolerance->tolerance, link.name, tried.size(), r.plan_ms, fmt::join(tried, ", "),
               r.auto_tolerance->moves_work ? ""
               : r.plan.is_balanced ? "; its plan moves no work: none is needed at this eps"
               : any_moved          ? "; its plan moves no work: the plans that moved work predict a slower step"
                                    : "; no eps planned moved any work");
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
  cmd->add_option("--model", args->request.model, "llama-8b, llama-34b or custom (then give every shape flag)")
      ->capture_default_str();
  cmd->add_option("--layers", args->request.layers, "override: transformer layers, 1..1024");
  cmd->add_option("--hidden", args->request.hidden, "override: hidden size, 1..2^20");
  cmd->add_option("--heads", args->request.heads, "override: query heads Hq, 1..1024");
  cmd->add_option("--kv-heads", args->request.kv_heads, "override: key/value heads Hkv, 1..1024, dividing Hq");
  cmd->add_option("--head-dim", args->request.head_dim, "override: head dim D, 1..1024");
  cmd->add_option("--ffn-hidden", args->request.ffn_hidden, "override: FFN hidden size, 1..2^22");
  cmd->add_option("--dtype-bytes", args->request.dtype_bytes, "override: bytes per activation element: 1, 2 (bf16) or 4");
  cmd->add_option("--tp", args->request.tp, "override: tensor-parallel degree, dividing Hq");
  cmd->add_option("--grad-return", args->request.grad_return,
                  "bf16 | fp32: the dtype of the returned dK/dV partial sums the bytes are counted at (default fp32, "
                  "what the runtime and distca.torch send unless told otherwise)");
  cmd->add_option("--policy", args->request.policy, "none, distca, minmax, minbytes, minlink or all")->capture_default_str();
  cmd->add_option("--tolerance", args->tolerance,
                  "eps in [0, 1]: target max load <= (1 + eps) x mean; auto: of eps = 0.2, 0.1, ..., 0.2/128, the one "
                  "whose plan predicts the fastest step on the profile (attention balance against the communication "
                  "the linear layers cannot hide), of at most 3 planned where the predictions point")
      ->capture_default_str();
  cmd->add_option("--granularity", args->request.granularity,
                  "g: shard size in tokens, a power of two from 16 to 4096 (cuts on kernel tile boundaries)")
      ->default_str("128");
  cmd->add_option("--max-rank-bytes", args->request.max_rank_bytes,
                  "minmax and minbytes: per-rank forward send and receive byte budget per layer (0 = none), or auto: what the "
                  "profile's link moves while the layer's linear work runs (the exchange ping-pong can hide)")
      ->default_str("0");
  cmd->add_option("--max-server-bytes", args->request.max_server_bytes,
                  "minmax, minbytes and minlink: the most bytes of one layer's attention rows a server may hold (its tasks' "
                  "Q, O and LSE, their keys' K and V: what a stateful server keeps per layer), 0 = no cap, or auto: memory "
                  "balanced as compute is, a cap of (1 + eps) x colocated's fullest server where a plan as balanced keeps it "
                  "with its busiest link within 5 %")
      ->default_str("auto");
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
  cmd->add_option("--gpus-per-node", args->request.gpus_per_node,
                  "GPUs per node, 1..1024: R x tp GPUs on more than one node use the inter-node link")
      ->capture_default_str();
  cmd->add_flag("--json", args->is_json, "print one JSON object instead of the tables");
  cmd->add_option("--json-out", args->json_out, "also write the JSON report to this file (the tables still print)");
  cmd->add_option("--out", args->out_path, "write the full plan (format distca-plan, version 1) to this file");
  return [args] { return run_plan(*args); };
}

}  // namespace distca::tools
