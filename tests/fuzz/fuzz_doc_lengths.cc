// Fuzz target: document-length files (a JSON array of positive lengths) through
// load_doc_lengths, which reads a path: the input is written to a scratch file first. A
// distribution it returns must give lengths in [1, kMaxTokens] at any quantile.
#include <cstdint>
#include <string>

#include "distca/plan/workload.h"
#include "fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = distca::fuzz::write_scratch_file("doc_lengths", ".json", data, size);
  distca::Result<distca::plan::LengthDistribution> dist = distca::plan::load_doc_lengths(path);
  if (!dist.is_ok()) return 0;
  for (const double u : {0.0, 0.25, 0.5, 0.999, 0.9999999}) {
    const int64_t length = dist.value().quantile(u);
    distca::fuzz::require(length >= 1 && length <= distca::plan::kMaxTokens, "a quantile out of [1, kMaxTokens]");
  }
  return 0;
}
