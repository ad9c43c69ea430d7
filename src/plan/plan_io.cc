#include "distca/plan/plan_io.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <limits>
#include <span>
#include <string_view>

#include "distca/core/check.h"
#include "distca/core/json.h"
#include "distca/plan/planner.h"
#include "distca/plan/verify.h"

namespace distca::plan {

using nlohmann::json;

namespace {

json load_json(const LoadSummary& s) {
  return {{"max", s.max}, {"mean", s.mean}, {"imbalance", s.imbalance},
          {"pairs_imbalance", s.pairs_imbalance}};
}

json model_json(const ModelShape& m) {
  return {{"name", m.name},          {"layers", m.num_layers},  {"hidden", m.hidden},
          {"heads", m.num_q_heads},  {"kv_heads", m.num_kv_heads}, {"head_dim", m.head_dim},
          {"ffn_hidden", m.ffn_hidden}, {"dtype_bytes", m.dtype_bytes}, {"tp", m.tp},
          {"grad_return", grad_return_name(m.grad_return)}};
}

json rate_json(const std::vector<RatePoint>& rates) {
  json out = json::array();
  for (const RatePoint& r : rates) out.push_back({{"keys", r.keys}, {"flops_per_second", r.flops_per_second}});
  return out;
}

json profile_json(const ThroughputProfile& p) {
  return {{"source", p.source},
          {"flops_per_second", p.flops_per_second},
          {"tile_rows", p.tile_rows},
          {"task_overhead_seconds", p.task_overhead_seconds},
          {"rate_by_keys", rate_json(p.rate_by_keys)}};
}

// One layer's attention rows per server (Plan::server_bytes) against colocated's (`before`).
json memory_json(const Plan& before, const Plan& after) {
  auto most = [](const std::vector<int64_t>& v) { return v.empty() ? int64_t{0} : *std::max_element(v.begin(), v.end()); };
  auto mean = [](const std::vector<int64_t>& v) {
    double sum = 0;
    for (int64_t x : v) sum += static_cast<double>(x);
    return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
  };
  const double m = mean(after.server_bytes);
  return {{"scope", "one layer's attention rows a server holds: Q, O and LSE of its tasks' query rows, K and V of their keys"},
          {"max_server_bytes", most(after.server_bytes)},
          {"mean_server_bytes", m},
          {"imbalance", m > 0 ? static_cast<double>(most(after.server_bytes)) / m : 0.0},
          {"colocated_max_server_bytes", most(before.server_bytes)},
          {"cap_bytes", after.memory_cap > 0 ? json(after.memory_cap) : json(nullptr)},
          {"within_cap", after.is_within_memory}};
}

std::string hex(uint64_t h) { return fmt::format("{:016x}", h); }

}  // namespace

json plan_report_json(const Plan& before, const Plan& after, const Batch& batch, const CostModel& cost,
                      double plan_ms, bool verified) {
  const CommSummary& c = after.traffic.forward;
  return {{"policy", after.policy},
          {"ranks", batch.num_ranks},
          {"tokens_per_rank", batch.tokens_per_rank},
          {"documents", batch.num_docs()},
          {"model", cost.model().name},
          {"tolerance", after.tolerance},
          {"tasks", after.tasks.size()},
          {"plan_ms", plan_ms},
          {"verified", verified},
          {"balanced", after.is_balanced},
          {"guaranteed", after.is_guaranteed},
          {"within_budget", after.is_within_budget},
          {"smallest_kept_budget_bytes", after.smallest_kept_budget > 0 ? json(after.smallest_kept_budget) : json(nullptr)},
          {"split_tasks", std::count_if(after.tasks.begin(), after.tasks.end(),
                                        [](const Task& t) { return t.k0 > 0 || !t.is_causal(); })},
          {"note", after.note},
          {"hash", hex(after.hash)},
          {"load_unit", "estimated seconds of core attention per step (all layers, fwd + bwd)"},
          {"load_before", load_json(before.load)},
          {"load_after", load_json(after.load)},
          {"memory", memory_json(before, after)},
          {"comm",
           {{"scope", "forward dispatch + return, one layer"},
            {"total_bytes", c.total_bytes},
            {"max_send_bytes", c.max_send_bytes},
            {"max_recv_bytes", c.max_recv_bytes},
            {"q_bytes", c.q_bytes},
            {"kv_bytes", c.kv_bytes},
            {"out_bytes", c.out_bytes},
            {"step_link_bytes", after.traffic.links[static_cast<int>(BackwardMode::kStateful)].step},
            {"step_link_scope", "the busiest link's bytes over a step's four phases, one layer, stateful backward"}}}};
}

namespace {

// Every field of a plan file but flows_per_layer.
json plan_json_without_flows(const Plan& plan, const Batch& batch, const CostModel& cost) {
  json pieces = json::array();
  for (const Piece& p : batch.pieces) pieces.push_back({p.doc, p.begin, p.end, p.rank});
  json tasks = json::array();
  for (const Task& t : plan.tasks) tasks.push_back({t.doc, t.q0, t.q1, t.k0, t.k1, t.server});
  return {{"format", kPlanFormat},
          {"version", kPlanVersion},
          {"policy", plan.policy},
          {"tolerance", plan.tolerance},
          {"hash", hex(plan.hash)},
          {"model", model_json(cost.model())},
          {"profile", profile_json(cost.profile())},
          {"batch",
           {{"ranks", batch.num_ranks},
            {"tokens_per_rank", batch.tokens_per_rank},
            {"doc_lengths", batch.doc_lengths},
            {"pieces", pieces}}},
          {"task_fields", {"doc", "q0", "q1", "k0", "k1", "server"}},
          {"tasks", tasks},
          {"server_seconds", plan.server_seconds},
          {"flow_fields", {"src", "dst", "bytes"}}};
}

// The phases in the order nlohmann::json keeps an object's keys (sorted), as a file lists them.
std::vector<Phase> phases_in_key_order() {
  std::vector<Phase> phases;
  for (int p = 0; p < kNumPhases; ++p) phases.push_back(static_cast<Phase>(p));
  std::sort(phases.begin(), phases.end(),
            [](Phase a, Phase b) { return std::string_view(phase_name(a)) < std::string_view(phase_name(b)); });
  return phases;
}

}  // namespace

json plan_to_json(const Plan& plan, const Batch& batch, const CostModel& cost) {
  json j = plan_json_without_flows(plan, batch, cost);
  json phases = json::object();
  for (int p = 0; p < kNumPhases; ++p) {
    json flows = json::array();
    for (const Flow& f : count_flows(batch, cost.token_bytes(), plan.tasks, static_cast<Phase>(p))) {
      flows.push_back({f.src, f.dst, f.bytes});
    }
    phases[phase_name(static_cast<Phase>(p))] = flows;
  }
  j["flows_per_layer"] = phases;
  return j;
}

Status write_plan_text(const Plan& plan, const Batch& batch, const CostModel& cost,
                       const std::function<Status(std::string_view)>& write) {
  const json j = plan_json_without_flows(plan, batch, cost);
  std::string text = "{";  // what is not yet written, passed on in pieces of about 1 MiB
  auto flush = [&](size_t at_least) {
    if (text.size() < at_least) return Status::ok();
    Status s = write(text);
    text.clear();
    return s;
  };
  constexpr size_t kPiece = size_t{1} << 20;
  auto write_flows = [&]() -> Status {
    text += "\"flows_per_layer\":{";
    bool is_first_phase = true;
    for (const Phase phase : phases_in_key_order()) {
      text += fmt::format("{}\"{}\":[", is_first_phase ? "" : ",", phase_name(phase));
      is_first_phase = false;
      // One phase's flows at a time: never the whole plan's, nor any as JSON values.
      bool is_first = true;
      for (const Flow& f : count_flows(batch, cost.token_bytes(), plan.tasks, phase)) {
        fmt::format_to(std::back_inserter(text), "{}[{},{},{}]", is_first ? "" : ",", f.src, f.dst, f.bytes);
        is_first = false;
        DISTCA_RETURN_IF_ERROR(flush(kPiece));
      }
      text += "]";
    }
    text += "}";
    return Status::ok();
  };
  bool is_first = true;
  bool is_flows_written = false;
  for (const auto& [key, value] : j.items()) {
    if (!is_flows_written && key > std::string_view("flows_per_layer")) {
      text += is_first ? "" : ",";
      DISTCA_RETURN_IF_ERROR(write_flows());
      is_flows_written = true;
      is_first = false;
    }
    text += (is_first ? "" : ",") + json(key).dump() + ":" + value.dump();
    is_first = false;
    DISTCA_RETURN_IF_ERROR(flush(kPiece));
  }
  if (!is_flows_written) {
    text += is_first ? "" : ",";
    DISTCA_RETURN_IF_ERROR(write_flows());
  }
  text += "}\n";
  return flush(0);
}

std::string plan_file_text(const Plan& plan, const Batch& batch, const CostModel& cost) {
  std::string text;
  const Status s = write_plan_text(plan, batch, cost, [&](std::string_view piece) {
    text += piece;
    return Status::ok();
  });
  DISTCA_CHECK(s.is_ok()) << s.to_string();  // appending to a string does not fail
  return text;
}

namespace {

// Reading a plan file back: every field typed and range-checked before it is used (json_int,
// json_number and the checks below throw JsonValueError), each error naming the field's place in
// the file ("batch.pieces[3][1]") and quoting at most kMaxQuoted characters of what was there.

constexpr int64_t kMaxPlanRanks = int64_t{1} << 20;
constexpr size_t kMaxModelNameChars = 128;
constexpr const char* kRegenerate = "regenerate it with `distca plan --out FILE` or Plan.to_json()";
constexpr const char* kTaskFields[] = {"doc", "q0", "q1", "k0", "k1", "server"};
constexpr const char* kFlowFields[] = {"src", "dst", "bytes"};

std::string at(std::string_view path, std::string_view key) {
  return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}
std::string item(std::string_view path, size_t index) { return fmt::format("{}[{}]", path, index); }

[[noreturn]] void fail(std::string message) { throw JsonValueError(message); }
[[noreturn]] void fail(std::string_view path, std::string_view expected, const json& got) {
  fail(fmt::format("{} must be {}, got {}", path, expected, json_excerpt(got)));
}
// A Status of a check that runs on what was read (Batch::validate, verify_tasks).
void check(const Status& s, std::string_view what) {
  if (!s.is_ok()) fail(what.empty() ? s.message() : fmt::format("{}: {}", what, s.message()));
}

// An object with every key of `required`, any of `optional` and nothing else.
const json& object(const json& obj, std::string_view path, std::initializer_list<std::string_view> required,
                   std::initializer_list<std::string_view> optional = {}) {
  if (!obj.is_object()) fail(path, "an object", obj);
  for (std::string_view key : required) {
    if (!obj.contains(key)) fail(fmt::format("{} is missing; {}", at(path, key), kRegenerate));
  }
  for (const auto& item : obj.items()) {
    const std::string& key = item.key();  // not a structured binding: clang < 16 cannot capture one
    auto is = [&](std::string_view k) { return k == key; };
    if (std::none_of(required.begin(), required.end(), is) && std::none_of(optional.begin(), optional.end(), is)) {
      fail(fmt::format("unknown key \"{}\" in {} (a {} version {} file has {})", text_excerpt(key),
                       path.empty() ? "the top level" : path, kPlanFormat, kPlanVersion, fmt::join(required, ", ")));
    }
  }
  return obj;
}

// An array of `size` values (any number when size < 0).
const json& array(const json& v, std::string_view path, int64_t size = -1) {
  if (!v.is_array() || (size >= 0 && static_cast<int64_t>(v.size()) != size)) {
    fail(path, size < 0 ? std::string("an array") : fmt::format("an array of {} values", size), v);
  }
  return v;
}

// A finite number in [lo, hi] (JSON has no inf or NaN; 1e400 does not parse).
double number(const json& v, const std::string& path, double lo, double hi, std::string_view range) {
  const double d = json_number(v, path);
  if (!(d >= lo && d <= hi)) fail(path, fmt::format("a number in {}", range), v);
  return d;
}

std::string string(const json& v, std::string_view path) {
  if (!v.is_string()) fail(path, "a string", v);
  return v.get<std::string>();
}

void names(const json& v, std::string_view path, std::span<const char* const> expected) {
  bool same = v.is_array() && v.size() == expected.size();
  for (size_t i = 0; same && i < expected.size(); ++i) same = v[i].is_string() && v[i].get<std::string>() == expected[i];
  if (!same) fail(path, fmt::format("[\"{}\"]", fmt::join(expected, "\", \"")), v);
}

ModelShape read_model(const json& m) {
  // grad_return is optional: files from before it returned dK/dV in fp32.
  object(m, "model", {"name", "layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "dtype_bytes", "tp"},
         {"grad_return"});
  ModelShape out;
  out.name = string(m["name"], "model.name");
  if (out.name.empty() || out.name.size() > kMaxModelNameChars) {
    fail("model.name", fmt::format("a name of 1 to {} characters", kMaxModelNameChars), m["name"]);
  }
  // The bounds `distca plan` puts on its shape flags (sim::PlanRequest::validate): within them
  // a step's byte counts fit in 64 bits.
  struct Field {
    const char* key;
    int* value;
    int64_t hi;
  };
  const Field fields[] = {{"layers", &out.num_layers, 1024},     {"hidden", &out.hidden, 1 << 20},
                          {"heads", &out.num_q_heads, 1024},    {"kv_heads", &out.num_kv_heads, 1024},
                          {"head_dim", &out.head_dim, 1024},    {"ffn_hidden", &out.ffn_hidden, 1 << 22},
                          {"dtype_bytes", &out.dtype_bytes, 4}, {"tp", &out.tp, 1024}};
  for (const Field& f : fields) *f.value = static_cast<int>(json_int(m[f.key], at("model", f.key), 1, f.hi));
  if (out.dtype_bytes == 3) fail("model.dtype_bytes", "1 (fp8), 2 (bf16) or 4 (fp32)", m["dtype_bytes"]);
  if (m.contains("grad_return")) {
    const std::string g = string(m["grad_return"], "model.grad_return");
    const Result<GradReturn> parsed = parse_grad_return(g);
    if (!parsed.is_ok()) fail("model.grad_return", "\"bf16\" or \"fp32\"", m["grad_return"]);
    out.grad_return = parsed.value();
  }
  check(out.validate(), "");
  return out;
}

ThroughputProfile read_profile(const json& p) {
  object(p, "profile", {"source", "flops_per_second", "tile_rows", "task_overhead_seconds"}, {"rate_by_keys"});
  constexpr double kMax = std::numeric_limits<double>::max();
  ThroughputProfile out;
  out.source = string(p["source"], "profile.source");
  out.flops_per_second = number(p["flops_per_second"], "profile.flops_per_second", 0, kMax, "(0, inf)");
  out.tile_rows = json_int(p["tile_rows"], "profile.tile_rows", 1, kMaxTokens);
  out.task_overhead_seconds = number(p["task_overhead_seconds"], "profile.task_overhead_seconds", 0, kMax, "[0, inf)");
  if (p.contains("rate_by_keys")) {
    const json& rates = array(p["rate_by_keys"], "profile.rate_by_keys");
    for (size_t i = 0; i < rates.size(); ++i) {
      const std::string path = item("profile.rate_by_keys", i);
      object(rates[i], path, {"keys", "flops_per_second"});
      out.rate_by_keys.push_back({json_int(rates[i]["keys"], at(path, "keys"), 1, kMaxTokens),
                                  number(rates[i]["flops_per_second"], at(path, "flops_per_second"), 0, kMax, "(0, inf)")});
    }
  }
  check(out.validate(), "");  // positive rates, keys ascending, no rate above flops_per_second
  return out;
}

Batch read_batch(const json& b) {
  object(b, "batch", {"ranks", "tokens_per_rank", "doc_lengths", "pieces"});
  Batch out;
  out.num_ranks = static_cast<int32_t>(json_int(b["ranks"], "batch.ranks", 1, kMaxPlanRanks));
  out.tokens_per_rank = json_int(b["tokens_per_rank"], "batch.tokens_per_rank", 1, kMaxTokens);
  const json& lengths = array(b["doc_lengths"], "batch.doc_lengths");
  if (lengths.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    fail("batch.doc_lengths", "at most 2^31 - 1 documents", lengths);
  }
  for (size_t d = 0; d < lengths.size(); ++d) {
    out.doc_lengths.push_back(json_int(lengths[d], item("batch.doc_lengths", d), 1, kMaxTokens));
  }
  const json& pieces = array(b["pieces"], "batch.pieces");
  for (size_t i = 0; i < pieces.size(); ++i) {
    const std::string path = item("batch.pieces", i);
    const json& p = array(pieces[i], path + " (doc, begin, end, rank)", 4);
    out.pieces.push_back(Piece{static_cast<int32_t>(json_int(p[0], item(path, 0), 0, out.num_docs() - int64_t{1})),
                               json_int(p[1], item(path, 1), 0, kMaxTokens), json_int(p[2], item(path, 2), 0, kMaxTokens),
                               static_cast<int32_t>(json_int(p[3], item(path, 3), 0, out.num_ranks - int64_t{1}))});
  }
  out.index();
  check(out.validate(), "batch");  // the pieces tile every document, no rank holds more than tokens_per_rank
  return out;
}

std::vector<Task> read_tasks(const json& j, const Batch& batch) {
  const json& tasks = array(j, "tasks");
  std::vector<Task> out;
  out.reserve(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    const std::string path = item("tasks", i);
    const json& t = array(tasks[i], path + " (doc, q0, q1, k0, k1, server)", 6);
    auto token = [&](size_t f) { return json_int(t[f], item(path, f), 0, kMaxTokens); };
    out.push_back(Task{static_cast<int32_t>(json_int(t[0], item(path, 0), 0, batch.num_docs() - int64_t{1})), token(1),
                       token(2), token(3), token(4),
                       static_cast<int32_t>(json_int(t[5], item(path, 5), 0, batch.num_ranks - int64_t{1}))});
  }
  return out;
}

// server_seconds and flows_per_layer follow from the tasks, the model and the profile: the file's
// must be what finalize_plan computes again (seconds to 1e-9 relative, as another machine's libm
// may round a logarithm differently; bytes exactly).
void check_derived(const json& j, const Plan& plan, const Batch& batch, const TokenBytes& bytes) {
  const int64_t ranks = static_cast<int64_t>(plan.server_seconds.size());
  const json& seconds = array(j["server_seconds"], "server_seconds", ranks);
  for (size_t r = 0; r < seconds.size(); ++r) {
    const double s = number(seconds[r], item("server_seconds", r), 0, std::numeric_limits<double>::max(), "[0, inf)");
    const double want = plan.server_seconds[r];
    if (std::abs(s - want) > 1e-9 * std::abs(want)) {
      fail(fmt::format("server_seconds[{}] is {} but its tasks cost {} on the file's model and profile: the file "
                       "was edited; {}", r, s, want, kRegenerate));
    }
  }
  std::string_view phases[kNumPhases];
  for (int p = 0; p < kNumPhases; ++p) phases[p] = phase_name(static_cast<Phase>(p));
  const json& flows_per_layer = object(j["flows_per_layer"], "flows_per_layer", {phases[0], phases[1], phases[2], phases[3]});
  for (int p = 0; p < kNumPhases; ++p) {
    const std::string path = at("flows_per_layer", phases[p]);
    const json& flows = array(flows_per_layer[phases[p]], path);
    const std::vector<Flow> want = count_flows(batch, bytes, plan.tasks, static_cast<Phase>(p));
    bool same = flows.size() == want.size();
    for (size_t i = 0; same && i < flows.size(); ++i) {
      const std::string fpath = item(path, i);
      const json& f = array(flows[i], fpath + " (src, dst, bytes)", 3);
      same = json_int(f[0], item(fpath, 0), 0, ranks - 1) == want[i].src &&
             json_int(f[1], item(fpath, 1), 0, ranks - 1) == want[i].dst &&
             json_int(f[2], item(fpath, 2), 0, std::numeric_limits<int64_t>::max()) == want[i].bytes;
    }
    if (!same) fail(fmt::format("{} is not the traffic its tasks move: the file was edited; {}", path, kRegenerate));
  }
}

Result<LoadedPlan> read_plan(const json& j) {
  if (!j.is_object() || !j.contains("format") || j["format"] != kPlanFormat) {
    return invalid_argument(fmt::format("not a plan file (expected \"format\": \"{}\"); "
                                        "write one with `distca plan --out FILE`", kPlanFormat));
  }
  if (!j.contains("version") || j["version"] != kPlanVersion) {
    return invalid_argument(fmt::format("plan file version {} is not supported (this build reads "
                                        "version {}); regenerate it with `distca plan --out FILE`",
                                        j.contains("version") ? json_excerpt(j["version"]) : "(none)", kPlanVersion));
  }
  object(j, "", {"format", "version", "policy", "tolerance", "hash", "model", "profile", "batch", "task_fields", "tasks",
                 "server_seconds", "flow_fields", "flows_per_layer"});
  const std::string policy = string(j["policy"], "policy");
  if (!find_planner(policy).is_ok()) fail("policy", fmt::format("one of {}", fmt::join(planner_names(), ", ")), j["policy"]);
  // What `distca plan --tolerance` takes (sim::PlanRequest::validate).
  const double tolerance = number(j["tolerance"], "tolerance", 0, 1, "[0, 1]");
  const std::string hash = string(j["hash"], "hash");
  if (hash.size() != 16 || !std::all_of(hash.begin(), hash.end(), [](char c) {
        return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
      })) {
    fail("hash", "16 lowercase hexadecimal digits", j["hash"]);
  }
  names(j["task_fields"], "task_fields", kTaskFields);
  names(j["flow_fields"], "flow_fields", kFlowFields);
  LoadedPlan out;
  out.model = read_model(j["model"]);
  const ThroughputProfile profile = read_profile(j["profile"]);
  out.batch = read_batch(j["batch"]);
  std::vector<Task> tasks = read_tasks(j["tasks"], out.batch);
  check(verify_tasks(out.batch, tasks), "");
  const CostModel cost(out.model, profile);
  // The bytes the tasks move must fit the plan's 64-bit counters: a row sent once per task that
  // covers it, in every phase, at the largest row size (a hand-made file can have many one-key
  // tasks over a huge model; fuzzing found the overflow).
  const TokenBytes& b = cost.token_bytes();
  const auto row = static_cast<long double>(std::max({b.q, b.kv, b.out, b.bwd_q, b.bwd_do, b.bwd_dq, b.bwd_dkv}));
  long double moved = 0;
  for (const Task& t : tasks) moved += static_cast<long double>((t.q1 - t.q0) + (t.k1 - t.k0)) * row * kNumPhases;
  if (moved > static_cast<long double>(int64_t{1} << 62)) {
    fail(fmt::format("tasks: they would move about {:.3g} bytes per layer, more than distca counts (2^62)",
                     static_cast<double>(moved)));
  }
  out.plan = finalize_plan(policy, tolerance, out.batch, cost, std::move(tasks));
  if (hex(out.plan.hash) != hash) {
    fail(fmt::format("hash {} does not match its contents ({}); the file was edited or truncated", hash,
                     hex(out.plan.hash)));
  }
  check_derived(j, out.plan, out.batch, cost.token_bytes());
  return out;
}

}  // namespace

Result<LoadedPlan> plan_from_json(const json& j) {
  try {
    return read_plan(j);
  } catch (const JsonValueError& e) {
    return invalid_argument(fmt::format("plan file: {}", e.what()));
  } catch (const json::exception& e) {  // not expected: every field is checked before it is read
    return invalid_argument(fmt::format("plan file: malformed field: {}", json_error_text(e)));
  }
}

Result<LoadedPlan> plan_from_text(std::string_view text, std::string_view origin) {
  DISTCA_ASSIGN_OR_RETURN(const json j, parse_json(text, origin));
  return plan_from_json(j);
}

}  // namespace distca::plan
