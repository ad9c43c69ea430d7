#include "cmd_bench.h"

#include <fmt/format.h>

#include <memory>
#include <optional>

#include "bench_attention.h"
#include "bench_dispatch.h"
#include "cmd_profile.h"
#include "world.h"

namespace distca::tools {
namespace {

struct AttentionArgs {
  AttentionBenchOptions options;
  bool is_json = false;
  bool is_quick = false;
};

int run_attention(AttentionArgs a) {
  if (a.is_quick) {
    a.options.docs = {1024, 2048};
    a.options.shard_doc = 2048;
  }
  if (Status s = validate(a.options); !s.is_ok()) {
    fmt::print(stderr, "distca bench attention: error: {}\n", s.message());
    return 2;
  }
  auto progress = [](const std::string& line) { fmt::print(stderr, "[bench attention] {}\n", line); };
  Result<nlohmann::json> report = run_attention_bench(a.options, progress);
  if (!report.is_ok()) {
    fmt::print(stderr, "distca bench attention: error: {}\n", report.status().message());
    return report.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
  }
  if (a.is_json) {
    fmt::print("{}\n", report.value().dump(2));
  } else {
    print_attention_report(report.value());
  }
  return 0;
}

struct DispatchArgs {
  DispatchBenchOptions options;
  bool is_json = false;
  bool is_quick = false;
};

int run_dispatch(DispatchArgs a, const CLI::App& cmd) {
  if (a.is_quick) {  // small sizes, for whatever was not given explicitly
    auto quick = [&](const char* flag, auto& field, auto value) {
      if (cmd.count(flag) == 0) field = value;
    };
    quick("--tokens-per-rank", a.options.tokens_per_rank, int64_t{2048});
    quick("--layers", a.options.layers, 2);
    quick("--repeats", a.options.repeats, 1);
    quick("--heads", a.options.q_heads, int64_t{4});
    quick("--kv-heads", a.options.kv_heads, int64_t{2});
    quick("--head-dim", a.options.head_dim, int64_t{64});
  }
  if (Status s = validate(a.options); !s.is_ok()) {
    fmt::print(stderr, "distca bench dispatch: error: {}\n", s.message());
    return 2;
  }
  auto progress = [](const std::string& line) { fmt::print(stderr, "[bench dispatch] {}\n", line); };
  auto finish = [&](const Result<nlohmann::json>& report) {
    if (!report.is_ok()) {
      fmt::print(stderr, "distca bench dispatch: error: {}\n", report.status().message());
      return report.status().code() == StatusCode::kInvalidArgument ? 2 : 1;
    }
    if (a.is_json) {
      fmt::print("{}\n", report.value().dump(2));
    } else {
      print_dispatch_report(report.value());
    }
    return 0;
  };
  std::optional<nlohmann::json> root_report;
  const int code = run_world("bench dispatch", a.options.ranks, [&](comm::Communicator& c) -> Status {
    DISTCA_ASSIGN_OR_RETURN(nlohmann::json report, run_dispatch_bench(c, a.options, progress));
    if (c.rank() == 0) root_report = std::move(report);
    return Status::ok();
  });
  if (code != 0 || !root_report) return code;  // under MPI only rank 0 reports
  return finish(*root_report);
}

}  // namespace

std::function<int()> add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "measured benchmarks, with baselines measured in the same run");
  bench->require_subcommand(1);

  auto attention = std::make_shared<AttentionArgs>();
  AttentionBenchOptions& o = attention->options;
  CLI::App* cmd = bench->add_subcommand(
      "attention", "fused CPU attention vs GEMM attention vs sgemm: GFLOP/s, causal-aware counts");
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
  cmd->add_option("--repeats", o.repeats, "each time is the best of this many runs")->capture_default_str();
  cmd->add_option("--seed", o.seed, "seed of the random inputs")->capture_default_str();
  cmd->add_flag("--quick", attention->is_quick, "small sizes (1K and 2K tokens) for a smoke run");
  cmd->add_flag("--json", attention->is_json, "print one JSON object instead of the table");

  auto dispatch = std::make_shared<DispatchArgs>();
  DispatchBenchOptions& d = dispatch->options;
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
  dcmd->add_option("--policy", d.policy, "planner: none, distca or minmax")->capture_default_str();
  dcmd->add_option("--backward", d.backward_mode, "stateless (re-send Q/K/V/O) or stateful (server keeps them)")
      ->capture_default_str();
  dcmd->add_option("--threads", d.threads, "attention and BLAS threads per rank")->capture_default_str();
  dcmd->add_option("--linear-ratio", d.linear_ratio, "stand-in linear FLOPs per attention FLOP, per stage")
      ->capture_default_str();
  dcmd->add_option("--link", d.link, "emulated link: auto (communication = compute), off, or GB/s")
      ->capture_default_str();
  dcmd->add_option("--latency-us", d.latency_us, "emulated link latency per operation")->capture_default_str();
  dcmd->add_option("--repeats", d.repeats, "each time is the best of this many runs")->capture_default_str();
  dcmd->add_option("--seed", d.seed, "seed of the batch and the inputs")->capture_default_str();
  dcmd->add_flag("--quick", dispatch->is_quick, "small sizes for a smoke run");
  dcmd->add_flag("--json", dispatch->is_json, "print one JSON object instead of the table");

  auto calibration = add_calibration_command(*bench);

  return [bench, attention, dispatch, dcmd, calibration]() -> int {
    if (bench->got_subcommand("attention")) return run_attention(*attention);
    if (bench->got_subcommand("dispatch")) return run_dispatch(*dispatch, *dcmd);
    if (bench->got_subcommand("calibration")) return calibration();
    return 2;
  };
}

}  // namespace distca::tools
