// Fuzz target: JSONL training data (one {"text": ...} object per line) through
// open_jsonl_source, which reads a path: the input is written to a scratch file first. A source
// it returns yields a few documents, across the end of the file (a new epoch), each non-empty
// bytes 0..255.
#include <cstdint>
#include <memory>
#include <string>

#include "distca/train/data.h"
#include "fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = distca::fuzz::write_scratch_file("data", ".jsonl", data, size);
  distca::Result<std::unique_ptr<distca::train::DocumentSource>> source = distca::train::open_jsonl_source(path);
  if (!source.is_ok()) return 0;
  distca::train::DocumentSource& s = *source.value();
  (void)s.describe();
  (void)s.identity();
  for (int i = 0; i < 4; ++i) {
    distca::Result<std::vector<int32_t>> doc = s.next();
    distca::fuzz::require(doc.is_ok(), "a document of an opened, unchanged file is refused");
    distca::fuzz::require(!doc.value().empty(), "an empty document");
    for (const int32_t token : doc.value()) distca::fuzz::require(token >= 0 && token < 256, "a token out of 0..255");
  }
  return 0;
}
