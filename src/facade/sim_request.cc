#include "distca/facade/sim_request.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>

namespace distca::facade {

Result<int64_t> parse_context(const std::string& s) {
  if (s.empty()) return invalid_argument("--context is empty");
  int64_t mult = 1;
  std::string digits = s;
  const char last = static_cast<char>(std::toupper(static_cast<unsigned char>(s.back())));
  if (last == 'K' || last == 'M') {
    mult = last == 'K' ? 1024 : 1024 * 1024;
    digits = s.substr(0, s.size() - 1);
  }
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9) {
    return invalid_argument(fmt::format("--context must be a token count such as 131072, 128K or 1M, got '{}'", s));
  }
  return std::stoll(digits) * mult;
}

std::string context_text(int64_t tokens) {
  return tokens % 1024 == 0 ? fmt::format("{}K", tokens / 1024) : fmt::format("{}", tokens);
}

namespace {

// Context parallelism so that a unit holds at most 64K tokens of a sequence (what an 8-GPU
// group holds in activations for these models), within what the GPUs allow.
int auto_cp(int64_t context, int gpus, int tp, int pp) {
  int cp = 1;
  while (context / cp > 65536 && (gpus / tp / pp) % (2 * cp) == 0) cp *= 2;
  return cp;
}

double imbalance(const std::vector<double>& v) {
  double sum = 0, mx = 0;
  for (double x : v) sum += x, mx = std::max(mx, x);
  return sum > 0 ? mx / (sum / static_cast<double>(v.size())) : 1.0;
}

}  // namespace

Status SimRequest::validate() const {
  if (iterations < 1 || iterations > 1000) return invalid_argument(fmt::format("--iterations must be 1..1000, got {}", iterations));
  if (seed < 0) return invalid_argument(fmt::format("--seed must be >= 0, got {}", seed));
  if (!(tolerance >= 0 && tolerance <= 1)) return invalid_argument(fmt::format("--tolerance must be in [0, 1], got {}", tolerance));
  // Options whose 0 means "choose for me": only negative values are wrong.
  if (cp < 0) return invalid_argument(fmt::format("--cp must be >= 1, or 0 for context / 64K, got {}", cp));
  if (wlb_cp < 0) return invalid_argument(fmt::format("--wlb-cp must be >= 1, or 0 for WLB-ideal, got {}", wlb_cp));
  return plan::parse_grad_return(grad_return).status();
}

Result<sim::SimOptions> SimRequest::options() const {
  DISTCA_RETURN_IF_ERROR(validate());
  DISTCA_ASSIGN_OR_RETURN(plan::ModelShape shape, plan::model_preset(model));
  DISTCA_ASSIGN_OR_RETURN(const int64_t tokens, parse_context(context));
  sim::SimOptions o;
  o.model = shape;
  o.model.grad_return = plan::parse_grad_return(grad_return).value();  // checked by validate
  o.cluster = {gpus, gpus_per_node, tp, pp, cp};
  if (cp == 0 && tp > 0 && pp > 0) o.cluster.cp = auto_cp(tokens, gpus, tp, pp);
  o.context = tokens;
  o.batch = batch;
  o.wlb_cp = wlb_cp;
  o.sampling = sampling;
  o.workload = workload;
  o.seed = static_cast<uint64_t>(seed);
  o.tolerance = tolerance;
  o.tolerance_sweep = tolerance_sweep;
  o.iterations = iterations;
  if (system != "all") {
    const auto names = sim::system_names();
    if (std::find(names.begin(), names.end(), system) == names.end()) {
      return invalid_argument(fmt::format("--system must be {} or all, got '{}'", fmt::join(names, ", "), system));
    }
  }
  DISTCA_RETURN_IF_ERROR(o.validate());
  return o;
}

std::vector<std::string> SimRequest::systems() const {
  return system == "all" ? sim::system_names() : std::vector<std::string>{system};
}

nlohmann::json simulation_report(const sim::SimOptions& o, const sim::Profile& profile, const std::vector<sim::SystemResult>& rs) {
  nlohmann::json systems = nlohmann::json::array();
  double wlb = 0, col = 0;
  for (const auto& r : rs) {
    if (r.system == "wlb") wlb = r.seconds;
    if (r.system == "colocated") col = r.seconds;
  }
  for (const auto& r : rs) {
    nlohmann::json j = r.to_json();
    j["attention_imbalance"] = imbalance(r.unit_attention);
    j["speedup_over_wlb"] = wlb > 0 ? nlohmann::json(wlb / r.seconds) : nlohmann::json(nullptr);
    j["speedup_over_colocated"] = col > 0 ? nlohmann::json(col / r.seconds) : nlohmann::json(nullptr);
    systems.push_back(j);
  }
  return {{"model", o.model.name},
          {"gpus", o.cluster.gpus},
          {"tp", o.cluster.tp},
          {"pp", o.cluster.pp},
          {"cp", o.cluster.cp},
          {"dp", o.cluster.dp()},
          {"units", o.cluster.units()},
          {"context", o.context},
          {"batch", o.batch},
          {"workload", o.workload},
          {"seed", o.seed},
          {"tolerance", o.tolerance},
          {"tolerance_sweep", o.tolerance_sweep},
          {"iterations", o.iterations},
          {"grad_return", plan::grad_return_name(o.model.grad_return)},
          {"profile", profile.name},
          {"device_memory_bytes", profile.device_memory_bytes > 0 ? nlohmann::json(profile.device_memory_bytes) : nlohmann::json(nullptr)},
          {"speedup", "the baseline's iteration time / the system's, of the mean times with several iterations "
                      "(speedup_over_wlb: over wlb, speedup_over_colocated: over colocated; null: not simulated)"},
          {"systems", systems}};
}

Result<nlohmann::json> run_simulation(const SimRequest& request, const sim::Profile& profile, Progress* progress) {
  DISTCA_ASSIGN_OR_RETURN(const sim::SimOptions options, request.options());
  DISTCA_ASSIGN_OR_RETURN(const std::vector<sim::SystemResult> results, simulate(profile, options, request.systems(), progress));
  return simulation_report(options, profile, results);
}

}  // namespace distca::facade
