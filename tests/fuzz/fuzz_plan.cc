// Fuzz target: plan files (distca-plan JSON, what `distca plan --out` writes) through parse_json
// and plan_from_json. A plan it returns must hold a batch that passes Batch::validate().
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "distca/core/json.h"
#include "distca/plan/plan_io.h"
#include "fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  distca::Result<nlohmann::json> json = distca::parse_json(text, "fuzz-plan");
  if (!json.is_ok()) return 0;
  distca::Result<distca::plan::LoadedPlan> plan = distca::plan::plan_from_json(json.value());
  if (!plan.is_ok()) return 0;
  distca::fuzz::require(plan.value().batch.validate().is_ok(), "a loaded plan's batch fails Batch::validate()");
  return 0;
}
