#include "distca/sim/profile.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "distca/core/file.h"
#include "distca/core/json.h"
#include "distca/plan/batch.h"

namespace distca::sim {

Status Profile::validate() const {
  if (attention.empty()) return invalid_argument(fmt::format("profile '{}': no attention entries", name));
  for (const AttentionProfile& a : attention) {
    if (a.num_q_heads < 1 || a.num_kv_heads < 1 || a.head_dim < 1 || a.num_q_heads % a.num_kv_heads != 0) {
      return invalid_argument(fmt::format("profile '{}': bad head configuration {}/{} x {}", name, a.num_q_heads,
                                          a.num_kv_heads, a.head_dim));
    }
    if (a.points.empty()) return invalid_argument(fmt::format("profile '{}': an attention entry has no points", name));
    for (size_t i = 0; i < a.points.size(); ++i) {
      const AttentionPoint& p = a.points[i];
      if (p.q_tokens < 1 || p.kv_tokens < p.q_tokens || !(p.fwd_seconds > 0) || !(p.bwd_seconds > 0)) {
        return invalid_argument(fmt::format("profile '{}': attention point {} needs 1 <= q <= kv and positive times",
                                            name, i));
      }
      if (i > 0 && p.kv_tokens <= a.points[i - 1].kv_tokens) {
        return invalid_argument(fmt::format("profile '{}': attention points must be sorted by kv_tokens", name));
      }
    }
    if (!(a.task_overhead_seconds >= 0) || a.tile_rows < 1) return invalid_argument("task overhead must be >= 0, tile rows >= 1");
  }
  if (!(linear_flops_per_second > 0)) return invalid_argument(fmt::format("profile '{}': linear FLOP/s must be > 0", name));
  for (const LinearEntry& e : linear_models) {
    if (!(e.seconds_per_token_layer > 0) || !(e.step_fixed_seconds >= 0)) {
      return invalid_argument(fmt::format("profile '{}': linear model entry '{}' needs positive times", name, e.model));
    }
  }
  if (!(device_memory_bytes >= 0) || !std::isfinite(device_memory_bytes)) {
    return invalid_argument(fmt::format("profile '{}': device memory must be >= 0 bytes (0: unknown)", name));
  }
  for (const Link* l : {&intra_node, &inter_node}) {
    if (!(l->bytes_per_second > 0) || !(l->latency_seconds >= 0)) {
      return invalid_argument(fmt::format("profile '{}': links need bandwidth > 0 and latency >= 0", name));
    }
  }
  return Status::ok();
}

AttentionPricer::AttentionPricer(const Profile& profile, int64_t hq, int64_t head_dim)
    : config_(&profile.attention[0]), hq_(hq), head_dim_(head_dim) {
  // The closest head configuration by head dim, then by heads.
  auto score = [&](const AttentionProfile& x) {
    return std::abs(std::log2(static_cast<double>(x.head_dim) / head_dim)) * 100 +
           std::abs(std::log2(static_cast<double>(x.num_q_heads) / hq));
  };
  for (const AttentionProfile& a : profile.attention) {
    if (score(a) < score(*config_)) config_ = &a;
  }
  for (const AttentionPoint& p : config_->points) {
    log_kv_.push_back(std::log(static_cast<double>(p.kv_tokens)));
    for (const bool is_backward : {false, true}) {
      const double flops = 4.0 * config_->head_dim * config_->num_q_heads *
                           static_cast<double>(shard_pairs(p.q_tokens, p.kv_tokens)) * (is_backward ? 2.5 : 1.0);
      rate_[is_backward].push_back(flops / (is_backward ? p.bwd_seconds : p.fwd_seconds));
    }
  }
}

std::array<double, 2> AttentionPricer::seconds_both(int64_t q_rows, int64_t kv_rows, int64_t pairs) const {
  if (q_rows <= 0 || pairs <= 0) return {0.0, 0.0};
  const auto& pts = config_->points;
  std::array<double, 2> rate{rate_[0].front(), rate_[1].front()};
  if (kv_rows >= pts.back().kv_tokens) {
    rate = {rate_[0].back(), rate_[1].back()};
  } else if (kv_rows > pts.front().kv_tokens) {
    size_t i = 1;
    while (pts[i].kv_tokens < kv_rows) ++i;
    const double x0 = log_kv_[i - 1], x1 = log_kv_[i];
    const double w = x1 > x0 ? (std::log(static_cast<double>(kv_rows)) - x0) / (x1 - x0) : 1.0;
    for (int b = 0; b < 2; ++b) rate[b] = rate_[b][i - 1] * (1 - w) + rate_[b][i] * w;
  }
  std::array<double, 2> seconds{};
  for (int b = 0; b < 2; ++b) {
    if (q_rows < config_->tile_rows) rate[b] *= static_cast<double>(q_rows) / static_cast<double>(config_->tile_rows);
    const double flops = 4.0 * head_dim_ * hq_ * static_cast<double>(pairs) * (b == 1 ? 2.5 : 1.0);
    seconds[b] = flops / rate[b] + config_->task_overhead_seconds;
  }
  return seconds;
}

double AttentionPricer::seconds(int64_t q_rows, int64_t kv_rows, int64_t pairs, bool is_backward) const {
  return seconds_both(q_rows, kv_rows, pairs)[is_backward ? 1 : 0];
}

double Profile::attention_seconds(int64_t q_rows, int64_t kv_rows, int64_t pairs, int64_t hq, int64_t head_dim,
                                  bool is_backward) const {
  return AttentionPricer(*this, hq, head_dim).seconds(q_rows, kv_rows, pairs, is_backward);
}

const LinearEntry* Profile::find_linear(const std::string& model) const {
  for (const LinearEntry& e : linear_models) {
    if (e.model == model) return &e;
  }
  return nullptr;
}

Profile default_h200_profile() {
  Profile p;
  p.name = "h200-published";
  p.source =
      "H200 SXM shares the H100 SXM's tensor cores (989 TFLOP/s dense BF16; NVIDIA H200 datasheet), so attention "
      "throughput is FlashAttention-3's on H100 SXM5, BF16, causal, head dim 128 (Shah et al. 2024, arXiv 2407.08608, "
      "figures 5 and 7: about 200/370/480/570/620/640 TFLOP/s forward and 150/260/360/430/480/510 backward at "
      "sequence 512..16K, read off the plots; the points below are per-GPU times of a 16-head shard at those rates). "
      "Linear layers: 50% of 989 TFLOP/s, within the 40-55% MFU Megatron-LM reports for Llama-class models on Hopper.";
  AttentionProfile a;
  a.num_q_heads = 4;  // Llama-8B at TP 8: 32 / 8 query heads, 8 / 8 KV heads per GPU
  a.num_kv_heads = 1;
  a.head_dim = 128;
  a.task_overhead_seconds = 5e-6;
  a.tile_rows = 128;
  const int64_t q[] = {512, 1024, 2048, 4096, 8192, 16384};
  const double fwd_tflops[] = {200, 370, 480, 570, 620, 640};
  const double bwd_tflops[] = {150, 260, 360, 430, 480, 510};
  for (int i = 0; i < 6; ++i) {
    const double pairs = static_cast<double>(shard_pairs(q[i], q[i]));
    const double flops = 4.0 * 128 * 4 * pairs;
    a.points.push_back({q[i], q[i], flops / (fwd_tflops[i] * 1e12), 2.5 * flops / (bwd_tflops[i] * 1e12)});
  }
  p.attention.push_back(a);
  p.linear_flops_per_second = 0.5 * 989e12;
  p.intra_node = {5e-6, 360e9};
  p.inter_node = {10e-6, 45e9};
  p.links_source =
      "NVLink 4: 900 GB/s per GPU both ways (H200 datasheet), about 360 GB/s bus bandwidth achieved per direction in "
      "nccl-tests all-reduce on H100 SXM; inter-node: one 400 Gb/s ConnectX-7 NIC per GPU (50 GB/s), about 45 GB/s "
      "achieved; latencies typical of NCCL on NVLink (5 us) and InfiniBand (10 us)";
  p.device_memory_bytes = 141e9;
  p.device_memory_source =
      "141 GB of HBM3e per GPU (NVIDIA H200 datasheet), read as 141e9 bytes (131.3 GiB): the lower reading of the "
      "datasheet's GB, which leaves some room for what the simulator's memory count leaves out (CUDA context, NCCL "
      "buffers, allocator fragmentation)";
  return p;
}

namespace {
nlohmann::json linear_models_json(const Profile& p) {
  nlohmann::json out = nlohmann::json::array();
  for (const LinearEntry& e : p.linear_models) {
    out.push_back({{"model", e.model}, {"seconds_per_token_layer", e.seconds_per_token_layer},
                   {"step_fixed_seconds", e.step_fixed_seconds}});
  }
  return out;
}
}  // namespace

nlohmann::json to_json(const Profile& p) {
  nlohmann::json attention = nlohmann::json::array();
  for (const AttentionProfile& a : p.attention) {
    nlohmann::json pts = nlohmann::json::array();
    for (const AttentionPoint& x : a.points) {
      pts.push_back({{"q_tokens", x.q_tokens}, {"kv_tokens", x.kv_tokens}, {"fwd_seconds", x.fwd_seconds},
                     {"bwd_seconds", x.bwd_seconds}});
    }
    attention.push_back({{"num_q_heads", a.num_q_heads}, {"num_kv_heads", a.num_kv_heads}, {"head_dim", a.head_dim},
                         {"task_overhead_seconds", a.task_overhead_seconds}, {"tile_rows", a.tile_rows}, {"points", pts}});
  }
  auto link = [](const Link& l) { return nlohmann::json{{"latency_seconds", l.latency_seconds}, {"bytes_per_second", l.bytes_per_second}}; };
  return {{"format", "distca-profile"},   {"version", kProfileVersion},
          {"name", p.name},               {"source", p.source},
          {"attention", attention},       {"linear_flops_per_second", p.linear_flops_per_second},
          {"intra_node", link(p.intra_node)}, {"inter_node", link(p.inter_node)},
          {"links_source", p.links_source},
          {"device_memory_bytes", p.device_memory_bytes}, {"device_memory_source", p.device_memory_source},
          {"linear_models", linear_models_json(p)}};
}

Result<Profile> profile_from_json(const nlohmann::json& j, const std::string& origin) {
  Profile p;
  try {
    if (j.at("format").get<std::string>() != "distca-profile") {
      return invalid_argument(fmt::format("{}: not a distca profile (format '{}')", origin,
                                          text_excerpt(j.at("format").get<std::string>())));
    }
    const int64_t version = json_int(j.at("version"), "version", 0, 1 << 30);
    if (version != kProfileVersion) {
      return invalid_argument(fmt::format("{}: profile version {} (this build reads version {})", origin, version, kProfileVersion));
    }
    p.name = j.at("name").get<std::string>();
    p.source = j.value("source", "");
    for (const auto& a : j.at("attention")) {
      AttentionProfile ap;
      ap.num_q_heads = json_int(a.at("num_q_heads"), "num_q_heads", 1, 1 << 20);
      ap.num_kv_heads = json_int(a.at("num_kv_heads"), "num_kv_heads", 1, 1 << 20);
      ap.head_dim = json_int(a.at("head_dim"), "head_dim", 1, 1 << 20);
      ap.task_overhead_seconds = a.value("task_overhead_seconds", 0.0);
      ap.tile_rows = a.contains("tile_rows") ? json_int(a.at("tile_rows"), "tile_rows", 1, 1 << 20) : 1;
      for (const auto& x : a.at("points")) {
        ap.points.push_back({json_int(x.at("q_tokens"), "q_tokens", 0, plan::kMaxTokens),
                             json_int(x.at("kv_tokens"), "kv_tokens", 0, plan::kMaxTokens),
                             x.at("fwd_seconds").get<double>(), x.at("bwd_seconds").get<double>()});
      }
      p.attention.push_back(std::move(ap));
    }
    p.linear_flops_per_second = j.at("linear_flops_per_second").get<double>();
    auto link = [](const nlohmann::json& l) { return Link{l.at("latency_seconds").get<double>(), l.at("bytes_per_second").get<double>()}; };
    p.intra_node = link(j.at("intra_node"));
    p.inter_node = link(j.at("inter_node"));
    p.links_source = j.value("links_source", "");
    // Optional: profiles written before it was added, and measured CPU profiles, have none.
    p.device_memory_bytes = j.value("device_memory_bytes", 0.0);
    p.device_memory_source = j.value("device_memory_source", "");
    if (j.contains("linear_models")) {
      for (const auto& e : j.at("linear_models")) {
        p.linear_models.push_back({e.at("model").get<std::string>(), e.at("seconds_per_token_layer").get<double>(),
                                   e.at("step_fixed_seconds").get<double>()});
      }
    }
  } catch (const nlohmann::json::exception& e) {
    // nlohmann's text after its "[json.exception.kind.id] " tag: "key 'inter_node' not found".
    const std::string what = e.what();
    const size_t tag = what.rfind("] ");
    return invalid_argument(fmt::format("{}: bad profile: {} (a profile is what `distca profile` writes: format, "
                                        "version, name, attention, linear_flops_per_second, intra_node, inter_node)",
                                        origin, tag == std::string::npos ? what : what.substr(tag + 2)));
  }
  if (Status s = p.validate(); !s.is_ok()) return invalid_argument(fmt::format("{}: {}", origin, s.message()));
  return p;
}

Result<Profile> load_profile(const std::string& path) {
  DISTCA_ASSIGN_OR_RETURN(std::string text, read_text_file(path));
  DISTCA_ASSIGN_OR_RETURN(const nlohmann::json j, parse_json(text, path));
  return profile_from_json(j, path);
}

}  // namespace distca::sim
