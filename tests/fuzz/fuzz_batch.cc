// Fuzz target: batch files ({"ranks": [[len, ...], ...]}) through parse_batch_json. Any input
// may be refused with a Status; a batch it returns must pass Batch::validate().
#include <cstdint>
#include <string>

#include "distca/plan/batch.h"
#include "fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  // 0: every rank's capacity is the largest rank's total; 4096: a capacity ranks must fit in.
  for (const int64_t tokens_per_rank : {int64_t{0}, int64_t{4096}}) {
    distca::Result<distca::plan::Batch> batch = distca::plan::parse_batch_json(text, tokens_per_rank, "fuzz-batch");
    if (!batch.is_ok()) break;
    distca::fuzz::require(batch.value().validate().is_ok(), "a parsed batch fails Batch::validate()");
    distca::fuzz::require(tokens_per_rank == 0 || batch.value().tokens_per_rank == tokens_per_rank,
                          "a parsed batch has another capacity than asked");
  }
  return 0;
}
