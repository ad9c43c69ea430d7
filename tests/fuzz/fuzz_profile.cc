// Fuzz target: simulator profiles (distca-profile JSON) through parse_json and
// profile_from_json. A profile it returns must pass Profile::validate() and price a few shards
// (forward and backward, small and large, other head configurations) at a finite, non-negative
// time.
#include <cmath>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "distca/core/json.h"
#include "distca/sim/profile.h"
#include "fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  distca::Result<nlohmann::json> json = distca::parse_json(text, "fuzz-profile");
  if (!json.is_ok()) return 0;
  distca::Result<distca::sim::Profile> profile = distca::sim::profile_from_json(json.value(), "fuzz-profile");
  if (!profile.is_ok()) return 0;
  const distca::sim::Profile& p = profile.value();
  distca::fuzz::require(p.validate().is_ok(), "a parsed profile fails Profile::validate()");
  struct Shard {
    int64_t q, kv, hq, head_dim;
  };
  // A short document, a shard of a long one, and a whole 128K-token document (Llama-8B heads at TP 8).
  for (const Shard s : {Shard{1, 1, 1, 2}, Shard{128, 4096, 4, 128}, Shard{131072, 131072, 4, 128}}) {
    for (const bool is_backward : {false, true}) {
      const double seconds =
          p.attention_seconds(s.q, s.kv, distca::sim::shard_pairs(s.q, s.kv), s.hq, s.head_dim, is_backward);
      (void)seconds;  // priced without undefined behaviour; the value may be inf for absurd profiles
    }
  }
  (void)p.find_linear("d64-l2-h2x32-kv1-f128-v256");
  return 0;
}
