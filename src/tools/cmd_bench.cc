#include "cmd_bench.h"

#include <fmt/format.h>

#include <memory>
#include <optional>
#include <string>

#include "distca/bench/bench_attention.h"
#include "distca/bench/bench_attention_cuda.h"
#include "distca/bench/bench_dispatch.h"
#include "distca/bench/bench_link.h"
#include "distca/bench/bench_planner.h"
#include "distca/bench/bench_step.h"
#include "cmd_profile.h"
#include "distca/core/file.h"
#include "distca/core/memory.h"
#include "world.h"

namespace distca::tools {
namespace {

// Where a benchmark's report goes: the table (or with --json the JSON) on stdout, and with
// --json-out the JSON also to a file, so that one run gives both.
struct ReportOutput {
  bool is_json = false;
  std::string json_out;
  const CLI::Option* json_out_option = nullptr;  // given on the command line: a file name is needed
};

struct AttentionArgs {
  bench::AttentionBenchOptions options;
  ReportOutput out;
  bool is_quick = false;
  std::string device = "cpu";
  bench::CudaAttentionBenchOptions cuda;  // --device cuda: its own defaults (a GPU's shapes), the flags given override them
};

// --quick sets the sizes that were not given on the command line.
auto quick_default(const CLI::App& cmd) {
  return [&cmd](const char* flag, auto& field, auto value) {
    if (cmd.count(flag) == 0) field = value;
  };
}

void add_report_flags(CLI::App* cmd, ReportOutput& out) {
  cmd->add_flag("--json", out.is_json, "print one JSON object instead of the table");
  out.json_out_option = cmd->add_option(
      "--json-out", out.json_out, "also write the JSON report to this file (written when the run ends; the table still prints)");
}

// --json-out checked before any work: a bad path fails in a second, not after the benchmark.
Status check_report_output(const ReportOutput& out, const FlagPaths& other_outputs = {}, const FlagPaths& inputs = {}) {
  if (out.json_out_option == nullptr || out.json_out_option->count() == 0) return Status::ok();
  DISTCA_RETURN_IF_ERROR(check_output_path("--json-out", out.json_out));  // refuses an empty name
  FlagPaths outputs = other_outputs;
  outputs.emplace_back("--json-out", out.json_out);
  return check_output_paths(outputs, inputs);
}

// The report to the --json-out file (if any), then to stdout as JSON or as the table.
template <typename Print>
int emit_report(const char* name, const ReportOutput& out, const nlohmann::json& report, Print&& print) {
  if (!out.json_out.empty()) {
    if (Status s = write_file_atomic(out.json_out, report.dump(2) + "\n"); !s.is_ok()) {
      fmt::print(stderr, "distca {}: error: {}\n", name, s.message());
      return exit_code(s);
    }
  }
  if (out.is_json) {
    fmt::print("{}\n", report.dump(2));
  } else {
    print(report);
  }
  return kExitOk;
}

// A one-process benchmark: the options checked (exit 2 with one line), the run, then its report.
template <typename Options, typename Run, typename Print>
int run_report(const char* name, const Options& options, const ReportOutput& out, Run&& run, Print&& print,
               const FlagPaths& other_outputs = {}, const FlagPaths& inputs = {}) {
  Status s = validate(options);
  if (s.is_ok()) s = check_report_output(out, other_outputs, inputs);
  if (!s.is_ok()) {
    print_usage_error(name, s.message());
    return kExitBadInput;
  }
  Result<nlohmann::json> report = run();
  if (!report.is_ok()) {
    fmt::print(stderr, "distca {}: error: {}\n", name, report.status().message());
    return exit_code(report.status());
  }
  return emit_report(name, out, report.value(), print);
}

// A multi-rank benchmark: `bench` on every rank (threads, or the processes of mpirun), then rank
// 0's report (the caller has checked its options and --json-out).
template <typename Bench, typename Print>
int run_world_report(const char* name, int ranks, const CLI::App& cmd, std::chrono::milliseconds timeout,
                     const ReportOutput& out, Bench&& bench, Print&& print) {
  std::optional<nlohmann::json> root_report;
  WorldOptions world;
  world.is_ranks_given = cmd.count("--ranks") > 0;
  world.timeout = timeout;
  const int code = run_world(
      name, ranks,
      [&](comm::Communicator& c) -> Status {
        DISTCA_ASSIGN_OR_RETURN(nlohmann::json report, bench(c));
        if (c.rank() == 0) root_report = std::move(report);
        return Status::ok();
      },
      world);
  if (code != kExitOk || !root_report) return code;  // under MPI only rank 0 reports
  return emit_report(name, out, *root_report, print);
}

// --device cuda: the sizes given on the command line replace the GPU defaults; CPU-only flags are refused.
int run_attention_cuda(AttentionArgs a, const CLI::App& cmd) {
  bench::CudaAttentionBenchOptions& o = a.cuda;
  if (cmd.count("--threads") > 0) {
    print_usage_error("bench attention", "--threads is for --device cpu (the CUDA kernels use the whole GPU)");
    return kExitBadInput;
  }
  auto given = [&cmd](const char* flag, auto& field, const auto& value) {
    if (cmd.count(flag) > 0) field = value;
  };
  if (a.is_quick) {
    o.docs = {4096};
    o.shard_doc = 4096;
    o.repeats = 2;
  }
  given("--docs", o.docs, a.options.docs);
  given("--shard-doc", o.shard_doc, a.options.shard_doc);
  given("--shards", o.shards, a.options.shards);
  given("--head-dim", o.head_dim, a.options.head_dim);
  given("--heads", o.q_heads, a.options.q_heads);
  given("--kv-heads", o.kv_heads, a.options.kv_heads);
  given("--repeats", o.repeats, a.options.repeats);
  given("--seed", o.seed, a.options.seed);
  auto progress = [](const std::string& line) { fmt::print(stderr, "[bench attention cuda] {}\n", line); };
  return run_report(
      "bench attention", o, a.out, [&] { return bench::run_cuda_attention_bench(o, progress); },
      bench::print_cuda_attention_report, FlagPaths{{"--profile-out", o.profile_out}});
}

int run_attention(AttentionArgs a, const CLI::App& cmd) {
  if (a.device == "cuda") return run_attention_cuda(std::move(a), cmd);
  if (cmd.count("--dtype") > 0 || cmd.count("--profile-out") > 0 || cmd.count("--gpu") > 0) {
    print_usage_error("bench attention", "--dtype, --profile-out and --gpu are for --device cuda (the CPU kernels run fp32)");
    return kExitBadInput;
  }
  if (a.is_quick) {
    auto quick = quick_default(cmd);
    quick("--docs", a.options.docs, std::vector<int64_t>{1024, 2048});
    quick("--shard-doc", a.options.shard_doc, int64_t{2048});
  }
  auto progress = [](const std::string& line) { fmt::print(stderr, "[bench attention] {}\n", line); };
  return run_report(
      "bench attention", a.options, a.out, [&] { return bench::run_attention_bench(a.options, progress); },
      bench::print_attention_report);
}

struct DispatchArgs {
  bench::DispatchBenchOptions options;
  ReportOutput out;
  bool is_quick = false;
  double timeout_seconds = kDefaultTimeoutSeconds;
};

int run_dispatch(DispatchArgs a, const CLI::App& cmd) {
  if (a.is_quick) {
    auto quick = quick_default(cmd);
    quick("--tokens-per-rank", a.options.tokens_per_rank, int64_t{2048});
    quick("--layers", a.options.layers, 2);
    quick("--heads", a.options.q_heads, int64_t{4});
    quick("--kv-heads", a.options.kv_heads, int64_t{2});
    quick("--head-dim", a.options.head_dim, int64_t{64});
    quick("--repeats", a.options.repeats, 3);
  }
  Status s = validate(a.options);
  if (s.is_ok() && a.options.link == "off" && cmd.count("--latency-us") > 0) {
    s = invalid_argument("--latency-us is the emulated link's latency, and --link off runs no emulated link: drop one");
  }
  if (s.is_ok() && a.options.link != "off" && a.options.ranks == 1 && !is_under_mpi()) {
    s = invalid_argument("--ranks 1: nothing crosses a link between one rank and itself, so there is nothing to "
                         "emulate; pass --link off or --ranks 2 or more");
  }
  Result<std::chrono::milliseconds> timeout = timeout_from_seconds(a.timeout_seconds);
  if (s.is_ok()) s = timeout.status();
  if (s.is_ok()) s = check_report_output(a.out);
  if (!s.is_ok()) {
    print_usage_error("bench dispatch", s.message());
    return kExitBadInput;
  }
  auto progress = [](const std::string& line) { fmt::print(stderr, "[bench dispatch] {}\n", line); };
  return run_world_report(
      "bench dispatch", a.options.ranks, cmd, timeout.value(), a.out,
      [&](comm::Communicator& c) { return bench::run_dispatch_bench(c, a.options, progress); }, bench::print_dispatch_report);
}

struct StepArgs {
  bench::StepBenchOptions options;
  ReportOutput out;
  double timeout_seconds = kDefaultTimeoutSeconds;
};

int run_step(const StepArgs& a, const CLI::App& cmd) {
  Status s = validate(a.options);
  if (s.is_ok() && a.options.link == "off" && cmd.count("--latency-us") + cmd.count("--ratio") > 0) {
    s = invalid_argument("--latency-us and --ratio shape the emulated link, and --link off runs none: drop them");
  }
  Result<std::chrono::milliseconds> timeout = timeout_from_seconds(a.timeout_seconds);
  if (s.is_ok()) s = timeout.status();
  if (s.is_ok()) s = check_report_output(a.out);
  if (!s.is_ok()) {
    print_usage_error("bench step", s.message());
    return kExitBadInput;
  }
  if (Status m = bench::check_step_memory(a.options); !m.is_ok()) {
    print_usage_error("bench step", m.message());
    return kExitBadInput;
  }
  auto progress = [](const std::string& line) { fmt::print(stderr, "[bench step] {}\n", line); };
  return run_world_report(
      "bench step", a.options.ranks, cmd, timeout.value(), a.out,
      [&](comm::Communicator& c) { return bench::run_step_bench(c, a.options, progress); }, bench::print_step_report);
}

struct LinkArgs {
  bench::LinkBenchOptions options;
  ReportOutput out;
  double timeout_seconds = kDefaultTimeoutSeconds;
};

int run_link(const LinkArgs& a, const CLI::App& cmd) {
  Status s = validate(a.options);
  Result<std::chrono::milliseconds> timeout = timeout_from_seconds(a.timeout_seconds);
  if (s.is_ok()) s = timeout.status();
  if (s.is_ok()) s = check_report_output(a.out);
  if (!s.is_ok()) {
    print_usage_error("bench link", s.message());
    return kExitBadInput;
  }
  auto progress = [](const std::string& line) { fmt::print(stderr, "[bench link] {}\n", line); };
  return run_world_report(
      "bench link", a.options.ranks, cmd, timeout.value(), a.out,
      [&](comm::Communicator& c) { return bench::run_link_bench(c, a.options, progress); }, bench::print_link_report);
}

struct PlannerArgs {
  bench::PlannerBenchOptions options;
  ReportOutput out;
};

int run_planner(const PlannerArgs& a) {
  // Every file the run reads, the default folder's included: --json-out never replaces one.
  FlagPaths inputs;
  for (const bench::PlannerBenchInput& in : bench::planner_bench_inputs(a.options)) inputs.emplace_back(in.flag, in.path);
  return run_report(
      "bench planner", a.options, a.out, [&] { return bench::run_planner_bench(a.options); }, bench::print_planner_report, {},
      inputs);
}

// An unsigned option refuses "-1" (which would wrap around to 2^64 - 1).
CLI::Validator non_negative() {
  return CLI::Validator([](std::string& value) { return value.starts_with("-") ? "must be >= 0, got " + value : std::string(); },
                        "", "non-negative");
}

}  // namespace

std::function<int()> add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "measured benchmarks, with baselines measured in the same run");
  bench->require_subcommand(1);

  auto attention = std::make_shared<AttentionArgs>();
  bench::AttentionBenchOptions& o = attention->options;
  CLI::App* cmd = bench->add_subcommand(
      "attention",
      "attention kernels, causal-aware FLOP counts: on cpu, fused CPU attention vs GEMM attention vs sgemm (GFLOP/s); "
      "on cuda, distca's CUDA kernels (TFLOP/s; PyTorch's beside them: python/bench/bench_cuda_attention.py)");
  cmd->add_option("--device", attention->device, "cpu, or cuda (GPU defaults: --docs 4096,16384,32768,65536 "
                                                 "--shard-doc 16384 --heads 32 --kv-heads 8 --repeats 5)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--dtype", attention->cuda.dtype, "--device cuda: bfloat16 or float16")
      ->check(CLI::IsMember({"bfloat16", "float16"}))
      ->capture_default_str();
  cmd->add_option("--gpu", attention->cuda.device, "--device cuda: the GPU index (-1: the current one)")
      ->capture_default_str();
  cmd->add_option("--profile-out", attention->cuda.profile_out,
                  "--device cuda: also write a simulator profile of this GPU with the measured attention points");
  cmd->add_option("--docs", o.docs, "whole-document lengths in tokens")->delimiter(',')->capture_default_str();
  cmd->add_option("--shard-doc", o.shard_doc, "the document cut into shards; also the headline case")
      ->capture_default_str();
  cmd->add_option("--shards", o.shards, "shard sizes (queries per task, sharing the document's K/V)")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--head-dim", o.head_dim, "D: 32, 64, 128 or 256")->capture_default_str();
  cmd->add_option("--heads", o.q_heads, "Hq: query heads")->capture_default_str();
  cmd->add_option("--kv-heads", o.kv_heads, "Hkv: key/value heads")->capture_default_str();
  cmd->add_option("--threads", o.threads, "threads of the all-threads runs (0 = one per hardware thread)")
      ->capture_default_str();
  cmd->add_option("--repeats", o.repeats, "each time is the best of this many runs (1..100)")->capture_default_str();
  cmd->add_option("--seed", o.seed, "seed of the random inputs (>= 0)")->check(non_negative())->capture_default_str();
  cmd->add_flag("--quick", attention->is_quick,
                "small sizes for a smoke run: --docs 1024,2048 --shard-doc 2048 unless given");
  add_report_flags(cmd, attention->out);

  auto dispatch = std::make_shared<DispatchArgs>();
  bench::DispatchBenchOptions& d = dispatch->options;
  CLI::App* dcmd = bench->add_subcommand(
      "dispatch",
      "the CAD runtime: bytes per phase, sequential vs ping-pong over the communicator as it is "
      "and over an emulated link; under mpirun over MPI, else --ranks threads");
  dcmd->add_option("--ranks", d.ranks, "ranks as threads when not started by mpirun")->capture_default_str();
  dcmd->add_option("--workload", d.workload, "document lengths: pretrain or prolong")->capture_default_str();
  dcmd->add_option("--tokens-per-rank", d.tokens_per_rank, "T: tokens of each rank's micro-batch")->capture_default_str();
  dcmd->add_option("--heads", d.q_heads, "Hq: query heads")->capture_default_str();
  dcmd->add_option("--kv-heads", d.kv_heads, "Hkv: key/value heads")->capture_default_str();
  dcmd->add_option("--head-dim", d.head_dim, "D: 32, 64, 128 or 256")->capture_default_str();
  dcmd->add_option("--layers", d.layers, "layers of forward and backward per step")->capture_default_str();
  dcmd->add_option("--policy", d.policy, "planner: none, distca, minmax, minbytes or minlink")->capture_default_str();
  dcmd->add_option("--backward", d.backward_mode, "stateless (re-send Q/K/V/O) or stateful (server keeps them)")
      ->capture_default_str();
  dcmd->add_option("--threads", d.threads, "attention and BLAS threads per rank")->capture_default_str();
  dcmd->add_option("--linear-ratio", d.linear_ratio, "stand-in linear FLOPs per attention FLOP, per stage")
      ->capture_default_str();
  dcmd->add_option("--link", d.link, "emulated link: auto (communication = compute), off, or GB/s")
      ->capture_default_str();
  dcmd->add_option("--latency-us", d.latency_us, "emulated link latency per operation")->capture_default_str();
  dcmd->add_option("--repeats", d.repeats,
                   "sequential and ping-pong runs per link; the report gives each figure's median and min..max (1..100)")
      ->capture_default_str();
  dcmd->add_option("--seed", d.seed, "seed of the batch and the inputs (>= 0)")
      ->check(non_negative())
      ->capture_default_str();
  dcmd->add_flag("--quick", dispatch->is_quick,
                 "small sizes for a smoke run: 2048 tokens per rank, 2 layers, 4 heads, 2 KV heads, D=64, 3 repeats, unless given");
  add_report_flags(dcmd, dispatch->out);
  dcmd->add_option("--timeout", dispatch->timeout_seconds, kTimeoutHelp)->capture_default_str();

  auto step = std::make_shared<StepArgs>();
  bench::StepBenchOptions& so = step->options;
  CLI::App* scmd = bench->add_subcommand(
      "step",
      "ping-pong inside the real CAD training step: sequential nano-batches vs ping-pong vs a zero-cost link vs the "
      "whole step, interleaved on the same batches; over an emulated link calibrated so that communication = linear "
      "compute, or over the communicator itself (--link off, e.g. under mpirun)");
  scmd->add_option("--ranks", so.ranks, "ranks as threads when not started by mpirun")->capture_default_str();
  scmd->add_option("--preset", so.preset, "model and context: tiny | demo")->capture_default_str();
  scmd->add_option("--context", so.context, "tokens per rank (0: the preset's)")->capture_default_str();
  scmd->add_option("--layers", so.layers, "layers (0: the preset's)")->capture_default_str();
  scmd->add_option("--workload", so.workload, "document lengths: pretrain | prolong | skewed (default: the preset's)");
  scmd->add_option("--steps", so.steps, "measured steps, after a warm-up and a calibration step")->capture_default_str();
  scmd->add_option("--threads", so.threads, "BLAS and attention threads per rank")->capture_default_str();
  scmd->add_option("--link", so.link, "auto: an emulated link, communication = --ratio x linear compute; off: the "
                                      "communicator itself")
      ->capture_default_str();
  scmd->add_option("--ratio", so.ratio, "emulated communication time / linear compute time of a step")->capture_default_str();
  scmd->add_option("--latency-us", so.latency_us, "emulated link latency per operation")->capture_default_str();
  scmd->add_option("--backward", so.backward_mode, "stateful | stateless")->capture_default_str();
  scmd->add_option("--progress", so.progress,
                   "how transfers advance while a rank computes: none (when the schedule waits) | poll (between the "
                   "model's GEMMs) | thread (a progress thread)")
      ->capture_default_str();
  scmd->add_option("--progress-interval-us", so.progress_interval_us,
                   "with --progress thread, microseconds between its polls (10..100000)")
      ->capture_default_str();
  scmd->add_option("--grad-sync", so.grad_sync,
                   "the gradient all-reduce: overlap (each layer's once the backward has finished it; with ping-pong "
                   "in slices queued behind the attention exchanges) | eager (each layer's at once) | after (one "
                   "after the backward)")
      ->capture_default_str();
  add_report_flags(scmd, step->out);
  scmd->add_option("--timeout", step->timeout_seconds, kTimeoutHelp)->capture_default_str();

  auto link = std::make_shared<LinkArgs>();
  bench::LinkBenchOptions& lo = link->options;
  CLI::App* lcmd = bench->add_subcommand(
      "link",
      "the CAD exchange alone (one layer's four all-to-alls of a planned batch) over the communicator as it is, e.g. "
      "between hosts under mpirun, beside the simulator's link model (latency + busiest bytes / --rate-gbit)");
  lcmd->add_option("--ranks", lo.ranks, "ranks as threads when not started by mpirun (2..64)")->capture_default_str();
  lcmd->add_option("--workload", lo.workload, "document lengths: pretrain or prolong")->capture_default_str();
  lcmd->add_option("--tokens-per-rank", lo.tokens_per_rank, "tokens of each rank's batch")->capture_default_str();
  lcmd->add_option("--heads", lo.q_heads, "Hq: query heads")->capture_default_str();
  lcmd->add_option("--kv-heads", lo.kv_heads, "Hkv: key/value heads")->capture_default_str();
  lcmd->add_option("--head-dim", lo.head_dim, "D")->capture_default_str();
  lcmd->add_option("--dtype-bytes", lo.dtype_bytes, "bytes per element on the wire: 2 (bf16) or 4 (fp32)")
      ->capture_default_str();
  lcmd->add_option("--policy", lo.policy, "planner: none, distca, minmax, minbytes or minlink")->capture_default_str();
  lcmd->add_option("--backward", lo.backward_mode, "stateless or stateful")->capture_default_str();
  lcmd->add_option("--rate-gbit", lo.rate_gbit,
                   "the link's rate in Gbit/s (what it was shaped to) for the model's prediction; 0: measure only")
      ->capture_default_str();
  lcmd->add_option("--repeats", lo.repeats, "each exchange this many times (median, min..max; 1..1000)")
      ->capture_default_str();
  lcmd->add_option("--seed", lo.seed, "seed of the batch (>= 0)")->check(non_negative())->capture_default_str();
  add_report_flags(lcmd, link->out);
  lcmd->add_option("--timeout", link->timeout_seconds, kTimeoutHelp)->capture_default_str();

  auto planner = std::make_shared<PlannerArgs>();
  bench::PlannerBenchOptions& po = planner->options;
  CLI::App* pcmd = bench->add_subcommand(
      "planner",
      "every policy on the batches the paper's planner was run on (shared/data/reference), beside its figures and "
      "the lower bounds; planning times in the same run");
  pcmd->add_option("--reference-dir", po.reference_dir,
                   "the folder of reference_planner.json and its batches (default: $DISTCA_SHARED_DATA/reference, "
                   "else ../shared/data/reference)");
  pcmd->add_option("--tolerance", po.tolerance,
                   "eps in [0, 1], or auto (each plan at the eps whose predicted step is fastest on the built-in H200 "
                   "profile); the reference's own figures are shown at 0.02 and 0.1, where it was run")
      ->capture_default_str();
  pcmd->add_option("--fresh", po.fresh_seeds,
                   "also this many fresh batches per sample and size: seeds 1..N of dist_wlbllm.json and "
                   "dist_prolong.json (beside the reference folder) at 64 and 512 ranks of 131072 tokens (0..100)")
      ->capture_default_str();
  pcmd->add_option("--policies", po.policies, "the planners to run")->delimiter(',')->capture_default_str();
  pcmd->add_option("--repeats", po.repeats, "planning time: the median of this many runs (1..1000)")->capture_default_str();
  add_report_flags(pcmd, planner->out);

  auto calibration = add_calibration_command(*bench);

  return [bench, attention, cmd, dispatch, dcmd, step, scmd, link, lcmd, planner, calibration]() -> int {
    if (bench->got_subcommand("attention")) return run_attention(*attention, *cmd);
    if (bench->got_subcommand("dispatch")) return run_dispatch(*dispatch, *dcmd);
    if (bench->got_subcommand("step")) return run_step(*step, *scmd);
    if (bench->got_subcommand("link")) return run_link(*link, *lcmd);
    if (bench->got_subcommand("planner")) return run_planner(*planner);
    if (bench->got_subcommand("calibration")) return calibration();
    return 2;
  };
}

}  // namespace distca::tools
