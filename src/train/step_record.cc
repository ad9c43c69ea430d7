#include "distca/train/step_record.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "distca/core/check.h"

namespace distca::train {

void StepRecord::derive() {
  DISTCA_CHECK(!ranks.empty()) << "a step record needs every rank's parts";
  const auto R = static_cast<double>(ranks.size());
  double attn_sum = 0, compute_sum = 0, serial_max = 0;
  slowest_rank = 0;
  attention_min_seconds = ranks[0].attention;
  attention_max_seconds = 0;
  wait_max_seconds = 0;
  attention_bytes = 0;
  memory_max_bytes = 0;
  memory_mean_bytes = 0;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const Rank& x = ranks[r];
    const Rank& w = ranks[static_cast<size_t>(slowest_rank)];
    if (x.step - x.wait > w.step - w.wait) slowest_rank = static_cast<int>(r);
    attn_sum += x.attention;
    attention_min_seconds = std::min(attention_min_seconds, x.attention);
    attention_max_seconds = std::max(attention_max_seconds, x.attention);
    wait_max_seconds = std::max(wait_max_seconds, x.wait);
    compute_sum += x.linear + x.optimizer + x.attention;
    serial_max = std::max(serial_max, x.linear + x.optimizer);
    attention_bytes += x.attention_bytes;
    memory_max_bytes = std::max(memory_max_bytes, x.memory());
    memory_mean_bytes += static_cast<double>(x.memory()) / R;
  }
  step_seconds = straggler().step;
  const double attn_mean = attn_sum / R;
  attention_imbalance = attn_mean > 0 ? attention_max_seconds / attn_mean : 1.0;
  bound_seconds = std::max(serial_max, compute_sum / R);
}

nlohmann::json StepRecord::to_json() const {
  nlohmann::json rs = nlohmann::json::array();
  for (const Rank& r : ranks) {
    rs.push_back({{"step_seconds", r.step},
                  {"linear_seconds", r.linear},
                  {"attention_seconds", r.attention},
                  {"comm_seconds", r.comm},
                  {"pipeline_wait_seconds", r.pipeline_wait},
                  {"idle_seconds", r.idle},
                  {"wait_seconds", r.wait},
                  {"optimizer_seconds", r.optimizer},
                  {"other_seconds", r.other},
                  {"grad_reduce_seconds", r.grad_reduce},
                  {"served_in_idle_seconds", r.served_in_idle},
                  {"recompute_seconds", r.recompute},
                  {"attention_bytes", r.attention_bytes},
                  {"memory_states_bytes", r.memory_states},
                  {"memory_activations_bytes", r.memory_activations},
                  {"memory_attention_bytes", r.memory_attention},
                  {"memory_messages_bytes", r.memory_messages},
                  {"memory_bytes", r.memory()}});
  }
  return {{"step", step},
          {"backend", backend},
          {"loss", loss},
          {"grad_norm", grad_norm},
          {"lr", lr},
          {"step_seconds", step_seconds},
          {"tokens_per_second", tokens_per_second},
          {"micro_batches", micro_batches},
          {"split_micro_batches", split_micro_batches},
          {"backward_mode", backward_mode},
          {"colocated_plan", colocated_plan},
          {"memory_budget_bytes", memory_budget_bytes},
          {"memory_predicted_bytes", memory_predicted_bytes},
          {"attention_tasks", attention_tasks},
          {"split_tasks", split_tasks},
          {"slowest_rank", slowest_rank},
          {"attention_min_seconds", attention_min_seconds},
          {"attention_max_seconds", attention_max_seconds},
          {"wait_max_seconds", wait_max_seconds},
          {"attention_imbalance", attention_imbalance},
          {"bound_seconds", bound_seconds},
          {"attention_bytes", attention_bytes},
          {"memory_max_bytes", memory_max_bytes},
          {"memory_mean_bytes", memory_mean_bytes},
          {"ranks", rs}};
}

void put_count(float* slots, int64_t count) {
  slots[0] = static_cast<float>(count >> 24);
  slots[1] = static_cast<float>(count & ((int64_t{1} << 24) - 1));
}

int64_t get_count(const float* slots) { return (static_cast<int64_t>(slots[0]) << 24) + static_cast<int64_t>(slots[1]); }

void StepRecord::Rank::to_row(float* row) const {
  const double times[11] = {step, linear, attention, comm, pipeline_wait, idle, wait, optimizer,
                            grad_reduce, served_in_idle, recompute};
  for (int i = 0; i < 11; ++i) row[i] = static_cast<float>(times[i]);
  const int64_t counts[5] = {attention_bytes, memory_states, memory_activations, memory_attention, memory_messages};
  for (int i = 0; i < 5; ++i) put_count(row + 11 + 2 * i, counts[i]);
}

StepRecord::Rank StepRecord::Rank::from_row(const float* row) {
  auto at = [&](int i) { return static_cast<double>(row[i]); };
  auto count = [&](int i) { return get_count(row + 11 + 2 * i); };
  Rank x;
  x.step = at(0);
  x.linear = at(1);
  x.attention = at(2);
  x.comm = at(3);
  x.pipeline_wait = at(4);
  x.idle = at(5);
  x.wait = at(6);
  x.optimizer = at(7);
  x.grad_reduce = at(8);
  x.served_in_idle = at(9);
  x.recompute = at(10);
  // The gather rounds each part to float: "other" closes the sum.
  x.other = x.step - x.linear - x.attention - x.comm - x.pipeline_wait - x.idle - x.wait - x.optimizer;
  x.attention_bytes = count(0);
  x.memory_states = count(1);
  x.memory_activations = count(2);
  x.memory_attention = count(3);
  x.memory_messages = count(4);
  return x;
}

nlohmann::json EvalRecord::to_json() const {
  return {{"step", step}, {"backend", backend}, {"loss", loss}, {"targets", targets}};
}

nlohmann::json summarize(const std::vector<StepRecord>& records, int64_t skip, int stages) {
  DISTCA_CHECK(!records.empty()) << "summarize needs at least one step record";
  std::map<std::string, std::vector<const StepRecord*>> by;
  std::vector<std::string> order;
  for (const StepRecord& r : records) {
    if (!by.contains(r.backend)) order.push_back(r.backend);
    by[r.backend].push_back(&r);
  }
  nlohmann::json out;
  nlohmann::json backends = nlohmann::json::object();
  for (const std::string& name : order) {
    const auto& rs = by[name];
    const size_t n = rs.size();
    const size_t first = std::min<size_t>(static_cast<size_t>(std::max<int64_t>(skip, 0)), n - 1);
    auto mean = [&](auto&& value, size_t from, size_t to) {
      double s = 0;
      for (size_t i = from; i < to; ++i) s += value(*rs[i]);
      return to > from ? s / static_cast<double>(to - from) : 0.0;
    };
    auto timed = [&](auto&& value) { return mean(value, first, n); };
    auto part = [&](double StepRecord::Rank::*field) {
      return timed([field](const StepRecord& r) { return r.straggler().*field; });
    };
    const size_t k = n == 1 ? 1 : std::min<size_t>(10, n / 2);
    // The peak over the run of the fullest rank's memory, and the largest max / mean over ranks;
    // within a stage (its replicas hold the same layers and as many micro-batches in flight),
    // the largest max / mean: what the attention layout decides, where across stages the
    // schedule does (stage s of 1F1B holds up to P - s micro-batches).
    int64_t peak_memory = 0;
    double memory_ratio = 1, stage_ratio = 1;
    for (const StepRecord* r : rs) {
      peak_memory = std::max(peak_memory, r->memory_max_bytes);
      if (r->memory_mean_bytes > 0) memory_ratio = std::max(memory_ratio, static_cast<double>(r->memory_max_bytes) / r->memory_mean_bytes);
      const size_t per = r->ranks.size() / static_cast<size_t>(std::max(stages, 1));
      for (size_t begin = 0; per > 0 && begin + per <= r->ranks.size(); begin += per) {
        int64_t most = 0;
        double sum = 0;
        for (size_t i = begin; i < begin + per; ++i) {
          most = std::max(most, r->ranks[i].memory());
          sum += static_cast<double>(r->ranks[i].memory());
        }
        if (sum > 0) stage_ratio = std::max(stage_ratio, static_cast<double>(most) / (sum / static_cast<double>(per)));
      }
    }
    // Attention served in idle ticks, all ranks, and its share of all the attention computed.
    double served = 0, attention = 0;
    for (size_t i = first; i < n; ++i) {
      for (const StepRecord::Rank& x : rs[i]->ranks) served += x.served_in_idle, attention += x.attention;
    }
    const double step = timed([](const StepRecord& r) { return r.step_seconds; });
    const double wait_and_bubble = timed([](const StepRecord& r) {
      const StepRecord::Rank& x = r.straggler();
      return x.pipeline_wait + x.idle + x.wait;
    });
    backends[name] = {{"steps", n},
                      {"timed_steps", n - first},
                      {"first_timed_step", rs[first]->step},
                      {"step_seconds", step},
                      {"tokens_per_second", timed([](const StepRecord& r) { return r.tokens_per_second; })},
                      {"linear_seconds", part(&StepRecord::Rank::linear)},
                      {"attention_seconds", part(&StepRecord::Rank::attention)},
                      {"comm_seconds", part(&StepRecord::Rank::comm)},
                      {"pipeline_wait_seconds", part(&StepRecord::Rank::pipeline_wait)},
                      {"idle_seconds", part(&StepRecord::Rank::idle)},
                      {"wait_seconds", part(&StepRecord::Rank::wait)},
                      {"optimizer_seconds", part(&StepRecord::Rank::optimizer)},
                      {"other_seconds", part(&StepRecord::Rank::other)},
                      {"wait_and_bubble_seconds", wait_and_bubble},
                      {"wait_and_bubble_share", step > 0 ? wait_and_bubble / step : 0.0},
                      {"wait_max_seconds", timed([](const StepRecord& r) { return r.wait_max_seconds; })},
                      {"attention_imbalance", timed([](const StepRecord& r) { return r.attention_imbalance; })},
                      {"bound_seconds", timed([](const StepRecord& r) { return r.bound_seconds; })},
                      {"served_in_idle_seconds", served / static_cast<double>(n - first)},
                      {"served_in_idle_share_of_attention", attention > 0 ? served / attention : 0.0},
                      // The rank that recomputed most, each step.
                      {"recompute_seconds", timed([](const StepRecord& r) {
                         double most = 0;
                         for (const StepRecord::Rank& x : r.ranks) most = std::max(most, x.recompute);
                         return most;
                       })},
                      {"memory_max_bytes", peak_memory},
                      {"memory_max_over_mean", memory_ratio},
                      {"memory_max_over_mean_within_stage", stage_ratio},
                      {"loss_steps", k},
                      {"loss_first", mean([](const StepRecord& r) { return r.loss; }, 0, k)},
                      {"loss_last", mean([](const StepRecord& r) { return r.loss; }, n - k, n)}};
    out[name + "_step_seconds"] = backends[name]["step_seconds"];
  }
  out["backends"] = backends;
  const std::string base = by.contains("colocated") ? "colocated" : order.front();
  out["loss_first"] = backends[base]["loss_first"];
  out["loss_last"] = backends[base]["loss_last"];
  if (by.contains("colocated") && by.contains("cad")) {
    const double col = backends["colocated"]["step_seconds"], cad = backends["cad"]["step_seconds"];
    out["speedup"] = cad > 0 ? col / cad : 0.0;
    const double bound = backends["cad"]["bound_seconds"];
    out["cad_over_bound"] = bound > 0 ? cad / bound : 0.0;
    double worst = 0;
    const auto& a = by["colocated"];
    const auto& b = by["cad"];
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      worst = std::max(worst, std::abs(a[i]->loss - b[i]->loss) / std::max(std::abs(a[i]->loss), 1e-30));
    }
    out["loss_max_rel_diff"] = worst;
  } else {
    out["speedup"] = nullptr;
    out["cad_over_bound"] = nullptr;
    out["loss_max_rel_diff"] = nullptr;
  }
  return out;
}

}  // namespace distca::train
