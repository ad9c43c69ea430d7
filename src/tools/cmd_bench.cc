#include "cmd_bench.h"

#include <fmt/format.h>

#include <memory>

#include "bench_attention.h"

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

  return [bench, attention]() -> int {
    if (bench->got_subcommand("attention")) return run_attention(*attention);
    return 2;
  };
}

}  // namespace distca::tools
